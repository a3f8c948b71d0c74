"""Training speed against the GPU's own limit: ``python -m bench.training.train``.

    python -m bench.training.train           # on a CUDA machine: resnet50, resnet18, efficientnet_lite0 at 224 px,
                                             # bf16 + channels_last, on data/photos (written first when missing)
    python -m bench.training.train --device cpu --archs resnet18 --batch-size 32 --steps 8
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
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from bench.paths import RESULTS
from bench.training.checks import checkpoint_stall, largest_batch, measure_variants
from bench.training.ddp import ddp_images_per_s
from bench.training.report import write_report
from bench.training.trainer import Point, Trainer, measure, synthetic_batches, training_args
from models.run.distributed import DistEnv
from models.data.gpu import Batch, DevicePrefetcher
from models.data.loaders import load_data
from models.architectures import ARCHS
from models.train import make_preset

PATHS = ("synthetic", "cpu", "gpu")
DEFAULT_DATA = Path("data/photos")


def folder_batches(args: argparse.Namespace, device: torch.device) -> tuple[Iterator[Batch], int]:
    """Batches of the folder through the chosen data path, epoch after epoch; and the number of classes."""
    data = load_data(args, make_preset(args), DistEnv(), device)

    def epochs() -> Iterator[Batch]:
        for epoch in itertools.count():
            data.train_sampler.set_epoch(epoch)
            yield from DevicePrefetcher(data.train, data.prepare, device)
    return epochs(), len(data.classes)


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
    parser = argparse.ArgumentParser(prog="python -m bench.training.train", description=__doc__,
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
    return {"device_name": name, "command": " ".join(["python -m bench.training.train", *given]),
            "torch": torch.__version__, "host cores": os.cpu_count(), "DataLoader workers": opts.workers,
            "batch": opts.batch_size, "crop": opts.crop_size, "amp": opts.amp, "channels_last": opts.channels_last,
            "compile": opts.compile, "data": str(opts.data),
            "steps": f"{opts.warmup} warm-up, then {opts.rounds} interleaved rounds of {opts.steps} measured (median)"}


def _ddp(opts: argparse.Namespace, device: torch.device, limits: dict[str, float]) -> dict[str, dict[str, float]]:
    world = opts.ddp if opts.ddp is not None else (torch.cuda.device_count() if device.type == "cuda" else 0)
    if world < 2:
        return {}
    out = {}
    for arch in opts.archs:
        rate = ddp_images_per_s(opts, arch, world)
        out[f"{arch}@{world}"] = {"images_per_s": rate, "efficiency": rate / (world * limits[arch])}
    return out


def main(argv: Sequence[str] | None = None) -> Path:
    """Measure, print and write the report; returns its path."""
    opts = parse(argv)
    device = _device(opts)
    _ensure_data(opts)
    points = [point for arch in opts.archs for point in measure_arch(opts, arch, device)]
    limits = {p.arch: p.images_per_s for p in points if p.path == "synthetic"}
    for point in points:
        point.of_limit = point.images_per_s / limits[point.arch] if point.arch in limits else None
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
