"""--weight-budget BYTES (GPU lanes): which layers stay on the device, and the streaming of the rest.

The contract (cli.md, http-api.md): at most BYTES of weights are on the device at any moment; the
other layers stream from pinned host memory for each pass, the copy of the next streamed layer
overlapped with the compute of the layers before it; speculation is refused; start-up says how
many layers stream.

Planning (`plan`): the weights that are not in a decoder layer (embedding, head, final norm)
always stay. Streamed layers pass through device buffers ("slots"): one slot when a single layer
streams, two when several do (one computing, one filling). Those slots count against the budget,
so fixed + resident layers + slots <= budget. The plan streams the fewest layers that fit, and
spreads them evenly over the depth so each copy has resident layers' compute to hide behind.

Streaming (`LayerStreamer`): each streamed layer is packed once into one pinned host buffer; a
pass copies it into a slot on a side stream (`torch.cuda.Stream`), the compute stream waits on
that copy's event, and the next copy into a slot waits on the event recorded when the compute
that read the slot's previous layer was queued. The CUDA calls sit behind a small `ops` object so
the scheduling logic runs with fakes on the CPU (tests/test_lanes_gpu_cpu.py).

Wiring (`stream_layers`, called by Engine.load): the model is loaded on the CPU, planned on its own
parameters, its streamed layers packed and hooked (`attach`), the rest moved to the device. The
runtime checks the budget first against the files' headers (`budget_refusal`), before loading.
On a CPU "device" (a GPU lane simulated in the tests) `HostOps` stands in for the CUDA calls.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import attrs
import torch

from caldrix.weights.tensor_files import model_files

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_ALIGN = 256  # byte alignment of each tensor in a packed layer (CUDA's allocation granularity)
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class BudgetError(ValueError):
    """A budget the plan cannot honour (exit status 2: the message names --weight-budget)."""


def parse_bytes(text: str) -> int:
    """'1073741824', '1GiB', '1.5G', '800MB' -> bytes (k/M/G/T are powers of 1000, KiB.. of 1024)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise ValueError(f"must be a number of bytes such as 4000000000, 4G or 3.5GiB, got {text!r}")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"must be at least 1 byte, got {text!r}")
    return value


