"""--weights q4: weights rounded to 4-bit groups at load (caldrix/kernels/q4_quantize.py).

The rounding is held to ggml's own Q4_1 quantizer (the `gguf` package's numpy port of
quantize_row_q4_1_ref), the layer to the matmul on its dequantized weights, and tiny random
Qwen3.5, Llama and Qwen3 models whose every projection and head are 4-bit to transformers
running the same dequantized weights (and, on its decode steps, the same 8-bit rounding of the
activations where caldrix::q4_vnni serves): the served model is the 4-bit model, computed right.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from caldrix.kernels import q4_quantize
from caldrix.kernels.q4 import unpack_q4_1
from caldrix.kernels.q4_quantize import QuantizedLinear, layer_weights, q4_1

pytestmark = pytest.mark.skipif(not q4_quantize.usable(torch.bfloat16, "cpu"), reason="no torch int4 CPU kernel")


def ggml_q4_1(w: torch.Tensor):
    from gguf import GGMLQuantizationType, quants

    raw = quants.quantize(w.float().numpy(), GGMLQuantizationType.Q4_1)
    return unpack_q4_1(np.ascontiguousarray(raw), w.shape[1])


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 3).map(lambda n: 16 * n), groups=st.integers(1, 4), seed=st.integers(0, 2 ** 16),
       scale=st.sampled_from([1e-3, 1.0, 30.0]), flat=st.booleans())
def test_rounding_is_ggmls_q4_1(rows, groups, seed, scale, flat):
    """q, d and m equal ggml's Q4_1 quantizer's, bit for bit (flat groups: d = 0, q = 0)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, 32 * groups, generator=g) * scale
    if flat:
        w[0, :32] = 0.5
    q, d, m = q4_1(w.bfloat16())
    q_ref, d_ref, m_ref = ggml_q4_1(w.bfloat16())
    assert torch.equal(q, q_ref) and torch.equal(d, d_ref) and torch.equal(m, m_ref)


def int8_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[T, N]: the most that rounding x to 8 bits a block of 32 (caldrix::q4_vnni) can move
    x @ w.T: half a step, max|x_b| / 254, an element, times |w|."""
    t, k = x.shape
    step = x.float().abs().view(t, k // 32, 32).amax(-1) / 254  # [T, blocks]
    return step.repeat_interleave(32, dim=1) @ w.float().abs().t()


def test_layer_is_the_matmul_on_its_dequantized_weights():
    """Both paths (the 4-bit kernel up to max_int4_rows rows, the packed dense copy past them)
    give x @ W.T for W the blocks' weights (`layer_weights`): to the bfloat16 rounding of the
    outputs, plus, on caldrix::q4_vnni, the rounding of x to 8 bits. W is d q + m as ggml
    dequantizes, to the bfloat16 rounding of the weights (and of torch's scale and zero)."""
    from gguf import GGMLQuantizationType, quants

    torch.manual_seed(0)
    w = torch.randn(64, 96).bfloat16()
    layer = QuantizedLinear(w, max_int4_rows=4)
    dense = layer_weights(w).float()
    raw = quants.quantize(w.float().numpy(), GGMLQuantizationType.Q4_1)
    ggml = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_1))
    assert (dense - ggml).abs().max() <= (2 ** -8 if layer.vnni else 2 ** -7) * ggml.abs().max()
    for rows in (1, 4, 5, 40):
        x = torch.randn(rows, 96).bfloat16()
        want = x.float() @ dense.t()
        slack = int8_bound(x, dense) if layer.vnni and rows <= 4 else 0
        got = layer(x).float()
        assert ((got - want).abs() <= 2 ** -8 * want.abs().max() + slack).all(), rows


@settings(max_examples=30, deadline=None)
@given(groups=st.integers(1, 4), blocks=st.integers(1, 6), rows=st.integers(1, 9), seed=st.integers(0, 2 ** 16),
       xscale=st.sampled_from([1e-3, 1.0, 50.0]), zero_block=st.booleans())
