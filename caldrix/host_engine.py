"""--backend host: the Hugging Face transformers model itself, one run at a time.

The reference lane the own engine is checked against; slow by design. It keeps the same step
contract as engine.Engine, with a transformers DynamicCache per slot.
"""

from __future__ import annotations

from pathlib import Path

import torch

from caldrix.batch import Batch, RunOutput, StepOutput
from caldrix.sampler import pick_run


class HostEngine:
    def __init__(self, path: Path, *, dtype: torch.dtype, max_batch: int, context: int | None):
        from transformers import AutoModelForCausalLM

        self.model = _load_vision(path, dtype) or AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
        cfg = getattr(self.model.config, "text_config", None) or self.model.config
        self.vocab_size = cfg.vocab_size
        self.takes_images = self.model.config.model_type == "idefics3"
        self.embeddings: dict[int, torch.Tensor] = {}  # image features by key (Run.embeds), as Engine's
        self.context = min(getattr(cfg, "max_position_embeddings", 2048), 8192) if context is None else context
        self.max_batch = max_batch
        self.dtype = dtype
        self.kv_bytes = 0  # grows per request; nothing is allocated up front
        self._rows: list[list[int]] = [[] for _ in range(max_batch)]
        self._cache: list = [None] * max_batch

    @torch.inference_mode()
    def step(self, batch: Batch) -> StepOutput:
        from transformers import DynamicCache

        outs = []
        for r in batch.runs:
            if r.restore or r.snapshot:
                raise NotImplementedError("the host lane runs no snapshots")
            rows = self._rows[r.slot]
            cache = self._cache[r.slot]
            if cache is None or cache.get_seq_length() > r.start:
                # rewind: recompute the kept rows from scratch (reference lane, slow on purpose)
                cache = self._cache[r.slot] = DynamicCache()
                keep = rows[: r.start]
                if keep:
                    self.model(input_ids=torch.tensor([keep]), past_key_values=cache, use_cache=True)
            del rows[r.start :]
            rows.extend(r.token_ids)
            if r.embeds:  # an image prompt's chunk: its <image> rows take the features
                x = self.model.get_input_embeddings()(torch.tensor(r.token_ids))
                for e in r.embeds:
                    lo, hi = max(e.start, r.start), min(e.start + e.count, r.end)
                    if lo < hi:
                        x[lo - r.start : hi - r.start] = self.embeddings[e.key][lo - e.start : hi - e.start].to(x.dtype)
                logits = self.model(inputs_embeds=x[None], past_key_values=cache, use_cache=True).logits
            else:
                logits = self.model(input_ids=torch.tensor([r.token_ids]), past_key_values=cache, use_cache=True).logits
            if not r.pick_at:
                outs.append(RunOutput(()))
                continue
            tokens, read = pick_run(r, logits[0, list(r.pick_at)].float(), rows)
            outs.append(RunOutput(tuple(tokens), tuple(read)))
        return StepOutput(tuple(outs))

    @torch.inference_mode()
    def embed_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Tiles [N, 3, S, S] -> transformers' image features [N * seq, D] (engine.Engine's call)."""
        return self.model.model.get_image_features(pixels[None].to(self.dtype)).pooler_output[0]

    def put_embeddings(self, key: int, rows: torch.Tensor) -> None:
        self.embeddings[key] = rows

    def drop_embeddings(self, keys) -> None:
        for key in keys:
            self.embeddings.pop(key, None)


def _load_vision(path: Path, dtype: torch.dtype):
    """transformers' Idefics3ForConditionalGeneration for an idefics3 directory (SmolVLM), else None."""
    import json

    if json.loads((Path(path) / "config.json").read_text()).get("model_type") != "idefics3":
        return None
    from transformers import Idefics3ForConditionalGeneration

    return Idefics3ForConditionalGeneration.from_pretrained(str(path), dtype=dtype).eval()
