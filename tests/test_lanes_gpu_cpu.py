"""The GPU lanes' CPU-side rules: lane defaults and refusals through the CLI (a GPU simulated by
injecting what torch would see), the sampler named in /debug/requests, the --weight-budget
planner and the layer streamer's scheduling with fake CUDA calls, the llama family's passes on
torch's meta device (no host reads, no CPU tensors mixed in), and bench/gpu_check.py's exit on a
machine without a GPU. Nothing here needs a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from caldrix import cli, lanes
from caldrix.config import FlagError, ServeConfig
from caldrix.protocol import SamplingParams
from caldrix.telemetry import Telemetry
from caldrix.weight_budget import (BudgetError, LayerStreamer, parse_bytes, plan, sizes_of_model, speculation_refusal,
                                   split_sizes, spread)

ROOT = Path(__file__).resolve().parent.parent


# --- lanes ------------------------------------------------------------------------------


def settled(argv: list[str], seen: str | None):
    args = cli.build_parser().parse_args(argv)
    wrong = lanes.settle_flags(args, seen=lambda: seen)
    return args, wrong


@pytest.mark.parametrize("command", [["serve"], ["run", "hi"]])
@pytest.mark.parametrize("seen, lane, batch, sampler", [
    ("hip", "hip", 8, "device"), ("cuda", "cuda", 1, "device"), (None, "cpu", 1, "host")])
def test_auto_lane_defaults(command, seen, lane, batch, sampler):
    args, wrong = settled(command, seen)
    assert wrong is None and (args.lane, args.max_batch, args.sampler) == (lane, batch, sampler)
    cfg = cli.config_from(args, None)
    assert (cfg.max_batch, cfg.sampler) == (batch, sampler)
    assert lanes.sampler_name(lane, cfg.max_batch, cfg.sampler) == ("device" if lane == "hip" else "cpu")


def test_explicit_backend_is_not_probed_and_explicit_max_batch_wins():
    def boom():
        raise AssertionError("probed")

    args = cli.build_parser().parse_args(["serve", "--backend", "hip"])
    assert lanes.settle_flags(args, seen=boom) is None and args.max_batch == 8
    args, _ = settled(["serve", "--max-batch", "2"], "hip")
    assert args.max_batch == 2 and lanes.uses_device_pick("hip", 2, args.sampler)
    args, _ = settled(["serve", "--backend", "cpu"], "hip")
    assert (args.lane, args.max_batch) == ("cpu", 1)


def test_which_pick():
    assert lanes.uses_device_pick("hip", 8, "device")
    assert not lanes.uses_device_pick("hip", 8, "host")
    assert not lanes.uses_device_pick("hip", 1, "device")
    for lane in ("cuda", "cpu", "host"):
        assert not lanes.uses_device_pick(lane, 8, "device")


@pytest.mark.parametrize("argv, seen, needle", [
    (["serve", "--sampler", "device"], "cuda", "--sampler device: the device pick runs on the AMD lane"),
    (["serve", "--sampler", "device"], None, "the cpu lane picks on the CPU"),
    (["serve", "--sampler", "device", "--max-batch", "1"], "hip", "not batched (--max-batch 1)"),
    (["run", "x", "--weight-budget", "1G"], None, "--weight-budget: streams weights to a GPU"),
    (["serve", "--backend", "host", "--weight-budget", "1G"], "cuda", "the host lane keeps every weight"),
])
def test_lane_refusals_through_main(monkeypatch, capsys, argv, seen, needle):
    monkeypatch.setattr(lanes, "gpu_seen", lambda: seen)
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_speculation_refusals_use_the_resolved_defaults(monkeypatch, capsys):
    monkeypatch.setattr(lanes, "gpu_seen", lambda: "hip")
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "x", "--speculate", "ngram"])
    assert exc.value.code == 2 and "batched (--max-batch 8)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["run", "x", "--speculate", "ngram", "--max-batch", "1", "--weight-budget", "3GiB"])
    assert "--speculate ngram: refused with --weight-budget" in capsys.readouterr().err


def test_main_passes_the_settled_config(monkeypatch):
    import caldrix.run
    import caldrix.server

    got = []
    monkeypatch.setattr(lanes, "gpu_seen", lambda: "hip")
    monkeypatch.setattr(caldrix.run, "run_once", lambda cfg, *a, **k: got.append(cfg) or 0)

    async def fake_serve(cfg, **_):
        got.append(cfg)

    monkeypatch.setattr(caldrix.server, "serve", fake_serve)
    assert cli.main(["run", "hello", "--weight-budget", "1.5GiB", "--sampler", "host"]) == 0
    assert cli.main(["serve"]) == 0
    assert [(c.max_batch, c.sampler, c.weight_budget) for c in got] == [(8, "host", 3 * 2**29), (8, "device", None)]


def test_cpu_only_models_are_refused_on_gpu_lanes(tmp_path):
    for arch, alias in (("idefics3", "smolvlm-256m"), ("qwen3_5", "decider-0.8b")):
        for lane in ("cuda", "hip"):
            why = lanes.lane_refusal(arch, lane)
            assert why.startswith(f"--backend {lane}: {alias} ({arch}) is a cpu-lane model")
        assert lanes.lane_refusal(arch, "cpu") is None
    assert lanes.lane_refusal("llama", "hip") is None and lanes.lane_refusal(None, "cuda") is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    assert lanes.architecture_of(tmp_path) == "qwen3_5" and lanes.architecture_of(tmp_path / "no") is None


def test_load_runtime_refuses_a_cpu_only_model_before_loading(tmp_path):
    from caldrix.runtime import load_runtime

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "idefics3"}))
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(FlagError, match=r"--backend hip: smolvlm-256m \(idefics3\)"):
        load_runtime(ServeConfig(model=str(tmp_path), backend="hip", max_batch=8))


def test_device_line():
    line = lanes.device_line("cuda", "NVIDIA H100 80GB HBM3", 85_045_460_992)
    assert line == "caldrix: device cuda:0 NVIDIA H100 80GB HBM3, 79.2 GiB (the cuda lane)"
    assert lanes.device_line("hip", "AMD Instinct MI300X", 192 * 2**30, 1).endswith(
        "cuda:1 AMD Instinct MI300X, 192.0 GiB (the AMD lane, ROCm)")


def test_debug_requests_name_the_sampler():
    for name in ("cpu", "device"):
        tel = Telemetry.create("m", 4, sampler=name)
        tel.refused("r1", route="chat", status=429, prompt_ids=(1, 2), max_tokens=3,
                    sampling=SamplingParams(temperature=0.5, seed=7), stream=False, ignore_eos=False)
        assert tel.records()[0].to_json()["sampler"] == name
        assert next(tel.trace())["sampler"] == name


# --- the engine's device pick ------------------------------------------------------------


DEVICE_PICKED = [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=5),
                 SamplingParams(temperature=1.3, min_p=0.05, repetition_penalty=1.3, seed=9),
                 SamplingParams()]  # greedy: the arg-max, on either pick


def test_the_engine_makes_the_device_pick_where_told(smollm2_dir, monkeypatch):
    """With picks_on_device every sampled token of a step comes from one device_pick call (on
    CPU tensors here, as on a GPU's), each the token an independent float32 reference picks
    from the same logits; seeded replies repeat, and a reply is the same alone as beside
    others. Greedy rows never reach it."""
    import caldrix.device_pick
    from caldrix.engine import Engine
    from caldrix.sampler import draw_uniform
    from engine_util import generate
    from test_device_pick import Tight, ref_pick

    engine = Engine.load(smollm2_dir, dtype=torch.float32, max_batch=3, context=128)
    engine.picks_on_device = True
    calls: list[tuple] = []
    real = caldrix.device_pick.device_pick

    def recorded(logits, params, seen_ids, draws):
        got = real(logits, params, seen_ids, draws)
        calls.append((logits.clone(), list(params), list(seen_ids), list(draws), got))
        return got

    monkeypatch.setattr(caldrix.device_pick, "device_pick", recorded)
    prompts = [(1, 504, 3458, 314, 1017), (1, 504, 2386, 29, 14), (1, 378, 2051)]
    together = generate(engine, prompts, 6, together=True, sampling=DEVICE_PICKED)
    assert len(calls) >= 6 and sum(len(c[1]) for c in calls) == 12  # two sampled replies, 6 tokens each
    assert all(not p.is_greedy for c in calls for p in c[1])
    checked = 0
    for logits, params, seen_ids, draws, got in calls:
        for row, p, seen, n, token in zip(logits, params, seen_ids, draws, got):
            try:
                want = ref_pick(row.numpy(), p, set() if seen is None else set(seen.tolist()), draw_uniform(p.seed, n))
            except Tight:
                continue
            assert token == want
            checked += 1
    assert checked >= 8
    assert generate(engine, prompts, 6, together=True, sampling=DEVICE_PICKED) == together
    assert generate(engine, prompts, 6, together=False, sampling=DEVICE_PICKED) == together
    engine.picks_on_device = False
    calls.clear()
    cpu = generate(engine, prompts, 6, together=True, sampling=DEVICE_PICKED)
    assert not calls and cpu[2] == together[2]


@pytest.mark.parametrize("max_batch, sampler, picks", [(2, "device", True), (2, "host", False), (1, "device", False)])
def test_the_runtime_gives_the_amd_lane_the_device_pick(smollm2_dir, monkeypatch, max_batch, sampler, picks):
    # The AMD lane simulated: its engine on the CPU. The device pick only batched and with
    # --sampler device; /debug/requests names the pick that runs.
    import caldrix.runtime as runtime

    monkeypatch.setitem(runtime.LANE_DEVICES, "hip", "cpu")
    rt = runtime.load_runtime(ServeConfig(model=str(smollm2_dir), backend="hip", dtype="float32", context=128,
                                          max_batch=max_batch, sampler=sampler))
    assert rt.engine.picks_on_device is picks
    assert rt.telemetry.sampler == ("device" if picks else "cpu")


# --- --weight-budget ---------------------------------------------------------------------


def test_parse_bytes():
    assert parse_bytes("1000") == 1000 and parse_bytes("2GiB") == 2 * 2**30 and parse_bytes("1.5G") == 1_500_000_000
    assert parse_bytes("800MB") == 800_000_000 and parse_bytes("64kib") == 65536
    for bad in ("", "lots", "-5", "3 parsecs", "0"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--weight-budget", "lots"])


def test_split_sizes_and_sizes_of_model(tmp_path):
    from safetensors.torch import save_file

    t = {"model.embed_tokens.weight": torch.zeros(10, 4), "model.norm.weight": torch.zeros(4),
         "model.layers.0.mlp.w": torch.zeros(4, 4), "model.layers.1.mlp.w": torch.zeros(4, 8, dtype=torch.bfloat16),
         "model.layers.1.attn.q": torch.zeros(4), "lm_head.weight": torch.zeros(10, 4)}
    assert split_sizes(t.items()) == (4 * (40 + 4 + 40), (64, 64 + 16))
    save_file(t, str(tmp_path / "model.safetensors"))
    assert sizes_of_model(tmp_path) == split_sizes(t.items())
    with pytest.raises(ValueError, match="not 0..0"):
        split_sizes([("layers.1.w", torch.zeros(1))])


def test_plan_equal_layers():
    fixed, layer, n = 1000, 100, 10
    full = fixed + n * layer
    p = plan(full, fixed, [layer] * n)
    assert p.streamed == () and p.device_bytes == full and "none stream" in p.line()
    # one layer short: streaming needs two buffers, so three layers stream to save one
    p = plan(full - 1, fixed, [layer] * n)
    assert len(p.streamed) == 3 and p.slots == 2 and p.device_bytes == fixed + 9 * layer
    assert p.resident == tuple(i for i in range(n) if i not in p.streamed)
    assert p.streamed_bytes == 300
    assert "7 of 10 layers stay on the device, 3 stream from pinned host memory" in p.line()
    p = plan(fixed + 2 * layer, fixed, [layer] * n)
    assert p.streamed == tuple(range(n)) and p.device_bytes == fixed + 2 * layer


def test_plan_refusals():
    with pytest.raises(BudgetError, match=r"--weight-budget 1199: too small .* are 1000 bytes.* at least 1200 bytes"):
        plan(1199, 1000, [100] * 10)
    with pytest.raises(BudgetError, match="at least 1000"):
        plan(999, 1000, [])
    assert speculation_refusal(None) is None and "speculation" in speculation_refusal(1)


def test_streamed_layers_are_spread():
    assert spread(10, 0) == () and spread(10, 1) == (5,) and spread(10, 2) == (2, 7) and spread(10, 10) == tuple(range(10))
    assert spread(30, 4) == (3, 11, 18, 26)


@settings(max_examples=200, deadline=None)
@given(fixed=st.integers(0, 5000), layers=st.lists(st.integers(1, 1000), min_size=1, max_size=24),
       frac=st.floats(0, 1.2))
def test_plan_streams_the_fewest_layers_within_the_budget(fixed, layers, frac):
    budget = max(1, int(frac * (fixed + sum(layers))))
    try:
        p = plan(budget, fixed, layers)
    except BudgetError:
        assert all(fixed + sum(layers) - sum(layers[i] for i in spread(len(layers), s))
                   + min(2, s) * max((layers[i] for i in spread(len(layers), s)), default=0) > budget
                   for s in range(len(layers) + 1))
        return
    on_device = fixed + sum(layers[i] for i in p.resident) + p.slots * max((layers[i] for i in p.streamed), default=0)
    assert p.device_bytes == on_device <= budget
    assert sorted(p.resident + p.streamed) == list(range(len(layers)))
    s = len(p.streamed)
    if s:
        fewer = spread(len(layers), s - 1)
        assert (fixed + sum(layers) - sum(layers[i] for i in fewer)
                + min(2, s - 1) * max((layers[i] for i in fewer), default=0)) > budget


def test_weight_budget_at_start(tmp_path):
    from safetensors.torch import save_file

    from caldrix.runtime import resolve_speculation
    from caldrix.weight_budget import budget_refusal

    t = {"embed.weight": torch.zeros(100), **{f"layers.{i}.w": torch.zeros(25) for i in range(4)}}
    save_file(t, str(tmp_path / "model.safetensors"))
    assert "give at least 600 bytes" in budget_refusal(599, tmp_path, 4)
    assert budget_refusal(600, tmp_path, 4) is None
    # the same float32 file loaded in bfloat16 takes half: the least budget halves too
    assert "give at least 300 bytes" in budget_refusal(299, tmp_path, 2)
    cfg = ServeConfig(speculate="auto", weight_budget=10**9)
    spec, notes = resolve_speculation(cfg, "cuda", object())
    assert spec is None and "speculation is not run with it" in notes[-1]
    with pytest.raises(FlagError, match="--speculate ngram: --weight-budget"):
        resolve_speculation(ServeConfig(speculate="ngram", weight_budget=10**9), "cuda", object())


class FakeOps:
    """The streamer's CUDA calls on the CPU: copies happen at once, events are numbered, and
    every call is logged."""

    def __init__(self):
        self.log, self.n = [], 0

    def pin(self, t):
        self.log.append(("pin", t.numel()))
        return t

    def buffer(self, nbytes):
        return torch.full((nbytes,), 0xAB, dtype=torch.uint8)

    def copy_async(self, dst, src, after):
        dst.copy_(src)
        self.n += 1
        self.log.append(("copy", src.data_ptr(), after, self.n))
        return self.n

    def wait(self, ev):
        self.log.append(("wait", ev))

    def mark(self):
        self.n += 1
        self.log.append(("mark", self.n))
        return self.n


def test_streamer_passes_with_fakes():
    n = 6
    g = torch.Generator().manual_seed(0)
    weights = {i: {"w": torch.randn(3, 5, generator=g), "b": torch.arange(i + 2, dtype=torch.bfloat16),
                   "idx": torch.tensor([i, 7], dtype=torch.int64)} for i in range(n)}
    sizes = [sum(t.numel() * t.element_size() for t in weights[i].values()) for i in range(n)]
    p = plan(sum(sizes) - sizes[0], 0, sizes)
    m = len(p.streamed)
    assert m >= 3 and p.slots == 2
    ops = FakeOps()
    st_ = LayerStreamer(p, lambda i: weights[i], ops)
    src = {st_.packed[i].flat.data_ptr(): i for i in p.streamed}
    seen_order = []
    for _ in range(3):  # passes
        for i in range(n):
            got = st_.enter(i)
            if i not in p.streamed:
                assert got is None
            else:
                for k, t in weights[i].items():  # "compute": the slot holds layer i's tensors
                    assert torch.equal(got[k], t) and got[k].dtype == t.dtype
                seen_order.append(i)
            st_.leave(i)
    assert seen_order == list(p.streamed) * 3
    copies = [e for e in ops.log if e[0] == "copy"]
    # copies in run order, wrapping into the next pass, one queued ahead of the computing layer
    assert [src[c[1]] for c in copies] == (list(p.streamed) * 4)[:len(copies)] and len(copies) == 3 * m + 1
    # a copy into a slot waits for the mark left by the compute that last read that slot
    marks = [e[1] for e in ops.log if e[0] == "mark"]
    assert [c[2] for c in copies[:2]] == [None, None]
    assert [c[2] for c in copies[2:]] == marks[: len(copies) - 2]
    with pytest.raises(RuntimeError, match="out of order"):
        st_.enter(p.streamed[1])


def test_streamed_transformers_model_gives_the_same_greedy_tokens():
    """attach() on transformers' llama with the fake copies: the hooks point each streamed
    layer at its slot's views, and greedy decoding is unchanged."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from caldrix.weight_budget import attach

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, initializer_range=0.2)
    ref = LlamaForCausalLM(cfg).eval()
    model = LlamaForCausalLM(cfg).eval()
    model.load_state_dict(ref.state_dict())
    fixed, layers = split_sizes(model.named_parameters())
    p = plan(fixed + sum(layers) - 2 * layers[0], fixed, layers)
    assert len(p.streamed) == 4
    ops = FakeOps()
    streamer = LayerStreamer(p, lambda i: {k: t.detach() for k, t in model.model.layers[i].named_parameters()}, ops)
    attach(model.model.layers, streamer, "cpu")
    assert all(t.numel() == 0 for i in p.streamed for t in model.model.layers[i].parameters())

    def greedy(m, n=12):
        ids = torch.tensor([[3, 17, 99, 4]])
        with torch.inference_mode():
            for _ in range(n):
                nxt = m(input_ids=ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        return ids[0].tolist()

    assert greedy(model) == greedy(ref)
    assert sum(e[0] == "copy" for e in ops.log) == 12 * 4 + 1  # every pass streamed every layer


# --- the passes keep to the device -------------------------------------------------------


def _tiny(tmp_path, arch: str) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)
    torch.manual_seed(0)
    model = (LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=True)) if arch == "llama"
             else Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=16)))
    model.save_pretrained(tmp_path / arch)
    return tmp_path / arch


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gpu_lane_passes_read_nothing_back_and_mix_in_no_cpu_tensor(tmp_path, arch):
    """The GPU lanes' forward passes, run on torch's meta device, which raises where a CUDA
    device would stall or fail: reading a device value on the host (`int(t)`, `.item()`: on a
    GPU a wait for the device, once per layer where the pass does it per layer) and an
    operation mixing a CPU tensor with device ones. Prefill from 0 and from a later start
    (the masked form), and a padded decode step with a verify run's rows, through the
    engine's own Attend plans; only the pick, after the pass, reads the device."""
    from caldrix.batch import Run
    from caldrix.engine import Engine
    from caldrix.models.base import Attend

    engine = Engine.load(_tiny(tmp_path, arch), dtype=torch.bfloat16, max_batch=4, context=96, device="meta")
    model, state = engine.model, engine.state
    for slot, start, n in ((0, 0, 40), (1, 0, 5), (0, 40, 7)):
        rows = torch.arange(start, start + n, device="meta")
        hidden = model(torch.zeros(n, dtype=torch.long, device="meta"),
                       Attend("prefill", (slot,), rows, rows, start=start), state)
        assert hidden.shape == (n, 64) and hidden.device.type == "meta"
    ids, at = engine._decode_inputs([Run(0, 47, (1,), (0,)), Run(1, 5, (2, 3, 4), (0, 1, 2), verify=True)])
    logits = model.logits(model(ids, at, state))
    assert logits.shape == (len(at.slots), 300) and logits.device.type == "meta"