def test_vnni_kernel_is_its_arithmetic(groups, blocks, rows, seed, xscale, zero_block):
    """caldrix::q4_vnni against its arithmetic in float32 (`int8_rows`: x rounded to 8 bits a
    block, d q summed against it, m against x's exact block sums), to the bfloat16 rounding
    of the outputs; an all-zero block of x included."""
    if not q4_quantize.vnni():
        pytest.skip("caldrix::q4_vnni is not compiled here (no AVX512-VNNI)")
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16 * groups, 32 * blocks, generator=g).bfloat16()
    x = (torch.randn(rows, 32 * blocks, generator=g) * xscale).bfloat16()
    if zero_block:
        x[:, :32] = 0
    layer = QuantizedLinear(w, max_int4_rows=9, dense_copy=False)
    want = int8_rows(x, w)
    got = layer(x).float()
    size = int8_rows(x, w, magnitude=True)
    assert ((got - want).abs() <= 2 ** -8 * want.abs() + 1e-5 * size).all()


def test_a_rows_result_does_not_depend_on_the_row_count(two_threads):
    """On the 4-bit path each row of a call of 1..9 rows equals the same row alone, on two
    threads as on one: the engine runs a q4 model's decode steps unpadded on this."""
    torch.manual_seed(1)
    layer = QuantizedLinear(torch.randn(64, 128).bfloat16(), max_int4_rows=9)
    x = torch.randn(9, 128).bfloat16()
    alone = torch.cat([layer(x[i:i + 1]) for i in range(9)])
    for n in range(1, 10):
        assert torch.equal(layer(x[:n]), alone[:n]), n
    torch.set_num_threads(1)
    assert torch.equal(layer(x), alone)


# ---- tiny models whose every projection and head the 4-bit kernels take ----

transformers = pytest.importorskip("transformers")
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig,  # noqa: E402
                          Qwen3Config, Qwen3ForCausalLM)

from caldrix.models import loader  # noqa: E402

# Shapes the kernels take throughout (rows in sixteens, K in groups of 32). Qwen3.5's linear
# layers' fused input projection has 2*16*8 + 16*8 (conv) + 128 (z) + 16 (b) + 16 (a) = 544 rows.
QWEN35 = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=8,
              linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=1024, num_hidden_layers=3,
              layer_types=["linear_attention", "full_attention", "linear_attention"],
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                               "mrope_section": [2, 1, 1], "mrope_interleaved": True})
LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, max_position_embeddings=1024)
QWEN3 = dict(LLAMA, head_dim=16)
MODELS = {"qwen3_5": (Qwen3_5ForCausalLM, Qwen3_5TextConfig, QWEN35), "llama": (LlamaForCausalLM, LlamaConfig, LLAMA),
          "qwen3": (Qwen3ForCausalLM, Qwen3Config, QWEN3)}


def as_4bit(w: torch.Tensor) -> torch.Tensor:
    """The weights a QuantizedLinear of `w` computes with (float32)."""
    return layer_weights(w).float()


@pytest.fixture(scope="module", params=[("qwen3_5", True), ("qwen3_5", False), ("llama", True), ("llama", False),
                                        ("qwen3", False)], ids=lambda p: f"{p[0]}-{'tied' if p[1] else 'untied'}")
def q4_pair(request, tmp_path_factory):
    """(the checkpoint's directory, caldrix's q4 load of it, transformers on the dequantized
    weights in float32, and in bf16)."""
    arch, tie = request.param
    cls, config, shape = MODELS[arch]
    torch.manual_seed(7)
    ref = cls(config(**shape, tie_word_embeddings=tie))
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.3 if p.dim() == 1 else 0.12)
    path = tmp_path_factory.mktemp("q4") / "tiny"
    ref.to(torch.bfloat16).save_pretrained(path)  # the checkpoint caldrix quantizes: bf16 weights
    got = loader(path)(path, dtype=torch.bfloat16, int4_rows=9, quantize=True)
    # transformers on the 4-bit weights: every projection and the head dequantized, the
    # embedding as saved (the lookup keeps plain rows), so the head is untied there
    sd = {k: v.float() for k, v in ref.state_dict().items()}
    for name in list(sd):
        if ("proj" in name and sd[name].dim() == 2) or name == "lm_head.weight":  # q_proj, in_proj_z, ...
            sd[name] = as_4bit(sd[name].bfloat16())
    sd["lm_head.weight"] = as_4bit(sd["model.embed_tokens.weight"].bfloat16()) if tie else sd["lm_head.weight"]
    untied = cls(config(**shape, tie_word_embeddings=False)).eval()
    untied.load_state_dict(sd)
    ref16 = cls(config(**shape, tie_word_embeddings=False)).eval()
    ref16.load_state_dict(sd)
    return path, got, untied, ref16.to(torch.bfloat16)


