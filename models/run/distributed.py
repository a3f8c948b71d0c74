"""The torchrun environment: one process per device, rank 0 writes, metrics summed across ranks; a scheduler's stop
(SIGTERM: SLURM, Kubernetes, torchrun's agent passing its own on) taken as Ctrl-C is."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job. A plain ``python -m`` run is rank 0 of 1."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        """Only rank 0 writes checkpoints, logs and progress bars."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True under torchrun with more than one process."""
        return self.world_size > 1


def env_from_torchrun() -> DistEnv:
    """Read the variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE); defaults describe a single process."""
    return DistEnv(rank=int(os.environ.get("RANK", 0)), local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                   world_size=int(os.environ.get("WORLD_SIZE", 1)))


def pick_device(requested: str, env: DistEnv) -> torch.device:
    """``auto`` is this rank's GPU when there is one, else the CPU; ``cuda`` without a GPU is an error."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    return torch.device("cuda", env.local_rank % torch.cuda.device_count())


def init_process_group(env: DistEnv, device: torch.device) -> None:
    """NCCL between GPUs, gloo between CPU processes; a no-op for a single process."""
    if not env.distributed:
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")


def destroy_process_group(env: DistEnv) -> None:
    """Leave the process group so torchrun sees a clean exit."""
    if env.distributed and dist.is_initialized():
        dist.destroy_process_group()


def sum_across_ranks(values: list[float], device: torch.device, env: DistEnv) -> list[float]:
    """Sum each value over all ranks (counts and loss totals, so that means stay exact with uneven shards)."""
    if not env.distributed:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def barrier(env: DistEnv) -> None:
    """Wait for every rank (e.g. until rank 0 has written a checkpoint)."""
    if env.distributed:
        dist.barrier()


def average_across_ranks(tensors: list[torch.Tensor], env: DistEnv) -> None:
    """Replace each tensor by its mean over all ranks, in place (BatchNorm statistics measured on each shard)."""
    if not env.distributed:
        return
    for tensor in tensors:
        dist.all_reduce(tensor)
        tensor.div_(env.world_size)


class Terminated(KeyboardInterrupt):
    """SIGTERM came: the run stops as Ctrl-C stops it (its one line, what to run next), with status 143."""


EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143  # 128 + SIGINT, 128 + SIGTERM, as a shell says them


def exit_status(exc: KeyboardInterrupt) -> int:
    return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED


@contextlib.contextmanager
def terminated_as_interrupt() -> Iterator[None]:
    """While open (on the main thread: where signals are handled), SIGTERM raises Terminated there (before, the
    process died where it stood, with no word of the checkpoint to resume from: a data scientist's trial); the
    handlers before it are put back after.

    A scheduler's SIGTERM often reaches every process of the job, DataLoader workers too, which die by it: torch's
    SIGCHLD handler would then raise "DataLoader worker ... killed by signal" in the main process as it unwinds,
    replacing the stop's one line with a traceback. So once SIGTERM came, SIGCHLD is left to the default (the run
    ends anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    children: list[Any] = []  # SIGCHLD's handler when SIGTERM came (torch's, once a loader had workers)

    def stop(signum: int, frame: object) -> None:
        children.append(signal.signal(signal.SIGCHLD, signal.SIG_DFL))
        raise Terminated(f"signal {signum}")

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        for signum, handler in ((signal.SIGTERM, before), *((signal.SIGCHLD, h) for h in children[:1])):
            if handler is not None:  # (None: one set from C, which Python cannot put back)
                signal.signal(signum, handler)
