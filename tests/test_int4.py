"""The GGUF's Q4_1 blocks kept 4-bit (caldrix/kernels/q4.py, models/llama_load.py) on the embedded SmolLM2."""

from __future__ import annotations

import os

import pytest
import torch

from caldrix.engine import Engine
from caldrix.kernels import q4
from caldrix.models import llama_load
from caldrix.models.base import Attend, KVCache
from caldrix.models.llama_load import load_decoder
from caldrix.weights.gguf import source_gguf
from engine_util import generate, generate_in_turn, prefill

pytestmark = pytest.mark.skipif(not q4.available(), reason="this torch has no int4 CPU matmul")


@pytest.fixture(scope="module")
def gguf_file(smollm2_dir):
    path = source_gguf(smollm2_dir)
    assert path is not None and path.suffix == ".gguf"
    return path


@pytest.fixture(scope="module")
def models(smollm2_dir, gguf_file):
    dense = load_decoder(smollm2_dir, torch.float32)
    quant = load_decoder(smollm2_dir, torch.bfloat16)
    assert llama_load.quantize_from_gguf(quant, gguf_file) == 4 * dense.cfg.num_layers
    return dense, quant


@pytest.mark.parametrize("layer", [0, 29])
@pytest.mark.parametrize("name", ["wqkv", "wo", "w_gate_up", "w_down"])
def test_4bit_weights_are_the_dequantized_weights(models, layer, name):
    """Multiplying by the identity reads each 4-bit weight back; it must equal the weight
    transformers dequantized from the same file, up to bfloat16 rounding. A wrong nibble order
    or q/k row permutation would be off by the weights' own size."""
    dense, quant = models
    lin = getattr(quant.layers[layer], name)
    assert isinstance(lin, q4.Int4Linear)
    want = getattr(dense.layers[layer], name).weight
    # The kernel itself: lin(...) would take the dense weights for this many rows.
    eye = torch.eye(lin.in_features, dtype=torch.bfloat16)
    got = q4.int4_mm(eye, lin.packed, lin.scale_zero, lin.ours).float().T
    rel = (got - want).abs().max() / want.abs().max()
    assert rel < 0.01


def test_4bit_logits_follow_the_reference(smollm2_dir, models):
    dense, quant = models
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(smollm2_dir)).encode("The history of the printing press begins in " * 8)[:64]
    logits = []
    for model in (dense, quant):
        model.setup_rope(64)
        kv = KVCache(model.cfg, 1, 64, model.embed.weight.dtype, "cpu")
        with torch.inference_mode():
            at = Attend("prefill", (0,), torch.arange(64), torch.arange(64))
            logits.append(model.logits(model(torch.tensor(ids), at, kv)))
    ref, got = logits
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"top-1 agreement {agree:.2f}"


def test_4bit_batch_invariance(smollm2_dir, gguf_file):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompts = [tuple(tok.encode(p)) for p in ("The capital of France is", "def add(a, b):", "Once upon a time",
                                              "Water boils at", "My name is", "List three fruits:")]
    engine = Engine.load(smollm2_dir, dtype=torch.bfloat16, max_batch=8, context=128, int4_from=gguf_file)
    alone = generate(engine, prompts, 24, together=False)
    together = generate(engine, prompts, 24, together=True)
    assert alone == together


def test_a_repeated_prompt_gets_the_same_reply_from_its_held_rows(smollm2_dir, gguf_file):
    """The second time, the slot still holds the prompt's rows and only its last token is
    recomputed (SlotTable's reuse). The first time runs that token alone too (Policy._chunk),
    so both compute it in the decode form and the replies match. Before that rule the first
    computed it inside the prompt's chunk, and this prompt's 48-token reply changed."""
    import random

    rng = random.Random(6)
    prompt = tuple(rng.randrange(1000, 30000) for _ in range(20))
    engine = Engine.load(smollm2_dir, dtype=torch.bfloat16, max_batch=1, context=128, int4_from=gguf_file)
    (first, reused0), (again, reused1) = generate_in_turn(engine, [prompt, prompt], 48)
    assert (reused0, reused1) == (0, 19)
    assert again == first




