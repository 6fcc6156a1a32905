"""--speculation-memory: the tuner's state round-trips, a torn, foreign or unreadable file is a
note and a fresh start, and a read-only path is a note, never a failed start."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from caldrix.sched.spec_memory import FORMAT, SpeculationMemory, TunerState
from caldrix.sched.speculate import DraftTuner


def trained_tuner() -> DraftTuner:
    t = DraftTuner()
    for rows, secs in ((1, 0.014), (2, 0.018), (3, 0.021), (5, 0.035)):
        t.timed(rows, secs)
    for kept in (3, 4, 0, 2, 4, 4):
        t.record(4, kept)
    return t


def test_round_trip_gives_the_same_next_length(tmp_path):
    tuner = trained_tuner()
    mem = SpeculationMemory(tmp_path / "spec.json", "target=a draft=b")
    assert mem.load() == (None, None)  # no file yet: fresh, and nothing to say
    assert mem.save(tuner.state()) is None
    state, note = mem.load()
    assert note is None and state == tuner.state()
    fresh = DraftTuner()
    fresh.restore(state)
    assert fresh.next_length() == tuner.next_length()
    assert fresh.state() == tuner.state()
    # No temporary file is left beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.json"]


def test_another_pair_of_models_is_ignored_with_a_note(tmp_path):
    path = tmp_path / "spec.json"
    SpeculationMemory(path, "target=a draft=b").save(trained_tuner().state())
    state, note = SpeculationMemory(path, "target=a draft=c").load()
    assert state is None
    assert "another pair of models" in note and "target=a draft=b" in note


@pytest.mark.parametrize("body", [
    b"",  # empty
    b'{"format": "caldrix-speculation-memory/1", "identity": "x", "tun',  # torn mid-write
    b"\xff\xfe not json",
    b'{"format": "something else", "identity": "x"}',
    b'{"format": "caldrix-speculation-memory/1", "identity": "x", "tuner": {"kept": -1, "missed": 1, "seconds": {}}}',
    b'{"format": "caldrix-speculation-memory/1", "identity": "x", "tuner": {"kept": 1, "missed": 1, "seconds": {"0": 1}}}',
    b'[1, 2, 3]',
    b" " * 70_000,
    b"[" * 32_000 + b"]" * 32_000,  # deeper than json's recursion: a RecursionError
])
def test_a_corrupt_file_is_a_note_and_a_fresh_start(tmp_path, body):
    path = tmp_path / "spec.json"
    path.write_bytes(body)
    state, note = SpeculationMemory(path, "x").load()
    assert state is None
    assert note.startswith(f"--speculation-memory {path}: unreadable") and note.endswith("starting fresh")


def test_an_unreadable_path_is_a_note(tmp_path):
    path = tmp_path / "dir-not-file"
    path.mkdir()
    state, note = SpeculationMemory(path, "x").load()
    assert state is None and "cannot be read" in note


def test_a_read_only_directory_is_a_note_not_a_failure():
    # /proc refuses new files even to root (CI runs as root, where chmod would not stop a write).
    note = SpeculationMemory(Path("/proc/caldrix-spec.json"), "x").save(trained_tuner().state())
    assert note is not None and "cannot be written" in note


def test_a_missing_directory_is_a_note_not_a_failure(tmp_path):
    # Also what a read-only mount gives root: the write fails, the server goes on.
    note = SpeculationMemory(tmp_path / "nope" / "spec.json", "x").save(trained_tuner().state())
    assert note is not None and "cannot be written" in note


def test_a_crash_mid_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "spec.json"
    mem = SpeculationMemory(path, "x")
    old = trained_tuner().state()
    mem.save(old)

    def crash(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    t = DraftTuner()
    t.timed(1, 0.5)
    assert "cannot be written" in mem.save(t.state())
    monkeypatch.undo()
    assert mem.load() == (old, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.json"]


counts = st.floats(min_value=0, max_value=1e6, allow_nan=False)
times = st.floats(min_value=1e-6, max_value=59.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(kept=counts, missed=counts, seconds=st.dictionaries(st.integers(1, 9), times, max_size=9))
def test_any_tuner_state_round_trips_exactly(tmp_path_factory, kept, missed, seconds):
    path = tmp_path_factory.mktemp("m") / "spec.json"
    state = TunerState(kept, missed, tuple(sorted(seconds.items())))
    mem = SpeculationMemory(path, "id")
    assert mem.save(state) is None
    assert mem.load() == (state, None)
    raw = json.loads(path.read_text())
    assert raw["format"] == FORMAT and raw["identity"] == "id"


def test_a_fifo_is_a_note_not_a_start_that_hangs(tmp_path):
    import os

    path = tmp_path / "fifo"
    os.mkfifo(path)
    state, note = SpeculationMemory(path, "x").load()
    assert state is None and "not a regular file" in note


def test_the_tuner_never_divides_by_zero():
    """Both counts 0 (a memory file may say so) divided by zero at the first greedy request and
    took the server down."""
    from caldrix.sched.speculate import DraftTuner

    tuner = DraftTuner()
    tuner.restore(TunerState(0.0, 0.0, ((1, 0.01), (2, 0.011))))  # as decay toward 0 could leave it
    assert 0 <= tuner.next_length() <= 8


def test_a_retrained_model_of_the_same_shapes_is_another_identity(tmp_path):
    """The identity the memory file is kept under: same config and file sizes, other weights."""
    from caldrix.draft import model_identity

    a, b = tmp_path / "a", tmp_path / "b"
    for d, seed in ((a, 1), (b, 2)):
        d.mkdir()
        (d / "config.json").write_text('{"model_type": "llama"}')
        (d / "model.safetensors").write_bytes(bytes((seed * 7 + i) % 256 for i in range(300_000)))
    assert (a / "model.safetensors").stat().st_size == (b / "model.safetensors").stat().st_size
    assert model_identity(a) != model_identity(b)
    assert model_identity(a) == model_identity(a)
