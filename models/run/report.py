"""What a training run tells the person watching it: one line per epoch, and a summary with what to run next."""
from __future__ import annotations

import argparse
import json
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from models.checkpoint import CHECKPOINT_NAME

TOP5_MIN_CLASSES = 6  # with 5 classes or fewer, top-5 accuracy is 1.0 by construction
CONFUSION_NAME = "confusion.json"


def duration(seconds: float) -> str:
    """``1h02m``, ``3m05s`` or ``42s``."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


@dataclass
class Progress:
    """Epoch lines with time, a best mark and the run's ETA; the best epoch for the summary."""

    epochs: int
    num_classes: int
    epoch_seconds: list[float] = field(default_factory=list)
    best: dict[str, float] = field(default_factory=dict)

    def line(self, row: dict[str, float], is_best: bool, seconds: float) -> str:
        self.epoch_seconds.append(seconds)
        if is_best:
            self.best = dict(row)
        remaining = self.epochs - 1 - int(row["epoch"])
        eta = sum(self.epoch_seconds) / len(self.epoch_seconds) * remaining
        top5 = f" top-5 {row['val_acc5']:.4f}" if self.num_classes >= TOP5_MIN_CLASSES else ""
        return (f"epoch {int(row['epoch'])}/{self.epochs - 1}: train loss {row['train_loss']:.4f} "
                f"top-1 {row['train_acc1']:.4f} | val loss {row['val_loss']:.4f} top-1 {row['val_acc1']:.4f}{top5}"
                f" | {duration(seconds)}, {row['images_per_s']:.0f} img/s{_peak(row)}{'  * best' if is_best else ''}"
                + (f" | ETA {duration(eta)}" if remaining else ""))

    def summary(self, output_dir: Path, best_checkpoint: Path) -> list[str]:
        if not self.best:
            return []
        export_dir = output_dir / "export"
        return [f"done: best epoch {int(self.best['epoch'])}, val top-1 {self.best['val_acc1']:.4f} "
                f"(loss {self.best['val_loss']:.4f}), {duration(sum(self.epoch_seconds))} in all",
                f"export: python -m models.export --checkpoint {best_checkpoint} --out {export_dir}",
                f"serve:  VISIONSERVE_WEIGHTS_DIR={export_dir} make serve"]


def _peak(row: dict[str, float]) -> str:
    peak = row.get("peak_gpu_memory_mb")
    return f", peak GPU memory {peak / 1024:.2f} GiB" if peak is not None else ""


def confusion_counts(probabilities: torch.Tensor, targets: Sequence[int], num_classes: int) -> torch.Tensor:
    """Counts of (true class, predicted class) for one rank's outputs; ranks' matrices add up."""
    matrix = torch.zeros(num_classes, num_classes, dtype=torch.int64)
    predicted = probabilities.argmax(dim=1).tolist() if len(probabilities) else []
    for truth, guess in zip(targets, predicted):
        matrix[truth, guess] += 1
    return matrix


def confusion(matrix: torch.Tensor, classes: Sequence[str]) -> dict[str, object]:
    """The confusion matrix (rows: true class, columns: predicted) and per-class precision, recall, support."""
    per_class = {}
    for i, name in enumerate(classes):
        hits, said, actual = int(matrix[i, i]), int(matrix[:, i].sum()), int(matrix[i].sum())
        per_class[name] = {"precision": hits / said if said else 0.0, "recall": hits / actual if actual else 0.0,
                           "support": actual}
    return {"classes": list(classes), "matrix": matrix.tolist(), "per_class": per_class}


def write_confusion(report: dict[str, object], output_dir: Path) -> tuple[Path, list[str]]:
    """Save ``confusion.json``; return its path and a printable table."""
    path = output_dir / CONFUSION_NAME
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    per_class: dict[str, dict[str, float]] = report["per_class"]  # type: ignore[assignment]
    width = max(len(name) for name in per_class)
    lines = [f"{'class':<{width}}  precision  recall  support"]
    lines += [f"{name:<{width}}  {m['precision']:9.3f}  {m['recall']:6.3f}  {int(m['support']):7d}"
              for name, m in per_class.items()]
    return path, lines


class Timer:
    """Seconds since the last ``lap``."""

    def __init__(self) -> None:
        self._last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        return seconds


def interrupted(args: argparse.Namespace, argv: list[str]) -> str:
    """What Ctrl-C leaves: the last checkpoint and the exact command that goes on from it."""
    saved = args.output_dir / CHECKPOINT_NAME
    if not saved.exists():
        return "interrupted before the first epoch ended: no checkpoint to resume from"
    kept, words = [], iter(argv)
    for word in words:  # the same options, without an earlier --resume
        if word == "--resume":
            next(words, None)  # and its value
        elif not word.startswith("--resume="):
            kept.append(word)
    command = shlex.join(["python", "-m", "models.train", *kept, "--resume", str(saved)])
    return f"interrupted: the last finished epoch is in {saved}; to go on: {command}"


class AsyncScalar:
    """A device scalar shown without stalling the GPU: copied to pinned host memory behind the queued work, read
    once that copy has landed (a ``.item()`` would wait for every queued kernel). On the CPU it is read at once."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host = torch.zeros((), dtype=torch.float32, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None
        self.pending, self.value = False, float("nan")

    def push(self, value: torch.Tensor) -> None:
        """Start copying ``value``; while the previous copy is still in flight, skip this one."""
        if self.event is None:
            self.value = float(value)
            return
        if self.pending:
            if not self.event.query():
                return
            self.value = float(self.host)
        self.host.copy_(value.detach(), non_blocking=True)
        self.event.record()
        self.pending = True

    def text(self) -> str:
        """The newest landed value, for a progress bar."""
        return f"{self.value:.4f}"


def reset_peak_memory(device: torch.device) -> None:
    """Start measuring the peak GPU memory anew (each epoch)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, float]:
    """``{"peak_gpu_memory_mb": ...}`` since the last reset on CUDA; nothing on the CPU."""
    if device.type != "cuda":
        return {}
    return {"peak_gpu_memory_mb": torch.cuda.max_memory_allocated(device) / 2**20}
