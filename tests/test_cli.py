"""The command line as a user runs it: real subprocesses, real weights."""

from __future__ import annotations

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
])
def test_bad_flag_exits_2_naming_it(args, flag):
    out = caldrix(*args)
    assert out.returncode == 2
    assert flag in out.stderr


def test_missing_model_is_a_message_not_a_traceback():
    out = caldrix("run", "org/not-in-the-cache", "hello")
    assert out.returncode == 1
    assert "caldrix fetch" in out.stderr
    assert "Traceback" not in out.stderr


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
