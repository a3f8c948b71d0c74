"""The evidence a rollout is decided on, gathered per worker and summed over the workers' reports.

- ``Comparison``: a candidate against the live version on the same images (the shadow's): images compared, top-1
  agreement, top-5 overlap, mean and largest probability difference, the most frequent disagreements, each side's
  forward time per image, the candidate's errors, the shadow work dropped and why.
- ``Traffic``: one version's requests since it took its role (the canary's, a new default's): count, failures
  (500 and 504: the model's, not the client's), latencies.

Each worker keeps its own (``Evidence``) and writes ``dump()`` into its report (app/engine/versions/desired.py); ``merged``
sums the dumps of every live worker, so ``/v1/models`` and the automatic promotion and rollback see the server's
traffic, not one worker's. Latencies are the last ``SAMPLES`` per worker, so percentiles are over recent requests.
"""
from __future__ import annotations

import collections
import math
import statistics
import threading
from typing import Any, Iterable, Sequence

import torch

from app.metrics import SHADOW_AGREED, SHADOW_COMPARED, SHADOW_DROPPED, SHADOW_ERRORS, SHADOW_PROBABILITY_DIFFERENCE
from models.export.manifest import TOP5_MIN_CLASSES

SAMPLES = 512  # latencies kept per worker and version
TOP_DISAGREEMENTS = 10  # disagreements listed, most frequent first
PAIR = "\x1f"  # between the live and the candidate label of a disagreement (no label holds it)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values`` (nearest rank: the ceil(q * n)-th smallest), None when there are
    none. Not round(q * n + 0.5): it rounds half to even, so p99 of 100 values was their largest."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class Comparison:
    """One candidate against one live version, in this worker."""

    def __init__(self, model: str, candidate: str, live: str) -> None:
        self.model, self.candidate, self.live = model, candidate, live
        self._lock = threading.Lock()
        self.compared = self.agreed = self.errors = 0
        self.top5_compared = 0  # images compared with TOP5_MIN_CLASSES classes or more on both sides (``top5_overlap``)
        self.differenced = 0  # images whose probabilities were compared class by class (the same label lists)
        self.top5_overlap = self.difference_sum = self.difference_max = 0.0
        self.disagreements: collections.Counter[str] = collections.Counter()
        self.dropped: collections.Counter[str] = collections.Counter()
        self.live_ms: collections.deque[float] = collections.deque(maxlen=SAMPLES)
        self.candidate_ms: collections.deque[float] = collections.deque(maxlen=SAMPLES)
        self.ended = False  # its rollout changed (``Evidence.restart``, ``forget``): no longer read, nothing more run

    def record(self, live: torch.Tensor, live_labels: list[str], candidate: torch.Tensor,
               candidate_labels: list[str], live_ms: Iterable[float], candidate_ms: Iterable[float]) -> None:
        """Rows of probabilities for the same images from both versions, and each side's forward time per image."""
        k = min(5, live.shape[1], candidate.shape[1])
        top5 = min(len(live_labels), len(candidate_labels)) >= TOP5_MIN_CLASSES  # else 1.0 by construction
        live_top, candidate_top = live.topk(k, dim=1).indices.tolist(), candidate.topk(k, dim=1).indices.tolist()
        same_classes = live_labels == candidate_labels
        differences = (live - candidate).abs().amax(dim=1).tolist() if same_classes else []
        agreed = 0  # by label, as /v1/models' agreement: two versions may list the same classes in another order
        with self._lock:
            for ours, theirs in zip(live_top, candidate_top):
                ours_labels, theirs_labels = [live_labels[i] for i in ours], [candidate_labels[i] for i in theirs]
                self.compared += 1
                if ours_labels[0] == theirs_labels[0]:
                    agreed += 1
                else:
                    self.disagreements[f"{ours_labels[0]}{PAIR}{theirs_labels[0]}"] += 1
                if top5:
                    self.top5_overlap += len(set(ours_labels) & set(theirs_labels)) / k
                    self.top5_compared += 1
            self.agreed += agreed
            self.differenced += len(differences)
            self.difference_sum += sum(differences)
            self.difference_max = max([self.difference_max, *differences])
            self.live_ms.extend(live_ms)
            self.candidate_ms.extend(candidate_ms)
        labels = (self.model, self.candidate, self.live)
        SHADOW_COMPARED.labels(*labels).inc(len(live_top))
        SHADOW_AGREED.labels(*labels).inc(agreed)
        for difference in differences:
            SHADOW_PROBABILITY_DIFFERENCE.labels(self.model, self.candidate).observe(difference)

    def error(self, count: int = 1) -> None:
        """The candidate failed on ``count`` images the live version answered."""
        with self._lock:
            self.errors += count
        SHADOW_ERRORS.labels(self.model, self.candidate).inc(count)

    def drop(self, reason: str, count: int = 1) -> None:
        """Shadow work not run: ``busy`` (live work queued), ``full`` (the shadow queue), ``stale`` (not run in
        time), ``retired`` (a version stops, the rollout changed), ``incompatible`` (tensors of another shape)."""
        with self._lock:
            self.dropped[reason] += count
        SHADOW_DROPPED.labels(self.model, self.candidate, reason).inc(count)

    def dump(self) -> dict[str, Any]:
        """This worker's figures, in a form ``merge_comparisons`` sums."""
        with self._lock:
            return {"model": self.model, "candidate": self.candidate, "live": self.live, "compared": self.compared,
                    "agreed": self.agreed, "top5_overlap": self.top5_overlap, "top5_compared": self.top5_compared,
                    "differenced": self.differenced,
                    "difference_sum": self.difference_sum, "difference_max": self.difference_max, "errors": self.errors,
                    "disagreements": dict(self.disagreements), "dropped": dict(self.dropped),
                    "live_ms": list(self.live_ms), "candidate_ms": list(self.candidate_ms)}


