"""A model version's prediction monitor: the top-1 class and probability of its last ``window`` predictions made for
requests, their class mix against a reference as a population stability index (PSI), their share below a
confidence threshold, and the classes they name most. One per loaded version and worker; thread-safe (one lock);
each batch costs one top-1 over its rows (numpy, as the answers rank), a step per row, and, once the window is full,
a term of the PSI for each bin the batch changed (the window keeps its counts per bin as it goes, and the PSI its
terms per bin): never a pass over the classes. No Flask, no Prometheus: the caller publishes what ``observe``
returns.

PSI = sum over the bins of (w - r) * ln(w / r), where w and r are the window's and the reference's shares of a bin:
- bins: one per class when the model has at most ``psi_bins`` (B) classes. With more, the reference's most frequent
  classes holding at least 1/(2B) of it get a bin each (at most B - 1 of them; ties: the lower class index), and
  the other classes are dealt over the remaining bins by class index (index mod their number). One bin per class
  of 1,000 ImageNet classes over 1,000 predictions reads about 1.3 for two samples of the same mix (sampling noise),
  and giving the reference's top B - 1 classes a bin each whatever their count about 0.1 (the top of a noisy count
  is over-counted); these bins read about 0.04 (tests/unit/test_monitor.py). The price: a shift among rare classes
  shows only as far as it moves mass between their shared bins;
- empty bins: a share below PSI_EPSILON counts as PSI_EPSILON, on either side, so a class the reference never
  predicted adds a large but finite term (a 10% share of it: about 0.7);
- reported (not None) only once the reference is complete and the window holds ``min_predictions``;
- the reference: the manifest's (the validation split's predictions at export) when it holds ``min_predictions``
  (a smaller one, a small folder's few held-out images, is mostly noise: 18 predictions of a balanced stream read
  0.24), else this monitor's first full window after the load ("first_predictions"), after which the window starts
  empty so the two share no prediction. Such a reference is kept for the version's later starts in the same server
  (``keep``: CONTROL_DIR, app/engine/loaded/version.py), and the first one kept is every start's after it: a worker
  restarted, a reload, or a server whose CONTROL_DIR is kept judges drift against the mix the version first met, not
  against what it meets after the restart (the drifted traffic itself, which would read as no drift).
Reading it: below 0.1 the mix is stable, 0.1 to 0.2 worth watching, above 0.2 it has drifted.
"""
from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from app.config import Settings
from app.engine.contract import ClassCount, MonitorSnapshot, ReferenceSummary
from app.engine.ranking import top_indices
from models.export.manifest import Manifest, PredictionReference

log = logging.getLogger(__name__)

PSI_EPSILON = 1e-4
TOP_CLASSES = 5  # classes a snapshot lists


def class_bins(reference_counts: torch.Tensor, max_bins: int) -> torch.Tensor:
    """The PSI bin of each class (see the module's text): one per class, or a bin each for the reference's frequent
    classes (at least 1/(2 max_bins) of it, at most max_bins - 1) and the others dealt over the remaining bins."""
    num_classes = len(reference_counts)
    if num_classes <= max_bins:
        return torch.arange(num_classes)
    top = torch.argsort(reference_counts, descending=True, stable=True)[:max_bins - 1]
    frequent = top[reference_counts[top] * 2 * max_bins >= reference_counts.sum()]
    bins = torch.arange(num_classes) % (max_bins - len(frequent)) + len(frequent)
    bins[frequent] = torch.arange(len(frequent))
    return bins


def population_stability_index(actual_counts: Sequence[float] | torch.Tensor,
                               expected_counts: Sequence[float] | torch.Tensor,
                               epsilon: float = PSI_EPSILON) -> float:
    """PSI of two count vectors over the same bins, shares below ``epsilon`` taken as ``epsilon``. Computed on
    Python floats (doubles): a batch's figure comes from a few dozen bins, where torch's per-operation cost, with the
    caches cold from the forward pass just run, was most of the monitor's time."""
    actual, expected = _as_list(actual_counts), _as_list(expected_counts)
    return math.fsum(_psi_terms(actual, shares(expected, epsilon), epsilon))


