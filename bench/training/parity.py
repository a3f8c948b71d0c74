"""Accuracy of the two data paths: ``python -m bench.training.parity`` trains the bundled demos and a fine-tune on the
ImageNet-like photos once with ``--data-backend cpu`` and once with ``gpu``, and reports each best val top-1.

    python -m bench.training.parity                        # every recipe, on CUDA when there is one
    python -m bench.training.parity --recipes digits --device cpu

The two paths give each sample the same crop and flip; the pixels differ only by the resize kernel, so the top-1
should agree within a point (the issue's bar). Writes ``<date>-train-parity-<device>.md`` under ``--out``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from bench.paths import RESULTS, WORK
from models import train
from demo_data.small_sets import write_digits, write_textures
from demo_data.photos import write_photos
from models.run.report import read_metrics

Writer = Callable[[Path], object]

# name: (how its folder is written, the training options: the Makefile's demos and a fine-tune on photos)
RECIPES: dict[str, tuple[Writer, list[str]]] = {
    "digits": (lambda out: write_digits(out), [
        "--arch", "resnet18", "--epochs", "15", "--batch-size", "64", "--resize-size", "32", "--crop-size", "32",
        "--hflip-prob", "0", "--min-crop-scale", "0.5"]),
    "textures": (lambda out: write_textures(out), [
        "--arch", "efficientnet_lite0", "--pretrained", "--freeze-backbone", "--epochs", "3", "--batch-size", "32",
        "--lr", "0.05"]),
    "photos-finetune": (lambda out: write_photos(out, classes=20, train_per_class=40, val_per_class=20), [
        "--arch", "efficientnet_lite0", "--pretrained", "--backbone-lr-scale", "0.1", "--epochs", "3",
        "--batch-size", "32", "--lr", "0.02"]),
}


def best_top1(run: Path) -> float:
    """The best validation top-1 of a finished run."""
    return max(row["val_acc1"] for row in read_metrics(run))


def train_both(name: str, device: str, workers: int, work: Path) -> dict[str, float]:
    """Train one recipe on each data path; best val top-1 and seconds for each."""
    writer, options = RECIPES[name]
    data = work / "data" / name
    if not (data / "train").is_dir():
        writer(data)
    result: dict[str, float] = {}
    for backend in ("cpu", "gpu"):
        run = work / "runs" / f"{name}-{backend}"
        start = time.perf_counter()
        code = train.main(["--data", str(data), *options, "--device", device, "--workers", str(workers),
                           "--data-backend", backend, "--output-dir", str(run)])
        if code != 0:
            raise SystemExit(f"training {name} on the {backend} path failed (exit {code})")
        result[backend], result[f"{backend}_s"] = best_top1(run), time.perf_counter() - start
    return result


def main(argv: Sequence[str] | None = None) -> Path:
    """Train, print and write the table; returns its path."""
    parser = argparse.ArgumentParser(prog="python -m bench.training.parity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", choices=sorted(RECIPES), default=list(RECIPES))
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--work", type=Path, default=WORK / "parity")
    parser.add_argument("--out", type=Path, default=RESULTS)
    opts = parser.parse_args(argv)
    device = opts.device if opts.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    rows = ["| recipe | CPU path best val top-1 | GPU path best val top-1 | difference (points) "
            "| time CPU / GPU path |", "|---|---:|---:|---:|---:|"]
    for name in opts.recipes:
        r = train_both(name, device, opts.workers, opts.work)
        rows.append(f"| {name} | {r['cpu']:.4f} | {r['gpu']:.4f} | {(r['gpu'] - r['cpu']) * 100:+.1f} "
                    f"| {r['cpu_s']:.0f} s / {r['gpu_s']:.0f} s |")
        print(rows[-1], flush=True)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    opts.out.mkdir(parents=True, exist_ok=True)
    path = opts.out / f"{time.strftime('%Y-%m-%d')}-train-parity-{device}.md"
    given = " ".join(sys.argv[1:] if argv is None else argv)
    path.write_text(f"# Data paths' accuracy: {name}\n\n`python -m bench.training.parity {given}`\n\n"
                    + "\n".join(rows) + "\n", encoding="utf-8")
    return path


if __name__ == "__main__":
    main()
