"""Shadow traffic: a candidate version runs the images a live request was answered with, off the response path,
and the two answers are compared (app/engine/evidence.Comparison).

``offer`` hands the work to the live version's batcher as background work (app/engine/batcher.submit_background),
after the live answer is ready: it runs on that batcher's thread only when no request waits and none is on its way,
so shadow work never runs beside the live version's batches, and is dropped (counted) when live work is queued, the
shadow queue is full, or it waited ``SHADOW_MAX_AGE_S``. The candidate runs it through its own batcher (its own
thread, where its warm-up tuned the kernels) and, when its preprocessing differs from the live version's, its own
decoder; the live thread waits for it, so the next live batch waits for one shadow batch at most.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Sequence

import torch

from app.engine.batch_types import BackgroundJob, BatcherClosed, BatchResult, BatcherError
from app.engine.decoders import Prepared
from app.engine.evidence import Comparison
from app.engine.loaded_version import LoadedVersion
from app.errors import ServiceError

log = logging.getLogger(__name__)


def reuses_prepared(live: LoadedVersion, candidate: LoadedVersion) -> bool:
    """Whether the candidate takes the live version's prepared images as they are: the same decode path and, where
    the request thread preprocesses, the same preprocessing."""
    if live.decoder.path != candidate.decoder.path:
        return False
    same_preprocessing = live.predictor.manifest.preprocess == candidate.predictor.manifest.preprocess
    return live.decoder.path == "device" or same_preprocessing


@dataclass(eq=False)
class ShadowJob:
    """One live request's images for the candidate, and the live answer to compare with."""

    candidate: LoadedVersion
    comparison: Comparison
    live_labels: list[str]
    live_rows: torch.Tensor  # (N, classes) probabilities the live version answered
    live_ms: list[float]  # the live forward time per image
    images: Sequence[bytes]  # encoded, when the candidate decodes them itself
    prepared: Sequence[Prepared]  # the live version's, when the candidate takes them as they are
    deadline: float

    @property
    def size(self) -> int:
        return len(self.live_rows)

    def group_key(self) -> object:
        return id(self.candidate)

    def drop(self, reason: str) -> None:
        self.comparison.drop(reason, self.size)

    def _inputs(self) -> list[Prepared] | None:
        if self.prepared:
            return list(self.prepared)
        try:
            return [self.candidate.decoder.prepare(data) for data in self.images]
        except ServiceError:  # the live version read these images; the candidate cannot
            self.comparison.error(self.size)
            return None

    def run_group(self, jobs: list[BackgroundJob]) -> None:
        """Run the group's images on the candidate in one submission and record each job's comparison."""
        ready = [(job, inputs) for job in jobs if isinstance(job, ShadowJob) and (inputs := job._inputs())]
        if not ready:
            return
        items = [item for _, inputs in ready for item in inputs]
        deadline = min(job.deadline for job, _ in ready)
        try:
            futures = self.candidate.batcher.submit_many(items, deadline=deadline)
        except BatcherClosed:
            return _drop_all(ready, "retired")
        except BatcherError:  # the candidate's own queue is busy (it may take canary traffic)
            return _drop_all(ready, "busy")
        wait(futures, timeout=max(0.0, deadline - time.monotonic()))
        position = 0
        for job, inputs in ready:
            job._compare(futures[position:position + len(inputs)])
            position += len(inputs)

    def _compare(self, futures: "list[Future[BatchResult[torch.Tensor]]]") -> None:
        if not all(f.done() for f in futures) or any(f.cancelled() for f in futures):
            for future in futures:
                future.cancel()  # still queued past the deadline: nobody waits for it
            return self.drop("stale")
        if any(f.exception() is not None for f in futures):
            return self.comparison.error(self.size)
        results = [f.result() for f in futures]
        rows = torch.stack([r.value for r in results]).float().cpu()
        self.comparison.record(self.live_rows, self.live_labels, rows, self.candidate.predictor.labels,
                               self.live_ms, [r.run_s * 1000 / r.batch_size for r in results])


def _drop_all(ready: list[tuple[ShadowJob, list[Prepared]]], reason: str) -> None:
    for job, _ in ready:
        job.drop(reason)


def offer(live: LoadedVersion, candidate: LoadedVersion, comparison: Comparison, images: Sequence[bytes],
          tensors: Sequence[torch.Tensor], prepared: Sequence[Prepared], results: Sequence[BatchResult[torch.Tensor]],
          max_age_s: float, queue_limit: int) -> None:
    """Queue the shadow comparison of one answered request behind the live version's work (never raises)."""
    try:
        rows = torch.stack([r.value for r in results]).float().cpu()
        job = ShadowJob(candidate, comparison, live.predictor.labels, rows,
                        [r.run_s * 1000 / r.batch_size for r in results], images, (), time.monotonic() + max_age_s)
        if tensors:
            if tuple(tensors[0].shape) != tuple(candidate.predictor.manifest.preprocess.input_shape):
                return job.drop("incompatible")
            job.prepared = list(tensors)
        elif reuses_prepared(live, candidate):
            job.prepared = list(prepared)
        refused = live.batcher.submit_background(job, queue_limit)
        if refused is not None:
            job.drop(refused)
    except Exception:  # noqa: BLE001 - the live answer is ready: shadow trouble is logged, never the client's
        log.exception("shadow work for %s version %s could not be queued", candidate.name, candidate.version)
