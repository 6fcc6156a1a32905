"""Idefics3's (SmolVLM's) entry in the architecture map (models/__init__.py): the engine's `load`
signature over idefics3.load_idefics3."""

from __future__ import annotations

from pathlib import Path

import torch

from caldrix.models.base import Loaded
from caldrix.models.idefics3 import load_idefics3


def load(path: Path, *, dtype: torch.dtype, device: str = "cpu", int4_from: Path | None = None,
         max_batch: int = 1, int4_rows: int = 8, pack: bool = True, quantize: bool = False) -> Loaded:
    """An Idefics3 from the Hugging Face directory `path`, dense in `dtype`, on the cpu lane.
    GGUF 4-bit weights are a llama-family path only; `max_batch` and `int4_rows` choose nothing,
    and `pack` neither: only a GPU lane streams layers, and this model has none."""
    if int4_from is not None:
        raise ValueError("idefics3: GGUF weights are not supported for this architecture; serve its "
                         "Hugging Face directory (safetensors)")
    if quantize:
        raise ValueError("--weights q4 rounds a text model's weights to 4 bits at load; not idefics3")
    if device != "cpu":
        raise ValueError("idefics3 (SmolVLM) runs on the cpu lane only")
    return Loaded(load_idefics3(Path(path), dtype, device))
