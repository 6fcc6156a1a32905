"""caldrix/weights/tensor_files.py against safetensors' own reader: the same tensors, every dtype
a checkpoint uses, across files."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from caldrix.weights.tensor_files import TensorFiles


def test_tensor_files_reads_what_safetensors_wrote(tmp_path):
    gen = torch.Generator().manual_seed(0)
    first = {
        "a.f32": torch.randn(3, 5, generator=gen),
        "a.bf16": torch.randn(7, generator=gen).bfloat16(),
        "a.f16": torch.randn(2, 2, 2, generator=gen).half(),
        "empty": torch.zeros(0, 4),
    }
    second = {"b.i64": torch.arange(10), "b.u8": torch.arange(200, dtype=torch.uint8).view(10, 20),
              "b.scalar": torch.tensor(3.5)}
    save_file(first, tmp_path / "m-1.safetensors", metadata={"format": "pt"})
    save_file(second, tmp_path / "m-2.safetensors")
    files = sorted(tmp_path.glob("*.safetensors"))
    want = {**load_file(files[0]), **load_file(files[1])}
    with TensorFiles(files) as tf:
        assert sorted(tf.keys()) == sorted(want)
        assert "a.f32" in tf and "missing" not in tf
        for name, w in want.items():
            got = tf.get(name)
            assert got.dtype == w.dtype and got.shape == w.shape and torch.equal(got, w), name


def test_tensor_files_names_a_truncated_file(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(64)}, path)
    path.write_bytes(path.read_bytes()[:-16])
    with TensorFiles([path]) as tf, pytest.raises(ValueError, match="w: the file ends inside its data"):
        tf.get("w")


def test_tensor_files_reads_a_range_of_rows(tmp_path):
    """`get(name, rows=(start, stop))` reads just those rows' bytes: the same values as the
    whole tensor sliced, an empty range and the last row included; a range outside is an error."""
    w = torch.randn(10, 3, 4, generator=torch.Generator().manual_seed(1)).bfloat16()
    save_file({"w": w, "s": torch.tensor(2.0)}, tmp_path / "m.safetensors")
    with TensorFiles([tmp_path / "m.safetensors"]) as tf:
        for start, stop in ((0, 10), (3, 7), (9, 10), (4, 4)):
            got = tf.get("w", rows=(start, stop))
            assert got.shape == (stop - start, 3, 4) and torch.equal(got, w[start:stop])
        with pytest.raises(ValueError, match=r"w: rows 8..11 are outside its shape \[10, 3, 4\]"):
            tf.get("w", rows=(8, 11))
        with pytest.raises(ValueError, match="s: rows 0..1 are outside its shape"):
            tf.get("s", rows=(0, 1))
