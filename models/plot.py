"""Draw a run's loss and accuracy curves from its metrics file, and its confusion matrix.

    .venv/bin/python -m models.plot runs/NAME          # writes runs/NAME/curves.png (and confusion.png)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from models.run.confusion import CONFUSION_NAME
from models.run.report import METRICS_NAME, read_metrics

PLOT_NAME = "curves.png"
CONFUSION_PLOT_NAME = "confusion.png"


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Loss (train, val) and top-1/top-5 accuracy per epoch, side by side, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    from matplotlib.ticker import MaxNLocator

    rows = read_metrics(run_dir)
    epochs = [row["epoch"] + 1 for row in rows]  # counted from 1, as the run's lines and the manifest count them
    figure, (loss_axes, acc_axes) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for key, label in (("train_loss", "train"), ("val_loss", "val")):
        loss_axes.plot(epochs, [row[key] for row in rows], marker="o", label=label)
    for key, label in (("train_acc1", "train top-1"), ("val_acc1", "val top-1"), ("val_acc5", "val top-5")):
        values = [row.get(key) for row in rows]
        if any(value is not None for value in values):  # no top-5 below 6 classes (null in metrics.jsonl)
            acc_axes.plot(epochs, values, marker="o", label=label)
    # Log scale: an early spike (fresh BatchNorm statistics) would otherwise flatten the rest of the curve.
    loss_axes.set(title="loss (log scale)", xlabel="epoch", yscale="log")
    acc_axes.set(title="accuracy", xlabel="epoch", ylim=(0, 1.02))
    for axes in (loss_axes, acc_axes):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(run_dir.name)
    target = out or run_dir / PLOT_NAME
    figure.savefig(target, dpi=100)
    plt.close(figure)
    if (run_dir / CONFUSION_NAME).is_file():
        plot_confusion(run_dir / CONFUSION_NAME, target.with_name(CONFUSION_PLOT_NAME))
    return target


def plot_confusion(report_path: Path, target: Path, title: str = "validation, best epoch") -> Path:
    """A confusion matrix (counts; rows true, columns predicted) with per-class recall: by default a run's best
    epoch, or an evaluation by ``python -m models.predict``."""
    import matplotlib.pyplot as plt

    report = json.loads(report_path.read_text(encoding="utf-8"))
    classes, matrix = report["classes"], report["matrix"]
    size = max(4.0, 0.5 * len(classes) + 2)
    figure, axes = plt.subplots(figsize=(size, size), constrained_layout=True)
    axes.imshow(matrix, cmap="Blues")
    dark = max(max(counts) for counts in matrix) / 2  # the colour map's darker half: white counts on it
    for row, counts in enumerate(matrix):
        for column, count in enumerate(counts):
            axes.text(column, row, str(count), ha="center", va="center", fontsize=8,
                      color="white" if count > dark else "black")
    recall = [f"{name} ({report['per_class'][name]['recall']:.2f})" for name in classes]
    axes.set(xticks=range(len(classes)), yticks=range(len(classes)), xlabel="predicted",
             ylabel="true class (recall)", title=title)
    axes.set_xticklabels(classes, rotation=45, ha="right")
    axes.set_yticklabels(recall)
    figure.savefig(target, dpi=100)
    plt.close(figure)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for ``python -m models.plot RUN_DIR``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None, help=f"PNG to write (default RUN_DIR/{PLOT_NAME})")
    args = parser.parse_args(argv)
    if not (args.run_dir / METRICS_NAME).is_file():
        print(f"error: {args.run_dir / METRICS_NAME} does not exist; is {args.run_dir} a training run?",
              file=sys.stderr)
        return 2
    curves = plot_run(args.run_dir, args.out)
    print(curves)
    if (args.run_dir / CONFUSION_NAME).is_file():  # plot_run drew the best epoch's confusion matrix beside it
        print(curves.with_name(CONFUSION_PLOT_NAME))
    return 0


if __name__ == "__main__":
    sys.exit(main())
