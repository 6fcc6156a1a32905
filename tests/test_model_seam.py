"""The engine seam (models/base.py): a second architecture, defined here in a few lines, served by
the same Engine and Scheduler as llama; snapshots and restores; runs with input embeddings.

The toy model's state is recurrent on purpose, the case llama's rows do not cover: a slot holds
the running sum of its tokens' embeddings, the hidden row at a position is the sum so far, and
the head reads it. Its reference is the same arithmetic written as a plain loop.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from torch import nn

from caldrix.batch import Batch, Run
from caldrix.engine import Engine
from caldrix.models.base import Attend, input_rows
from caldrix.protocol import EmbedSpan
from engine_util import generate, generate_in_turn

V, D = 50, 16


@attrs.frozen
class SumConfig:
    vocab_size: int = V
    hidden_size: int = D


@attrs.frozen
class SumSnapshot:
    slot: int
    length: int
    total: torch.Tensor
    in_place: bool = False  # a copy: later writes into the slot do not touch it


class SumState:
    """Per slot: the sum of the embeddings of its tokens so far, and how many there were."""

    def __init__(self, cfg, num_slots, rows, dtype, device):
        self.total = torch.zeros(num_slots, cfg.hidden_size, dtype=dtype, device=device)
        self.length = [0] * num_slots

    @property
    def nbytes(self) -> int:
        return self.total.nbytes

    def snapshot(self, slot, length):
        assert length == self.length[slot], "a running sum exists only at the end of what was summed"
        return SumSnapshot(slot, length, self.total[slot].clone())

    def restore(self, snap, slot):
        self.total[slot] = snap.total
        self.length[slot] = snap.length


class RunningSum(nn.Module):
    reuses_rows = False  # a sum cannot be cut back to a shorter prefix

    def __init__(self, cfg: SumConfig):
        super().__init__()
        self.cfg = cfg
        g = torch.Generator().manual_seed(3)
        self.embed = nn.Embedding.from_pretrained(torch.randn(V, D, generator=g))
        self.head = nn.Parameter(torch.randn(V, D, generator=g))

    new_state = classmethod(lambda cls, cfg, n, rows, dtype, device: SumState(cfg, n, rows, dtype, device))

    @property
    def dtype(self):
        return self.head.dtype

    def forward(self, ids, at: Attend, state: SumState):
        x = input_rows(self.embed, ids, at)  # [T, D]
        out = torch.empty_like(x)
        for i in range(ids.shape[0]):
            slot = at.slots[0] if at.kind == "prefill" else at.slots[i]
            if at.kind == "decode" and not at.lengths[i]:
                continue  # a padding row
            pos = int(at.positions[i])
            if pos == 0:
                state.total[slot], state.length[slot] = 0, 0  # a fresh sequence
            assert pos == state.length[slot], "a recurrent state cannot rewind"
            state.total[slot] += x[i]
            state.length[slot] = pos + 1
            out[i] = state.total[slot]
        return out

    def logits(self, hidden):
        return (hidden @ self.head.T).float()


def reference(model: RunningSum, prompt, n: int, rows=None) -> list[int]:
    """Greedy decoding as a plain loop; `rows`, input rows to use in place of the prompt's."""
    with torch.inference_mode():
        total = (rows if rows is not None else model.embed.weight[list(prompt)]).sum(0)
        out = []
        for _ in range(n):
            out.append(int(model.logits(total).argmax()))
            total = total + model.embed.weight[out[-1]]
    return out


@pytest.fixture()
def toy():
    return Engine(RunningSum(SumConfig()), max_batch=2, context=64, pad_decode=False)


PROMPTS = [(3, 1, 4, 1, 5, 9, 2, 6, 5, 3), (2, 7, 1, 8)]


def test_a_second_architecture_serves_through_the_same_scheduler(toy):
    # The start-up probe of the lanes computes its decode row twice, restoring the state between.
    assert toy.check_lanes() in (None, "one thread: nothing to overlap") and toy._rows[0] == []
    want = [reference(toy.model, p, 6) for p in PROMPTS]
    assert generate(toy, PROMPTS, 6, together=True, chunk=4) == want
    assert generate(toy, PROMPTS, 6, together=False, chunk=4) == want
    assert not toy.reuses_rows and toy.check_verify() is not None  # no speculation on a running sum


