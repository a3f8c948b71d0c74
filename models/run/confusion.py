"""The confusion matrix of a validation pass: counted per rank, summed, reported per class in ``confusion.json``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

CONFUSION_NAME = "confusion.json"


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
    width = max((len(name) for name in per_class), default=len("class"))  # no class: every labelled input unreadable
    lines = [f"{'class':<{width}}  precision  recall  support"]
    lines += [f"{name:<{width}}  {m['precision']:9.3f}  {m['recall']:6.3f}  {int(m['support']):7d}"
              for name, m in per_class.items()]
    return path, lines
