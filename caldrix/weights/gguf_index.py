"""A GGUF file's tensor index, read without parsing its metadata values.

`gguf.GGUFReader` builds a numpy view for every metadata value, and a chat model's tokenizer
arrays hold about 200,000 strings: 6-7 s on 2 cores before the first tensor is reachable,
paid by every start that keeps the 4-bit blocks. The 4-bit paths need only the tensors, so
this walks past the metadata by length and maps the data section once (about 50 ms).

Layout (GGUF v2/v3, little-endian): magic, version u32, tensor count u64, metadata count u64;
the metadata (key string, value type u32, value); one entry per tensor (name string, dims
count u32, dims u64..., ggml type u32, offset u64); padding to `general.alignment` (32 unless
the metadata says otherwise); the data, each tensor at its offset.
"""

from __future__ import annotations

import struct
from pathlib import Path

import attrs
import numpy as np

# ggml type id -> (elements per block, bytes per block), for the types caldrix reads or skips
BLOCKS = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 30: (1, 2)}
# metadata value type -> fixed size in bytes (8 string and 9 array have their own lengths)
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


@attrs.frozen
class GgufTensor:
    name: str
    tensor_type: int  # ggml type id (3: Q4_1, 8: Q8_0)
    shape: tuple[int, ...]  # GGUF order: the row length first
    data: np.ndarray | None  # uint8 [rows, bytes per row], a view into the file's map; None: a type not in BLOCKS


def read_tensors(path: Path) -> dict[str, GgufTensor]:
    """Name -> tensor for every tensor of a GGUF file (data None for a type whose block size
    BLOCKS does not list). Raises ValueError on a file that is not GGUF v2/v3."""
    _, alignment, infos, pos = _read_header(path, frozenset())
    start = -(-pos // alignment) * alignment
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, ttype, dims, offset in infos:
        if ttype not in BLOCKS:
            out[name] = GgufTensor(name, ttype, dims, None)
            continue
        per_block, block_bytes = BLOCKS[ttype]
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        row_bytes = dims[0] // per_block * block_bytes
        at = start + offset
        out[name] = GgufTensor(name, ttype, dims, mapped[at : at + rows * row_bytes].reshape(rows, row_bytes))
    return out


def read_strings(path: Path, keys: frozenset[str]) -> dict[str, str]:
    """The string values of the metadata `keys` that the file has (general.architecture,
    tokenizer.ggml.pre), read the same way, without the tokenizer's arrays."""
    strings, *_ = _read_header(path, keys)
    return strings


def _read_header(path: Path, keys: frozenset[str]) -> tuple[dict[str, str], int, list, int]:
    """(the string values of `keys`, the alignment, (name, type, dims, offset) per tensor, the
    end of the tensor infos)."""
    strings: dict[str, str] = {}
    with open(path, "rb") as f:
        buf = f.read(1 << 20)
        pos = 0

        def need(n: int) -> None:
            nonlocal buf
            while pos + n > len(buf):
                more = f.read(max(1 << 20, n))
                if not more:
                    raise ValueError(f"{path}: truncated GGUF header")
                buf += more

        def take(fmt: str):
            nonlocal pos
            size = struct.calcsize(fmt)
            need(size)
            out = struct.unpack_from(fmt, buf, pos)
            pos += size
            return out

        def string() -> str:
            nonlocal pos
            (n,) = take("<Q")
            need(n)
            s = buf[pos : pos + n].decode("utf-8", "replace")
            pos += n
            return s

        def skip(vtype: int) -> None:
            nonlocal pos
            if vtype in _FIXED:
                need(_FIXED[vtype])
                pos += _FIXED[vtype]
            elif vtype == _STRING:
                (n,) = take("<Q")
                need(n)
                pos += n
            elif vtype == _ARRAY:
                etype, count = take("<IQ")
                if etype in _FIXED:
                    need(_FIXED[etype] * count)
                    pos += _FIXED[etype] * count
                else:
                    for _ in range(count):
                        skip(etype)
            else:
                raise ValueError(f"{path}: unknown GGUF metadata type {vtype}")

        magic, version = take("<4sI")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path}: not a GGUF v2/v3 file")
        n_tensors, n_kv = take("<QQ")
        alignment = 32
        for _ in range(n_kv):
            key = string()
            (vtype,) = take("<I")
            if key == "general.alignment" and vtype == _UINT32:
                (alignment,) = take("<I")
            elif key in keys and vtype == _STRING:
                strings[key] = string()
            else:
                skip(vtype)
        infos = []
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = take("<I")
            dims = take(f"<{n_dims}Q")
            ttype, offset = take("<IQ")
            infos.append((name, ttype, tuple(int(x) for x in dims), offset))
    return strings, alignment, infos, pos