def split_sizes(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[int, tuple[int, ...]]:
    """(bytes outside the decoder layers, bytes of each layer by index) of named weights, e.g.
    a model's named_parameters() or a safetensors state dict; layers are `...layers.<i>....`."""
    fixed = 0
    layers: dict[int, int] = {}
    for name, t in named:
        n = t.numel() * t.element_size()
        hit = _LAYER.search(name)
        if hit:
            i = int(hit.group(1))
            layers[i] = layers.get(i, 0) + n
        else:
            fixed += n
    if layers and sorted(layers) != list(range(len(layers))):
        raise ValueError(f"layer indexes are not 0..{len(layers) - 1}: {sorted(layers)}")
    return fixed, tuple(layers[i] for i in range(len(layers)))


@attrs.frozen
class WeightPlan:
    budget: int
    fixed_bytes: int  # embedding, head, norms: never streamed
    layer_bytes: tuple[int, ...]
    streamed: tuple[int, ...]  # layer indexes that stream each pass, ascending
    slots: int  # device buffers for streamed layers (0, 1 or 2)
    slot_bytes: int  # bytes of each slot: the largest streamed layer

    @property
    def resident(self) -> tuple[int, ...]:
        s = set(self.streamed)
        return tuple(i for i in range(len(self.layer_bytes)) if i not in s)

    @property
    def device_bytes(self) -> int:
        """Weights on the device at most: fixed, resident layers and the slots."""
        return self.fixed_bytes + sum(self.layer_bytes[i] for i in self.resident) + self.slots * self.slot_bytes

    @property
    def streamed_bytes(self) -> int:
        """Bytes copied from host memory each pass."""
        return sum(self.layer_bytes[i] for i in self.streamed)

    def line(self) -> str:
        """The start-up line."""
        n = len(self.layer_bytes)
        gib = 2**30
        if not self.streamed:
            return (f"caldrix: weight budget {self.budget / gib:.2f} GiB: all {n} layers stay on the device "
                    f"({self.device_bytes / gib:.2f} GiB), none stream")
        return (f"caldrix: weight budget {self.budget / gib:.2f} GiB: {n - len(self.streamed)} of {n} layers stay on "
                f"the device, {len(self.streamed)} stream from pinned host memory each pass "
                f"({self.streamed_bytes / gib:.2f} GiB a pass, through {self.slots} buffer"
                f"{'s' if self.slots > 1 else ''} of {self.slot_bytes / 2**20:.1f} MiB)")


def spread(n: int, s: int) -> tuple[int, ...]:
    """s of the layer indexes 0..n-1, evenly spaced (the middle of each of s equal spans)."""
    return tuple(sorted({min(n - 1, (2 * j + 1) * n // (2 * s)) for j in range(s)})) if s else ()


def _candidate(budget: int, fixed: int, layers: tuple[int, ...], s: int) -> WeightPlan:
    streamed = spread(len(layers), s)
    slots = min(2, len(streamed))
    return WeightPlan(budget, fixed, layers, streamed, slots, max((layers[i] for i in streamed), default=0))


def plan(budget: int, fixed: int, layers: Sequence[int]) -> WeightPlan:
    """The plan that streams the fewest layers with device_bytes <= budget; BudgetError if none.

    fixed: bytes of the weights outside the layers; layers: bytes of each layer, by index."""
    layers = tuple(int(b) for b in layers)
    best = None
    for s in range(len(layers) + 1):
        cand = _candidate(budget, fixed, layers, s)
        if cand.device_bytes <= budget:
            return cand
        best = cand if best is None or cand.device_bytes < best.device_bytes else best
    need = best.device_bytes if best is not None else fixed
    raise BudgetError(
        f"--weight-budget {budget}: too small for this model: the weights that never stream (embedding, head, norms) "
        f"are {fixed} bytes, and streaming needs {best.slots if best else 0} layer buffer(s) of "
        f"{best.slot_bytes if best else 0} bytes beside them; give at least {need} bytes")


_STORED_ITEMSIZE = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def sizes_of_model(model_dir: Path, itemsize: int | None = None) -> tuple[int, tuple[int, ...]]:
    """split_sizes of a model directory's *.safetensors, read from their headers (nothing loaded).
    Bytes are as stored, or with `itemsize` as floating-point tensors cast to a dtype of that
    many bytes would take (a float32 file loaded in bfloat16 halves)."""
    named: list[tuple[str, int]] = []
    for f in model_files(Path(model_dir)):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k == "__metadata__":
                continue
            size = v["data_offsets"][1] - v["data_offsets"][0]
            stored = _STORED_ITEMSIZE.get(v.get("dtype", ""), 0)
            if itemsize and stored and v["dtype"].startswith(("F", "BF")):
                size = size // stored * itemsize
            named.append((k, size))
    return split_sizes((k, _Sized(n)) for k, n in named)


class _Sized:
    """A stand-in for a tensor of `n` bytes (split_sizes needs numel() and element_size())."""

    def __init__(self, n: int) -> None:
        self.n = n

    def numel(self) -> int:
        return self.n

    def element_size(self) -> int:
        return 1


def budget_refusal(budget: int, model_dir: Path, itemsize: int) -> str | None:
    """Checked before loading (refuse before paying): the plan's refusal for a budget too small
    for the model's weights as they will be on the device, `itemsize` bytes a value (the stored
    sizes scaled from each tensor's own dtype, read from the safetensors headers); None if a
    plan fits. The engine plans again on the loaded weights (stream_layers)."""
    fixed, layers = sizes_of_model(model_dir, itemsize)
    try:
        plan(budget, fixed, layers)
    except BudgetError as exc:
        return str(exc)
    return None


def speculation_refusal(weight_budget: int | None) -> str | None:
    """http-api.md: an explicit --speculate mode is refused with --weight-budget (auto turns off
    with this as its note)."""
    if weight_budget is None:
        return None
    return "--weight-budget streams layers from host memory each pass, and speculation is not run with it"


# --- streaming ---------------------------------------------------------------------------


@attrs.frozen
class PackedLayer:
    """One layer's tensors packed into one flat uint8 host buffer, and how to view them back."""

    flat: torch.Tensor  # uint8 [nbytes], pinned on a GPU lane
    entries: tuple[tuple[str, int, torch.dtype, tuple[int, ...]], ...]  # (name, offset, dtype, shape)

    @property
    def nbytes(self) -> int:
        return self.flat.numel()


def pack(tensors: dict[str, torch.Tensor], pin: Callable[[torch.Tensor], torch.Tensor]) -> PackedLayer:
    """Copy a layer's tensors into one host buffer, each at a multiple of _ALIGN bytes."""
    entries, off = [], 0
    for name, t in tensors.items():
        entries.append((name, off, t.dtype, tuple(t.shape)))
        off += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    flat = torch.empty(off, dtype=torch.uint8)
    for (name, o, _, _), t in zip(entries, tensors.values()):
        n = t.numel() * t.element_size()
        flat[o:o + n] = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return PackedLayer(pin(flat), tuple(entries))


def views(buf: torch.Tensor, layer: PackedLayer) -> dict[str, torch.Tensor]:
    """The layer's tensors as views into a slot buffer holding its packed bytes."""
    out = {}
    for name, off, dtype, shape in layer.entries:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out[name] = buf[off:off + n].view(dtype).view(shape)
    return out


class CudaOps:
    """The torch.cuda calls the streamer makes (a GPU lane only; constructing it needs CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory()

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, after):
        """Queue dst <- src on the copy stream once `after` (an event or None) has passed;
        return the event the compute stream waits on."""
        with torch.cuda.stream(self.copy_stream):
            if after is not None:
                self.copy_stream.wait_event(after)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        return done

    def wait(self, event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def mark(self):
        """An event on the compute stream after the work queued so far (the slot is free then)."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev


class LayerStreamer:
    """Runs the streamed layers of a pass through the plan's slots.

    Usage each pass, layers in order: `for i in range(n): w = streamer.enter(i); <compute layer i
    with w (None: resident, use its own weights)>; streamer.leave(i)`. Copies alternate between
    the two slots in the order the layers run (wrapping from the last streamed layer of a pass
    to the first of the next), so the copy of the next streamed layer is always queued while
    the current one computes: enter() makes the compute stream wait for layer i's copy and
    queues the next copy into the other slot, which first waits for the compute that last read
    that slot (the event leave() recorded)."""

    def __init__(self, plan: WeightPlan, layer_tensors: Callable[[int], dict[str, torch.Tensor]], ops) -> None:
        self.plan, self.ops = plan, ops
        self.order = plan.streamed
        self.packed = {i: pack(layer_tensors(i), ops.pin) for i in self.order}
        size = max((p.nbytes for p in self.packed.values()), default=0)
        self.slots = [ops.buffer(size) for _ in range(plan.slots)]
        self.free: list[object] = [None] * plan.slots  # per slot: compute-stream event after its last reader
        self.queued: list[tuple[int, int, object]] = []  # (layer, slot, copy event), in run order
        self.holding: dict[int, int] = {}  # layer entered and not yet left -> its slot
        self._turn = 0  # the slot the next copy goes to
        if self.order:
            self._queue(self.order[0])

    def _queue(self, i: int) -> None:
        s = self._turn
        self._turn = (self._turn + 1) % len(self.slots)
        src = self.packed[i].flat
        self.queued.append((i, s, self.ops.copy_async(self.slots[s][: src.numel()], src, self.free[s])))

    def enter(self, i: int) -> dict[str, torch.Tensor] | None:
        if i not in self.packed:
            return None
        if not self.queued or self.queued[0][0] != i:
            raise RuntimeError(f"streamed layer {i} entered out of order (next: {self.queued[:1]})")
        _, s, ready = self.queued.pop(0)
        self.ops.wait(ready)
        self.holding[i] = s
        if len(self.slots) > 1:  # the other slot takes the next streamed layer now
            k = self.order.index(i)
            self._queue(self.order[(k + 1) % len(self.order)])
        return views(self.slots[s], self.packed[i])

    def leave(self, i: int) -> None:
        if i not in self.packed:
            return
        s = self.holding.pop(i)
        self.free[s] = self.ops.mark()
        if len(self.slots) == 1:  # one slot: the next copy can only follow this compute
            k = self.order.index(i)
            self._queue(self.order[(k + 1) % len(self.order)])


def attach(blocks: Sequence[torch.nn.Module], streamer: LayerStreamer, device) -> list:
    """Stream `blocks` (the model's decoder layers, in run order) through `streamer`: each
    streamed block's parameters are emptied on the device, and forward hooks point them at the
    slot views before the block runs and free the slot after. Returns the hook handles. For
    any torch module whose layers run in index order once per pass."""
    handles = []
    for i in streamer.order:
        for prm in blocks[i].parameters():
            prm.data = torch.empty(0, dtype=prm.dtype, device=device)

    def pre(i):
        def hook(module, args):
            got = streamer.enter(i)
            for name, view in (got or {}).items():
                module.get_parameter(name).data = view
        return hook

    def post(i):
        def hook(module, args, output):
            streamer.leave(i)
        return hook

    for i in streamer.order:
        handles.append(blocks[i].register_forward_pre_hook(pre(i)))
        handles.append(blocks[i].register_forward_hook(post(i)))
    return handles


class HostOps:
    """The streamer's calls where the engine's device is the CPU (a GPU lane simulated, as the
    tests do): the "device" buffers are plain memory, copies happen at once, nothing to wait on."""

    def __init__(self, device) -> None:
        self.device = device

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, after) -> None:
        dst.copy_(src)

    def wait(self, event) -> None:
        pass

    def mark(self) -> None:
        return None


def stream_layers(model: torch.nn.Module, budget: int, device) -> WeightPlan:
    """Keep at most `budget` bytes of `model`'s weights on `device`: plan over its own
    parameters, pack the streamed decoder layers (`model.layers`, run in index order once a
    pass) into host buffers, hook them to their slots, and move everything else to `device`.
    The model must still be on the CPU, so the streamed layers never reach the device whole.
    BudgetError if no plan fits. The streamer lives on as `model.streamer`."""
    fixed, layers = split_sizes(model.named_parameters())
    p = plan(budget, fixed, layers)
    ops = CudaOps(torch.device(device)) if torch.device(device).type == "cuda" else HostOps(device)
    streamer = LayerStreamer(p, lambda i: dict(model.layers[i].named_parameters()), ops)
    attach(model.layers, streamer, device)  # the streamed layers' own parameters are emptied
    model.to(device)
    model.streamer = streamer
    return p
