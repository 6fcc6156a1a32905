"""Architectures, one file each, behind one contract (base.py); where weights come from is
caldrix/weights/, the compiled kernels caldrix/kernels/.

A new architecture adds its file and one line to ARCHITECTURES: config.json's model_type ->
the "module:function" that loads it, `load(path, *, dtype, device, int4_from, max_batch,
int4_rows, pack) -> base.Loaded` (`pack`: whether CPU matmul weights may be reordered for oneDNN;
off where the engine streams layers, which must see every weight as a parameter). Nothing is
imported until a model of that type is loaded.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

ARCHITECTURES: dict[str, str] = {
    "llama": "caldrix.models.llama_load:load",
    "qwen3": "caldrix.models.llama_load:load",
    "qwen3_5": "caldrix.models.qwen3_5_load:load",
    "qwen3_5_text": "caldrix.models.qwen3_5_load:load",
    "idefics3": "caldrix.models.idefics3_load:load",
}

# config.json `architectures` names -> model_type, for configs that name a class only
CLASS_NAMES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3",
               "Qwen3_5ForCausalLM": "qwen3_5_text", "Qwen3_5ForConditionalGeneration": "qwen3_5",
               "Idefics3ForConditionalGeneration": "idefics3"}


def model_type(path: Path) -> str:
    """The architecture a Hugging Face directory holds, as a key of ARCHITECTURES; ValueError,
    naming what is supported, where it is none of them.

    config.json's `model_type` decides, as it does for transformers' Auto classes: a Mistral
    config whose `architectures` says LlamaForCausalLM is a Mistral (with its sliding window),
    and is refused. The class names count only in a config without `model_type`."""
    return model_type_of(json.loads((Path(path) / "config.json").read_text()))


def model_type_of(raw: dict) -> str:
    """model_type for a config.json already read."""
    archs = raw.get("architectures") or []
    declared = raw.get("model_type")
    if declared:
        found = declared if declared in ARCHITECTURES else None
    else:
        found = next((CLASS_NAMES[a] for a in archs if a in CLASS_NAMES), None)
    if found is None:
        what = (f"model_type {declared!r}" + (f" (architectures {archs!r})" if archs else "")
                if declared and any(a in CLASS_NAMES for a in archs) else repr(archs or declared))
        raise ValueError(f"unsupported architecture {what}; this engine runs {', '.join(sorted(ARCHITECTURES))}")
    return found


def loader(path: Path):
    """The load function for the directory's architecture."""
    module, name = ARCHITECTURES[model_type(path)].split(":")
    return getattr(importlib.import_module(module), name)