def shares(counts: Sequence[float], epsilon: float = PSI_EPSILON) -> list[float]:
    """Each count's share of their total (a total of 0 taken as 1), ``epsilon`` at least."""
    total = max(float(sum(counts)), 1.0)
    return [max(count / total, epsilon) for count in counts]


def _psi_term(count: float, total: float, expected_share: float, epsilon: float) -> float:
    actual_share = max(count / total, epsilon)
    return (actual_share - expected_share) * math.log(actual_share / expected_share)


def _psi_terms(actual: Sequence[float], expected_shares: Sequence[float], epsilon: float) -> list[float]:
    total = max(float(sum(actual)), 1.0)
    return [_psi_term(a, total, e, epsilon) for a, e in zip(actual, expected_shares, strict=True)]


def _as_list(counts: Sequence[float] | torch.Tensor) -> list[float]:
    return counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)


class _Window:
    """The last ``size`` predictions' top-1 classes and low-confidence flags in a ring, with running counts per
    class, per PSI bin (once the bins are known: ``bins``, a bin per class) and of low-confidence predictions.
    Python lists, one step per row: a batch holds a few rows, and torch's operations on them cost more than the
    rows' own work (about 0.5 ms a batch right after a forward pass)."""

    def __init__(self, size: int, num_classes: int, bins: list[int] | None = None, num_bins: int = 0) -> None:
        self.size = size
        self.classes = [0] * size
        self.low = [False] * size
        self.class_counts = [0] * num_classes
        self.bins = bins
        self.bin_counts = [0] * num_bins
        self.low_count = 0
        self.filled = 0
        self._next = 0

    def add(self, classes: Sequence[int], low: Sequence[bool], changed_bins: set[int]) -> None:
        """Add rows in order; each takes the oldest slot once the ring is full (a batch longer than the window: its
        last rows). The bins whose counts moved are added to ``changed_bins``."""
        counts, bins, bin_counts = self.class_counts, self.bins, self.bin_counts
        for cls, is_low in zip(classes[-self.size:], low[-self.size:]):
            slot = self._next
            if slot < self.filled:  # the ring fills in order, so this slot holds an older prediction
                evicted = self.classes[slot]
                counts[evicted] -= 1
                self.low_count -= self.low[slot]
                if bins is not None:
                    bin_counts[bins[evicted]] -= 1
                    changed_bins.add(bins[evicted])
            else:
                self.filled += 1
            self.classes[slot], self.low[slot] = cls, is_low
            counts[cls] += 1
            self.low_count += is_low
            if bins is not None:
                bin_counts[bins[cls]] += 1
                changed_bins.add(bins[cls])
            self._next = (slot + 1) % self.size


@dataclass(frozen=True)
class TakenReference:
    """A reference a monitor took from its first full window: its top-1 class counts (label order) and its
    low-confidence share."""

    class_counts: list[int]
    low_confidence_share: float


# What a monitor does with the reference it took: keeps it for the version's later starts, and answers the one to
# judge by (the one kept first, by this or another worker)
KeepReference = Callable[[TakenReference], TakenReference]


@dataclass(frozen=True)
class Observed:
    """What one batch added: each row's top-1 label and probability, and the window's figures after it (None: not
    reported yet)."""

    labels: list[str]
    confidences: list[float]
    low_confidence_ratio: float | None
    psi: float | None