@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weights", ["4-bit", "dense"])
def test_lanes_overlap_only_where_steps_do_not_depend_on_the_thread_count(smollm2_dir, gguf_file, weights, dtype,
                                                                          two_threads):
    """The scheduler runs a decode step and a prefill chunk at once on one core each, and
    alone on every core, where Engine.check_lanes found the bits the same either way; else a
    reply would depend on whether another prompt was arriving. Two slots, chunks and decode
    positions other than the probe's: the engine's answer must hold for them too."""
    if weights == "4-bit" and not q4.runs_4bit(dtype, "cpu"):
        pytest.skip(f"no 4-bit kernel for {dtype} on this CPU")
    engine = Engine.load(smollm2_dir, dtype=dtype, max_batch=2, context=256,
                         int4_from=gguf_file if weights == "4-bit" else None)
    model, kv = engine.model, engine.kv
    ids = torch.arange(1000, 1160) % engine.vocab_size
    got = {}
    with torch.inference_mode():
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for slot in range(2):  # a 128-token chunk, then a 32-token one after it
                h1 = model(ids[:128], Attend("prefill", (slot,), torch.arange(128), torch.arange(128)), kv)
                h2 = model(ids[128:160], Attend("prefill", (slot,), torch.arange(128, 160), torch.arange(128, 160)), kv)
            pos = torch.tensor([160, 140])
            slots = (0, 1)
            at = Attend("decode", slots, pos, pos, tuple(int(p) + 1 for p in pos), torch.tensor(slots), engine.native_attend)
            d = model(ids[:2], at, kv)
            got[threads] = (h1.clone(), h2.clone(), d.clone(), model.logits(d))
    torch.set_num_threads(engine.max_threads)
    same = all(torch.equal(a, b) for a, b in zip(got[1], got[2]))
    assert engine.overlap_lanes == same, engine.lanes_why
    if dtype == torch.bfloat16:  # measured on every development machine: bfloat16 keeps its sums whole
        assert engine.overlap_lanes


def test_a_step_that_depends_on_the_thread_count_keeps_the_lanes_apart(smollm2_dir, monkeypatch, two_threads):
    # bfloat16: its dense kernels keep their sums whole on every machine seen so far, so only the
    # patched head can differ (float32 dense splits them on some CPUs, and the probe would stop
    # at the prefill chunk first).
    engine = Engine.load(smollm2_dir, dtype=torch.bfloat16, max_batch=2, context=256)
    # A head whose last bits follow the thread count, as a matmul that splits its sums does.
    head = engine.model.logits
    monkeypatch.setattr(engine.model, "logits", lambda h: head(h) + torch.get_num_threads() * 2.0**-20)
    why = engine.check_lanes()
    assert not engine.overlap_lanes
    assert why == engine.lanes_why and why.startswith("a decode step's logits on 1 thread differs from 2 threads")
    monkeypatch.setattr(engine.model, "logits", head)
    assert engine.check_lanes() is None and engine.overlap_lanes
    assert engine._rows[0] == []  # the probe leaves its slot empty


@pytest.mark.parametrize("ours", [True, False], ids=["q4_mm", "torch-int4"])
def test_only_torchs_int4_kernel_keeps_dense_projections(smollm2_dir, gguf_file, monkeypatch, ours):
    """Through caldrix's kernel prefill chunks take the 4-bit blocks too, so the loader never
    reads the dense projections (212 MB of bfloat16 for SmolLM2, a fifth of the server's peak
    memory before); torch's int4 kernel is slower than the dense matmul for long chunks, so
    there the dense weights are read and kept for them."""
    from caldrix.kernels import native
    from caldrix.weights.tensor_files import TensorFiles

    if ours and not native.has_q4_mm():
        pytest.skip("caldrix::q4_mm is not built on this CPU")
    if not ours:
        monkeypatch.setattr(native, "has_q4_mm", lambda: False)
    read = []  # (name, rows or None for the whole tensor)
    get = TensorFiles.get
    monkeypatch.setattr(TensorFiles, "get", lambda self, name, rows=None: read.append((name, rows)) or get(self, name, rows))
    engine = Engine.load(smollm2_dir, dtype=torch.bfloat16, max_batch=2, context=256, int4_from=gguf_file)
    projections = [m for b in engine.model.layers for m in (b.wqkv, b.wo, b.w_gate_up, b.w_down)]
    assert engine.int4_ours is ours and all(isinstance(m, q4.Int4Linear) for m in projections)
    assert all((m.dense is None) is ours for m in projections)
    assert any("_proj." in name for name, _ in read) is not ours
    assert any("norm" in name for name, _ in read)
    # The embedding: read whole where it is kept; through q4_mm only a slice at a time, to check
    # the rows read from the head's blocks (test_the_tied_embedding_is_read_from_the_head...).
    embed_reads = [rows for name, rows in read if "embed_tokens" in name]
    assert embed_reads and all((rows is not None) is ours for rows in embed_reads)
    assert engine.q8_embed is ours
    # A 160-token prompt in two chunks, then decode: the engine answers either way.
    ids = tuple(range(1000, 1160))
    (reply,) = generate(engine, [ids], 4, together=True)
    assert len(reply) == 4


