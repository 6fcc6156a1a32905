"""The command line as a user runs it: real subprocesses, real weights."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from caldrix import __version__


def caldrix(*args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "caldrix", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


def test_version_and_help():
    out = caldrix("--version")
    assert out.returncode == 0 and __version__ in out.stdout
    out = caldrix("serve", "--help")
    assert out.returncode == 0
    for flag in ("--max-batch", "--queue-depth", "--context", "--dtype", "--backend", "--served-name", "--port"):
        assert flag in out.stdout


@pytest.mark.parametrize("args, flag", [
    (["serve", "--max-batch", "0"], "--max-batch"),
    (["serve", "--top-p", "2"], "--top-p"),
    (["serve", "--dtype", "int3"], "--dtype"),
    (["run", "--temperature", "-1", "hi"], "--temperature"),
    (["serve", "--seed", str(2**64)], "--seed"),  # past 64 bits /debug/requests could not write it
    (["serve", "--port", "65536"], "--port"),
    (["run", "hi", "--stop", ""], "--stop"),
    (["run", "hi", "--stop", "x" * 257], "--stop"),
    (["run", ""], "PROMPT"),
])
def test_bad_flag_exits_2_naming_it(args, flag):
    out = caldrix(*args)
    assert out.returncode == 2
    assert flag in out.stderr


def test_bench_runs_the_checkouts_benchmark_with_its_own_arguments(tmp_path):
    """cli.md's `caldrix bench`: bench/serve.py, every argument after `bench` its own."""
    out = caldrix("bench", "--help", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage: serve.py" in out.stdout and "--quick" in out.stdout
    bad = caldrix("bench", "--no-such-flag", timeout=120)
    assert bad.returncode == 2 and "--no-such-flag" in bad.stderr
    from caldrix.bench_command import bench

    probe = tmp_path / "bench" / "serve.py"
    probe.parent.mkdir()
    probe.write_text("import sys; print(sys.argv[1:]); sys.exit(7)\n")
    # another distribution's bench/serve.py beside an installed caldrix is not run
    assert bench(["--quick", "x"], script=probe) == 2
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "caldrix"\n')
    assert bench(["--quick", "x"], script=probe) == 7


def test_bench_without_a_checkout_says_where_the_benchmark_is(tmp_path, capsys):
    from caldrix.bench_command import bench

    assert bench([], script=tmp_path / "bench" / "serve.py") == 2
    assert "bench/serve.py in a source checkout" in capsys.readouterr().err


def test_missing_model_is_a_message_not_a_traceback():
    out = caldrix("run", "org/not-in-the-cache", "hello")
    assert out.returncode == 1
    assert "caldrix fetch" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_cache_that_cannot_be_written_is_one_line_naming_caldrix_cache(tmp_path):
    # a file where the cache directory should be: mkdir fails for root too (a read-only
    # directory does not stop root)
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    out = subprocess.run([sys.executable, "-m", "caldrix", "run", "hi", "--max-tokens", "1"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "CALDRIX_CACHE": str(blocked)})
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].endswith(
        f"the cache {blocked}/gguf cannot be written (Not a directory); set CALDRIX_CACHE to a writable directory")


def test_run_streams_the_greedy_reply(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    prompt = "The capital of France is"
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=10, do_sample=False)
    want = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    got = caldrix("run", str(smollm2_dir), "-", "--max-tokens", "10", "--dtype", "float32", stdin=prompt)
    assert got.returncode == 0, got.stderr
    assert got.stdout == want + "\n"


def test_stdin_prompt_drops_one_final_line_end_for_chat_only():
    from caldrix.cli import stdin_prompt

    assert stdin_prompt("Q?\n", chat=True) == "Q?" and stdin_prompt("Q?\r\n", chat=True) == "Q?"
    assert stdin_prompt("Q?\n\n", chat=True) == "Q?\n"  # one line end, not every trailing blank
    assert stdin_prompt("a\nb", chat=True) == "a\nb"
    assert stdin_prompt("Q?\n", chat=False) == "Q?\n"  # a raw prompt is taken exactly as sent