def merge_comparisons(dumps: list[dict[str, Any]]) -> dict[str, Any]:
    """One candidate's figures over every worker's dump (same model, candidate and live version). The probability
    differences are over the images whose probabilities could be compared (both versions' labels the same, in the
    same order): None when there were none, not 0.0 (which would read as identical answers)."""
    total = {key: sum(d[key] for d in dumps) for key in ("compared", "agreed", "top5_overlap", "differenced",
                                                         "difference_sum", "errors")}
    total["top5_compared"] = sum(d.get("top5_compared", d["compared"]) for d in dumps)  # (a worker of the code before
    # it, in a HUP's drain, compared every image so)
    disagreements: collections.Counter[str] = collections.Counter()
    dropped: collections.Counter[str] = collections.Counter()
    live_ms: list[float] = []
    candidate_ms: list[float] = []
    for d in dumps:
        disagreements.update(d["disagreements"])
        dropped.update(d["dropped"])
        live_ms += d["live_ms"]
        candidate_ms += d["candidate_ms"]
    compared, differenced = total["compared"], total["differenced"]
    return {
        "compared": compared, "errors": total["errors"], "dropped": dict(dropped),
        "top1_agreement": total["agreed"] / compared if compared else None,
        "top5_overlap": total["top5_overlap"] / total["top5_compared"] if total["top5_compared"] else None,
        "mean_probability_difference": total["difference_sum"] / differenced if differenced else None,
        "max_probability_difference": max(d["difference_max"] for d in dumps) if differenced else None,
        "disagreements": [{"live": pair.partition(PAIR)[0], "candidate": pair.partition(PAIR)[2], "count": n}
                          for pair, n in disagreements.most_common(TOP_DISAGREEMENTS)],
        "live_forward_ms": _latency(live_ms), "candidate_forward_ms": _latency(candidate_ms),
    }


