"""The compiled decode kernels (caldrix/kernels/attend.cpp) against torch (SDPA, ops.py's RoPE
and RMSNorm), and the exactness contract the engine relies on: a row's result never depends on
its batch mates, their count or the thread count."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from caldrix.kernels import build, native

H, G = 9, 3  # SmolLM2's query and kv heads
BF16, F32 = torch.bfloat16, torch.float32
DTYPES = pytest.mark.parametrize("dtype", [BF16, F32])  # a bf16 engine (AVX512-BF16 CPUs) and a float32 one


def on_threads(fn):
    """fn() on 1 and on 2 threads, the thread count restored after."""
    saved = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(fn())
        return outs
    finally:
        torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def op():
    if build.compiler() is None:
        pytest.skip("no C++ compiler on this machine")
    assert native.load(), "a C++ compiler is here, so the kernel must build and load"
    return torch.ops.caldrix.decode_attend


def make(T, e=64, h=H, g=G, slots=8, rows=1100, seed=0, dtype=BF16):
    gen = torch.Generator().manual_seed(seed)
    K = torch.randn(slots, g, rows, e, generator=gen).to(dtype)
    V = torch.randn(slots, g, rows, e, generator=gen).to(dtype)
    # q, k, v as the model makes them: views into one fused projection row
    qkv = (3 * torch.randn(T, (h + 2 * g) * e, generator=gen)).to(dtype)
    qk, v = qkv.split([(h + g) * e, g * e], dim=-1)
    qk, v = qk.view(T, h + g, e), v.view(T, g, e)
    return qk[:, :h], qk[:, h:], v, K, V


@DTYPES
@pytest.mark.parametrize("e,h,g", [(64, 9, 3), (128, 16, 8), (64, 4, 4)])
def test_kernel_agrees_with_sdpa_and_writes_the_same_cache(op, e, h, g, dtype):
    q, k, v, K, V = make(6, e, h, g, dtype=dtype)
    slots, lengths = [0, 3, 5, 2, 7, 1], [1, 37, 200, 0, 1024, 5]  # a padding row among them
    K2, V2 = K.clone(), V.clone()
    want = native.torch_decode_attend(q, k, v, K2, V2, slots, lengths, e ** -0.5)
    got = op(q, k, v, K, V, slots, lengths, e ** -0.5)
    assert torch.equal(K, K2) and torch.equal(V, V2)
    assert got.shape == (6, h * e) and got.dtype == dtype
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    # The two differ only in float rounding: the sums of up to 1024 keys run in other orders.
    # bf16 outputs within a few bf16 ulps (2^-8) of |out| ~ 1; float32 ones within a few
    # hundred float32 ulps (2^-24), the rounding of a 1024-term sum.
    tol, mean = (2e-2, 2e-3) if dtype is BF16 else (2e-5, 1e-6)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert (got.float() - want.float()).abs().mean() < mean


@DTYPES
def test_a_row_is_the_same_alone_in_a_batch_and_on_any_thread_count(op, dtype):
    q, k, v, K, V = make(8, dtype=dtype)
    slots, lengths = list(range(8)), [50, 80, 1000, 60, 200, 1050, 70, 150]  # long enough to split across threads
    outs = on_threads(lambda: op(q, k, v, K.clone(), V.clone(), slots, lengths, 0.125))
    assert torch.equal(outs[0], outs[1])
    for i in (0, 2, 7):
        alone = op(q[i : i + 1], k[i : i + 1], v[i : i + 1], K.clone(), V.clone(), [slots[i]], [lengths[i]], 0.125)
        assert torch.equal(alone[0], outs[0][i])


@DTYPES
def test_verify_rows_of_one_slot_equal_one_row_calls_in_turn(op, dtype):
    # A speculative verify: four rows of slot 2 at consecutive positions, each attending over
    # the keys its predecessors in the same call wrote.
    q, k, v, K, V = make(4, dtype=dtype)
    K1, V1 = K.clone(), V.clone()
    one = torch.cat([op(q[i : i + 1], k[i : i + 1], v[i : i + 1], K1, V1, [2], [41 + i], 0.125) for i in range(4)])
    many = op(q, k, v, K, V, [2] * 4, [41, 42, 43, 44], 0.125)
    assert torch.equal(one, many) and torch.equal(K, K1) and torch.equal(V, V1)


def rope_inputs(T, e, h, g, seed=1, dtype=BF16):
    gen = torch.Generator().manual_seed(seed)
    qkv = (3 * torch.randn(T, (h + 2 * g) * e, generator=gen)).to(dtype)
    angle = torch.arange(T).unsqueeze(1) * torch.rand(e, generator=gen) * 50  # positions far apart
    return qkv, angle.cos().to(dtype).unsqueeze(1), angle.sin().to(dtype).unsqueeze(1)  # [T, 1, E]


@DTYPES
@pytest.mark.parametrize("e,h,g", [(64, 9, 3), (128, 16, 8)])
def test_rope_attend_is_split_rope_and_attend_bit_for_bit(op, e, h, g, dtype):
    # The fused op's RoPE rounds as torch's elementwise ops round (for float32: no fused
    # multiply-add), so it is the torch path exactly: the same cache writes, the same outputs.
    qkv, cos, sin = rope_inputs(5, e, h, g, dtype=dtype)
    _, _, _, K, V = make(1, e, h, g, dtype=dtype)
    K2, V2 = K.clone(), V.clone()
    slots, lengths = [0, 3, 5, 2, 7], [1, 37, 200, 0, 1024]
    want = native.torch_decode_rope_attend(qkv, cos, sin, K2, V2, slots, lengths, h, e ** -0.5)
    got = torch.ops.caldrix.decode_rope_attend(qkv, cos, sin, K, V, slots, lengths, h, e ** -0.5)
    assert torch.equal(got, want) and torch.equal(K, K2) and torch.equal(V, V2)
    with pytest.raises(RuntimeError, match="columns, not"):
        torch.ops.caldrix.decode_rope_attend(qkv, cos, sin, K, V, slots, lengths, h + 1, e ** -0.5)


@DTYPES
def test_norm_follows_torch_and_a_row_depends_on_itself_alone(op, dtype):
    gen = torch.Generator().manual_seed(2)
    x = (4 * torch.randn(16, 576, generator=gen)).to(dtype)
    w = torch.randn(576, generator=gen).to(dtype)
    got = torch.ops.caldrix.decode_norm(x, w, 1e-5)
    want = native.torch_decode_norm(x, w, 1e-5)
    # Only the order of the float sum of squares (and how the root is taken) differs: at most
    # an ulp of the dtype here and there, bf16's 2^-7 or float32's few 2^-23.
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2 ** -7 if dtype is BF16 else 2 ** -21)
    for row in on_threads(lambda: torch.ops.caldrix.decode_norm(x[5:6], w, 1e-5)[0]):
        assert torch.equal(row, got[5])
    with pytest.raises(RuntimeError, match="x and w of one dtype"):
        torch.ops.caldrix.decode_norm(x.half(), w.half(), 1e-5)
    with pytest.raises(RuntimeError, match="x and w of one dtype"):
        torch.ops.caldrix.decode_norm(x, w.double(), 1e-5)


@pytest.fixture(scope="module")
def q4_mm(op):
    if not native.has_q4_mm():
        pytest.skip("caldrix::q4_mm is built only for CPUs with AVX512-BF16")
    return torch.ops.caldrix.q4_mm


def q4_weights(n, k, seed=3):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02).half().float()  # the GGUF's float16 d and m
    m = (-torch.rand(n, k // 32, generator=gen) * 0.1).half().float()
    w = (q.float().view(n, k // 32, 32) * d.unsqueeze(-1) + m.unsqueeze(-1)).view(n, k)
    return q, d, m, w


@pytest.mark.parametrize("n,k", [(3072, 576), (576, 1536), (960, 576)])
def test_q4_mm_follows_the_dequantized_weights_and_torchs_kernel(q4_mm, n, k):
    from caldrix.kernels import q4

    q, d, m, w = q4_weights(n, k)
    qw, dm = q4.q4_mm_layout(q, d, m)
    theirs = q4.Int4Linear(q, d, m)
    gen = torch.Generator().manual_seed(4)
    for T in (1, 5, 9, 20):  # 20: more rows than one pass over the weights takes (8)
        x = torch.randn(T, k, generator=gen).bfloat16()
        want = x.float() @ w.T
        got = q4_mm(x, qw, dm)
        assert got.shape == (T, n) and got.dtype == torch.bfloat16
        # float32 sums of exact products: off by the output's bfloat16 rounding and little else
        assert (got.float() - want).abs().max() <= 2 ** -7 * want.abs().max()
        other = q4.int4_mm(x, theirs.packed, theirs.scale_zero, ours=False).float()
        assert (got.float() - other).abs().max() <= 2 ** -6 * want.abs().max()


def test_q4_mm_layout_keeps_the_gguf_float16_scales_and_refuses_others():
    """The layout holds d and m as float16 (half the bytes of float32, what a one-row step
    reads most of after the nibbles); that loses nothing only for values that are float16."""
    from caldrix.kernels import q4

    q, d, m, _ = q4_weights(64, 64)
    _, dm = q4.q4_mm_layout(q, d, m)
    assert dm.dtype == torch.float16
    got_d = dm.view(64 // 16, 64 // 32, 2, 16)[:, :, 0].permute(0, 2, 1).reshape(64, 2)
    assert torch.equal(got_d.float(), d)
    with pytest.raises(ValueError, match="float16"):
        q4.q4_mm_layout(q, d + 1e-6, m)  # not a float16 value


def test_q4_mm_rows_depend_on_themselves_alone(q4_mm):
    from caldrix.kernels import q4

    # 65 column groups: the prefill path's pairs of groups leave one over. 130 rows: a prefill
    # chunk's worth, which takes that path (more than 8 rows), against calls of up to 8 rows.
    q, d, m, _ = q4_weights(1040, 576)
    qw, dm = q4.q4_mm_layout(q, d, m)
    x = torch.randn(130, 576, generator=torch.Generator().manual_seed(5)).bfloat16()
    outs = on_threads(lambda: q4_mm(x, qw, dm))
    assert torch.equal(outs[0], outs[1])
    for i in (0, 7, 8, 11, 129):  # either side of the 8-row passes
        assert torch.equal(q4_mm(x[i : i + 1], qw, dm)[0], outs[0][i])
    assert torch.equal(q4_mm(x[3:10], qw, dm), outs[0][3:10])
    assert torch.equal(q4_mm(x[3:11], qw, dm), outs[0][3:11])
    assert torch.equal(q4_mm(x[100:], qw, dm), outs[0][100:])


def test_q4_mm_refuses_what_it_cannot_take(q4_mm):
    from caldrix.kernels import q4

    q, d, m, _ = q4_weights(32, 64)
    qw, dm = q4.q4_mm_layout(q, d, m)
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        q4_mm(x.float(), qw, dm)
    with pytest.raises(RuntimeError, match="K / 2"):
        q4_mm(torch.randn(2, 96).bfloat16(), qw, dm)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        q4_mm(x, qw[:24], dm)
    assert not q4.ours_fits(24, 64) and not q4.ours_fits(32, 48) and q4.ours_fits(32, 64)


@pytest.fixture(scope="module")
def q4_mm_f32(op):
    if not native.has_q4_mm_f32():
        pytest.skip("caldrix::q4_mm_f32 is built only for CPUs with AVX2, FMA and F16C")
    return torch.ops.caldrix.q4_mm_f32


@pytest.mark.parametrize("n,k", [(3072, 576), (576, 1536), (968, 576)])
def test_q4_mm_f32_follows_the_dequantized_weights(q4_mm_f32, n, k):
    from caldrix.kernels import q4

    q, d, m, w = q4_weights(n, k)
    qw, dm = q4.q4_mm_f32_layout(q, d, m)
    gen = torch.Generator().manual_seed(4)
    for T in (1, 2, 3, 5, 9, 20):  # every row tile (1-4), and more rows than one pass takes (8)
        x = torch.randn(T, k, generator=gen)
        want = x.double() @ w.double().T
        got = q4_mm_f32(x, qw, dm)
        assert got.shape == (T, n) and got.dtype == torch.float32
        # float32 sums of float32 products over k: off by a few float32 roundings of the sum
        assert (got.double() - want).abs().max() <= 2 ** -18 * want.abs().max()


def test_q4_mm_f32_rows_depend_on_themselves_alone(q4_mm_f32):
    from caldrix.kernels import q4

    q, d, m, _ = q4_weights(1032, 576)  # 129 column groups: the interleaved passes leave a tail
    qw, dm = q4.q4_mm_f32_layout(q, d, m)
    x = torch.randn(12, 576, generator=torch.Generator().manual_seed(5))
    outs = on_threads(lambda: q4_mm_f32(x, qw, dm))
    assert torch.equal(outs[0], outs[1])
    for i in range(12):
        assert torch.equal(q4_mm_f32(x[i : i + 1], qw, dm)[0], outs[0][i])
    assert torch.equal(q4_mm_f32(x[3:10], qw, dm), outs[0][3:10])
    assert torch.equal(q4_mm_f32(x[1:3], qw, dm), outs[0][1:3])


def test_q4_mm_f32_refuses_what_it_cannot_take(q4_mm_f32):
    from caldrix.kernels import q4

    q, d, m, _ = q4_weights(24, 64)
    qw, dm = q4.q4_mm_f32_layout(q, d, m)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        q4_mm_f32(x.bfloat16(), qw, dm)
    with pytest.raises(RuntimeError, match="K / 2"):
        q4_mm_f32(torch.randn(2, 96), qw, dm)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        q4_mm_f32(x, qw[:20], dm)
    f32 = torch.float32
    assert not q4.ours_fits(20, 64, f32) and not q4.ours_fits(24, 48, f32) and q4.ours_fits(24, 64, f32)


def test_bad_calls_are_errors_that_name_the_problem(op):
    q, k, v, K, V = make(2)
    with pytest.raises(RuntimeError, match="bfloat16 or float32 CPU tensors only, all of one dtype"):
        op(q.float(), k, v, K, V, [0, 1], [3, 3], 0.125)
    with pytest.raises(RuntimeError, match="bfloat16 or float32 CPU tensors only"):
        op(q.half(), k.half(), v.half(), K.half(), V.half(), [0, 1], [3, 3], 0.125)
    with pytest.raises(RuntimeError, match="row 1 is slot 1 length 5000"):
        op(q, k, v, K, V, [0, 1], [3, 5000], 0.125)
    with pytest.raises(RuntimeError, match="one slot and one length a row"):
        op(q, k, v, K, V, [0], [3], 0.125)


def test_without_the_kernel_the_op_is_the_torch_definition(tmp_path):
    # CALDRIX_NATIVE=0 (or no compiler) still registers caldrix::decode_attend, as the torch
    # definition, so the eager and scripted layers have one name to call.
    code = (
        "import torch\n"
        "from caldrix.kernels import native\n"
        "assert native.load() is False and native.has_q4_mm() is False and native.has_q4_mm_f32() is False\n"
        "q = torch.randn(2, 9, 64).bfloat16(); k = torch.randn(2, 3, 64).bfloat16(); v = k.clone()\n"
        "K = torch.zeros(2, 3, 16, 64).bfloat16(); V = K.clone()\n"
        "K2, V2 = K.clone(), V.clone()\n"
        "got = torch.ops.caldrix.decode_attend(q, k, v, K, V, [0, 1], [4, 0], 0.125)\n"
        "want = native.torch_decode_attend(q, k, v, K2, V2, [0, 1], [4, 0], 0.125)\n"
        "assert torch.equal(got, want) and torch.equal(K, K2)\n"
        "x = torch.randn(2, 64).bfloat16(); w = torch.randn(64).bfloat16()\n"
        "assert torch.equal(torch.ops.caldrix.decode_norm(x, w, 1e-5), native.torch_decode_norm(x, w, 1e-5))\n"
        "print('ok')\n"
    )
    env = {**os.environ, "CALDRIX_NATIVE": "0", "CALDRIX_CACHE": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
    assert not (tmp_path / "kernels").exists()  # nothing was compiled


def _failing_compiler(tmp_path):
    """A CXX that fails the way a broken toolchain does: an error on stderr, exit 1."""
    cxx = tmp_path / "broken-c++"
    cxx.write_text("#!/bin/sh\necho 'attend.cpp:1:10: fatal error: torch/extension.h: no such file' >&2\nexit 1\n")
    cxx.chmod(0o755)
    return cxx


def test_a_failed_build_is_a_start_up_note_and_the_ops_still_answer(tmp_path):
    # A failed build must not pass for the kernels: the start-up says so, in one line naming
    # the compiler's error, and the torch definitions answer the same calls.
    code = (
        "import torch\n"
        "from caldrix.kernels import native\n"
        "from caldrix.runtime import kernel_notes\n"
        "assert native.load() is False\n"
        "notes = kernel_notes('cpu')\n"
        "assert kernel_notes('cuda') == () and kernel_notes('host') == ()\n"
        "x = torch.randn(2, 64); w = torch.randn(64)\n"
        "assert torch.equal(torch.ops.caldrix.decode_norm(x, w, 1e-5), native.torch_decode_norm(x, w, 1e-5))\n"
        "print(repr(notes))\n"
    )
    cxx = _failing_compiler(tmp_path)
    env = {**os.environ, "CXX": str(cxx), "CALDRIX_CACHE": str(tmp_path / "cache")}
    env.pop("CALDRIX_NATIVE", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    notes = eval(r.stdout.strip())
    assert len(notes) == 1
    assert "the compiled decode kernels are off" in notes[0]
    assert "did not build or load" in notes[0] and "torch/extension.h: no such file" in notes[0]
    assert not list((tmp_path / "cache" / "kernels").glob("*/attend.so"))


def test_a_server_without_its_kernels_says_so_and_serves(tmp_path, smollm2_dir):
    import httpx
    from server_harness import ServerProcess

    env = {"CXX": str(_failing_compiler(tmp_path)), "CALDRIX_CACHE": str(tmp_path / "cache")}
    with ServerProcess.start(smollm2_dir, "--dtype", "float32", "--weights", "dense", env=env) as srv:
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": smollm2_dir.name, "prompt": "The capital of France is",
                                                           "max_tokens": 4, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        notes = [ln for ln in srv.stderr.splitlines() if ln.startswith("caldrix: note: the compiled decode kernels")]
        assert len(notes) == 1, srv.stderr
        assert "torch/extension.h" in notes[0] and "several times slower" in notes[0]


@pytest.mark.parametrize("free_mib,most", [(700, 1), (None, 2)])
def test_the_build_runs_as_many_compilers_as_memory_allows(tmp_path, monkeypatch, free_mib, most):
    """build.compile_sources starts one compiler per source, at most one per core and per
    COMPILER_BYTES of free memory (a 1.5 GiB container has room for one): counted with a
    stand-in compiler that notes when it starts and ends."""
    log = tmp_path / "log"
    cxx = tmp_path / "fake-c++"
    cxx.write_text(f"#!/bin/sh\necho start >> {log}\nsleep 0.3\necho end >> {log}\n"
                   "while [ \"$1\" != -o ]; do shift; done; touch \"$2\"\n")
    cxx.chmod(0o755)
    monkeypatch.setattr(build, "_free_bytes", lambda: None if free_mib is None else free_mib << 20)
    monkeypatch.setattr(build.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    objs = build.compile_sources([str(cxx)], [], [], tmp_path)
    assert [o.name for o in objs] == [f"{s.stem}.o" for s in build.SOURCES] and all(o.exists() for o in objs)
    running = peak = 0
    for line in log.read_text().split():
        running += 1 if line == "start" else -1
        peak = max(peak, running)
    assert peak == most


def _stand_in(tmp_path, body: str):
    """A compiler that notes each call's arguments in `calls` and runs `body` (sh); its objects
    and links are empty files, so _build runs to its end in milliseconds."""
    calls = tmp_path / "calls"
    cxx = tmp_path / "stand-in c++"  # a space in the path: CXX is split as a shell splits it
    cxx.write_text(f"#!/bin/sh\necho \"$*\" >> '{calls}'\n{body}\n"
                   "while [ \"$1\" != -o ]; do shift; done; touch \"$2\"\n")
    cxx.chmod(0o755)
    return cxx, calls


def _build_with(monkeypatch, cxx, out):
    monkeypatch.setenv("CXX", f"'{cxx}' --wrapped")
    build.build_object(build.compiler(), out)


def test_a_compiler_without_openmp_builds_once_more_without_it(tmp_path, monkeypatch):
    # clang without libomp: the second round drops -fopenmp and is kept, readable by every user
    # of a shared cache; CXX with an argument is split, the argument passed on each call.
    cxx, calls = _stand_in(tmp_path, "case \"$*\" in *-fopenmp*) echo \"clang: error: unsupported option '-fopenmp'\" >&2; exit 1;; esac")
    out = tmp_path / "kernels" / "k" / "attend.so"
    out.parent.mkdir(parents=True)
    (out.parent / "tmpstale.so").write_text("")  # a build killed earlier left these
    (out.parent / "tmpstale").mkdir()
    _build_with(monkeypatch, cxx, out)
    lines = calls.read_text().splitlines()
    assert all(ln.startswith("--wrapped ") for ln in lines)
    with_omp = ["-fopenmp" in ln for ln in lines]
    # the first round (its other compilers may have started before the first failed), then
    # every source and the link without it
    assert with_omp[0] and with_omp == sorted(with_omp, reverse=True)
    assert with_omp.count(False) == len(build.SOURCES) + 1
    umask = os.umask(0)
    os.umask(umask)
    assert out.exists() and (out.stat().st_mode & 0o777) == 0o755 & ~umask
    assert sorted(p.name for p in out.parent.iterdir()) == ["attend.so", "build.lock"]


@pytest.mark.parametrize("body, says", [
    ("kill -INT $$", "killed by signal 2"),  # Ctrl-C reaches the compilers of a terminal's process group
    ("echo 'attend.cpp:9: error: expected ;' >&2; exit 1", "exited 1"),
])
def test_a_build_that_fails_otherwise_is_not_retried_and_leaves_nothing(tmp_path, monkeypatch, body, says):
    cxx, calls = _stand_in(tmp_path, body)
    out = tmp_path / "kernels" / "k" / "attend.so"
    with pytest.raises(build.CompileError, match=says):
        _build_with(monkeypatch, cxx, out)
    assert not any("-fopenmp" not in ln for ln in calls.read_text().splitlines())  # no second round
    assert sorted(p.name for p in out.parent.iterdir()) == ["build.lock"]