def test_every_projection_and_the_head_are_4bit(q4_pair):
    _, got, _, _ = q4_pair
    model = got.model
    from caldrix.kernels.packed import PackedLinear

    # the layers' matmul modules, less the dense copies inside the 4-bit ones
    linears = [c for m in model.layers.modules() if not isinstance(m, QuantizedLinear) for c in m.children()
               if isinstance(c, (torch.nn.Linear, PackedLinear, QuantizedLinear))]
    assert linears and all(isinstance(m, QuantizedLinear) for m in linears)
    assert isinstance(model.head, QuantizedLinear) and model.head.dense is None
    assert got.int4_layers == len(linears) + 1 and not got.row_count_dependent
    assert model.embed.weight.dtype == torch.bfloat16  # the lookup's rows stay as loaded
    if hasattr(model, "read_logits"):  # Qwen3.5's label reading takes the whole head
        assert model.read_logits(torch.zeros(1, 64, dtype=torch.bfloat16), (1, 2)) is None


def int8_rows(x: torch.Tensor, w: torch.Tensor, magnitude: bool = False) -> torch.Tensor:
    """caldrix::q4_vnni's arithmetic in float32 for a QuantizedLinear of `w` (bf16 [N, K]):
    sum_b d_b (q_b . xq_b dx_b) + m_b sum(x_b), x [..., K] rounded to 8 bits a block of 32."""
    q, d, m = q4_1(w)
    k = q.shape[1]
    blocks = x.float().reshape(-1, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    # as the kernel: x * (127 / max), the quotient rounded once (torch's `127 / t` is 127 * (1 / t),
    # two roundings, which moved a tie like 63.5 to the other side)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / torch.where(amax > 0, amax, 1), 0)
    xq = torch.round(blocks * inv) * (amax / 127)
    scaled = (q.float().view(-1, k // 32, 32) * d[..., None]).view(-1, k)
    y = xq.reshape(-1, k) @ scaled.t() + blocks.sum(-1) @ m.t()
    if magnitude:  # the sum of the terms' sizes, which float32's rounding scales with
        y = xq.reshape(-1, k).abs() @ scaled.abs().t() + blocks.sum(-1).abs() @ m.abs().t()
    return y.view(*x.shape[:-1], -1)


def test_q4_model_is_transformers_on_the_dequantized_weights(q4_pair):
    """A 100-token prompt (dense copies: 100 rows > 9) and 16 decode steps (the 4-bit kernel),
    teacher-forced: as close to transformers' float32 run of the 4-bit weights as transformers'
    own bf16 run of them is (within a factor of 2). Where the kernel is caldrix::q4_vnni, the
    float32 run's decode steps round each 4-bit layer's input to 8 bits as it does
    (`int8_rows`), so the comparison is of the same function."""
    from caldrix.models.base import Attend

    path, got, ref, ref16 = q4_pair
    model = got.model
    decoding = []  # non-empty while the reference runs a decode step

    def as_kernel(weight):
        def hook(module, args, out):
            return int8_rows(args[0], weight) if decoding else out
        return hook

    hooks = []
    if q4_quantize.vnni():
        from safetensors.torch import load_file

        saved = load_file(str(path / "model.safetensors"))  # the bf16 weights caldrix rounded
        for name, module in ref.named_modules():
            if isinstance(module, torch.nn.Linear):
                w = saved.get(name + ".weight", saved.get("model.embed_tokens.weight") if name == "lm_head" else None)
                hooks.append(module.register_forward_hook(as_kernel(w)))
    ids = torch.randint(0, 128, (100,), generator=torch.Generator().manual_seed(3))
    assert len(hooks) == (sum(isinstance(m, torch.nn.Linear) for m in ref.modules()) if q4_quantize.vnni() else 0)
    try:
        with torch.no_grad():
            out = ref(input_ids=ids[None], use_cache=True)
            want, cache, tokens = [out.logits[0]], out.past_key_values, []
            decoding.append(True)
            for _ in range(16):
                tokens.append(int(want[-1][-1].argmax()))
                out = ref(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
                cache = out.past_key_values
                want.append(out.logits[0])
            want = torch.cat(want).float()
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        theirs = ref16(input_ids=torch.cat([ids, torch.tensor(tokens)])[None]).logits[0].float()
    state = type(model).new_state(model.cfg, 2, 256, torch.bfloat16, "cpu")
    native = bool(getattr(model, "uses_native", lambda d: False)("cpu"))  # llama's compiled decode attention
    if hasattr(model, "setup"):
        model.setup(256)
    with torch.inference_mode():
        at = torch.arange(len(ids))
        rows = [model.logits(model(ids, Attend("prefill", (0,), at, at), state))]
        for i, t in enumerate(tokens):
            pos = torch.tensor([len(ids) + i])
            step = Attend("decode", (0,), pos, pos, (len(ids) + i + 1,), torch.tensor([0]), native)
            rows.append(model.logits(model(torch.tensor([t]), step, state)))
    ours = torch.cat(rows)
    their_err = (theirs - want).abs().max()
    assert (ours - want).abs().max() <= 2 * their_err


def test_q4_engine_is_batch_invariant(q4_pair):
    """Through the engine (unpadded decode steps: every projection is 4-bit), four prompts
    decoding together give what each gives alone."""
    from engine_util import generate

    from caldrix.engine import Engine

    path = q4_pair[0]
    engine = Engine.load(path, dtype=torch.bfloat16, max_batch=4, context=256, quantize=True)
    assert engine.quantized and not engine.pad_decode
    prompts = [tuple(torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(30 + n)).tolist())
               for n in (3, 41, 17, 70)]
    together = generate(engine, prompts, 16, together=True, chunk=16)
    alone = generate(engine, prompts, 16, together=False, chunk=16)
    assert together == alone


def test_refused_at_start_where_it_cannot_run(tmp_path, qwen35_tokenizer_dir):
    """`caldrix serve --weights q4` exits 2 naming the flag, before loading, for a float32
    engine, off the cpu lane, and for an architecture whose loader does not round (idefics3)."""
    import json
    import shutil
    import subprocess
    import sys

    model, vision = tmp_path / "model", tmp_path / "vision"
    Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN35)).to(torch.bfloat16).save_pretrained(model)
    vision.mkdir()
    (vision / "config.json").write_text(json.dumps({"model_type": "idefics3",
                                                    "architectures": ["Idefics3ForConditionalGeneration"]}))
    from safetensors.torch import save_file

    save_file({"unread": torch.zeros(1)}, str(vision / "model.safetensors"))  # refused before it is read
    for d in (model, vision):  # a tokenizer makes them model directories; nothing reads it before the refusal
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(qwen35_tokenizer_dir / name, d / name)
    for path, flags, why in ((model, ["--dtype", "float32"], "not float32"),
                             (model, ["--dtype", "bfloat16", "--backend", "host"], "on the host lane"),
                             (vision, ["--dtype", "bfloat16"], "not idefics3")):
        out = subprocess.run([sys.executable, "-m", "caldrix", "serve", str(path), "--port", "0", "--weights", "q4",
                              *flags], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr
        assert "--weights q4" in out.stderr and why in out.stderr, out.stderr
