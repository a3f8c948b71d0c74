"""Training speed against the GPU's own limit: ``python -m bench.train``.

    python -m bench.train                    # on a CUDA machine: resnet50, resnet18, efficientnet_lite0 at 224 px,
                                             # bf16 + channels_last, on data/photos (written first when missing)
    python -m bench.train --device cpu --archs resnet18 --batch-size 32 --steps 8
                                             # the CPU figures (bench/results/*-train-cpu-*.md)

For each arch, training images/s from (1) synthetic tensors already on the device: the compute limit; (2) the JPEG
folder through the DataLoader (PIL decode, random resized crop and flip in the workers; ``--data-backend cpu``);
(3) the GPU data path (``--data-backend gpu``: workers read bytes; nvJPEG, crop, flip, normalise on the device).
Each runs the training script's own step (``models.train.train_step``), optimiser, scaler and data loaders. Per
point: images/s, its share of the limit, the share of wall time the loop waited for a batch, GPU utilisation
(nvidia-smi), host CPU cores used (this process and its DataLoader workers), peak GPU memory. On CUDA also the
largest batch that fits, the training-step choices measured one by one, and with several GPUs DDP's scaling.
Writes ``<date>-train-<device>.md``, ``.json`` and ``.png`` under ``--out``.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from bench.gpu_util import GpuUtilisation
from bench.load import process_group_cpu_s
from bench.paths import RESULTS
from models.run.distributed import DistEnv
from models.data.gpu import Batch, DevicePrefetcher
from models.data.loaders import load_data
from models.run.device_stats import peak_memory, reset_peak_memory
from models.architectures import ARCHS
from models.train import build_parts, make_preset, train_step
from models.run.args import get_args_parser

PATHS = ("synthetic", "cpu", "gpu")
DEFAULT_DATA = Path("data/photos")


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


def folder_batches(args: argparse.Namespace, device: torch.device) -> tuple[Iterator[Batch], int]:
    """Batches of the folder through the chosen data path, epoch after epoch; and the number of classes."""
    data = load_data(args, make_preset(args), DistEnv(), device)

    def epochs() -> Iterator[Batch]:
        for epoch in itertools.count():
            data.train_sampler.set_epoch(epoch)
            yield from DevicePrefetcher(data.train, data.prepare, device)
    return epochs(), len(data.classes)


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


def setup_path(opts: argparse.Namespace, arch: str, path: str, device: torch.device) -> tuple[Trainer, Iterator[Batch]]:
    """One arch's trainer and batches on one data path."""
    args = training_args(opts, arch, "cpu" if path == "synthetic" else path)
    if path == "synthetic":
        num_classes = opts.classes
        batches = synthetic_batches(args, num_classes, device)
    else:
        batches, num_classes = folder_batches(args, device)
    return Trainer(args, num_classes, device), batches


def _median(points: Sequence[Point]) -> Point:
    """Each figure's median over the rounds of one point."""
    def mid(name: str) -> float | None:
        values = [getattr(p, name) for p in points if getattr(p, name) is not None]
        return statistics.median(values) if values else None
    return Point(points[0].arch, points[0].path, points[0].batch_size, mid("images_per_s") or 0.0,
                 data_wait=mid("data_wait"), gpu_util=mid("gpu_util"), host_cores=mid("host_cores"),
                 peak_gpu_memory_mb=mid("peak_gpu_memory_mb"), note=f"median of {len(points)} rounds")


