"""--backend host: the Hugging Face transformers model itself, one run at a time.

The reference lane the own engine is checked against; slow by design. It keeps the same step
contract as engine.Engine, with transformers' own cache per slot (the one its model makes,
which for Qwen3.5 holds conv windows and recurrent matrices beside K/V rows).
"""

from __future__ import annotations

from pathlib import Path

import torch

from caldrix.batch import Batch, RunOutput, StepOutput
from caldrix.sampler import pick_run


def load_host_model(path: Path, dtype: torch.dtype):
    """The transformers model of a Hugging Face directory, in eval mode.

    A composite Qwen3.5 checkpoint (model_type qwen3_5, text_config inside) loads as
    Qwen3_5ForConditionalGeneration: AutoModelForCausalLM would build the text model alone and
    read the tie flag from text_config, so a checkpoint that ties its head only at the top level
    would get a freshly initialized lm_head. Everything else loads through AutoModelForCausalLM."""
    import transformers

    from caldrix.models import model_type

    try:
        kind = model_type(path)
    except ValueError:
        kind = None  # not one of the own engine's: transformers may still know it
    if kind == "qwen3_5":
        cls = transformers.Qwen3_5ForConditionalGeneration
    elif kind == "idefics3":
        cls = transformers.Idefics3ForConditionalGeneration
    else:
        cls = transformers.AutoModelForCausalLM
    return cls.from_pretrained(str(path), dtype=dtype).eval()


class HostEngine:
    def __init__(self, path: Path, *, dtype: torch.dtype, max_batch: int, context: int | None):
        self.model = load_host_model(path, dtype)
        cfg = self.model.config.get_text_config()  # a composite config's text part; else itself
        self.vocab_size = cfg.vocab_size
        self.takes_images = self.model.config.model_type == "idefics3"
        self.embeddings: dict[int, torch.Tensor] = {}  # image features by key (Run.embeds), as Engine's
        self.context = min(getattr(cfg, "max_position_embeddings", 2048), 8192) if context is None else context
        self.max_batch = max_batch
        self.max_threads = torch.get_num_threads()  # as Engine's: what an image slot takes with nothing running
        self.dtype = dtype
        self.kv_bytes = 0  # grows per request; nothing is allocated up front
        self._rows: list[list[int]] = [[] for _ in range(max_batch)]
        self._cache: list = [None] * max_batch  # the cache transformers returned for the slot's rows

    def _forward(self, ids: list[int], slot: int, x: torch.Tensor | None = None) -> torch.Tensor:
        """Feed `ids` (or their input rows `x` [len(ids), D], image features in place) after the
        slot's cached rows (none: a new cache): logits [len(ids), V]."""
        inputs = {"inputs_embeds": x[None]} if x is not None else {"input_ids": torch.tensor([ids])}
        out = self.model(**inputs, past_key_values=self._cache[slot], use_cache=True)
        self._cache[slot] = out.past_key_values
        return out.logits[0]

    @torch.inference_mode()
    def step(self, batch: Batch) -> StepOutput:
        outs = []
        for r in batch.runs:
            if r.restore or r.snapshot:
                raise NotImplementedError("the host lane runs no snapshots")
            rows = self._rows[r.slot]
            if self._cache[r.slot] is None or len(rows) != r.start:
                # rewind: recompute the kept rows from scratch (reference lane, slow on purpose;
                # a recurrent cache cannot be cut back anyway)
                keep = rows[: r.start]
                self._cache[r.slot] = None
                if keep:
                    self._forward(keep, r.slot)
            del rows[r.start :]
            rows.extend(r.token_ids)
            x = self._with_images(r) if r.embeds else None  # an image prompt's chunk
            logits = self._forward(list(r.token_ids), r.slot, x)
            if not r.pick_at:
                outs.append(RunOutput(()))
                continue
            tokens, read = pick_run(r, logits[list(r.pick_at)].float(), rows)
            outs.append(RunOutput(tuple(tokens), tuple(read)))
        return StepOutput(tuple(outs))

    def _with_images(self, r) -> torch.Tensor:
        """The run's input rows [T, D]: the token table's, with the features of its <image> rows."""
        x = self.model.get_input_embeddings()(torch.tensor(r.token_ids))
        for e in r.embeds:
            lo, hi = max(e.start, r.start), min(e.start + e.count, r.end)
            if lo < hi:
                x[lo - r.start : hi - r.start] = self.embeddings[e.key][lo - e.start : hi - e.start].to(x.dtype)
        return x

    @torch.inference_mode()
    def embed_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Tiles [N, 3, S, S] -> transformers' image features [N * seq, D] (engine.Engine's call)."""
        return self.model.model.get_image_features(pixels[None].to(self.dtype)).pooler_output[0]

    def put_embeddings(self, key: int, rows: torch.Tensor) -> None:
        self.embeddings[key] = rows

    def drop_embeddings(self, keys) -> None:
        for key in keys:
            self.embeddings.pop(key, None)

