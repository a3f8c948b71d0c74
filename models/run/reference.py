"""The validation pass's prediction reference, written into the manifest at export: how many images each class was
the top-1 answer for, the histogram of the top-1 probabilities and the share below LOW_CONFIDENCE_THRESHOLD. Each
rank counts its own outputs; the counts add up across ranks. The server compares the class mix of its recent
predictions with it (app/engine/loaded/monitor.py)."""
from __future__ import annotations

from typing import Sequence

import torch

from models.export.manifest import CONFIDENCE_BUCKETS, LOW_CONFIDENCE_THRESHOLD, PredictionReference


def reference_counts(probabilities: torch.Tensor, num_classes: int) -> list[float]:
    """This rank's counts as one flat list, to sum across ranks: ``num_classes`` top-1 class counts, one count per
    confidence bucket, then the low-confidence count."""
    if len(probabilities) == 0:
        return [0.0] * (num_classes + len(CONFIDENCE_BUCKETS) + 1)
    confidences, classes = probabilities.float().max(dim=1)
    confidences = torch.nan_to_num(confidences, nan=0.0)  # a NaN row answered nothing with any confidence
    per_class = torch.bincount(classes, minlength=num_classes)
    edges = torch.tensor(CONFIDENCE_BUCKETS)
    buckets = torch.bucketize(confidences, edges).clamp(max=len(CONFIDENCE_BUCKETS) - 1)  # 1.0000001 -> 1.0
    per_bucket = torch.bincount(buckets, minlength=len(CONFIDENCE_BUCKETS))
    low = int((confidences < LOW_CONFIDENCE_THRESHOLD).sum())
    return [*map(float, per_class.tolist()), *map(float, per_bucket.tolist()), float(low)]


def reference_from_counts(counts: Sequence[float], num_classes: int) -> dict[str, object] | None:
    """The reference (as the manifest's plain dict, which a checkpoint can hold) from the counts summed over the
    ranks; None for an empty validation pass."""
    per_class = [int(round(v)) for v in counts[:num_classes]]
    per_bucket = [int(round(v)) for v in counts[num_classes:num_classes + len(CONFIDENCE_BUCKETS)]]
    total = sum(per_class)
    if total == 0:
        return None
    low = int(round(counts[num_classes + len(CONFIDENCE_BUCKETS)]))
    return PredictionReference(
        source="validation", predictions=total, class_counts=per_class, confidence_buckets=list(CONFIDENCE_BUCKETS),
        confidence_counts=per_bucket, low_confidence_threshold=LOW_CONFIDENCE_THRESHOLD,
        low_confidence_share=round(low / total, 6)).model_dump()