def test_a_chat_prompt_from_stdin_asks_what_the_argument_asks(smollm2_dir):
    """`echo QUESTION | caldrix run - --chat` renders the prompt `caldrix run QUESTION --chat`
    does. A context too small for it makes each run name its prompt's length and stop (exit 2)."""
    question = "What is the capital of France?"
    said = []
    for source, stdin in (("-", question + "\n"), (question, None)):
        got = caldrix("run", str(smollm2_dir), source, "--chat", "--context", "16", "--dtype", "float32", stdin=stdin)
        assert got.returncode == 2, got.stderr
        said.append(got.stderr.strip().splitlines()[-1])
    assert said[0] == said[1] and said[0].startswith("caldrix: the prompt is "), said


def test_an_empty_prompt_from_stdin_exits_2_at_once():
    out = caldrix("run", "-", stdin="", timeout=60)  # it once loaded the model and then hung
    assert out.returncode == 2 and "the prompt is empty" in out.stderr


def test_a_gpu_backend_without_that_gpu_exits_2_before_loading(monkeypatch, capsys):
    from caldrix import cli, lanes

    for seen, backend, needle in ((None, "cuda", "torch sees no GPU here"), (None, "hip", "torch sees no GPU here"),
                                  ("hip", "cuda", "this torch is a ROCm build, which drives the hip lane"),
                                  ("cuda", "hip", "this torch is a CUDA build, which drives the cuda lane")):
        monkeypatch.setattr(lanes, "gpu_seen", lambda: seen)
        with pytest.raises(SystemExit) as exc:
            cli.main(["serve", "--backend", backend])
        assert exc.value.code == 2 and f"--backend {backend}: {needle}" in capsys.readouterr().err
    assert lanes.backend_refusal("cuda", lambda: "cuda") is None and lanes.backend_refusal("cpu", None) is None


def test_run_ends_quietly_on_ctrl_c_and_on_a_closed_pipe(monkeypatch):
    from caldrix import cli

    def raising(exc):
        def generate():
            raise BaseExceptionGroup("trio", [exc])
        return generate

    assert cli._quietly(raising(KeyboardInterrupt())) == 130
    with pytest.raises(BaseExceptionGroup):  # anything else is not swallowed
        cli._quietly(raising(RuntimeError("boom")))
    monkeypatch.setattr(cli.os, "dup2", lambda *a: None)  # keep the test's own stdout
    assert cli._quietly(raising(BrokenPipeError())) == 141


def test_run_into_a_closed_pipe_leaves_no_traceback(smollm2_dir):
    proc = subprocess.run(f"{sys.executable} -m caldrix run {smollm2_dir} 'Count from one to fifty:' --max-tokens 200 "
                          "--ignore-eos | head -c 5", shell=True, capture_output=True, text=True, timeout=300)
    assert len(proc.stdout) == 5
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr


def test_the_start_up_url_is_the_one_bound(monkeypatch):
    import socket

    from caldrix.server import base_url, check_bindable

    assert base_url("::1", 8425) == "http://[::1]:8425" and base_url("127.0.0.1", 0, ["http://127.0.0.1:4242"]) \
        == "http://127.0.0.1:4242"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"--port: cannot listen on 127.0.0.1 port {port}"):
            check_bindable("127.0.0.1", port)
    check_bindable("127.0.0.1", 0)


def test_a_kv_cache_that_does_not_fit_is_one_line_naming_the_flags():
    from caldrix.config import ServeConfig
    from caldrix.runtime import memory_refusal

    cfg = ServeConfig(model=None, context=10**10, max_batch=1)
    err = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 115200000000000 bytes.\nmore")
    line = memory_refusal(err, cfg)
    assert line.startswith("--context 10000000000 with --max-batch 1: the model and its KV cache do not fit")
    assert "\n" not in line and memory_refusal(RuntimeError("shape mismatch"), cfg) is None