# --- bench/gpu_check.py ------------------------------------------------------------------


def test_the_engine_streams_its_layers_within_the_budget(smollm2_dir):
    """--weight-budget wired into the engine, its "device" the CPU (weight_budget.HostOps): the
    plan is made on the loaded weights, the streamed layers hold no weights of their own outside
    a pass, and greedy replies, alone and batched, are the whole model's token for token."""
    from caldrix.engine import Engine
    from engine_util import generate

    whole = Engine.load(smollm2_dir, dtype=torch.float32, max_batch=2, context=128)
    fixed, layers = split_sizes(whole.model.named_parameters())
    budget = fixed + sum(layers) // 4 + 2 * max(layers)
    engine = Engine.load(smollm2_dir, dtype=torch.float32, max_batch=2, context=128, weight_budget=budget)
    p = engine.weight_plan
    assert p.device_bytes <= budget and len(p.streamed) >= len(layers) // 2 and p.slots == 2
    # a streamed layer's parameters are views into the two slot buffers (or empty before its
    # first pass), never storage of their own
    slots = {buf.untyped_storage().data_ptr() for buf in engine.model.streamer.slots}
    assert all(prm.numel() == 0 or prm.untyped_storage().data_ptr() in slots
               for i in p.streamed for prm in engine.model.layers[i].parameters())
    assert f"{len(layers) - len(p.streamed)} of {len(layers)} layers stay on the device" in p.line()
    prompts = [(1, 504, 3458, 314, 1017), (1, 378, 2051)]
    want = generate(whole, prompts, 8, together=True)
    assert generate(engine, prompts, 8, together=True) == want
    assert generate(engine, prompts, 8, together=False) == want
    with pytest.raises(BudgetError, match="give at least"):
        Engine.load(smollm2_dir, dtype=torch.float32, max_batch=1, context=64, weight_budget=fixed)


