"""What the host offers, read with the standard library only (the gunicorn master must not import torch): the
CPU cores this process may use (models/serving.py's rule, models.predict's too), the NVIDIA GPUs it can see, the
number of workers chosen from them when ``WORKERS`` is 0 (auto), and whether the address to listen on is free."""
from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from models.serving import usable_cores  # standard library only, as this module

CPU_WORKERS_MAX = 8  # auto on a CPU host: one worker per core, at most this many (each holds its own model copy)
CORES_PER_GPU_WORKER = 4  # auto on a GPU host: about one worker per 4 cores (H100 run, inline; H200 run, process)
GPU_WORKERS_PER_GPU_MAX = 4  # ... and at most this many per GPU (an inline one holds its own copy in GPU memory)
_NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


def visible_gpus() -> int:
    """NVIDIA GPUs the driver lists, as many as CUDA_VISIBLE_DEVICES leaves visible (no CUDA call)."""
    try:
        found = sum(1 for _ in _NVIDIA_GPUS.iterdir())
    except OSError:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return found if visible is None else min(found, _cuda_visible_count(visible, found))


def _cuda_visible_count(visible: str, found: int) -> int:
    """How many of ``found`` GPUs CUDA_VISIBLE_DEVICES=``visible`` leaves: CUDA's rule, the entries before the first
    invalid one (an index that is negative or not below ``found``, or what is neither an index nor a GPU-/MIG- UUID;
    "0,-1,1" leaves one, "" none)."""
    count = 0
    for entry in (part.strip() for part in visible.split(",")):
        if entry.isdigit() and int(entry) < found or entry.startswith(("GPU-", "MIG-")):
            count += 1
        else:
            break
    return count