def test_replay_refuses_a_file_that_is_not_a_trace(tmp_path):
    from caldrix import replay

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    headless = tmp_path / "headless.jsonl"
    headless.write_text('{"arrival": 0, "prompt_tokens": 3, "completion_tokens": 2}\n')
    for path in (empty, headless):
        assert replay.main(str(path), "http://127.0.0.1:9") == 2


HEADER = '{"trace": "caldrix", "version": 1, "block_tokens": 16}\n'


@pytest.mark.parametrize("header, line, says", [
    (HEADER, '{"arrival": 0, "prompt_tokens": 1e12, "completion_tokens": 2}', "prompt_tokens must be 1 to 1048576"),
    (HEADER, '{"arrival": 0, "prompt_tokens": -3, "completion_tokens": 2}', "prompt_tokens must be 1 to"),
    (HEADER, '{"arrival": 0, "prompt_tokens": 1048577, "completion_tokens": 2}', "must be 1 to 1048576, got 1048577"),
    (HEADER, '{"arrival": 0, "prompt_tokens": 3, "completion_tokens": 1e300}', "completion_tokens must be 0 to"),
    (HEADER, '{"arrival": 0, "prompt_tokens": 2.5, "completion_tokens": 2}', "prompt_tokens must be a whole number"),
    (HEADER, '{"arrival": true, "prompt_tokens": 3, "completion_tokens": 2}', "arrival must be a number"),
    (HEADER, '{"arrival": 1e300, "prompt_tokens": 3, "completion_tokens": 2}', "arrival must be 0 to"),
    (HEADER, '{"arrival": -1, "prompt_tokens": 3, "completion_tokens": 2}', "arrival must be 0 to"),
    (HEADER, '{"arrival": 0, "prompt_tokens": 3, "completion_tokens": 2, "sampling": [1, 2]}', "sampling must be an object"),
    (HEADER, '{"arrival": 0, "prompt_tokens": 3, "completion_tokens": 2, "blocks": "abc"}', "blocks must be a list"),
    ('{"trace": "caldrix", "version": 1, "vocab_size": "big"}\n', '{"arrival": 0, "prompt_tokens": 3, "completion_tokens": 2}',
     "vocab_size must be a whole number"),
    ('{"trace": "caldrix", "version": 1, "block_tokens": 0}\n', '{"arrival": 0, "prompt_tokens": 3, "completion_tokens": 2}',
     "block_tokens must be 1 to 4096"),
    ('{"trace": "caldrix", "version": 999}\n', '{"arrival": 0, "prompt_tokens": 3, "completion_tokens": 2}',
     "trace version 999; this caldrix reads version 1"),
])
def test_replay_refuses_a_damaged_trace_before_it_sends_anything(tmp_path, capsys, header, line, says):
    """Checked when read, before the server is asked anything (port 9 answers nothing): a hostile
    file must not build a 10**12-token prompt, wait for 1e300 seconds, or end in a traceback."""
    from caldrix import replay

    path = tmp_path / "t.jsonl"
    path.write_text(header + line + "\n")
    assert replay.main(str(path), "http://127.0.0.1:9") == 2
    assert says in capsys.readouterr().err


def test_replay_refuses_a_url_it_cannot_parse_and_reads_a_small_vocabulary(tmp_path, capsys):
    from caldrix import replay

    path = tmp_path / "t.jsonl"
    path.write_text('{"trace": "caldrix", "version": 1, "vocab_size": 500}\n'
                    '{"arrival": 0, "prompt_tokens": 40, "completion_tokens": 2, "blocks": ["a1", "b2"]}\n')
    for url in ("http://[::1", "notaurl", "ftp://127.0.0.1:9"):
        assert replay.main(str(path), url) == 2
        assert "is not a URL" in capsys.readouterr().err
    # a test model's 500-token vocabulary: every id under it, none refused for want of a range
    ids = replay.synthetic_prompt(replay.load_trace(path).requests[0], 16, 500)
    assert len(ids) == 40 and all(0 <= i < 500 for i in ids)
