"""`caldrix bench`: the project's serving benchmark (bench/serve.py: caldrix against llama.cpp and
transformers on the same model, one run, ratios printed), run from a source checkout.

The benchmark is no part of the installed package: it builds its peers in its own virtual
environment and reads traces/ from the repository. So the command finds bench/serve.py beside the
package's directory, runs it with this Python and every argument after `bench` untouched
(`caldrix bench --quick`, `caldrix bench --help`), and exits with its status; an installation
without the checkout gets exit status 2 and a line that says where the benchmark lives.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
SCRIPT = CHECKOUT / "bench" / "serve.py"


def _in_checkout(script: Path) -> bool:
    """Whether `script` is caldrix's own: a checkout's root holds caldrix's pyproject.toml. Once
    installed, the folder above the package is site-packages, where another distribution's
    bench/serve.py could sit."""
    try:
        project = (script.parent.parent / "pyproject.toml").read_text()
    except OSError:
        return False
    return script.is_file() and 'name = "caldrix"' in project


def bench(args: list[str], script: Path = SCRIPT) -> int:
    """Run `script` with `args`, in the checkout's root; its exit status."""
    if not _in_checkout(script):
        print(f"caldrix bench: the benchmark is bench/serve.py in a source checkout of caldrix, and this "
              f"installation has none (looked for {script}); clone the repository and run it there",
              file=sys.stderr)
        return 2
    try:
        return subprocess.call([sys.executable, str(script), *args], cwd=script.parent.parent)
    except KeyboardInterrupt:  # the benchmark got the same Ctrl-C and stops its peers itself
        return 130
