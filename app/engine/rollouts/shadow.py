"""Shadow traffic: a candidate version runs the images a live request was answered with, off the response path,
and the two answers are compared (app/engine/rollouts/evidence.Comparison).

``offer`` hands the work to the live version's batcher as background work
(app/engine/batching/batcher.submit_background), after the live answer is ready: it is taken only when no request
waits and none is on its way, and is dropped (counted, by reason) when live work is queued or the candidate's own
queue is busy (``busy``), shadow work waits already and this would take it past ``SHADOW_QUEUE_SIZE`` images
(``full``), it waited ``SHADOW_MAX_AGE_S`` (``stale``), its pixels are of another size than the candidate takes
(``incompatible``), or a version stops or the rollout changes (``retired``). The live thread then hands the images to
the candidate's batcher (its own thread, where its warm-up tuned the kernels; with its own decoder when its
preprocessing differs), two batches of its cap at most at a time (``_Handover``), as low-priority items (behind every
request the candidate answers itself, the ones queued after them included), and goes on: a live request arriving
meanwhile never waits for the shadow's forward pass, which runs beside it on another core (waiting for it, as a first
version did, slowed a lone client's every request; docs/performance.md: Figures behind the code's choices).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from app.engine.batching.batcher import Batcher
from app.engine.batching.types import (BackgroundJob, BatcherClosed, BatcherError, BatchResult, BatchRun,
                                      DeadlineExpired, DeadlineTooShort)
from app.engine.decoding.decoders import Prepared
from app.engine.decoding.device import Encoded
from app.engine.rollouts.evidence import Comparison
from app.engine.loaded.version import LoadedVersion
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
    images: Sequence[bytes]  # encoded (its own: ``_owned``), when the candidate decodes them itself
    prepared: Sequence[Prepared]  # the live version's, when the candidate takes them as they are
    deadline: float
    live: LoadedVersion  # the version that answered (whose batcher runs this job)

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
        """Hand the group's images to the candidate's batcher (never run on this thread), a piece at a time
        (``_Handover``), and record each job's comparison when the candidate answers; the live batcher goes on
        meanwhile."""
        ready = [(job, inputs) for job in jobs if isinstance(job, ShadowJob) and (inputs := job._inputs())]
        if ready:
            _Handover(self.live.batcher, self.candidate.batcher, ready).next_piece()

    def _compare(self, futures: "list[Future[BatchResult[np.ndarray]]]") -> None:
        if any(f.cancelled() or isinstance(f.exception(), DeadlineExpired) for f in futures):
            return self.drop("stale")  # not run within SHADOW_MAX_AGE_S
        if any(f.exception() is not None for f in futures):
            return self.comparison.error(self.size)
        results = [f.result() for f in futures]
        classes = self.candidate.predictor.num_classes  # the probabilities: an embedding may follow them
        rows = torch.from_numpy(np.stack([r.value[:classes] for r in results]))
        self.comparison.record(self.live_rows, self.live_labels, rows, self.candidate.predictor.labels,
                               self.live_ms, [r.run_s * 1000 / r.batch_size for r in results])


def _when_all_done(futures: "list[Future[BatchResult[np.ndarray]]]",
                   then: Callable[["list[Future[BatchResult[np.ndarray]]]"], None]) -> None:
    """Call ``then(futures)`` once every future is done (on the thread that finished the last one)."""
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            try:
                then(futures)
            except Exception:  # noqa: BLE001 - the candidate's thread must not fail on a comparison
                log.exception("a shadow comparison failed")

    for future in futures:
        future.add_done_callback(one_done)


class _Handover:
    """A group of shadow jobs' images handed to the candidate's batcher in pieces of two batches of its cap at most,
    the next once the candidate answered the one before, as low-priority items: a request the candidate answers
    itself (a canary's, one naming it, or any once it is promoted) waits for no shadow work queued, only for a shadow
    batch already running, and a shadowed request of any size is compared.
    A piece goes only while the candidate's queue holds two batches at most with it and, after the first, no live
    work waits on the live version's batcher (the first was taken when none did); else, or once the candidate stops,
    the rollout changes (a promotion) or the group's time is up, the jobs not wholly handed over are dropped for that
    (``busy``, ``retired``, ``stale``). A job's comparison is made once all of its images are answered."""

    def __init__(self, live: Batcher, candidate: Batcher, ready: list[tuple[ShadowJob, list[Prepared]]]) -> None:
        self.live, self.candidate, self.ready = live, candidate, ready
        self.items = [item for _, inputs in ready for item in inputs]
        self.ends = list(itertools.accumulate(len(inputs) for _, inputs in ready))  # where each job's images end
        self.deadline = min(job.deadline for job, _ in ready)
        self.futures: list[Future[BatchResult[np.ndarray]]] = []  # of the images handed over so far, in order
        self.whole = 0  # the jobs whose images were all handed over (their comparisons wait for the candidate)

    def next_piece(self, _: object = None) -> None:
        """The next piece handed over, or the jobs left dropped; the piece after it once the candidate answered
        this one (on its thread)."""
        batcher, start = self.candidate, len(self.futures)
        size = 2 * batcher.current_max_batch_size
        piece = self.items[start:start + size]
        if self.ready[self.whole][0].comparison.ended:  # the rollout changed (a promotion): nobody reads it now
            return self._drop("retired")
        if batcher.depth + len(piece) > size or (start and self.live.depth):
            return self._drop("busy")
        try:
            futures = batcher.submit_many(piece, deadline=self.deadline, low_priority=True)
        except BatcherClosed:
            return self._drop("retired")
        except DeadlineExpired:
            return self._drop("stale")
        except DeadlineTooShort as short:  # past SHADOW_MAX_AGE_S (a passed deadline, once batches ran), or near it
            return self._drop("stale" if short.left_s <= 0 else "busy")
        except BatcherError:  # its queue full, or the backlog ahead past the deadline
            return self._drop("busy")
        self.futures += futures
        while self.whole < len(self.ready) and self.ends[self.whole] <= len(self.futures):
            first = self.ends[self.whole - 1] if self.whole else 0
            _when_all_done(self.futures[first:self.ends[self.whole]], self.ready[self.whole][0]._compare)
            self.whole += 1
        if len(self.futures) < len(self.items):
            _when_all_done(futures, self.next_piece)

    def _drop(self, reason: str) -> None:
        for job, _ in self.ready[self.whole:]:
            job.drop(reason)


def _owned(item: Any) -> Any:
    """An image the job keeps (encoded, or waiting for its device decode) as its own bytes when the engine's loop
    link lent it (a view of the worker's arena, app/link/arena.py): a job waits behind the live version's work, and
    the worker's ring is held from its place on until it lets go; anything else as it is."""
    if isinstance(item, memoryview):
        return bytes(item)
    if isinstance(item, Encoded) and isinstance(item.data, memoryview):
        return dataclasses.replace(item, data=bytes(item.data))
    return item


def offer(live: LoadedVersion, candidate: LoadedVersion, comparison: Comparison, images: Sequence[bytes],
          tensors: Sequence[torch.Tensor], prepared: Sequence[Prepared], values: Sequence[np.ndarray],
          runs: Sequence[BatchRun], max_age_s: float, queue_limit: int) -> None:
    """Queue the shadow comparison of one answered request (its rows, ``values``, and the batches they ran in)
    behind the live version's work (never raises)."""
    try:
        classes = live.predictor.num_classes  # the probabilities: an embedding may follow them
        rows = torch.from_numpy(np.stack(values)[:, :classes])
        live_ms = [run.run_s * 1000 / run.batch_size for run in runs for _ in range(run.rows)]
        job = ShadowJob(candidate, comparison, live.predictor.labels, rows, live_ms, (), (),
                        time.monotonic() + max_age_s, live)
        if tensors:
            if tuple(tensors[0].shape) != tuple(candidate.predictor.manifest.preprocess.input_shape):
                return job.drop("incompatible")
            job.prepared = list(tensors)
        elif prepared and reuses_prepared(live, candidate):
            job.prepared = [_owned(item) for item in prepared]
        else:
            job.images = [_owned(data) for data in images]
        refused = live.batcher.submit_background(job, queue_limit)
        if refused is not None:
            job.drop(refused)
    except Exception:  # noqa: BLE001 - the live answer is ready: shadow trouble is logged, never the client's
        log.exception("shadow work for %s version %s could not be queued", candidate.name, candidate.version)