def _top_one(probabilities: np.ndarray | torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Each row's top-1 class as the answers rank it (top_indices: ties the lower index, argmax's; NaN last) and its
    probability; a row whose highest is NaN (max's) takes top_indices itself. Five numpy steps a batch where
    top_indices and its probabilities took eleven."""
    rows = np.asarray(probabilities, dtype=np.float32)
    top, best = rows.argmax(axis=1), rows.max(axis=1)
    if (total := best.sum()) != total:
        top = top_indices(rows, 1)[:, 0]
        best = rows[np.arange(len(rows)), top]
    return top, best


class PredictionMonitor:
    """One version's prediction monitor (the module's text says what it measures and how)."""

    def __init__(self, labels: Sequence[str], *, window: int, min_predictions: int, low_confidence_threshold: float,
                 psi_bins: int, reference: PredictionReference | None = None, taken: TakenReference | None = None,
                 keep: KeepReference | None = None) -> None:
        self.labels = list(labels)
        self.min_predictions = min_predictions
        self.low_confidence_threshold = low_confidence_threshold
        # The confidences are float32: compared with the threshold as float32 holds it, so a confidence equal to
        # it is not low whatever the threshold's decimal (0.7 is not a float32).
        self._low_below = float(torch.tensor(low_confidence_threshold, dtype=torch.float32))
        self.psi_bins = min(psi_bins, len(self.labels))
        self._lock = threading.Lock()
        self._total = 0
        self._manifest_reference = reference
        self._reference_low_share = reference.low_confidence_share if reference else None
        self._bins: list[int] | None = None
        self._reference_shares: list[float] | None = None  # per bin, PSI_EPSILON at least
        self._reference_predictions = 0
        # The PSI's terms per bin for the window's count ``_terms_total`` (None: to be computed), and the bins
        # changed since: a full window's total stays, so a batch recomputes only the terms of the bins it moved
        self._terms: list[float] | None = None
        self._terms_total = 0
        self._changed_bins: set[int] = set()
        self._keep = keep
        if reference is not None:
            self._set_reference(torch.tensor(reference.class_counts, dtype=torch.int64))
        elif taken is not None:  # taken by an earlier start of the version in this server
            self._take(taken)
        self._window = self._new_window(window)

    @classmethod
    def for_version(cls, settings: Settings, manifest: Manifest, taken: TakenReference | None = None,
                    keep: KeepReference | None = None) -> "PredictionMonitor":
        """The monitor of a version with this manifest, as the settings ask; ``taken``: the reference an earlier
        start of it took from its first predictions, ``keep``: where this one keeps its own."""
        reference = manifest.reference
        if reference is not None and sum(reference.class_counts) < settings.monitor_min_predictions:
            log.info("%s version %s: its manifest's reference holds %d predictions (its validation split's), fewer "
                     "than MONITOR_MIN_PREDICTIONS (%d): its drift is judged against its first %d predictions after "
                     "the load instead", manifest.name, manifest.version, sum(reference.class_counts),
                     settings.monitor_min_predictions, settings.monitor_window)
            reference = None
        if reference is None and taken is not None and not _fits(taken, len(manifest.labels),
                                                                 settings.monitor_min_predictions):
            taken = None
        if reference is None and taken is not None:
            log.info("%s version %s: its drift is judged against the first %d predictions an earlier start of it in "
                     "this server made (kept in CONTROL_DIR)", manifest.name, manifest.version, sum(taken.class_counts))
        return cls(manifest.labels, window=settings.monitor_window, min_predictions=settings.monitor_min_predictions,
                   low_confidence_threshold=settings.monitor_low_confidence, psi_bins=settings.monitor_psi_bins,
                   reference=reference, taken=taken, keep=keep)

    def _take(self, taken: TakenReference) -> None:
        self._reference_low_share = taken.low_confidence_share
        self._set_reference(torch.tensor(taken.class_counts, dtype=torch.int64))

    def _set_reference(self, class_counts: torch.Tensor) -> None:
        bins = class_bins(class_counts, self.psi_bins)
        self._bins = bins.tolist()
        self._reference_shares = shares(
            torch.zeros(self.psi_bins, dtype=torch.int64).index_add_(0, bins, class_counts).tolist())
        self._reference_predictions = int(class_counts.sum())

    def _new_window(self, size: int) -> _Window:
        self._terms = None
        self._changed_bins.clear()
        return _Window(size, len(self.labels), self._bins, self.psi_bins)

    def observe(self, probabilities: np.ndarray | torch.Tensor) -> Observed:
        """Add a batch's softmax rows (rows x classes, float32, on the CPU) made for requests; returns what it added
        and the figures."""
        return self._add(*_top_one(probabilities))

    def observe_batches(self, batches: Sequence[np.ndarray | torch.Tensor]) -> Observed:
        """``observe`` of several batches' rows, in order (the batches a settle holds): each looked at where it lies,
        not copied into one array first (a busy engine's settle holds a row of 4 KB an image for 1,000 classes)."""
        tops = [_top_one(rows) for rows in batches]
        if len(tops) == 1:
            return self._add(*tops[0])
        if not tops:  # (nothing held: the figures as they stand)
            return self._add(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32))
        return self._add(np.concatenate([top for top, _ in tops]), np.concatenate([best for _, best in tops]))

    def _add(self, top: np.ndarray, best: np.ndarray) -> Observed:
        """The rows' top-1 classes and their probabilities (``_top_one``) into the window; what was added and the
        figures."""
        classes = top.tolist()
        confidences = [c if c == c else 0.0 for c in best.tolist()]  # NaN: no confidence
        low = [c < self._low_below for c in confidences]
        with self._lock:
            self._total += len(classes)
            self._window.add(classes, low, self._changed_bins)
            if self._bins is None and self._window.filled == self._window.size:  # the first full window
                taken = TakenReference(list(self._window.class_counts), self._window.low_count / self._window.size)
                self._take(self._kept(taken))
                self._window = self._new_window(self._window.size)
            psi, ratio = self._psi(), self._low_confidence_ratio()
        return Observed([self.labels[i] for i in classes], confidences, ratio, psi)

    def _kept(self, taken: TakenReference) -> TakenReference:
        """``taken`` kept for later starts, or the reference kept before it to judge by (once a version, under the
        lock: a few small file operations); ``taken`` itself where it cannot be kept."""
        if self._keep is None:
            return taken
        try:
            kept = self._keep(taken)
        except OSError as exc:
            log.warning("the drift reference its first predictions made could not be kept for later starts (%s); "
                        "this worker judges by it", exc)
            return taken
        return kept if _fits(kept, len(self.labels), self.min_predictions) else taken

    def _psi(self) -> float | None:
        """Under the lock: ``population_stability_index`` of the window's bins against the reference's, from the
        terms kept per bin (each computed as it computes it), those of the bins changed since recomputed."""
        window, reference = self._window, self._reference_shares
        if reference is None or window.bins is None or window.filled < self.min_predictions:
            return None
        counts, total = window.bin_counts, float(window.filled)
        if self._terms is None or self._terms_total != window.filled:  # the total moved: every share did
            self._terms, self._terms_total = _psi_terms(counts, reference, PSI_EPSILON), window.filled
        else:
            terms = self._terms
            for b in self._changed_bins:
                terms[b] = _psi_term(counts[b], total, reference[b], PSI_EPSILON)
        self._changed_bins.clear()
        return math.fsum(self._terms)

    def _low_confidence_ratio(self) -> float | None:
        if self._window.filled < self.min_predictions:
            return None
        return self._window.low_count / self._window.filled

    def _top_classes(self) -> list[ClassCount]:
        counts = torch.tensor(self._window.class_counts, dtype=torch.int64)
        top = torch.topk(counts, min(TOP_CLASSES, len(counts)))
        filled = max(self._window.filled, 1)
        return [ClassCount(self.labels[i], i, n, round(n / filled, 6))
                for n, i in zip(top.values.tolist(), top.indices.tolist()) if n > 0]

    def _reference_summary(self) -> ReferenceSummary:
        manifest = self._manifest_reference
        complete = self._bins is not None
        return ReferenceSummary(
            source=manifest.source if manifest else "first_predictions",
            predictions=self._reference_predictions if complete else self._window.filled, complete=complete,
            low_confidence_threshold=manifest.low_confidence_threshold if manifest else self.low_confidence_threshold,
            low_confidence_share=self._reference_low_share)

    def snapshot(self) -> MonitorSnapshot:
        """The window, the figures (None until reported), the most predicted classes and the reference."""
        with self._lock:
            psi, ratio = self._psi(), self._low_confidence_ratio()
            return MonitorSnapshot(
                window_size=self._window.size, predictions=self._window.filled, predictions_total=self._total,
                psi=None if psi is None else round(psi, 6), psi_bins=self.psi_bins,
                low_confidence_threshold=self.low_confidence_threshold,
                low_confidence_ratio=None if ratio is None else round(ratio, 6), top_classes=self._top_classes(),
                reference=self._reference_summary())


def _fits(taken: TakenReference, num_classes: int, min_predictions: int) -> bool:
    """Whether a kept reference can judge a version of ``num_classes`` classes: one count a class, enough of them."""
    counts = taken.class_counts
    return (len(counts) == num_classes and min(counts, default=0) >= 0 and sum(counts) >= min_predictions
            and 0.0 <= taken.low_confidence_share <= 1.0)