def test_the_runtime_streams_on_a_gpu_lane_and_says_so(smollm2_dir, monkeypatch):
    # A GPU lane simulated on the CPU: the budget reaches the engine, the start-up lines name the
    # plan, and a budget no plan fits exits 2 before anything is loaded.
    import caldrix.runtime as runtime

    monkeypatch.setitem(runtime.LANE_DEVICES, "cuda", "cpu")
    monkeypatch.setattr(runtime, "device_facts", lambda: ("a simulated GPU", 2**34))
    cfg = ServeConfig(model=str(smollm2_dir), backend="cuda", dtype="float32", context=64, weight_budget=300 * 2**20)
    rt = runtime.load_runtime(cfg)
    lines: list[str] = []
    rt.announce(lines.append)
    assert rt.engine.weight_plan is not None and rt.engine.weight_plan.line() in lines
    import attrs

    import caldrix.engine

    def no_load(*args, **kwargs):
        raise AssertionError("loaded before the budget was checked")

    monkeypatch.setattr(caldrix.engine.Engine, "load", no_load)
    with pytest.raises(FlagError, match="--weight-budget.*give at least"):
        runtime.load_runtime(attrs.evolve(cfg, weight_budget=10**6))


def test_gpu_check_exits_clearly_without_a_gpu(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert proc.returncode == 3, proc.stderr
    assert "no GPU" in proc.stderr
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["gpu"] is None and summary["checks"] == []
