"""The lane rules of cli.md "Lanes and backends", as pure functions (no torch import at module load).

  * `--backend auto` takes the GPU lane when torch sees a GPU: `hip` where torch is a ROCm
    build (torch.version.hip), else `cuda`; otherwise `cpu`.
  * `--max-batch` defaults to 8 on the AMD lane (hip) and 1 elsewhere, for serve and run alike;
    it is resolved once the lane is known.
  * `--sampler device|host`: the device pick (device_pick.py) runs only on the hip lane with
    max-batch above 1 and --sampler device (its default there); every other case picks on the
    CPU (sampler.py). An explicit `--sampler device` where it would not run is refused.
  * `--weight-budget` only on the GPU lanes (cuda, hip).
  * cpu-lane-only architectures (cli.md's registry: idefics3 for smolvlm-256m, qwen3_5 for
    decider-0.8b) are refused on cuda and hip by name.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

GPU_LANES = ("cuda", "hip")
AMD_MAX_BATCH = 8

# architecture (config.json model_type) -> (registry alias, why) for models the GPU lanes refuse
CPU_ONLY = {
    "idefics3": ("smolvlm-256m", "its vision tower runs on the cpu lane only"),
    "qwen3_5": ("decider-0.8b", "its gated delta-net layers run on the cpu lane (and --backend host) only"),
    # a text-only Qwen3.5 checkpoint: the same layers, whatever it is called
    "qwen3_5_text": ("Qwen3.5", "its gated delta-net layers run on the cpu lane (and --backend host) only"),
}


def gpu_seen() -> str | None:
    """The GPU lane torch sees here: 'hip' (ROCm torch), 'cuda', or None."""
    import torch

    if not torch.cuda.is_available():
        return None
    return "hip" if getattr(torch.version, "hip", None) else "cuda"


def resolve_lane(backend: str, seen: str | None) -> str:
    """The lane for --backend, given what gpu_seen() found (pure)."""
    if backend != "auto":
        return backend
    return seen or "cpu"


def default_max_batch(lane: str) -> int:
    return AMD_MAX_BATCH if lane == "hip" else 1


def uses_device_pick(lane: str, max_batch: int, sampler: str) -> bool:
    """Whether sampled tokens are picked by the device pick (else the CPU pick of run.md)."""
    return lane == "hip" and max_batch > 1 and sampler == "device"


def sampler_name(lane: str, max_batch: int, sampler: str) -> str:
    """What /debug/requests records as the pick: 'device' or 'cpu'."""
    return "device" if uses_device_pick(lane, max_batch, sampler) else "cpu"


def settle_flags(args: argparse.Namespace, seen: Callable[[], str | None] | None = None) -> str | None:
    """Resolve the lane-dependent defaults of serve/run in place (max_batch, sampler; args.lane
    is set too) and return what is wrong with --sampler or --weight-budget for the lane, naming
    the flag; None if nothing. `seen` (default gpu_seen) is called only for --backend auto."""
    probe = seen or gpu_seen
    lane = resolve_lane(args.backend, probe() if args.backend == "auto" else None)
    args.lane = lane
    if args.max_batch is None:
        args.max_batch = default_max_batch(lane)
    explicit = args.sampler
    if explicit is None:
        args.sampler = "device" if lane in GPU_LANES else "host"
    if explicit == "device" and not uses_device_pick(lane, args.max_batch, "device"):
        where = (f"this server is not batched (--max-batch {args.max_batch})" if lane == "hip"
                 else f"the {lane} lane picks on the CPU")
        return (f"--sampler device: the device pick runs on the AMD lane (--backend hip) with --max-batch "
                f"above 1, and {where}; leave --sampler out or use --sampler host")
    if getattr(args, "weight_budget", None) is not None and lane not in GPU_LANES:
        return f"--weight-budget: streams weights to a GPU (--backend cuda or hip); the {lane} lane keeps every weight in memory"
    return None


def backend_refusal(backend: str, seen: Callable[[], str | None] | None = None) -> str | None:
    """Why an explicit `--backend cuda|hip` cannot run here, naming the flag; None if it can.
    Checked before any weight loads: torch must see a GPU of that kind (a ROCm build drives
    the hip lane, a CUDA build the cuda lane). `seen` defaults to gpu_seen."""
    if backend not in GPU_LANES:
        return None
    found = (seen or gpu_seen)()
    if found is None:
        return (f"--backend {backend}: torch sees no GPU here (torch.cuda.is_available() is false); "
                "use --backend cpu, or auto")
    if found != backend:
        build = "a ROCm" if found == "hip" else "a CUDA"
        return f"--backend {backend}: this torch is {build} build, which drives the {found} lane; use --backend {found}, or auto"
    return None


def architecture_of(model_dir: Path) -> str | None:
    """config.json's model_type of a model directory (None when it has none)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def lane_refusal(architecture: str | None, lane: str) -> str | None:
    """Why this architecture cannot run on this lane (the message names the model), or None."""
    if lane not in GPU_LANES or architecture not in CPU_ONLY:
        return None
    alias, why = CPU_ONLY[architecture]
    return f"--backend {lane}: {alias} ({architecture}) is a cpu-lane model: {why}; use --backend cpu"


def device_line(lane: str, name: str, total_bytes: int, index: int = 0) -> str:
    """The start-up line naming the GPU and its memory, e.g.
    'caldrix: device cuda:0 NVIDIA H100 80GB HBM3, 79.1 GiB (the cuda lane)'."""
    kind = "the AMD lane, ROCm" if lane == "hip" else "the cuda lane"
    return f"caldrix: device cuda:{index} {name}, {total_bytes / 2**30:.1f} GiB ({kind})"


def device_facts(index: int = 0) -> tuple[str, int]:
    """(name, total memory in bytes) of a torch.cuda device; only on a GPU lane."""
    import torch

    props = torch.cuda.get_device_properties(index)
    return props.name, int(props.total_memory)
