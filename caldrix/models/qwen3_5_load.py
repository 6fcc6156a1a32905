"""Qwen3.5's entry in the architecture map (models/__init__.py): the engine's `load` signature
over qwen3_5.load_qwen35. Both config shapes (qwen3_5, qwen3_5_text) load here."""

from __future__ import annotations

from pathlib import Path

import torch

from caldrix.models.base import Loaded
from caldrix.models.qwen3_5 import load_qwen35


def load(path: Path, *, dtype: torch.dtype, device: str = "cpu", int4_from: Path | None = None,
         max_batch: int = 1, int4_rows: int = 8) -> Loaded:
    """A Qwen35 from the Hugging Face directory `path`, dense in `dtype`. GGUF 4-bit weights are
    a llama-family path only; `max_batch` and `int4_rows` choose nothing here."""
    if int4_from is not None:
        raise ValueError("qwen3_5: GGUF weights are not supported for this architecture; serve its "
                         "Hugging Face directory (safetensors)")
    return Loaded(load_qwen35(Path(path), dtype, device))
