"""The training step's checks for ``python -m bench.training.train``: the largest batch that fits, the step's
choices one at a time, and how long a checkpoint write holds the loop."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.training.trainer import Point, Trainer, measure, synthetic_batches, training_args


def largest_batch(opts: argparse.Namespace, arch: str, device: torch.device, limit: int = 4096) -> int | None:
    """The largest power-of-two batch whose training step fits in GPU memory (None on the CPU)."""
    if device.type != "cuda":
        return None
    fits, size = None, opts.batch_size
    while size <= limit:
        try:
            args = training_args(opts, arch, "cpu", batch_size=size)
            trainer = Trainer(args, opts.classes, device)
            measure(trainer, synthetic_batches(args, opts.classes, device), 1, 1)
            fits, size = size, size * 2
        except torch.OutOfMemoryError:
            break
        finally:
            trainer = None  # noqa: F841 - free the model before the next, larger try
            torch.cuda.empty_cache()
    return fits


def _variants(device: torch.device) -> dict[str, tuple[list[str], bool, bool]]:
    """name: (training options added, fused optimiser, a loss.item() per step), the first as the script trains."""
    fused = device.type == "cuda"  # what models.train asks for
    variants = {"as shipped": ([], fused, False), "a loss.item() per step": ([], fused, True),
                f"optimiser {'not ' if fused else ''}fused": ([], not fused, False)}
    if device.type == "cuda":
        variants["TF32 off"] = (["--no-tf32"], fused, False)
    return variants


def measure_variants(opts: argparse.Namespace, arch: str, device: torch.device) -> list[Point]:
    """The training step's choices, one at a time, on synthetic data (so only the step's own cost shows)."""
    points = []
    for name, (extra, fused, sync) in _variants(device).items():
        args = training_args(opts, arch, "cpu", extra=extra)
        trainer = Trainer(args, opts.classes, device, fused=fused)
        point = measure(trainer, synthetic_batches(args, opts.classes, device), opts.warmup, opts.steps, sync=sync)
        point.path, point.note = "synthetic", name
        points.append(point)
    return points


def checkpoint_stall(opts: argparse.Namespace, arch: str, device: torch.device, out: Path) -> dict[str, float]:
    """Seconds a checkpoint write holds the training loop: written inline, and by the training script's writer."""
    from models.run import checkpoint as ckpt

    args = training_args(opts, arch, "cpu")
    trainer = Trainer(args, opts.classes, device)
    state = {"model": trainer.parts.model.state_dict(), "optimizer": trainer.parts.optimizer.state_dict()}
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    ckpt.save_checkpoint(ckpt.snapshot(state), out, is_best=False)
    inline = time.perf_counter() - start
    writer = ckpt.CheckpointWriter()
    start = time.perf_counter()
    writer.save(state, out, is_best=False)
    held = time.perf_counter() - start
    writer.wait()
    return {"inline_s": inline, "writer_s": held, "bytes": (out / ckpt.CHECKPOINT_NAME).stat().st_size}
