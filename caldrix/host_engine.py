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

        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
        cfg = self.model.config
        self.vocab_size = cfg.vocab_size
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
            if r.embeds or r.restore or r.snapshot:
                raise NotImplementedError("the host lane runs token ids only: no input embeddings or snapshots")
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
            logits = self.model(input_ids=torch.tensor([r.token_ids]), past_key_values=cache, use_cache=True).logits
            if not r.pick_at:
                outs.append(RunOutput(()))
                continue
            tokens, read = pick_run(r, logits[0, list(r.pick_at)].float(), rows)
            outs.append(RunOutput(tuple(tokens), tuple(read)))
        return StepOutput(tuple(outs))
