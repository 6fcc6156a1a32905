"""Qwen3.5 through the real Engine and Scheduler (tests/engine_util.py), against transformers.

The tiny random models are tests/test_qwen3_5.py's `build()`: a text config with an untied
head, a text config with a tied one, and a composite config (text_config inside) tied at the top
level. The reference is transformers' own greedy decoding of the same weights (test_qwen3_5's `reference`).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from engine_util import generate, generate_in_turn  # noqa: E402
from test_qwen3_5 import VARIANTS, VOCAB, build, reference  # noqa: E402

from caldrix.batch import Batch, Run  # noqa: E402
from caldrix.engine import Engine  # noqa: E402

STEPS = 64
ALL_IDS = tuple(range(VOCAB))  # read every logit of a pick: bit-for-bit comparisons


def hf_greedy(ref, prompt: tuple[int, ...], n: int) -> list[int]:
    """transformers' greedy reply (its own cache, which a Qwen3.5 needs: engine_util's plain
    DynamicCache has no linear-attention layers)."""
    return reference(ref, torch.tensor(prompt), n)[1]


def ids(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


@pytest.fixture(scope="module", params=list(VARIANTS))
def model(request, tmp_path_factory):
    """(directory, transformers model) of one variant."""
    return build(tmp_path_factory.mktemp("q35e"), request.param, seed=5)


def load(path, max_batch: int) -> Engine:
    return Engine.load(path, dtype=torch.float32, max_batch=max_batch, context=256)


def test_engine_greedy_matches_transformers_in_chunks(model):
    """One prompt, prefilled in chunks of 7, 32 and 128 positions (--prefill-chunk), then 64
    greedy steps: transformers' tokens every time."""
    path, ref = model
    engine = load(path, 1)
    assert not engine.reuses_rows
    prompt = ids(90, seed=1)
    want = hf_greedy(ref, prompt, STEPS)
    for chunk in (7, 32, 128):
        assert generate(engine, [prompt], STEPS, together=False, chunk=chunk) == [want], chunk


def test_engine_batch_of_four_is_batch_invariant(model):
    """max_batch 4: four prompts of different lengths decoding together give what each gives
    alone, which is transformers' greedy reply."""
    path, ref = model
    engine = load(path, 4)
    prompts = [ids(n, seed=20 + i) for i, n in enumerate((3, 41, 17, 70))]
    together = generate(engine, prompts, 24, together=True, chunk=16)
    alone = generate(engine, prompts, 24, together=False, chunk=16)
    assert together == alone
    assert together == [hf_greedy(ref, p, 24) for p in prompts]


def _continue(engine: Engine, slot: int, start: int, tail: tuple[int, ...], steps: int, restore: int = 0):
    """Prefill `tail` into `slot` at `start` (after restoring snapshot `restore`, if any), then
    decode greedily: [(token, every logit at its pick)] for the first pick and `steps` more."""
    out = engine.step(Batch((Run(slot, start, tail, (len(tail) - 1,), read_ids=ALL_IDS, restore=restore),))).runs[0]
    got = [(out.token_ids[0], out.read)]
    pos = start + len(tail)
    for i in range(steps):
        out = engine.step(Batch((Run(slot, pos + i, (got[-1][0],), (0,), read_ids=ALL_IDS),))).runs[0]
        got.append((out.token_ids[0], out.read))
    return got


def test_engine_snapshot_restore_continues_bit_for_bit(model):
    """Run.snapshot keeps a slot's state mid-prompt; Run.restore puts it into another slot, and
    into its own after it went on: the continuation equals the straight one bit for bit (every
    logit), and its tokens are transformers'."""
    path, ref = model
    engine = load(path, 2)
    prompt, cut = ids(80, seed=3), 50
    engine.step(Batch((Run(0, 0, prompt[:cut], snapshot=7),)))
    straight = _continue(engine, 0, cut, prompt[cut:], STEPS - 1)
    assert [t for t, _ in straight] == hf_greedy(ref, prompt, STEPS)
    assert _continue(engine, 1, cut, prompt[cut:], STEPS - 1, restore=7) == straight
    assert _continue(engine, 0, cut, prompt[cut:], STEPS - 1, restore=7) == straight
    engine.drop_snapshot(7)
    with pytest.raises(KeyError):
        engine.restore(7, 1)


