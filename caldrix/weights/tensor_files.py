"""Read the tensors of *.safetensors files one at a time, with plain reads.

Why not safetensors' own `safe_open`: it maps the whole file, and every page read through the
mapping counts in the process's resident memory until the file is closed, so reading SmolLM2's
540 MB float32 file to build a bfloat16 model held the file and the model at once (a 1053 MiB
peak for an engine that then holds about 800; docs/performance-history.md). Here each tensor is read
into memory of its own, which the caller casts and drops.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header size,
a JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": ...},
then the data, offsets counted from the header's end.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

INDEX = "model.safetensors.index.json"


class MissingWeight(ValueError):
    """A tensor the model's config.json calls for is in none of its files: the directory is
    incomplete (a one-line refusal at start, as for any bad model directory)."""

    def __init__(self, path: Path, name: str):
        super().__init__(f"cannot load {path}: it lacks the weight {name}, which its config.json calls for")


def model_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory: the ones its model.safetensors.index.json
    maps weights to, as transformers reads them (a stray shard left by an older save is not
    read), else every *.safetensors in it. ValueError for an index that is not one or names a
    file that is not there; FileNotFoundError when there is no file at all."""
    path = Path(path)
    index = path / INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            raise ValueError(f"{index} is not a safetensors index (a JSON object with a weight_map)") from None
        if not names or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{index} maps no weight to a file")
        absent = [n for n in names if not (path / n).is_file()]
        if absent:
            raise ValueError(f"{path} is incomplete: its {INDEX} maps weights to {absent[0]}, which is not there")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return files

import torch

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


class TensorFiles:
    """The tensors of some *.safetensors files by name; `get` reads one. Use as a context
    manager: the files stay open until it exits."""

    def __init__(self, files: list[Path]) -> None:
        self._files = [open(f, "rb") for f in files]
        self._where: dict[str, tuple[int, int, dict]] = {}  # name -> (file index, data start, entry)
        for i, fh in enumerate(self._files):
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
            header.pop("__metadata__", None)
            for name, entry in header.items():
                self._where[name] = (i, 8 + size, entry)

    def __enter__(self) -> "TensorFiles":
        return self

    def __exit__(self, *exc) -> None:
        for fh in self._files:
            fh.close()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def keys(self) -> list[str]:
        return list(self._where)

    def get(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor `name`, or only its rows start..stop-1 (`rows`), read from the file."""
        i, base, entry = self._where[name]
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{name}: safetensors dtype {entry['dtype']} is not supported")
        begin, end = entry["data_offsets"]
        shape = list(entry["shape"])
        if rows is not None:  # rows are contiguous in the file: read just their bytes
            start, stop = rows
            if not shape or not 0 <= start <= stop <= shape[0]:
                raise ValueError(f"{name}: rows {start}..{stop} are outside its shape {shape}")
            row_bytes = (end - begin) // shape[0] if shape[0] else 0
            begin, end, shape[0] = begin + start * row_bytes, begin + stop * row_bytes, stop - start
        fh = self._files[i]
        fh.seek(base + begin)
        data = bytearray(end - begin)
        if fh.readinto(data) != len(data):
            raise ValueError(f"{name}: the file ends inside its data")
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(shape)
