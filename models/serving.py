"""The host's share of a forward pass, one rule for the server (app/) and ``python -m models.predict``: the CPU
cores this process may use, and how many intra-op threads a forward pass gets beside the image decoding.

Standard library only: the gunicorn master imports it (app/hosting/host.py), and must not import torch.
"""
from __future__ import annotations

import os
from pathlib import Path

_CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, within its container's CPU quota (cgroup v2)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = _CGROUP_CPU_MAX.read_text().split()
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def forward_threads(setting: int, device: object, cores: int | None = None, workers: int = 1, *,
                    decoders_apart: bool = False) -> int:
    """Intra-op threads of a forward pass (0: torch's default): ``setting`` when set, torch's default off the CPU;
    on the CPU the cores the image decoding leaves it, at least 1.

    ``decoders_apart``: ``workers`` processes of their own decode (models.predict's DataLoader workers) and one
    forward pass gets the cores they leave (a 2-thread forward pass beside 2 decoding workers on 2 cores ran at
    half the images/s of a 1-thread one). Else each of ``workers`` processes (the server's gunicorn workers)
    decodes in its own request threads beside its forward pass, which takes half of its share of the cores (+7 to
    +20% images/s on 2 cores: Settings.torch_threads). ``device``: a torch.device or its name; ``cores``: the
    usable cores when not given.
    """
    if setting or str(device).partition(":")[0] != "cpu":
        return setting
    cores = cores or usable_cores()
    if decoders_apart:
        return max(1, cores - workers)
    return max(1, cores // (2 * max(1, workers)))
