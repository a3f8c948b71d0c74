"""DDP's scaling for ``python -m bench.training.train``: the synthetic limit on N processes (one per GPU; gloo on the
CPU, where it only checks that the code runs) against N times one process."""
from __future__ import annotations

import argparse
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.training.trainer import Trainer, measure, synthetic_batches, training_args
from models.run.distributed import DistEnv


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, opts: argparse.Namespace, arch: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = opts.device != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        args = training_args(opts, arch, "cpu")
        trainer = Trainer(args, opts.classes, device, env=DistEnv(rank=rank, local_rank=rank, world_size=world))
        point = measure(trainer, synthetic_batches(args, opts.classes, device), opts.warmup, opts.steps)
        Path(out, f"rank{rank}").write_text(str(point.images_per_s))
    finally:
        dist.destroy_process_group()


def ddp_images_per_s(opts: argparse.Namespace, arch: str, world: int) -> float:
    """The job's training images/s on ``world`` processes (the sum of the ranks' rates)."""
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(world, _free_port(), opts, arch, out), nprocs=world, join=True)
        return sum(float(Path(out, f"rank{rank}").read_text()) for rank in range(world))
