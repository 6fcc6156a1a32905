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
