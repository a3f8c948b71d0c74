"""The memory check before a load: refuse a version that cannot fit, instead of failing live traffic with it; on a
GPU, the check and the load one process at a time."""
from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path
from typing import Iterator

import torch

from app.engine.loaded.graphs import release_cached_memory
from app.errors import InsufficientMemory
from app.hosting import control

MIB = 1024 * 1024
_CGROUP = Path("/sys/fs/cgroup")


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _cgroup_room() -> int | None:
    # A container's limit (cgroup v2): the host's MemAvailable says nothing of it.
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((_CGROUP / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None


def available_bytes(device: torch.device, release_cache: bool = False) -> int | None:
    """Free memory where the model will live: the GPU's free memory (``release_cache``: once this process's cache has
    given back the blocks it holds unused), or the host's (container-limited)."""
    if device.type == "cuda":
        if release_cache:
            release_cached_memory(wait=True)
        return torch.cuda.mem_get_info(device)[0]
    found = [v for v in (_meminfo_available(), _cgroup_room()) if v is not None]
    return min(found) if found else None


def check_fits(what: str, need_bytes: int, device: torch.device, loaded_bytes: int, limit_mb: int,
               reserve_mb: int) -> None:
    """InsufficientMemory (507) when ``need_bytes`` more would pass ``limit_mb`` (0: none) over what the loaded
    models take, or leave less than ``reserve_mb`` free on ``device``."""
    if limit_mb and loaded_bytes + need_bytes > limit_mb * MIB:
        raise InsufficientMemory(
            f"{what} needs about {need_bytes / MIB:.0f} MiB; the loaded models take {loaded_bytes / MIB:.0f} MiB of "
            f"MODEL_MEMORY_LIMIT_MB={limit_mb}: unload a version first or raise the limit")
    free = available_bytes(device)
    if free is not None and free - need_bytes < reserve_mb * MIB and device.type == "cuda":
        # The driver counts the blocks this process's allocator keeps cached (a warm-up's activations) as taken, and
        # memory_reserved - memory_allocated would count a CUDA graph's pool, which no load can use: the cache is
        # given back, only when short (the batches after a release allocate afresh), and free memory read again.
        free = available_bytes(device, release_cache=True)
    if free is not None and free - need_bytes < reserve_mb * MIB:
        raise InsufficientMemory(
            f"{what} needs about {need_bytes / MIB:.0f} MiB on {device}, which has {free / MIB:.0f} MiB free and "
            f"keeps MEMORY_RESERVE_MB={reserve_mb} for traffic: unload a version first")


def device_bytes_taken(allocated_before: int, allocated_after: int, weights_bytes: int) -> int:
    """The device memory a load took, from the process's allocated bytes before and after it: at least its weights.
    A version retiring on its own thread may free memory during the load, so the difference alone can read less
    than the weights hold, or below 0."""
    return max(allocated_after - allocated_before, weights_bytes)


@contextlib.contextmanager
def loading_onto(device: torch.device, control_dir: Path | None) -> Iterator[None]:
    """Held from a load's memory check until the version has warmed up. On a GPU that several processes share (engines
    of one device, inline workers), one of them at a time: each would otherwise read the device's free memory before
    the other had taken its share, both loads would pass the check, and one of them, or a serving version, would run
    out of memory. A file lock in ``control_dir`` (each process has it); on the CPU, or with one process, nothing."""
    if device.type != "cuda" or control_dir is None:
        yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    with open(control.device_loads_lock(control_dir, f"cuda:{index}"), "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