def measure_arch(opts: argparse.Namespace, arch: str, device: torch.device) -> list[Point]:
    """Every data path of one arch, in ``opts.rounds`` interleaved rounds (a noisy machine drifts: each path gets
    its share of the drift), as the median of the rounds."""
    setups = {path: setup_path(opts, arch, path, device) for path in opts.paths}
    rounds: dict[str, list[Point]] = {path: [] for path in opts.paths}
    for number in range(opts.rounds):
        for path, (trainer, batches) in setups.items():
            point = measure(trainer, batches, opts.warmup if number == 0 else 1, opts.steps)
            point.path = path
            rounds[path].append(point)
            print(f"{arch:20s} {path:9s} round {number}: {point.images_per_s:9.1f} img/s, "
                  f"waiting {point.data_wait:.0%}", flush=True)
    return [_median(rounds[path]) for path in opts.paths]


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--archs", nargs="+", choices=ARCHS, default=["resnet50", "resnet18", "efficientnet_lite0"])
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA,
                        help="a train/val JPEG folder (default: data/photos, written by demo_data when missing)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--crop-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=40, help="measured steps per point")
    parser.add_argument("--warmup", type=int, default=8, help="steps before measuring (cudnn, allocator, workers)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per point; the median is reported")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--prefetch", type=int, default=4)
    parser.add_argument("--amp", choices=("bf16", "fp16", "none"), default="bf16")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (as --compile trains)")
    parser.add_argument("--classes", type=int, default=100, help="head size for synthetic data")
    parser.add_argument("--variants", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the training step's choices one by one (first arch)")
    parser.add_argument("--ddp", type=int, default=None,
                        help="processes for DDP's scaling (default: every GPU when there are several, else none)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--tag", default="", help="added to the report's name")
    return parser.parse_args(argv)


def _device(opts: argparse.Namespace) -> torch.device:
    if opts.device == "auto":
        opts.device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(opts.device)


def _ensure_data(opts: argparse.Namespace) -> None:
    if (opts.data / "train").is_dir() or not {"cpu", "gpu"} & set(opts.paths):
        return
    if opts.data != DEFAULT_DATA:
        raise SystemExit(f"error: {opts.data} has no train/ folder")
    from demo_data.photos import write_photos
    print(f"writing the ImageNet-like folder {opts.data} (once; python -m demo_data photos)", flush=True)
    write_photos(opts.data)


def _meta(opts: argparse.Namespace, device: torch.device, argv: Sequence[str] | None) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    given = list(sys.argv[1:] if argv is None else argv)
    return {"device_name": name, "command": " ".join(["python -m bench.train", *given]),
            "torch": torch.__version__, "host cores": os.cpu_count(), "DataLoader workers": opts.workers,
            "batch": opts.batch_size, "crop": opts.crop_size, "amp": opts.amp, "channels_last": opts.channels_last,
            "compile": opts.compile, "data": str(opts.data),
            "steps": f"{opts.warmup} warm-up, then {opts.rounds} interleaved rounds of {opts.steps} measured (median)"}


def _ddp(opts: argparse.Namespace, device: torch.device, limits: dict[str, float]) -> dict[str, dict[str, float]]:
    world = opts.ddp if opts.ddp is not None else (torch.cuda.device_count() if device.type == "cuda" else 0)
    if world < 2:
        return {}
    from bench.train_ddp import ddp_images_per_s
    out = {}
    for arch in opts.archs:
        rate = ddp_images_per_s(opts, arch, world)
        out[f"{arch}@{world}"] = {"images_per_s": rate, "efficiency": rate / (world * limits[arch])}
    return out


def main(argv: Sequence[str] | None = None) -> Path:
    """Measure, print and write the report; returns its path."""
    from bench.train_report import write_report

    opts = parse(argv)
    device = _device(opts)
    _ensure_data(opts)
    points = [point for arch in opts.archs for point in measure_arch(opts, arch, device)]
    limits = {p.arch: p.images_per_s for p in points if p.path == "synthetic"}
    for point in points:
        point.of_limit = point.images_per_s / limits[point.arch] if point.arch in limits else None
    from bench.train_checks import checkpoint_stall, largest_batch, measure_variants

    variants = measure_variants(opts, opts.archs[0], device) if opts.variants else []
    largest = {arch: largest_batch(opts, arch, device) for arch in opts.archs}
    stem = f"{time.strftime('%Y-%m-%d')}-train-{device.type}{'-' + opts.tag if opts.tag else ''}"
    stall = checkpoint_stall(opts, opts.archs[0], device, Path(os.environ.get("TMPDIR", "/tmp")) / stem)
    report = write_report(opts.out, stem, _meta(opts, device, argv), points, variants, largest, stall,
                          _ddp(opts, device, limits))
    print(report.read_text(), flush=True)
    return report


if __name__ == "__main__":
    main()
