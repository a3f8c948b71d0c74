"""The training benchmarks' shared step: a run built by the training script's own parts (``Trainer``), its options
parsed by the script's own parser (``training_args``), synthetic batches (the compute limit) and one timed
measurement (``measure`` -> ``Point``). The speed benchmark (train.py), its checks (checks.py) and DDP's scaling
(ddp.py) all import it."""
from __future__ import annotations

import argparse
import itertools
import os
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from bench.usage import GpuUtilisation, process_group_cpu_s
from models.run.distributed import DistEnv
from models.data.gpu import Batch
from models.run.device_stats import peak_memory, reset_peak_memory
from models.architectures import ARCHS
from models.train import build_parts, train_step
from models.run.args import get_args_parser


@dataclass
class Point:
    """One measured configuration."""

    arch: str
    path: str
    batch_size: int
    images_per_s: float
    of_limit: float | None = None
    data_wait: float | None = None  # share of the wall time spent blocked on the next batch
    gpu_util: float | None = None  # percent, mean over the measured steps
    host_cores: float | None = None  # CPU seconds of this process and its workers per wall second
    peak_gpu_memory_mb: float | None = None
    note: str = ""


def training_args(opts: argparse.Namespace, arch: str, backend: str, batch_size: int | None = None,
                  extra: Sequence[str] = ()) -> argparse.Namespace:
    """The training script's own options for one point, parsed by its own parser."""
    argv = ["--data", str(opts.data), "--arch", arch, "--batch-size", str(batch_size or opts.batch_size),
            "--workers", str(opts.workers), "--prefetch", str(opts.prefetch), "--device", opts.device,
            "--crop-size", str(opts.crop_size), "--resize-size", str(opts.crop_size * 8 // 7), "--lr", "0.1",
            "--data-backend", backend, *extra]
    if opts.amp != "none":
        argv += ["--amp", "--amp-dtype", opts.amp]
    argv += ["--channels-last"] if opts.channels_last else []
    argv += ["--compile"] if opts.compile else []
    return get_args_parser(ARCHS).parse_args(argv)


class Trainer:
    """A run's model, optimiser and scaler, built by the training script's own ``build_parts``."""

    def __init__(self, args: argparse.Namespace, num_classes: int, device: torch.device, fused: bool | None = None,
                 env: DistEnv = DistEnv()) -> None:
        self.args, self.device = args, device
        self.parts = build_parts(args, num_classes, device, env, fused=fused)
        self.trainable = [p for p in self.parts.model.parameters() if p.requires_grad]
        self.parts.model.train()

    def step(self, batch: Batch, sync: bool = False) -> None:
        p = self.parts
        loss, _ = train_step(p.step_model, *batch, p.optimizer, p.scaler, self.args, self.trainable)
        if sync:  # what a loss.item() per step costs (bench only: the training script never does it)
            loss.item()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic_batches(args: argparse.Namespace, num_classes: int, device: torch.device) -> Iterator[Batch]:
    """The same random batch again and again, already on the device: no data cost at all."""
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    images = torch.randn(args.batch_size, 3, args.crop_size, args.crop_size, device=device)
    targets = torch.randint(0, num_classes, (args.batch_size,), device=device)
    return itertools.repeat((images.contiguous(memory_format=memory_format), targets))


def measure(trainer: Trainer, batches: Iterator[Batch], warmup: int, steps: int, *, sync: bool = False) -> Point:
    """Run ``warmup`` steps, then time ``steps`` steps: images/s, data wait, GPU utilisation, host CPU."""
    device = trainer.device
    for _ in range(warmup):
        trainer.step(next(batches), sync)
    synchronize(device)
    reset_peak_memory(device)
    waited, seen, cpu_before = 0.0, 0, process_group_cpu_s(os.getpgid(0))
    with GpuUtilisation() as gpu:
        start = time.perf_counter()
        for _ in range(steps):
            before = time.perf_counter()
            batch = next(batches)
            waited += time.perf_counter() - before
            trainer.step(batch, sync)
            seen += len(batch[1])
        synchronize(device)
        wall = time.perf_counter() - start
    cores = (process_group_cpu_s(os.getpgid(0)) - cpu_before) / wall
    return Point(trainer.args.arch, "", trainer.args.batch_size, seen / wall, data_wait=waited / wall,
                 gpu_util=gpu.mean, host_cores=cores, peak_gpu_memory_mb=peak_memory(device).get("peak_gpu_memory_mb"))
