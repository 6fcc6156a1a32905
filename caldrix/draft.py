"""A draft model for speculative decoding (--speculate draft): proposes guesses greedily.

The draft runs in its own Engine with one slot (max_batch 1), on the same lane and in the same
worker thread as the target's step, which calls `propose` for a run marked `Run.draft`. The
draft's slot keeps the rows of the last sequence it proposed for; `_rows[0]` (the engine's
mirror of the slot's token ids) says which. Before proposing it catches up: only the tokens
after the common prefix of its rows and the sequence are fed, which after a verify is the one
correction (or, when every guess was kept, the last guess and the correction). A new request
whose prompt shares a prefix with the previous one reuses those rows too.

The draft's guesses are never the reply: the target verifies them (engine.py, Run.verify), so a
draft that proposes badly costs time, never correctness. What the draft must share with the
target is the vocabulary: a token id has to mean the same text in both (`vocab_mismatch`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from caldrix.batch import Batch, Run

CATCH_UP_CHUNK = 256  # the draft prefills a new prompt in chunks of this many tokens


class DraftProposer:
    """Greedy guesses from a draft Engine (max_batch 1)."""

    def __init__(self, engine) -> None:
        assert engine.max_batch == 1, "the draft runs one sequence"
        self.engine = engine

    @torch.inference_mode()
    def propose(self, tokens: list[int], k: int, threads: int = 0) -> tuple[int, ...]:
        """Up to k greedy next tokens after `tokens` (the sequence's known tokens, the last one
        included); fewer where the draft's context ends."""
        eng = self.engine
        k = min(k, eng.context - len(tokens))
        if k <= 0 or not tokens:
            return ()
        rows = eng._rows[0]
        same = 0
        limit = min(len(rows), len(tokens) - 1)  # the last token always runs: its pick is wanted
        while same < limit and rows[same] == tokens[same]:
            same += 1
        # Catch up: every chunk but the last fills rows only; the last picks the first guess.
        while len(tokens) - same > CATCH_UP_CHUNK:
            eng.step(Batch((Run(0, same, tuple(tokens[same:same + CATCH_UP_CHUNK])),), threads))
            same += CATCH_UP_CHUNK
        tail = tuple(tokens[same:])
        out = eng.step(Batch((Run(0, same, tail, (len(tail) - 1,)),), threads))
        guesses = [out.runs[0].token_ids[0]]
        pos = len(tokens)
        while len(guesses) < k:
            out = eng.step(Batch((Run(0, pos, (guesses[-1],), (0,)),), threads))
            guesses.append(out.runs[0].token_ids[0])
            pos += 1
        return tuple(guesses)


def vocab_mismatch(target_dir: Path, draft_dir: Path, target_tok, draft_tok, target_vocab: int,
                   draft_vocab: int) -> str | None:
    """What differs between the target's and the draft's vocabularies, or None if a token id
    means the same in both: the models' vocab sizes, the tokenizers' token strings, and the
    special ids (eos, bos, pad)."""
    if target_vocab != draft_vocab:
        return f"vocab size: the target has {target_vocab} rows, the draft {draft_vocab}"
    a, b = target_tok.hf.get_vocab(), draft_tok.hf.get_vocab()
    if a != b:
        only_a = sorted(set(a) - set(b))
        only_b = sorted(set(b) - set(a))
        moved = sorted(t for t in set(a) & set(b) if a[t] != b[t])
        if only_a or only_b:
            t = (only_a or only_b)[0]
            side = "the target's" if only_a else "the draft's"
            return (f"token strings: {len(only_a)} only in the target's tokenizer, {len(only_b)} only in the "
                    f"draft's (e.g. {t!r}, only in {side})")
        t = moved[0]
        return f"token ids: {len(moved)} tokens have another id (e.g. {t!r}: {a[t]} in the target, {b[t]} in the draft)"
    if target_tok.eos_token_ids != draft_tok.eos_token_ids:
        return (f"eos ids: the target stops on {sorted(target_tok.eos_token_ids)}, "
                f"the draft on {sorted(draft_tok.eos_token_ids)}")
    for name in ("bos_token_id", "pad_token_id"):
        x, y = getattr(target_tok.hf, name, None), getattr(draft_tok.hf, name, None)
        if x != y:
            return f"{name.removesuffix('_token_id')} id: {x} in the target, {y} in the draft"
    return None


IDENTITY_SAMPLES = 16  # slices of each weight file read into its identity
IDENTITY_SLICE = 64 * 1024


def model_identity(path: Path) -> str:
    """A short digest naming a model's weights: its config.json, and its weight files' names,
    sizes and IDENTITY_SAMPLES slices of their bytes spread over each file (about 1 MiB read a
    file). Sizes alone named a retrained model of the same shapes as the old one, whose tuner
    state then passed for its own; a retrained or re-quantized model changes every slice."""
    import hashlib

    h = hashlib.sha256()
    cfg = path / "config.json"
    h.update(cfg.read_bytes() if cfg.exists() else b"")
    for f in sorted(path.iterdir()):
        if f.suffix in (".safetensors", ".gguf", ".bin", ".pt"):
            size = f.stat().st_size
            h.update(f"{f.name}:{size};".encode())
            with f.open("rb") as fh:
                for i in range(IDENTITY_SAMPLES):
                    fh.seek(size * i // IDENTITY_SAMPLES)
                    h.update(fh.read(IDENTITY_SLICE))
    return h.hexdigest()[:16]