class Traffic:
    """One version's requests in this worker since it took its current role."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = self.failures = 0
        self.latencies_ms: collections.deque[float] = collections.deque(maxlen=SAMPLES)

    def record(self, seconds: Sequence[float], failed: bool) -> None:
        """Answered requests (one, or an event loop's of a turn): how long the engine held each, and whether the
        model failed them."""
        with self._lock:
            self.requests += len(seconds)
            self.failures += failed * len(seconds)
            self.latencies_ms.extend([each * 1000 for each in seconds])

    def dump(self) -> dict[str, Any]:
        """This worker's figures, in a form ``merge_traffic`` sums."""
        with self._lock:
            return {"requests": self.requests, "failures": self.failures, "latencies_ms": list(self.latencies_ms)}


def merge_traffic(dumps: list[dict[str, Any]]) -> dict[str, Any]:
    """One version's requests over every worker's dump."""
    requests = sum(d["requests"] for d in dumps)
    failures = sum(d["failures"] for d in dumps)
    latencies = [ms for d in dumps for ms in d["latencies_ms"]]
    return {"requests": requests, "failures": failures, "error_ratio": failures / requests if requests else None,
            **(_latency(latencies) or {"p50": None, "p99": None})}


def _latency(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"p50": round(statistics.median(values), 3), "p99": round(percentile(values, 0.99) or 0.0, 3)}


class Evidence:
    """This worker's comparisons (by model, candidate, live version) and traffic (by model and version)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._comparisons: dict[tuple[str, str, str], Comparison] = {}
        self._traffic: dict[tuple[str, str], Traffic] = {}

    def comparison(self, model: str, candidate: str, live: str) -> Comparison:
        """The comparison of ``candidate`` against ``live`` (made on first use)."""
        key = (model, candidate, live)
        with self._lock:
            if key not in self._comparisons:
                self._comparisons[key] = Comparison(*key)
            return self._comparisons[key]

    def traffic(self, model: str, version: str) -> Traffic:
        """``version``'s traffic since its role last changed (made on first use)."""
        with self._lock:
            traffic = self._traffic.get((model, version))
            if traffic is None:  # not made on every call: each request of the version asks for it
                traffic = self._traffic[model, version] = Traffic()
            return traffic

    def restart(self, model: str, keep: set[tuple[str, str]], versions: set[str]) -> None:
        """A rollout changed: keep the comparisons in ``keep`` ((candidate, live) pairs) and start every other
        count of ``model`` again; ``versions``' traffic starts again (their role changed)."""
        with self._lock:
            self._end({k: c for k, c in self._comparisons.items() if k[0] != model or k[1:] in keep})
            for version in versions:
                self._traffic[(model, version)] = Traffic()

    def keep_only(self, model: str, versions: set[str]) -> None:
        """``model``'s traffic of the ``versions`` it serves kept, that of versions it no longer serves ended (a
        previous default a load call dropped: /v1/models listed its old counts for ever)."""
        with self._lock:
            self._traffic = {k: t for k, t in self._traffic.items() if k[0] != model or k[1] in versions}

    def forget(self, model: str) -> None:
        """``model`` is no longer served here (unloaded, or gone from the repository): its comparisons and traffic
        end, so a later load of it starts with none (requests in flight record into what they took, now unread)."""
        with self._lock:
            self._end({k: c for k, c in self._comparisons.items() if k[0] != model})
            self._traffic = {k: t for k, t in self._traffic.items() if k[0] != model}

    def _end(self, kept: dict[tuple[str, str, str], Comparison]) -> None:
        """Under the lock: the comparisons not ``kept`` ended (the shadow work still queued for them is dropped)."""
        for key, comparison in self._comparisons.items():
            if key not in kept:
                comparison.ended = True
        self._comparisons = kept

    def dump(self) -> dict[str, Any]:
        """Everything, for this worker's report."""
        with self._lock:
            comparisons, traffic = list(self._comparisons.values()), dict(self._traffic)
        return {"comparisons": [c.dump() for c in comparisons],
                "traffic": [{"model": m, "version": v, **t.dump()} for (m, v), t in traffic.items()]}


def merged(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Every worker's evidence summed: {"comparisons": {(model, candidate, live): summary}, "traffic": {(model,
    version): summary}}."""
    comparisons: dict[tuple[str, str, str], list[dict[str, Any]]] = collections.defaultdict(list)
    traffic: dict[tuple[str, str], list[dict[str, Any]]] = collections.defaultdict(list)
    for report in reports:
        evidence = report.get("evidence") or {}
        for dump in evidence.get("comparisons", []):
            comparisons[(dump["model"], dump["candidate"], dump["live"])].append(dump)
        for dump in evidence.get("traffic", []):
            traffic[(dump["model"], dump["version"])].append(dump)
    return {"comparisons": {k: merge_comparisons(v) for k, v in comparisons.items()},
            "traffic": {k: merge_traffic(v) for k, v in traffic.items()}}


def traffic_p99_ms(reports: list[dict[str, Any]], name: str, version: str) -> float | None:
    """``version`` of ``name``'s p99 over every worker's traffic since its role changed (None: no requests yet)."""
    return merged(reports)["traffic"].get((name, version), {}).get("p99")
