"""caldrix/memory.py: the memory a KV cache may take, and Engine.load's refusal past it.

The cache's rows map lazily, so a reservation past the machine's memory used to start and be
killed by the kernel mid-reply; these check the figure it is compared with and the refusal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from caldrix import memory


def fake_proc(tmp_path: Path, available_kib: int, cgroup: str) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:       24683772 kB\nMemFree:  1000 kB\nMemAvailable:   {available_kib} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    return proc


def test_meminfo_alone_when_the_cgroup_has_no_limit(tmp_path):
    proc = fake_proc(tmp_path, 2_000_000, "0::/user.slice\n")
    root = tmp_path / "cg"
    (root / "user.slice").mkdir(parents=True)
    (root / "user.slice" / "memory.max").write_text("max\n")
    (root / "user.slice" / "memory.current").write_text("123\n")
    assert memory.available_bytes(proc, root) == 2_000_000 * 1024


def test_a_v2_container_limit_caps_memavailable(tmp_path):
    proc = fake_proc(tmp_path, 20_000_000, "0::/docker/abc\n")
    d = tmp_path / "cg" / "docker" / "abc"
    d.mkdir(parents=True)
    (d / "memory.max").write_text(str(4 * 2**30))
    (d / "memory.current").write_text(str(3 * 2**30))
    assert memory.available_bytes(proc, tmp_path / "cg") == 2**30


def test_a_v1_memory_controller_limit_caps_it_too(tmp_path):
    proc = fake_proc(tmp_path, 20_000_000, "12:cpu,cpuacct:/x\n4:memory:/box\n")
    d = tmp_path / "cg" / "memory" / "box"
    d.mkdir(parents=True)
    (d / "memory.limit_in_bytes").write_text(str(2 * 2**30))
    (d / "memory.usage_in_bytes").write_text(str(2**29))
    assert memory.available_bytes(proc, tmp_path / "cg") == 3 * 2**29
    (d / "memory.limit_in_bytes").write_text(str(2**63 - 4096))  # v1's "no limit"
    assert memory.available_bytes(proc, tmp_path / "cg") == 20_000_000 * 1024


def test_nothing_known_is_no_check(tmp_path):
    assert memory.available_bytes(tmp_path / "nope", tmp_path / "nope") is None


def test_this_machine_reports_a_figure_within_its_ram():
    got = memory.available_bytes()
    if got is None:
        pytest.skip("no /proc/meminfo here")
    total = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    assert 0 < got <= total


def test_engine_load_refuses_a_kv_cache_past_the_memory_left(tiny_llama_dir, monkeypatch):
    from caldrix.engine import Engine
    from caldrix.models.llama import DecoderConfig

    cfg = DecoderConfig.from_dir(tiny_llama_dir)
    row = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # K and V, float32
    # a dense engine at --max-batch 2 pads its decode steps into a third, scratch slot
    need = 3 * 256 * row
    monkeypatch.setattr(memory, "available_bytes", lambda: need - 1)
    with pytest.raises(MemoryError, match=r"the KV cache needs .* GiB and .* GiB of memory is available"):
        Engine.load(tiny_llama_dir, dtype=torch.float32, max_batch=2, context=256)
    monkeypatch.setattr(memory, "available_bytes", lambda: need)
    engine = Engine.load(tiny_llama_dir, dtype=torch.float32, max_batch=2, context=256)
    assert engine.kv_bytes == need


@pytest.fixture
def tiny_llama_dir(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    return tmp_path
