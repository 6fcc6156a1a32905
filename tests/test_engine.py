"""The engine against the transformers reference: tiny random llama and qwen3 models built here,
and the real embedded SmolLM2. Also batch invariance and the host lane."""

from __future__ import annotations

import sys

import pytest
import torch
import trio

from caldrix.engine import Engine, resolve_dtype
from caldrix.models.base import Attend, KVCache
from caldrix.models.llama_load import load_decoder
from engine_util import generate, generate_in_turn, hf_greedy, prefill

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three colors:",
    "The quick brown fox",
    "In 1492, Columbus",
    "Water boils at a temperature of",
    "My favourite food is",
]


def tiny_model(tmp_path_factory, arch: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1234)
    Cfg, Model = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen3Config, Qwen3ForCausalLM)
    cfg = Cfg(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
              tie_word_embeddings=arch == "qwen3", rope_theta=10000.0)
    model = Model(cfg).eval()
    path = tmp_path_factory.mktemp(f"tiny-{arch}")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    return tiny_model(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(smollm2_dir))


def all_logits(path, ids: list[int], chunk: int) -> torch.Tensor:
    """Our fp32 logits at every prompt position, prefilled in chunks of `chunk` into slot 1."""
    model = load_decoder(path, torch.float32)
    model.setup_rope(len(ids))
    kv = KVCache(model.cfg, 2, len(ids), torch.float32, "cpu")
    out = []
    with torch.inference_mode():
        for s in range(0, len(ids), chunk):
            e = min(s + chunk, len(ids))
            at = Attend("prefill", (1,), torch.arange(s, e), torch.arange(s, e))
            out.append(model.logits(model(torch.tensor(ids[s:e]), at, kv)))
    return torch.cat(out)


def test_tiny_logits_match_transformers(tiny):
    path, ref = tiny
    ids = torch.randint(0, 512, (64,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0]
    for chunk in (64, 17):  # one pass, and chunks that end mid-way
        got = all_logits(path, ids, chunk)
        assert (got - want).abs().max().item() < 1e-4


def test_tiny_greedy_matches_transformers(tiny):
    path, ref = tiny
    gen = torch.Generator().manual_seed(11)
    prompts = [tuple(torch.randint(0, 512, (int(n),), generator=gen).tolist()) for n in torch.randint(3, 40, (8,), generator=gen)]
    engine = Engine.load(path, dtype=torch.float32, max_batch=8, context=256)
    got = generate(engine, prompts, 32, together=True)
    for ids, reply in zip(prompts, got):
        assert reply == hf_greedy(ref, ids, 32)


def test_smollm2_logits_match_transformers(smollm2_dir, smollm2_reference):
    ref, tok = smollm2_reference
    text = " ".join(PROMPTS) * 3
    ids = tok.encode(text)[:64]
    assert len(ids) == 64
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0]
    got = all_logits(smollm2_dir, ids, 24)
    assert (got - want).abs().max().item() < 1e-4