def auto_workers(cores: int, gpus: int) -> int:
    """Workers for ``cores`` usable cores and ``gpus`` GPUs the model will use (0: a CPU host)."""
    if gpus <= 0:
        return max(1, min(cores, CPU_WORKERS_MAX))
    return max(gpus, min(cores // CORES_PER_GPU_WORKER, GPU_WORKERS_PER_GPU_MAX * gpus))


def workers_for(setting: int, device: str) -> tuple[int, str]:
    """The number of workers (``setting``, or auto when 0) and why, for the start-up log line."""
    if setting:
        return setting, "WORKERS"
    cores = usable_cores()
    gpus = 0 if device == "cpu" else visible_gpus()
    where = f"{gpus} GPU{'s' if gpus != 1 else ''}" if gpus else "no GPU"
    return auto_workers(cores, gpus), f"auto: {cores} usable cores, {where}"


def workers_past_cores(workers: int, engine: str) -> str | None:
    """A warning for inline workers set past the usable cores: each holds a copy of every model and runs its
    forward passes on the same cores, so past one a core they add memory, not speed (before: only "6 workers
    (WORKERS)" on 2 cores, 3.9 GB of worker memory; a trial). None otherwise (process mode's HTTP workers hold no
    model)."""
    cores = usable_cores()
    if engine != "inline" or workers <= cores:
        return None
    return (f"{workers} inline workers on {cores} usable core{'s' if cores != 1 else ''}: each holds a copy of every "
            f"model and runs its forward passes on the same cores, so the ones past {cores} add memory, not "
            f"throughput; VISIONSERVE_WORKERS=0 (auto) picks {auto_workers(cores, 0)} here")


def gpu_for(slot: int, gpus: int, workers_per_gpu: int) -> int:
    """The GPU of worker ``slot`` out of ``gpus`` (Settings.workers_per_gpu: 0 round robin, k per GPU in turn)."""
    if gpus <= 0:
        raise ValueError(f"no GPU to place worker {slot} on")
    return (slot if workers_per_gpu <= 0 else slot // workers_per_gpu) % gpus


def placed_device(setting: str, slot: int | None, gpus: int, workers_per_gpu: int) -> str:
    """The device a worker serves on: ``auto``/``cuda`` spread over ``gpus`` by ``slot``; anything else as set."""
    if setting not in ("auto", "cuda") or slot is None or gpus < 2:
        return setting
    return f"cuda:{gpu_for(slot, gpus, workers_per_gpu)}"


def engine_mode(setting: str, device: str) -> str:
    """``process`` or ``inline`` (Settings.engine): ``auto`` is ``process`` when ``device`` (Settings.device) puts the
    model on a GPU this host shows, else ``inline``. On an H200 (16 cores, Lite0 float32) one engine process served
    1.06-1.34x what inline workers did at one image per request and 1.24-1.44x at 16, C=64 to 1,024, with no error
    (bench/results/2026-11-28-gpu-drill-h200.md); on a CPU host two inline workers each running forward passes keep
    both cores busy."""
    if setting != "auto":
        return setting
    return "process" if device != "cpu" and visible_gpus() > 0 else "inline"


def engine_count(device: str, per_device: int = 1) -> int:
    """How many engine processes serve (``ENGINE=process``): ``per_device`` (ENGINES_PER_DEVICE) on each visible GPU
    that ``auto``/``cuda`` spreads over, or on the one device named (``cpu``, ``cuda:1``)."""
    devices = max(1, visible_gpus()) if device in ("auto", "cuda") else 1
    return per_device * devices


def unserved_engines(workers: int, engines: int) -> int:
    """Engines no HTTP worker talks to (worker n talks to engine n mod ``engines``)."""
    return max(0, engines - workers)


def _tcp_address(bind: str) -> tuple[str, str] | None:
    """The host and port of a TCP ``bind`` as gunicorn reads it (``HOST:PORT``, ``[IPv6]:PORT``, ``:PORT``, or
    ``HOST`` with gunicorn's port 8000, each maybe after ``tcp://``; the host without brackets, "" for every
    address); None for a unix socket or an ``fd://``. The port as written: it may be no number."""
    if bind.startswith(("unix:", "fd://")):
        return None
    address = bind.removeprefix("tcp://")
    if address.startswith("["):  # [IPv6] or [IPv6]:PORT
        host, _, rest = address[1:].partition("]")
        return host, rest.removeprefix(":") if rest else "8000"
    host, sep, port = address.rpartition(":")
    return (host, port) if sep else (address, "8000")


def bind_problem(bind: str) -> str | None:
    """Why gunicorn could not listen on ``bind`` as given (``_tcp_address``): a port that is none, a host that does
    not resolve; None for one that may serve, a unix socket or an ``fd://``. gunicorn itself retries such an address
    for 5 s, then says "Can't connect" without naming the setting."""
    address = _tcp_address(bind)
    if address is None:
        return None
    host, port = address
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        return f"its port {port!r} is not a port number (0-65535)"
    if host.isdigit() and bind.removeprefix("tcp://") == host:  # gunicorn reads "18440" as a host (an IPv4 number)
        return f"{host!r} is read as a host with port 8000: a port alone is written :{host} (every address)"
    try:
        socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else exc
        return f"its host {host!r} is no address this machine resolves ({reason})"
    failed = _bind_failure(bind)  # (an address not there yet, EADDRNOTAVAIL, is gunicorn's to retry: it may come up)
    if failed is not None and failed.errno == errno.EACCES:
        return f"this user may not listen on its port {port} ({failed.strerror}: below 1024, or a policy's)"
    return None


def address_in_use(bind: str, reuse_port: bool = False) -> bool:
    """Whether another process listens on TCP ``bind`` (``_tcp_address``), tried as gunicorn binds it
    (SO_REUSEADDR: a socket of a server just stopped does not count; with gunicorn's ``reuse_port``, SO_REUSEPORT
    too: a server that shares its port is no refusal). False for a unix socket, an ``fd://`` and an address that
    fails otherwise (``bind_problem`` says why)."""
    failed = _bind_failure(bind, reuse_port)
    return failed is not None and failed.errno == errno.EADDRINUSE


def _bind_failure(bind: str, reuse_port: bool = False) -> OSError | None:
    """What binding a socket to TCP ``bind`` as gunicorn does raises (``address_in_use``), None when it binds (or
    for what is no TCP address with a port number)."""
    address = _tcp_address(bind)
    if address is None or not address[1].isdigit():
        return None
    host, port = address[0] or "0.0.0.0", address[1]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            probe.bind((host, int(port)))
    except OSError as exc:
        return exc
    return None
