"""How much more memory this process may take: the kernel's MemAvailable, capped by the room left
under the process's cgroup limit (a container's --memory), which MemAvailable does not see.

Read by Engine.load before it reserves the KV cache (`check_state_fits`): the cache's rows are
mapped lazily as they are written, so a reservation past this figure would start fine and be
killed by the kernel mid-reply once enough rows filled. None where /proc is not readable (not
Linux): no check then.
"""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")
CGROUP = Path("/sys/fs/cgroup")


def _meminfo_available(proc: Path) -> int | None:
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2) or unreadable: no limit


def _cgroup_room(proc: Path, root: Path) -> int | None:
    """Bytes left under the tightest memory limit of this process's cgroup (v2 unified, else v1's
    memory controller); None without a limit."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        ident, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if ident == "0" and controllers == "":  # v2
            d = root / rel.lstrip("/")
            limit, used = _read_int(d / "memory.max"), _read_int(d / "memory.current")
        elif "memory" in controllers.split(","):  # v1
            d = root / "memory" / rel.lstrip("/")
            limit, used = _read_int(d / "memory.limit_in_bytes"), _read_int(d / "memory.usage_in_bytes")
            if limit is not None and limit >= 1 << 60:  # v1 writes "no limit" as a huge number
                limit = None
        else:
            continue
        if limit is not None and used is not None:
            return max(limit - used, 0)
    return None


def available_bytes(proc: Path = PROC, cgroup_root: Path = CGROUP) -> int | None:
    """The smaller of MemAvailable and the cgroup's room; None when neither is known."""
    known = [b for b in (_meminfo_available(proc), _cgroup_room(proc, cgroup_root)) if b is not None]
    return min(known) if known else None


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_state_fits(model, slots: int, rows: int) -> None:
    """MemoryError when `model`'s per-slot state (the KV cache) for `slots` slots of `rows` rows
    would need more than `available_bytes()`. The rows are mapped lazily as they are first
    written, so without this a cache past the machine's memory starts and is killed by the
    kernel mid-reply once enough rows fill; llama-server and vLLM reserve theirs whole at start,
    and so refuse there. Sized on the meta device (the model's `new_state`): nothing is allocated."""
    need = type(model).new_state(model.cfg, slots, rows, model.dtype, "meta").nbytes
    room = available_bytes()
    if room is not None and need > room:
        raise MemoryError(f"the KV cache needs {gib(need)} and {gib(room)} of memory is available")
