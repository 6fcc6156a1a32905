"""A .gguf file, dequantized once into a cached Hugging Face directory.

transformers reads the GGUF (weights dequantized to float32, tokenizer and chat template from
its metadata) and `save_pretrained` writes a plain directory the engine loads like any other.
The weights stay float32: the engine casts to its own dtype at load, and parity tests compare
against transformers reading the GGUF itself, which is float32.

The cache is keyed by the file's content (a SHA-256 of all of it), not its path, so a
reinstalled package or a copy of the file finds the same directory, and an edited file does not.
A directory at the key's path is always complete: conversion writes into a temporary sibling and
renames it into place.

What transformers' reading leaves out is checked or mended here: a file whose architecture the
engine does not run is refused before anything is read; a file that lacks tensors the model needs
is refused (transformers would fill them with random values and say so in a warning); and the
pre-tokenizer the file names in tokenizer.ggml.pre, which transformers ignores, is written into
tokenizer.json (PRE_TOKENIZERS).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Part of the cache key: bump it when the layout of a converted directory changes.
# 2: tokenizer.ggml.pre's pre-tokenizer written into tokenizer.json (SmolLM2's digit split).
CONVERTER_VERSION = 2
# general.architecture values the engine runs (models/llama.py); any other is refused before the
# file is read (transformers reads more of them, and the engine then refused them after a minute).
ARCHITECTURES = ("llama", "qwen3")
_MIB = 1 << 20
# A temporary directory older than this belongs to a conversion that was killed.
_STALE_S = 3600.0

# Conversions run by this process; tests read it to tell a cache hit from a conversion.
conversions = 0


def cache_root() -> Path:
    """The caldrix cache: $CALDRIX_CACHE, else $XDG_CACHE_HOME/caldrix, else ~/.cache/caldrix."""
    if os.environ.get("CALDRIX_CACHE"):
        return Path(os.environ["CALDRIX_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "caldrix"


def cache_key(gguf_path: str | os.PathLike) -> str:
    """16 hex digits of a SHA-256 of the converter version and the whole file: about 0.25 s for
    the embedded 94 MiB file on the 2-core machine. (Its size and first and last MiB alone gave
    a file edited in the middle the old file's entry.)"""
    h = hashlib.sha256(f"caldrix-gguf-v{CONVERTER_VERSION}:".encode())
    with Path(gguf_path).open("rb") as f:
        while chunk := f.read(16 * _MIB):
            h.update(chunk)
    return h.hexdigest()[:16]


def cached_dir(gguf_path: str | os.PathLike) -> Path:
    """Where the converted directory of this file lives (whether or not it exists yet)."""
    return cache_root() / "gguf" / cache_key(gguf_path)


def convert(gguf_path: str | os.PathLike, *, progress: bool = True) -> Path:
    """The converted directory of `gguf_path`, converting it first if it is not cached.

    With `progress`, each stage of a conversion prints one line to stderr with the seconds
    elapsed; a cache hit prints nothing. Raises ModelNotFound (a user-facing message) when
    transformers cannot read the file.
    """
    global conversions
    src = Path(gguf_path).resolve()
    final = cached_dir(src)
    if final.is_dir():
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        _sweep_stale(final.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    except OSError as e:  # a read-only cache, a HOME that is not there
        from caldrix.weights import ModelNotFound

        raise ModelNotFound(f"cannot convert {src}: the cache {final.parent} cannot be written "
                            f"({e.strerror or e}); set CALDRIX_CACHE to a writable directory") from None
    try:
        conversions += 1
        # Quiet means quiet: transformers' own bars (the dequantizing one cannot be switched
        # off through transformers) go to a buffer too. Conversion happens before serving,
        # so swapping the process's stderr for a moment is harmless.
        with contextlib.nullcontext() if progress else contextlib.redirect_stderr(io.StringIO()):
            _export(src, tmp, _Progress(src.name, progress))
        # mkdtemp (and safetensors' own temp file) make things private; a cache is as
        # readable as the rest of ~/.cache.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
        try:
            os.rename(tmp, final)  # atomic: readers see nothing or the whole directory
        except OSError:
            if not final.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first; same bytes
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


class _Progress:
    """One stderr line per conversion stage, with the seconds since the conversion began."""

    def __init__(self, name: str, enabled: bool):
        self.name, self.enabled, self.t0 = name, enabled, time.monotonic()

    def __call__(self, stage: str) -> None:
        if self.enabled:
            elapsed = time.monotonic() - self.t0
            line = f"caldrix: converting {self.name} once ({stage}) {elapsed:.1f}s"
            print(line, file=sys.stderr, flush=True)


def _export(src: Path, out: Path, say: _Progress) -> None:
    """Read the GGUF with transformers and save it as a Hugging Face directory into `out`."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from caldrix.weights import ModelNotFound
    from caldrix.weights.gguf_index import read_strings

    try:
        meta = read_strings(src, frozenset({"general.architecture", "tokenizer.ggml.pre"}))
    except (ValueError, OSError) as e:
        raise ModelNotFound(f"cannot convert {src}: {e}") from e
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelNotFound(f"cannot convert {src}: its architecture is {arch!r}; this engine runs GGUF files of "
                            f"{', '.join(ARCHITECTURES)}")
    try:
        say("1/4 reading the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        say("2/4 dequantizing the weights")
        # dequantize=True: plain dense float32 modules even where a GGUF matmul kernel is
        # installed, since the point is a checkpoint the engine can read.
        model, info = AutoModelForCausalLM.from_pretrained(
            src.parent,
            gguf_file=src.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
            output_loading_info=True,
        )
    except Exception as e:
        reason = (str(e).strip().splitlines() or [""])[0]
        raise ModelNotFound(f"cannot convert {src}: {type(e).__name__}: {reason}") from e
    # transformers fills a weight the file lacks (or holds in another shape) with random values
    # and only warns; llama.cpp refuses such a file, and so does this. A tied head is not lacking.
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    lacking = sorted(set(info.get("missing_keys") or ()) - tied) + sorted(
        str(m[0]) if isinstance(m, tuple) else str(m) for m in info.get("mismatched_keys") or ())
    if lacking:
        raise ModelNotFound(f"cannot convert {src}: it lacks {len(lacking)} of the model's tensors, or holds them "
                            f"in another shape ({', '.join(lacking[:3])}{', ...' if len(lacking) > 3 else ''})")

    odd = {p.dtype for p in model.parameters()} - {torch.float32}
    _require(not odd, f"the GGUF weights were not dequantized to float32: {odd}")
    # The quantizer only marks the model as "loaded from GGUF"; the weights are dense already,
    # and without it save_pretrained writes an ordinary checkpoint.
    model.hf_quantizer = None
    max_len = getattr(model.config, "max_position_embeddings", None)
    if max_len:
        tokenizer.model_max_length = max_len  # as the original repositories say, not "infinite"

    say("3/4 writing safetensors")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _set_pre_tokenizer(out / "tokenizer.json", meta.get("tokenizer.ggml.pre"))
    (out / "caldrix_source.json").write_text(
        json.dumps(
            {
                "gguf": str(src),
                "size": src.stat().st_size,
                "converter_version": CONVERTER_VERSION,
                "transformers": transformers.__version__,
            },
            indent=2,
        )
        + "\n"
    )

    say("4/4 checking")
    _check(out, had_template=bool(getattr(tokenizer, "chat_template", None)))
    say("done")


# tokenizer.ggml.pre -> the pre-tokenizer of the model's own tokenizer.json, where transformers'
# GGUF reading writes another. "smollm" (SmolLM2's): each digit is split off before the byte-level
# split, as SmolLM2's tokenizer.json and llama.cpp's "smollm" pre-tokenizer do; without it
# "Steps:\n\n1." was 198,198,33 where both give 1116,33.
PRE_TOKENIZERS = {
    "smollm": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ]},
}


def _set_pre_tokenizer(tokenizer_json: Path, pre: str | None) -> None:
    if pre not in PRE_TOKENIZERS or not tokenizer_json.is_file():
        return
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    data["pre_tokenizer"] = PRE_TOKENIZERS[pre]
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")


def _check(out: Path, *, had_template: bool) -> None:
    """The converted directory has what the loaders need; fail before it enters the cache."""
    config = json.loads((out / "config.json").read_text())
    _require("quantization_config" not in config, "config.json still marks the weights as GGUF")
    _require(bool(config.get("architectures")), "config.json names no architecture")
    _require(bool(list(out.glob("*.safetensors"))), "no safetensors were written")
    has_tokenizer = (out / "tokenizer.json").is_file() or (out / "tokenizer.model").is_file()
    _require(has_tokenizer, "no tokenizer was written")
    if had_template:
        tok_config = json.loads((out / "tokenizer_config.json").read_text())
        has = (out / "chat_template.jinja").is_file() or "chat_template" in tok_config
        _require(has, "the chat template was lost")


def _require(ok: bool, what: str) -> None:
    # Not `assert`: these guard the cache under `python -O` too.
    if not ok:
        raise RuntimeError(f"GGUF conversion went wrong: {what}")


def _sweep_stale(root: Path) -> None:
    """Remove the temporary directories of conversions that were killed long ago."""
    now = time.time()
    for tmp in root.glob(".tmp-*"):
        try:
            if now - tmp.stat().st_mtime > _STALE_S:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass  # another process removed or renamed it meanwhile


def source_gguf(model_dir: str | os.PathLike) -> Path | None:
    """The GGUF file a cached directory was converted from, if it is still there unchanged."""
    meta = Path(model_dir) / "caldrix_source.json"
    try:
        info = json.loads(meta.read_text())
        src = Path(info["gguf"])
        if src.stat().st_size == info["size"]:
            return src
    except (OSError, ValueError, KeyError):
        pass
    return None
