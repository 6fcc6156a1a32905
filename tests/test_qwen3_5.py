"""caldrix/models/qwen3_5.py against transformers' Qwen3.5 on tiny random models built here.

Each model is made from transformers' config classes with a fixed seed, every weight drawn
again at a scale that makes the logits move (the defaults leave norms at zero and the head
near zero), saved with save_pretrained, and read back by load_qwen35. The reference is the
transformers model itself, run with its own cache (its torch fallbacks for the delta rule).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (Qwen3_5Config, Qwen3_5ForCausalLM,  # noqa: E402
                          Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig)

from caldrix.models.base import Attend  # noqa: E402
from caldrix.models.qwen3_5 import Qwen35, Qwen35Config  # noqa: E402
from caldrix.models.qwen3_5_load import load_qwen35  # noqa: E402

VOCAB = 97
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=24, linear_conv_kernel_dim=4, max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True})
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=2,
              temporal_patch_size=1, num_position_embeddings=16)
# (config shape, tied head, layer layout): the text shape names layer_types; the composite one
# leaves them to full_attention_interval, with the tie only at the top level, as a composite
# checkpoint may
VARIANTS = {
    "text-untied": ("text", False, dict(num_hidden_layers=5, layer_types=[
        "linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"])),
    "text-tied": ("text", True, dict(num_hidden_layers=3, layer_types=[
        "full_attention", "linear_attention", "linear_attention"])),
    "composite-tied": ("composite", True, dict(num_hidden_layers=4, full_attention_interval=2)),
}
PROMPT = 150  # three chunks of the delta rule's 64
STEPS = 64


def build(tmp_path, name: str, seed: int = 0):
    shape, tie, layers = VARIANTS[name]
    torch.manual_seed(seed)
    if shape == "text":
        ref = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TEXT, **layers, tie_word_embeddings=tie))
    else:
        ref = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config={**TEXT, **layers}, vision_config=VISION,
                                                            tie_word_embeddings=tie))
    with torch.no_grad():
        for pname, p in ref.named_parameters():
            if "visual" not in pname:
                p.normal_(0.0, 0.3 if p.dim() == 1 else 0.12)
    path = tmp_path / name
    ref.save_pretrained(path)
    return path, ref.eval()


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    path, ref = build(tmp_path_factory.mktemp("qwen35"), request.param)
    return load_qwen35(path, torch.float32), ref


def prompt(n: int = PROMPT, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def prefill(model: Qwen35, state, ids: torch.Tensor, slot: int, start: int) -> torch.Tensor:
    rows = torch.arange(start, start + len(ids))
    return model.logits(model(ids, Attend("prefill", (slot,), rows, rows), state))


def decode(model: Qwen35, state, ids: list[int], slots: list[int], positions: list[int]) -> torch.Tensor:
    """One decode pass, one row per slot; a slot of None is a padding row (the last slot)."""
    scratch = state.num_slots - 1
    real = [s is not None for s in slots]
    slots = [scratch if s is None else s for s in slots]
    pos = torch.tensor([p if r else 0 for p, r in zip(positions, real)])
    lengths = tuple(p + 1 if r else 0 for p, r in zip(positions, real))
    at = Attend("decode", tuple(slots), pos, pos, lengths, torch.tensor(slots))
    return model.logits(model(torch.tensor(ids), at, state))


def reference(ref, ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[int]]:
    """transformers: logits [len(ids) + steps, V] of the prompt then `steps` greedy tokens."""
    with torch.no_grad():
        out = ref(input_ids=ids[None], use_cache=True)
        logits, tokens = [out.logits[0]], []
        for _ in range(steps):
            tokens.append(int(logits[-1][-1].argmax()))
            out = ref(input_ids=torch.tensor([[tokens[-1]]]), cache=out.past_key_values, use_cache=True)
            logits.append(out.logits[0])
    return torch.cat(logits).float(), tokens


def greedy(model: Qwen35, state, slot: int, first: torch.Tensor, start: int, steps: int):
    """Our greedy continuation in `slot` after logits `first` at position start-1."""
    logits, tokens, last = [], [], first
    for i in range(steps):
        tokens.append(int(last.argmax()))
        last = decode(model, state, [tokens[-1]], [slot], [start + i])[0]
        logits.append(last)
    return torch.stack(logits), tokens


@pytest.fixture(scope="module")
def expected(pair):
    _, ref = pair
    return reference(ref, prompt(), STEPS)


def test_config_shapes(tmp_path):
    text = Qwen35Config.from_dict({"model_type": "qwen3_5_text", **TEXT, "num_hidden_layers": 8,
                                   "tie_word_embeddings": True})
    assert text.layer_types == tuple(Qwen3_5TextConfig(**TEXT, num_hidden_layers=8).layer_types)
    assert text.full_layers == (3, 7) and text.rotary_dim == 8 and text.tie_embeddings
    composite = Qwen35Config.from_dict({"model_type": "qwen3_5", "tie_word_embeddings": True, "vision_config": {},
                                        "text_config": {**TEXT, "num_hidden_layers": 4, "full_attention_interval": 2,
                                                        "tie_word_embeddings": False}})
    assert composite.layer_types == ("linear_attention", "full_attention") * 2 and composite.tie_embeddings
    with pytest.raises(ValueError, match="not a Qwen3.5 config"):
        Qwen35Config.from_dict({"model_type": "qwen3", **TEXT, "num_hidden_layers": 2})
    with pytest.raises(ValueError, match="layer_types"):
        Qwen35Config.from_dict({"model_type": "qwen3_5_text", **TEXT, "num_hidden_layers": 2,
                                "layer_types": ["linear_attention"]})


def test_one_shot_prompt_and_decode_match_transformers(pair, expected):
    model, _ = pair
    want, tokens = expected
    state = Qwen35.new_state(model.cfg, 2, 512, torch.float32, "cpu")
    got = prefill(model, state, prompt(), 0, 0)
    torch.testing.assert_close(got, want[:PROMPT], atol=1e-4, rtol=0)
    logits, ours = greedy(model, state, 0, got[-1], PROMPT, STEPS)
    assert ours == tokens
    torch.testing.assert_close(logits, want[PROMPT:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("sizes", [(70, 80), (1, 63, 64, 22), (7,) * 21 + (3,)])
def test_chunked_prompt_matches_transformers(pair, expected, sizes):
    model, _ = pair
    want, _ = expected
    state = Qwen35.new_state(model.cfg, 2, 512, torch.float32, "cpu")
    ids, start, got = prompt(), 0, []
    for n in sizes:
        got.append(prefill(model, state, ids[start:start + n], 0, start))
        start += n
    torch.testing.assert_close(torch.cat(got), want[:PROMPT], atol=1e-4, rtol=0)
    logits, _ = greedy(model, state, 0, got[-1][-1], PROMPT, 8)
    torch.testing.assert_close(logits, want[PROMPT:PROMPT + 8], atol=1e-4, rtol=0)


def test_snapshot_restore_is_exact(pair, expected):
    model, _ = pair
    want, tokens = expected
    ids, cut = prompt(), 90
    state = Qwen35.new_state(model.cfg, 4, 512, torch.float32, "cpu")
    prefill(model, state, ids[:cut], 0, 0)
    kept = state.snapshot(0, cut)  # K/V rows left in slot 0
    alone = state.snapshot(0, cut, copy_kv=True)
    first = prefill(model, state, ids[cut:], 0, cut)
    straight, ours = greedy(model, state, 0, first[-1], PROMPT, STEPS)
    assert ours == tokens
    torch.testing.assert_close(straight, want[PROMPT:], atol=1e-4, rtol=0)

    def again(slot: int) -> torch.Tensor:
        first = prefill(model, state, ids[cut:], slot, cut)
        return greedy(model, state, slot, first[-1], PROMPT, STEPS)[0]

    state.restore(kept, 1)  # into another slot: rows copied from slot 0, which went on past the cut
    assert torch.equal(again(1), straight)
    state.restore(kept, 0)  # into its own slot, after it went on
    assert torch.equal(again(0), straight)
    prefill(model, state, prompt(200, seed=7), 0, 0)  # slot 0 starts another sequence
    state.restore(alone, 2)
    assert torch.equal(again(2), straight)
    with pytest.raises(ValueError, match="another sequence"):
        state.restore(kept, 3)  # its rows were in slot 0, which now holds something else
    with pytest.raises(ValueError, match="current length"):
        state.snapshot(2, cut)


def test_positions_must_continue(pair):
    model, _ = pair
    state = Qwen35.new_state(model.cfg, 2, 512, torch.float32, "cpu")
    prefill(model, state, prompt(20), 0, 0)
    with pytest.raises(ValueError, match="restore a snapshot"):
        prefill(model, state, prompt(5), 0, 10)
    with pytest.raises(ValueError, match="decode row"):
        decode(model, state, [3], [0], [25])
    prefill(model, state, prompt(5), 0, 0)  # position 0 starts over
    assert state.lengths[0] == 5


def test_batch_of_four_decodes_as_alone(pair):
    """Greedy output of 4 slots decoding together equals each decoding alone (padded to 4 rows
    into a scratch slot, as the engine pads its decode steps)."""
    model, _ = pair
    lengths = [30, 75, 5, 130]
    prompts = [prompt(n, seed=10 + i) for i, n in enumerate(lengths)]
    steps = 24
    alone = []
    for p in prompts:
        state = Qwen35.new_state(model.cfg, 5, 256, torch.float32, "cpu")
        last, tokens, logits = prefill(model, state, p, 0, 0)[-1], [], []
        for i in range(steps):
            tokens.append(int(last.argmax()))
            last = decode(model, state, [tokens[-1], 0, 0, 0], [0, None, None, None], [len(p) + i, 0, 0, 0])[0]
            logits.append(last)
        alone.append((tokens, torch.stack(logits)))
    state = Qwen35.new_state(model.cfg, 5, 256, torch.float32, "cpu")
    last = torch.stack([prefill(model, state, p, s, 0)[-1] for s, p in enumerate(prompts)])
    tokens, logits = [[] for _ in prompts], []
    for i in range(steps):
        for s in range(4):
            tokens[s].append(int(last[s].argmax()))
        last = decode(model, state, [t[-1] for t in tokens], [0, 1, 2, 3], [n + i for n in lengths])
        logits.append(last)
    logits = torch.stack(logits, dim=1)  # [slot, step, V]
    for s in range(4):
        assert tokens[s] == alone[s][0]
        assert torch.equal(logits[s], alone[s][1])


def test_bfloat16_loads_and_runs(tmp_path):
    """bf16 weights and activations: as close to transformers' float32 logits as transformers'
    own bf16 run of the prompt is (within a factor of 2), over the prompt and 16 decode steps."""
    path, ref = build(tmp_path, "text-untied", seed=3)
    ids = prompt(100, seed=4)
    want, _ = reference(ref, ids, 16)
    ref16 = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        theirs = ref16(input_ids=ids[None]).logits[0].float()
    model = load_qwen35(path, torch.bfloat16)
    assert model.embed.weight.dtype == torch.bfloat16
    state = Qwen35.new_state(model.cfg, 2, 256, torch.bfloat16, "cpu")
    assert state.rec.dtype == torch.float32 and state.conv.dtype == torch.bfloat16
    first = prefill(model, state, ids, 0, 0)
    rest = []
    for i, t in enumerate(want[len(ids) - 1:-1].argmax(-1).tolist()):  # teacher-forced on float32's path
        rest.append(decode(model, state, [t], [0], [len(ids) + i])[0])
    ours = torch.cat([first, torch.stack(rest)])
    their_err = (theirs - want[:len(ids)]).abs().max()
    assert (ours - want).abs().max() <= 2 * their_err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_logits_are_the_heads_rows(tmp_path, dtype):
    """read_logits (a probe's few label logits, engine.step's read-only path) equals the head's
    logits at those ids; an untied head packed at load keeps no plain rows, so it says None
    and the engine computes the whole head."""
    from caldrix.kernels.packed import can_pack

    ids = (5, 0, 77, 5, 96)
    for name in ("text-tied", "text-untied"):
        path, _ = build(tmp_path, name)
        model = load_qwen35(path, dtype)
        hidden = torch.randn(1, model.cfg.hidden_size).to(dtype)
        got = model.read_logits(hidden, ids)
        if name == "text-untied" and dtype == torch.bfloat16 and can_pack(dtype, "cpu"):
            assert got is None
            continue
        want = model.logits(hidden)[0, list(ids)]
        assert got.dtype == torch.float32 and got.shape == (len(ids),)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7 * want.abs().max().item()
        assert (got - want).abs().max().item() <= tol


def test_compiled_decode_step_is_the_torch_step(tmp_path, monkeypatch):
    """caldrix::delta_decode (kernels/delta.cpp) against the same step in torch ops: three slots
    and two padding rows sharing the scratch slot, 8 teacher-forced steps. float32: logits and
    the slots' conv windows and recurrent matrices agree to 1e-5. bfloat16: the compiled step's
    logits are as close to float32's as the torch step's are (within 1.5x)."""
    import copy

    from caldrix.kernels import native
    from caldrix.models import qwen3_5

    if not native.has_delta_decode():
        pytest.skip("the kernels did not compile here")
    path, _ = build(tmp_path, "text-untied", seed=9)
    lengths = [40, 7, 90]
    forced = torch.randint(0, VOCAB, (8, 3), generator=torch.Generator().manual_seed(8)).tolist()

    def run(dtype, compiled):
        monkeypatch.setattr(qwen3_5, "native_delta", lambda device: compiled)
        model = load_qwen35(path, dtype)
        state = Qwen35.new_state(model.cfg, 4, 256, dtype, "cpu")
        for s, n in enumerate(lengths):
            prefill(model, state, prompt(n, seed=50 + s), s, 0)
        out = [decode(model, state, toks + [0, 0], [0, 1, 2, None, None], [n + i for n in lengths] + [0, 0])[:3]
               for i, toks in enumerate(forced)]
        return torch.stack(out), state

    (ours, st1), (theirs, st2) = run(torch.float32, True), run(torch.float32, False)
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()
    for a, b in ((st1.rec, st2.rec), (st1.conv, st2.conv)):
        assert (a[:, :3] - b[:, :3]).abs().max() <= 1e-5 * b[:, :3].abs().max()
    ours16, theirs16 = run(torch.bfloat16, True)[0], run(torch.bfloat16, False)[0]
    assert (ours16 - theirs).abs().max() <= 1.5 * (theirs16 - theirs).abs().max()