def test_a_recurrent_state_is_reused_only_whole(toy):
    """The slot table restarts a recurrent model only where its state is: the end of what a
    held slot computed. A prompt that extends it all reuses it; one that diverges inside it
    starts over. Either way the reply is the reference's."""
    first = PROMPTS[0]
    (reply, _), = generate_in_turn(toy, [first], 5, chunk=4)
    held = first + tuple(reply[:-1])  # the last pick was never run through the model
    longer, diverging = held + (7, 7), first[:-2] + (8, 8, 8)
    toy2 = Engine(RunningSum(SumConfig()), max_batch=1, context=64, pad_decode=False)
    got = generate_in_turn(toy2, [first, longer, diverging], 5, chunk=4)
    assert [rows for _, rows in got] == [0, len(held), 0]
    assert [r for r, _ in got] == [reference(toy.model, p, 5) for p in (first, longer, diverging)]


def step(engine, *runs):
    return engine.step(Batch(tuple(runs))).runs


def test_snapshot_and_restore_through_runs(toy):
    """A run keeps a snapshot at its end; later runs restore it into the same slot after the slot
    went on, and into another slot: each continues exactly as from the snapshot's tokens."""
    prefix, more = (3, 1, 4, 1, 5), (9, 2, 6)
    step(toy, Run(0, 0, prefix, snapshot=11))
    (out,) = step(toy, Run(0, len(prefix), more, pick_at=(2,)))  # the slot goes on past the snapshot
    assert list(out.token_ids) == reference(toy.model, prefix + more, 1)
    for slot in (0, 1):
        (out,) = step(toy, Run(slot, len(prefix), (8, 8), pick_at=(1,), restore=11))
        assert list(out.token_ids) == reference(toy.model, prefix + (8, 8), 1)
        assert toy._rows[slot] == list(prefix + (8, 8))
    with pytest.raises(ValueError, match="holds 5 positions"):
        step(toy, Run(1, 3, (8,), pick_at=(0,), restore=11))
    toy.drop_snapshot(11)
    with pytest.raises(KeyError):
        toy.restore(11, 0)


def test_input_embeddings_take_the_place_of_token_rows(toy):
    """Positions 3..6 get rows the engine holds (key 5), across chunk boundaries; the reply is
    the one their tokens would give, and the engine forgets the rows when the request ends."""
    prompt, stand_ins = (3, 1, 4, 0, 0, 0, 0, 9, 2), (7, 7, 2, 8)
    rows = toy.model.embed.weight[list(stand_ins)].clone()
    toy.put_embeddings(5, rows)
    (got,) = generate(toy, [prompt], 4, together=True, chunk=4, embeds=[(EmbedSpan(5, 3, 4),)])
    assert got == reference(toy.model, prompt[:3] + stand_ins + prompt[7:], 4)
    assert 5 not in toy.embeddings


def tiny_llama(seed: int = 0):
    from caldrix.models.llama import Decoder, DecoderConfig

    cfg = DecoderConfig(arch="llama", vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                        tie_embeddings=True, max_positions=64)
    model = Decoder(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval().requires_grad_(False)


def test_llama_snapshots_keep_rows_in_place_until_overwritten():
    """For attention-only state a snapshot is the length alone: restoring it into another slot
    copies the rows and the continuation reads the same logits, bit for bit, as the prefix
    computed fresh in that slot. Rewriting the source slot below the length spoils it."""
    engine = Engine(tiny_llama(), max_batch=2, context=32, pad_decode=False)
    assert engine.reuses_rows
    prefix, ids = (5, 6, 7, 8, 9, 10), tuple(range(V))
    step(engine, Run(0, 0, prefix, snapshot=3))
    step(engine, Run(0, len(prefix), (11,)))  # a write past the length: the snapshot holds
    (restored,) = step(engine, Run(1, len(prefix), (12,), pick_at=(0,), restore=3, read_ids=ids))
    step(engine, Run(1, 0, prefix))
    (fresh,) = step(engine, Run(1, len(prefix), (12,), pick_at=(0,), read_ids=ids))
    assert restored == fresh
    step(engine, Run(0, 2, (1, 2)))  # below the length: spoiled
    with pytest.raises(ValueError, match="spoiled"):
        engine.restore(3, 1)


def test_llama_takes_input_embeddings():
    """The embedding rows of other tokens, given as input embeddings through the scheduler, give
    the reply those tokens give."""
    engine = Engine(tiny_llama(1), max_batch=1, context=32, pad_decode=False)
    prompt, stand_ins = (3, 1, 4, 0, 0, 0, 9, 2), (17, 23, 42)
    (want,) = generate(engine, [prompt[:3] + stand_ins + prompt[6:]], 5, together=True, chunk=4)
    engine.put_embeddings(9, engine.model.embed.weight[list(stand_ins)].clone())
    (got,) = generate(engine, [prompt], 5, together=True, chunk=4, embeds=[(EmbedSpan(9, 3, 3),)])
    assert got == want and 9 not in engine.embeddings