def test_held_slot_is_reused_whole_or_not_at_all(model):
    """SlotTable with reuse_rows False: a prompt that begins with everything the held slot
    computed goes on from it; one that diverges mid-prefix starts over. Both replies are
    transformers'."""
    path, ref = model
    engine = load(path, 1)
    first = ids(30, seed=4)
    reply = hf_greedy(ref, first, 12)
    longer = first + tuple(reply) + ids(9, seed=5)
    diverged = first[:15] + ids(20, seed=6)
    got = generate_in_turn(engine, [first, longer, diverged], 12, chunk=16)
    assert got[0] == (reply, 0)
    # the whole held state: the prompt and the 11 reply tokens fed back (the last one never was)
    assert got[1] == (hf_greedy(ref, longer, 12), len(first) + 11)
    assert got[2] == (hf_greedy(ref, diverged, 12), 0)  # a mid-prefix divergence starts over


def test_speculation_is_refused(model):
    path, _ = model
    engine = load(path, 1)
    assert engine.check_verify() == "the model keeps a recurrent state, which cannot take back a rejected guess"
    assert not engine.can_verify


def test_the_lane_probe_reads_only_its_own_row(model, two_threads):
    """A padded decode step's padding rows run over whatever the scratch slot last held (the
    recurrent rule on leftover state), so the thread probe compares the probe's own row only:
    in bfloat16 a Qwen3.5 engine's steps are the same on one thread as on two, and the lanes
    overlap at --max-batch 4 as they do at 1."""
    path, _ = model
    for max_batch in (1, 4):
        engine = Engine.load(path, dtype=torch.bfloat16, max_batch=max_batch, context=256)
        assert engine.lanes_why is None, (max_batch, engine.lanes_why)
    assert torch.tensor(1e-40).item() != 0.0  # the model's flush of subnormals ended with its pass


def test_host_lane_equals_the_cpu_lane(model):
    """--backend host (transformers' own classes, a composite checkpoint as
    Qwen3_5ForConditionalGeneration so its top-level tie holds) gives the cpu lane's greedy
    replies, including a second prompt in the same slot that rewinds it."""
    from caldrix.host_engine import HostEngine

    path, ref = model
    prompts = [ids(40, seed=8), ids(9, seed=9)]
    host = HostEngine(path, dtype=torch.float32, max_batch=1, context=256)
    assert host.vocab_size == VOCAB
    ours = generate(load(path, 1), prompts, 20, together=False, chunk=16)
    assert generate(host, prompts, 20, together=False, chunk=16) == ours
    assert ours == [hf_greedy(ref, p, 20) for p in prompts]


@pytest.mark.parametrize("backend, seen", [("cuda", "cuda"), ("hip", "hip"), ("auto", "cuda"), ("auto", "hip")])
def test_gpu_lanes_refuse_qwen35_at_start(model, tmp_path, monkeypatch, capsys, backend, seen):
    """`caldrix run DIR --backend cuda|hip` (or auto) where torch sees that GPU (simulated) on a
    Qwen3.5 directory of either config shape exits 2 naming the model, before any weight is
    read. (Without the GPU an explicit backend is refused first, for the machine: test_cli.py.)"""
    import json

    from caldrix import cli, lanes

    path, _ = model
    raw = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").write_bytes(b"never read")
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(lanes, "gpu_seen", lambda: seen)
    assert cli.main(["run", str(tmp_path), "hi", "--backend", backend]) == 2
    lane = seen or backend
    name = "decider-0.8b (qwen3_5)" if raw["model_type"] == "qwen3_5" else "Qwen3.5 (qwen3_5_text)"
    assert capsys.readouterr().err.strip() == (
        f"caldrix: --backend {lane}: {name} is a cpu-lane model: its gated delta-net layers run on the cpu "
        f"lane (and --backend host) only; use --backend cpu")