def test_smollm2_greedy_matches_transformers(smollm2_dir, smollm2_reference):
    ref, tok = smollm2_reference
    prompts = [tuple(tok.encode(p)) for p in PROMPTS]
    engine = Engine.load(smollm2_dir, dtype=torch.float32, max_batch=8, context=256)
    got = generate(engine, prompts, 32, together=True)
    for ids, reply in zip(prompts, got):
        assert reply == hf_greedy(ref, ids, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariance(smollm2_dir, smollm2_reference, dtype):
    """8 different prompts decoded together give exactly the tokens each gives alone."""
    _, tok = smollm2_reference
    prompts = [tuple(tok.encode(p)) for p in PROMPTS]
    engine = Engine.load(smollm2_dir, dtype=dtype, max_batch=8, context=256)
    # 24 tokens, as tests/test_int4.py's 4-bit check: a bf16 row that depended on its batch
    # mates would differ by tenths of a logit and flip a token within a few steps.
    alone = generate(engine, prompts, 24, together=False)
    together = generate(engine, prompts, 24, together=True)
    same = sum(a == b for a, b in zip(alone, together))
    assert same == len(prompts), f"{same}/{len(prompts)} identical"


@pytest.mark.parametrize("weights", ["dense", "4-bit"])
def test_no_step_reads_a_kv_row_it_did_not_write(smollm2_dir, smollm2_reference, weights):
    """The KV cache starts uninitialized (KVCache): rows full of NaN must change no reply, with
    decode steps padded (dense) or not (4-bit), prompts of several chunks, batch mates of other
    lengths, and a prompt that reuses a finished one's rows."""
    from caldrix.kernels import q4
    from caldrix.weights.gguf import source_gguf

    if weights == "4-bit" and not q4.runs_4bit(torch.float32, "cpu"):
        pytest.skip("no float32 4-bit kernel on this CPU")
    _, tok = smollm2_reference
    prompts = [tuple(tok.encode(p)) for p in PROMPTS[:4]]
    prompts[1] = prompts[1] * 6  # several 16-token chunks
    gguf = source_gguf(smollm2_dir) if weights == "4-bit" else None
    replies = []
    for fill in (0.0, float("nan")):
        engine = Engine.load(smollm2_dir, dtype=torch.float32, max_batch=4, context=256, int4_from=gguf)
        engine.kv.k.fill_(fill)
        engine.kv.v.fill_(fill)
        together = generate(engine, prompts, 8, together=True)
        again = generate_in_turn(engine, [prompts[1], prompts[1][:-3] + prompts[2]], 8, chunk=16)
        replies.append((together, again))
    assert replies[1] == replies[0]
    assert all(len(r) == 8 for r in replies[1][0])
    assert replies[1][1][1][1] > 0  # the second prompt did reuse the first one's rows


def test_eos_ends_a_reply(tiny):
    path, ref = tiny
    engine = Engine.load(path, dtype=torch.float32, max_batch=2, context=128)
    ids = (5, 6, 7, 8)
    free = hf_greedy(ref, ids, 10)
    stop_at = free[3]
    (reply,) = generate(engine, [ids], 10, together=True, stop=frozenset({stop_at}))
    assert reply == free[: free.index(stop_at)]


def test_host_lane_matches_engine(tiny):
    from caldrix.host_engine import HostEngine

    path, _ = tiny
    prompts = [(1, 2, 3, 4, 5), (9, 8, 7)]
    ours = generate(Engine.load(path, dtype=torch.float32, max_batch=1, context=128), prompts, 20, together=False)
    host = generate(HostEngine(path, dtype=torch.float32, max_batch=1, context=128), prompts, 20, together=False)
    assert ours == host


def test_dtype_auto(monkeypatch):
    import caldrix.engine as eng

    monkeypatch.setattr(eng, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu") is torch.bfloat16
    monkeypatch.setattr(eng, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", "cpu") is torch.float32
    assert resolve_dtype("auto", "cuda") is torch.bfloat16
    assert resolve_dtype("float32", "cuda") is torch.float32


def test_a_mixed_decode_step_picks_what_each_run_picks_alone(tiny):
    """Plain greedy rows share one arg-max; a penalized, a sampled and a logit-reading row take
    their own pick. Each run's token and read logits in one 4-row step equal its step alone."""
    from caldrix.batch import Batch, Run
    from caldrix.protocol import SamplingParams

    path, _ = tiny
    engine = Engine.load(path, dtype=torch.float32, max_batch=4, context=64)
    prompts = [(5, 9, 2, 7), (11, 3, 3, 3), (40, 41, 42), (8, 1, 8, 1, 8)]
    settings = [SamplingParams(), SamplingParams(repetition_penalty=1.3),
                SamplingParams(temperature=0.8, seed=7), SamplingParams()]
    reads = [(), (), (), (3, 17, 200)]

    def runs(tokens):
        return tuple(Run(s, len(p), (t,), (0,), sp, len(p), rd)
                     for s, (p, t, sp, rd) in enumerate(zip(prompts, tokens, settings, reads)))

    firsts = []
    for s, (p, sp) in enumerate(zip(prompts, settings)):
        out = engine.step(Batch((Run(s, 0, p, (len(p) - 1,), sp),)))
        firsts.append(out.runs[0].token_ids[0])
    together = engine.step(Batch(runs(firsts))).runs
    alone = [engine.step(Batch((run,))).runs[0] for run in runs(firsts)]
    assert together == tuple(alone)
    assert len(together[3].read) == 3 and together[0].token_ids != ()


def test_the_heap_loading_freed_goes_back_to_the_os():
    """runtime.release_freed_heap, run once after loading, is glibc's malloc_trim; elsewhere it
    says it could not. Freed pages of a heap it trimmed are no longer resident."""
    import platform

    from caldrix.runtime import release_freed_heap

    if not (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"):
        assert release_freed_heap() is False
        return
    blocks = [bytearray(b"\1" * 64 * 1024) for _ in range(4096)]  # 256 MiB of heap chunks, every page touched
    pin = bytearray(b"\1" * 64 * 1024)  # above them: free() alone cannot shrink the heap from its top
    before = _rss_kib()
    del blocks
    freed = _rss_kib()
    release_freed_heap()
    assert _rss_kib() < min(before, freed) - 128 * 1024
    del pin


def _rss_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_packed_projections_give_the_plain_matmuls_bits(smollm2_dir):
    """A dense bfloat16 engine on a CPU with oneDNN's bf16 support keeps its projections in
    oneDNN's blocked layout (Decoder.pack): the same bits as nn.Linear's matmul, for a prompt
    chunk and for decode steps of 1 and 8 rows."""
    from caldrix.kernels.packed import PackedLinear, can_pack

    if not can_pack(torch.bfloat16, "cpu"):
        pytest.skip("no oneDNN bfloat16 here: projections stay nn.Linear")
    engine = Engine.load(smollm2_dir, dtype=torch.bfloat16, max_batch=8, context=64)
    assert isinstance(engine.model.layers[0].wqkv, PackedLinear)
    plain, packed = load_decoder(smollm2_dir, torch.bfloat16), load_decoder(smollm2_dir, torch.bfloat16)
    packed.pack()
    assert all(isinstance(getattr(b, n), PackedLinear) for b in packed.layers for n in ("wqkv", "wo", "w_gate_up", "w_down"))
    ids = torch.arange(3000, 3040)
    out = []
    for model in (plain, packed):
        rows, kv = prefill(model, ids[:32], slots=8)
        with torch.inference_mode():
            for n in (1, 8):
                slots = tuple(range(n))
                at = Attend("decode", slots, torch.full((n,), 32), torch.full((n,), 32), (33,) * n, torch.arange(n))
                rows.append(model(ids[32:32 + n], at, kv))
        out.append(rows)
    for a, b in zip(*out):
        assert torch.equal(a, b)


@pytest.mark.parametrize("residual", [False, True])
def test_a_packed_projection_takes_long_calls_in_pieces(residual, two_threads):
    """Decoder projections take at most CALL_ROWS rows a oneDNN call (pack_linears): a 300-row
    call is the three calls of its 128, 128 and 44 rows, bit for bit, and the same on one
    thread as on two (what the engine's lanes rest on); the vision tower's packed layers, built
    without the bound, take their tiles whole."""
    from caldrix.kernels.packed import CALL_ROWS, PackedLinear, can_pack, pack_linears

    if not can_pack(torch.bfloat16, "cpu"):
        pytest.skip("no oneDNN bfloat16 here: projections stay nn.Linear")
    g = torch.Generator().manual_seed(0)
    holder = torch.nn.Sequential(torch.nn.Linear(576, 960, bias=False).bfloat16())
    assert pack_linears(holder) == 1 and holder[0].max_rows == CALL_ROWS == 128
    assert PackedLinear(torch.zeros(32, 32, dtype=torch.bfloat16)).max_rows is None  # siglip's: whole tiles
    lin = holder[0]
    x = torch.randn(300, 576, generator=g).bfloat16()
    r = torch.randn(300, 960, generator=g).bfloat16() if residual else None
    whole = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        whole[threads] = lin(x, r) if residual else lin(x)
    parts = [lin(x[i:i + 128], r[i:i + 128]) if residual else lin(x[i:i + 128]) for i in range(0, 300, 128)]
    assert torch.equal(whole[2], torch.cat(parts)) and torch.equal(whole[1], whole[2])