def test_a_projection_the_loader_skipped_refuses_to_run(smollm2_dir):
    from caldrix.models.llama_load import Pending

    skip = frozenset({"layers.0.wo.weight", "layers.3.w_down.weight", "embed.weight"})
    model = load_decoder(smollm2_dir, torch.bfloat16, skip=skip)
    assert isinstance(model.layers[0].wo, Pending) and isinstance(model.layers[3].w_down, Pending)
    assert isinstance(model.embed, Pending)
    with pytest.raises(RuntimeError, match="never loaded"):
        model.embed(torch.tensor([1, 2]))
    assert model.layers[0].wo.in_features == model.cfg.num_heads * model.cfg.head_dim
    assert isinstance(model.layers[1].wo, torch.nn.Linear)
    with pytest.raises(RuntimeError, match="never loaded"):
        model.layers[0].wo(torch.zeros(1, model.cfg.hidden_size, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="missing"):
        load_decoder(smollm2_dir, torch.bfloat16, skip=frozenset({"layers.0.nothing.weight"}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_q8_0_head_laid_out_in_slices_is_the_head_laid_out_whole(dtype, monkeypatch):
    """Q8AsInt4Linear lays out caldrix's kernel operands a slice of rows at a time (the whole
    head's temporaries were loading's peak memory); every buffer must be what one slice gives,
    a short last slice included."""
    if not q4.ours_built(dtype):
        pytest.skip(f"caldrix's kernel for {dtype} is not built on this CPU")
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-128, 128, (5008, 96), generator=gen).to(torch.int8)
    d = (torch.rand(5008, 3, generator=gen) * 0.01).half().float()
    monkeypatch.setattr(q4, "HEAD_SLICE", 1 << 30)
    whole = q4.Q8AsInt4Linear(q, d, ours=True, dtype=dtype)
    monkeypatch.setattr(q4, "HEAD_SLICE", 1024)
    sliced = q4.Q8AsInt4Linear(q, d, ours=True, dtype=dtype)
    for name in ("hi_packed", "hi_scale_zero", "lo_packed", "lo_scale_zero"):
        assert torch.equal(getattr(whole, name), getattr(sliced, name)), name


def test_q4_dense_reads_back_the_q4_1_weights():
    """caldrix::q4_dense unpacks q4_mm's layout into dense bfloat16 weights: each value
    bfloat16(float32(d) * q + float32(m)), rounded once, as the GGUF's float32 dequantization
    cast to bfloat16; every nibble (0 and 15 included) and every column of a group in place."""
    if not q4.ours_built(torch.bfloat16):
        pytest.skip("caldrix::q4_mm is not built on this CPU")
    gen = torch.Generator().manual_seed(2)
    for n, k in ((16, 32), (48, 96), (576, 1536), (1536, 576)):
        q = torch.randint(0, 16, (n, k), generator=gen)
        q[0, 0], q[-1, -1] = 0, 15
        d = (torch.randn(n, k // 32, generator=gen) * 0.02).half().float()
        m = (torch.randn(n, k // 32, generator=gen) * 0.2).half().float()
        want = (q.float() * d.repeat_interleave(32, dim=1) + m.repeat_interleave(32, dim=1)).bfloat16()
        got = torch.ops.caldrix.q4_dense(*q4.q4_mm_layout(q, d, m))
        assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16)), (n, k)


def test_long_prefill_chunks_take_the_dense_conversions_bits(smollm2_dir, models):
    """Through caldrix's kernel a call of more than UNPACK_FROM_ROWS rows unpacks the blocks and
    takes the dense matmul: every projection's unpacked weights are the dense bfloat16 model's
    bits, so a long prefill chunk's hidden rows are the dense model's exactly; a decode-sized
    call keeps q4_mm."""
    dense32, quant = models
    if not quant.int4_ours:
        pytest.skip("caldrix::q4_mm is not built on this CPU")
    if not q4.unpacks_long_calls():
        assert quant.layers[0].wqkv.unpack_rows is None
        pytest.skip("no AMX here: long calls stay on q4_mm")
    for i, layer in enumerate(quant.layers):
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            lin = getattr(layer, name)
            want = getattr(dense32.layers[i], name).weight.bfloat16()
            assert torch.equal(torch.ops.caldrix.q4_dense(lin.packed, lin.scale_zero), want), (i, name)
    lin = quant.layers[3].w_down
    x = torch.randn(q4.UNPACK_FROM_ROWS + 1, lin.in_features).bfloat16()
    assert torch.equal(lin(x), torch.nn.functional.linear(x, dense32.layers[3].w_down.weight.bfloat16()))
    assert torch.equal(lin(x[:8]), q4.int4_mm(x[:8], lin.packed, lin.scale_zero, True))

    dense = load_decoder(smollm2_dir, torch.bfloat16)
    ids = torch.arange(1000, 1064)
    (dense_rows,), _ = prefill(dense, ids)
    (quant_rows,), _ = prefill(quant, ids)
    assert torch.equal(dense_rows, quant_rows)


def test_a_long_unpacked_call_gives_the_same_bits_on_one_thread_as_on_two(models):
    """A 512-row chunk on unpacked weights is multiplied in pieces of UNPACKED_CALL_ROWS rows:
    in one oneDNN call of 512 rows the sums split between two threads (other bits than on one,
    which would make a reply depend on whether the lanes overlapped). Every projection, 1 against
    2 threads, bit for bit; and the pieces are the rows' own results at 128 rows."""
    _, quant = models
    if not quant.layers[0].wqkv.unpack_rows:
        pytest.skip("prompt chunks stay on the 4-bit kernel here (no AMX)")
    saved = torch.get_num_threads()
    gen = torch.Generator().manual_seed(3)
    try:
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            lin = getattr(quant.layers[2], name)
            x = torch.randn(512, lin.in_features, generator=gen).bfloat16()
            out = {}
            for threads in (1, 2):
                torch.set_num_threads(threads)
                out[threads] = lin(x)
            assert torch.equal(out[1], out[2]), name
            assert torch.equal(out[2][128:256], lin(x[128:256])), name
    finally:
        torch.set_num_threads(saved)


def test_the_default_prefill_chunk_follows_the_lanes(smollm2_dir, gguf_file):
    """--prefill-chunk's default: 512 where the lanes overlap (the start-up probe then ran a
    512-row chunk on 1 and 2 threads, or a 128-row one where only the 512-row chunk differed),
    else 128; 4-bit and dense alike."""
    engine = Engine.load(smollm2_dir, dtype=torch.bfloat16, max_batch=1, context=1200, int4_from=gguf_file)
    amx = q4.unpacks_long_calls() and engine.int4_ours and torch.get_num_threads() >= 2
    if amx:  # the probe's 512-row chunk must pass: unpacked calls run in 128-row pieces
        assert engine.unpacks_prompts and engine.lanes_why is None, engine.lanes_why
        assert engine.default_prefill_chunk == 512
    dense = Engine.load(smollm2_dir, dtype=torch.bfloat16, max_batch=1, context=1200)
    assert not dense.unpacks_prompts
    for e in (engine, dense):
        assert e.default_prefill_chunk == (e.lanes_chunk if e.overlap_lanes else 128)
    if torch.get_num_threads() >= 2:  # dense matmuls run in 128-row pieces (kernels/packed.CALL_ROWS)
        assert dense.overlap_lanes and dense.default_prefill_chunk == 512, dense.lanes_why


def test_the_lane_probe_falls_back_to_the_short_chunk(smollm2_dir, monkeypatch, two_threads):
    """Where only the long probe chunk's bits follow the thread count, the lanes still overlap,
    with 128-row chunks; where a decode step's do, they do not, whatever the chunk."""
    engine = Engine.load(smollm2_dir, dtype=torch.bfloat16, max_batch=1, context=1200)
    forward = engine.model.forward

    def long_rows_differ(ids, at, kv):  # as a matmul that splits its sums past 128 rows would
        h = forward(ids, at, kv)
        return h + torch.get_num_threads() * 2.0**-10 if len(ids) > 128 else h

    monkeypatch.setattr(engine.model, "forward", long_rows_differ)
    assert engine.check_lanes() is None and engine.overlap_lanes
    assert engine.lanes_chunk == 128 and engine.default_prefill_chunk == 128
    monkeypatch.setattr(engine.model, "forward", forward)
    head = engine.model.logits
    monkeypatch.setattr(engine.model, "logits", lambda h: head(h) + torch.get_num_threads() * 2.0**-20)
    assert engine.check_lanes().startswith("a decode step's logits") and engine.default_prefill_chunk == 128
    # without the lanes every step runs on every core: the 128-row pieces only cost time
    assert {m.max_rows for m in packed_layers(engine)} == {None}
    monkeypatch.setattr(engine.model, "logits", head)
    assert engine.check_lanes() is None and engine.default_prefill_chunk == 512
    assert {m.max_rows for m in packed_layers(engine)} == {128}
    assert engine._rows[0] == []


def packed_layers(engine):
    from caldrix.kernels.packed import PackedLinear

    layers = [m for m in engine.model.modules() if isinstance(m, PackedLinear)]
    assert len(layers) >= 4 * engine.model.cfg.num_layers
    return layers


def test_q8_rows_reads_back_the_q8_0_weights():
    """caldrix::q8_rows gives rows of a Q8_0 matrix from the head's two 4-bit halves: each value
    bfloat16(float32(d) * q), rounded once, for ids in any order, repeated, first and last; an
    id out of range is an error that names it."""
    if not q4.ours_built(torch.bfloat16):
        pytest.skip("caldrix::q4_mm is not built on this CPU")
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-128, 128, (5008, 96), generator=gen).to(torch.int8)
    d = (torch.rand(5008, 3, generator=gen) * 0.01).half().float()
    emb = q4.Q8Embedding(q4.Q8AsInt4Linear(q, d, ours=True))
    want = (q.float() * d.repeat_interleave(32, dim=1)).bfloat16()
    ids = torch.tensor([5007, 0, 17, 17, 4096, 2500, 15, 16])
    got = emb(ids)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want[ids])
    assert torch.equal(emb(torch.arange(5008)), want)
    with pytest.raises(RuntimeError, match="id 5008 is out of range for 5008 rows"):
        emb(torch.tensor([3, 5008]))
    assert not any(name.startswith("_head") for name, _ in emb.named_buffers())  # it owns no tensor


def test_the_tied_embedding_is_read_from_the_head_with_the_dense_bits(smollm2_dir, gguf_file, monkeypatch):
    """Where the head runs on caldrix::q4_mm, the engine never holds SmolLM2's dense embedding
    (56 MB of bfloat16) and reads the rows from the head's Q8_0 blocks: the same bits, so prefill
    and decode logits equal those of an engine that keeps the table. Against a table that
    differs from the blocks in one value, the table is kept."""
    from caldrix.batch import Batch, Run
    from caldrix.kernels import native

    if not native.has_q4_mm():
        pytest.skip("caldrix::q4_mm is not built on this CPU")

    def logits(engine):  # a prompt's rows through a prefill chunk, then three decode-form passes
        prompt = tuple(range(300, 340))
        engine.step(Batch((Run(0, 0, prompt[:-1], ()),)))
        rows = [engine.decode_logits([Run(0, len(prompt) - 1 + i, (t,), (0,))])[0] for i, t in
                enumerate((prompt[-1], 5, 48000))]
        return torch.cat(rows)

    engine = Engine.load(smollm2_dir, dtype=torch.bfloat16, max_batch=1, context=128, int4_from=gguf_file)
    assert engine.q8_embed and isinstance(engine.model.embed, q4.Q8Embedding) and engine.scripted_pass
    assert not any("embed" in name for name, _ in engine.model.named_parameters())
    got = logits(engine)
    with monkeypatch.context() as m:
        m.setattr(llama_load, "embed_from_head", lambda model, rows: False)  # the table read whole after all
        dense = Engine.load(smollm2_dir, dtype=torch.bfloat16, max_batch=1, context=128, int4_from=gguf_file)
    assert not dense.q8_embed and isinstance(dense.model.embed, torch.nn.Embedding)
    assert torch.equal(got, logits(dense))
    table = dense.model.embed.weight.detach().clone()
    assert llama_load.embed_from_head(dense.model, lambda start, stop: table[start:stop])
    assert isinstance(dense.model.embed, q4.Q8Embedding) and torch.equal(got, logits(dense))
    dense.model.embed = torch.nn.Embedding.from_pretrained(table)
    table[40000, 7] += 1  # one value that is not the blocks' own
    assert not llama_load.embed_from_head(dense.model, lambda start, stop: table[start:stop])
    assert isinstance(dense.model.embed, torch.nn.Embedding)


def test_q8_0_head_reads_back_the_embedding(smollm2_dir, gguf_file):
    """The tied lm_head kept as two 4-bit halves of the GGUF's Q8_0 blocks: multiplying by the
    identity reads each weight back, which must equal the embedding transformers dequantized
    from the same file, up to the bfloat16 rounding of each block's scale. A hi half off by
    one (16 times a block's scale) fails it."""
    model = load_decoder(smollm2_dir, torch.bfloat16)
    assert llama_load.head_from_gguf(model, gguf_file)
    want = load_decoder(smollm2_dir, torch.float32).embed.weight
    eye = torch.eye(model.cfg.hidden_size, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = model.head(eye).T  # [V, D]
    rel = (got - want).abs().max() / want.abs().max()
    assert rel < 0.01


@pytest.mark.parametrize("ours", [True, False], ids=["q4_mm", "torch-int4"])
def test_q8_0_head_where_it_is_cheaper(smollm2_dir, gguf_file, monkeypatch, ours):
    """Through caldrix::q4_mm the Q8_0 head costs less than the dense one at 1 row and at 8, so
    every engine takes it; through torch's int4 kernel it costs twice the dense one at 8 rows,
    so only a --max-batch 1 engine does. Either way the head is chosen once, never by a step's
    row count. The greedy replies follow each other: the first tokens agree."""
    from transformers import AutoTokenizer

    from caldrix.kernels import native

    if ours and not native.has_q4_mm():
        pytest.skip("caldrix::q4_mm is not built on this CPU")
    if not ours:
        monkeypatch.setattr(native, "has_q4_mm", lambda: False)
    ids = tuple(AutoTokenizer.from_pretrained(str(smollm2_dir)).encode("The capital of France is"))
    one = Engine.load(smollm2_dir, dtype=torch.bfloat16, max_batch=1, context=64, int4_from=gguf_file)
    two = Engine.load(smollm2_dir, dtype=torch.bfloat16, max_batch=2, context=64, int4_from=gguf_file)
    assert one.int4_ours is ours and two.int4_ours is ours
    assert one.int4_head and isinstance(one.model.head, q4.Q8AsInt4Linear) and one.model.head.ours is ours
    assert two.int4_head is ours and (two.model.head is not None) is ours
    a, b = generate(one, [ids], 8, together=True)[0], generate(two, [ids], 8, together=True)[0]
    assert a[:4] == b[:4], (a, b)


def test_scripted_decode_layers_give_the_eager_bits(smollm2_dir, gguf_file):
    """kernels/scripted.py runs a decode-form pass through every 4-bit layer as one TorchScript
    call: one row, three slots' rows, and a verify run's rows must give the eager path's logits
    bit for bit, step after step (the KV rows it writes included, since later steps read them).
    And the whole pass as one call (scripted.decode_logits: embedding, layers, norm, Q8_0 head,
    arg-max), as Engine.step takes it: the same logits again, and the arg-max of each row."""
    from caldrix.batch import Batch, Run

    engine = Engine.load(smollm2_dir, dtype=torch.bfloat16, max_batch=3, context=128, int4_from=gguf_file)
    assert engine.scripted_rows and engine.scripted_pass
    stack_fn, whole_fn = engine.model.stack_fn, engine.model.logits_fn
    assert stack_fn is not None and len(engine.model.stack_weights) == 10 * len(engine.model.layers)
    assert whole_fn is not None

    def passes(stack: bool, whole: bool) -> list[tuple[torch.Tensor, list[int] | None]]:
        engine.model.stack_fn = stack_fn if stack else None
        engine.model.logits_fn = whole_fn if whole else None
        prompts = [tuple(range(500, 530)), tuple(range(700, 711)), tuple(range(900, 947))]
        for slot, p in enumerate(prompts):
            engine.step(Batch((Run(slot, 0, p, ()),)))
        out = []
        for i, t in enumerate((11, 4000, 37, 29000)):
            out.append(engine.decode_logits([Run(0, len(prompts[0]) + i, (t,), (0,))]))  # one row
            out.append(engine.decode_logits([Run(s, len(p) + i, (t + s,), (0,)) for s, p in enumerate(prompts)]))
        verify = Run(1, len(prompts[1]) + 4, (5, 812, 77, 3), (0, 1, 2, 3), verify=True)
        out.append(engine.decode_logits([verify, Run(2, len(prompts[2]) + 4, (9,), (0,))]))
        return out

    eager, layered, whole = passes(False, False), passes(True, False), passes(True, True)
    assert all(top is None for _, top in eager + layered) and all(top is not None for _, top in whole)
    for (a, _), (b, _), (c, top) in zip(eager, layered, whole):
        assert torch.equal(a, b) and torch.equal(a, c) and top == torch.argmax(a, dim=-1).tolist()


def test_the_tensor_index_reads_what_the_gguf_package_reads(gguf_file):
    """weights/gguf_index.py skips the metadata values gguf.GGUFReader parses (7 s of the
    tokenizer's strings); every tensor's type, shape and bytes must still be the same."""
    import numpy as np
    from gguf import GGUFReader

    from caldrix.weights.gguf_index import read_tensors

    ours = read_tensors(gguf_file)
    ref = {t.name: t for t in GGUFReader(str(gguf_file)).tensors}
    assert ours.keys() == ref.keys() and len(ours) == 272
    for name, r in ref.items():
        t = ours[name]
        assert (t.tensor_type, t.shape) == (int(r.tensor_type), tuple(int(x) for x in r.shape)), name
        assert np.array_equal(t.data, np.asarray(r.data).view(np.uint8).reshape(t.data.shape)), name
    assert {t.tensor_type for t in ours.values()} == {0, 3, 8}  # F32 norms, Q4_1, Q8_0


def test_the_tensor_index_refuses_what_is_not_gguf(tmp_path):
    from caldrix.weights.gguf_index import read_tensors

    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_tensors(bad)
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little") + (5).to_bytes(8, "little"))
    with pytest.raises(ValueError, match="truncated"):
        read_tensors(bad)


def test_torch_layouts_refuse_float32_activations():
    # torch's int4 kernel is bfloat16 only: a float32 layer laid out for it would fail at its
    # first call, so both 4-bit layers refuse it when built, naming the dtype.
    q = torch.randint(0, 16, (16, 64), dtype=torch.int32)
    d = torch.rand(16, 2) / 16
    m = -8 * d
    with pytest.raises(ValueError, match="bfloat16 activations, not torch.float32"):
        q4.Int4Linear(q, d, m, ours=False, dtype=torch.float32)
    with pytest.raises(ValueError, match="bfloat16 activations, not torch.float32"):
        q4.Q8AsInt4Linear(torch.randint(-128, 128, (16, 64), dtype=torch.int32), d, ours=False, dtype=torch.float32)
    assert q4.Int4Linear(q, d, m, ours=False, dtype=torch.bfloat16).packed.numel() > 0
