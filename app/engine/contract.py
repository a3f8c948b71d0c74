"""What crosses between the engine and the HTTP side: plain data only (numpy, no torch), so the protocols and the
web layer can run in processes that never import torch (an engine process of its own, app/engine/remote.py) and the
same types serve when the engine runs inside the worker.

- ``Signature``: what a protocol parses a request with (the answering version, its classes, its input shape).
- ``Served`` and ``Ranked``: a request's answer (probabilities, top-k) and its stage times (``stage_ms``).
- ``VersionInfo``: one loaded version's facts, as /v1/models and the V2 metadata show them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np

from app.engine.batching.types import BatchResult
from models.export.manifest import Manifest

NOT_READY_RETRY_S = 5  # Retry-After of every 503: loading, draining, a stopped batcher, an engine away


@dataclass(frozen=True)
class Signature:
    """What a protocol parses a request and shapes its answer with: the version that answers, its classes in output
    order, and the input a client may send preprocessed."""

    name: str
    version: str
    labels: list[str]
    input_shape: tuple[int, ...]  # (C, H, W) of one preprocessed image

    @property
    def num_classes(self) -> int:
        """How many classes the model tells apart (the width of its output)."""
        return len(self.labels)


class Ranked(NamedTuple):
    """One class of an image's top k: its index in the output, its label, its probability."""

    index: int
    label: str
    score: float


@dataclass(frozen=True)
class Served:
    """A request's answer: one result per input, in order (each a float32 row of probabilities), which version gave
    it, and how long decoding took."""

    results: list[BatchResult[np.ndarray]]
    model: str
    version: str
    labels: list[str]  # class names in output order
    decode_s: float
    started_ns: int = 0  # wall clock (time.time_ns) when decoding began: traces place the stages from it

    def probabilities(self) -> np.ndarray:
        """(N, classes) float32 softmax probabilities, one row per input."""
        return np.stack([r.value for r in self.results]).astype(np.float32, copy=False)

    def top_k(self, k: int) -> list[list[Ranked]]:
        """Each image's ``k`` most probable classes (at most every class), most probable first (ties: the lower
        index first)."""
        probabilities = self.probabilities()
        k = min(k, probabilities.shape[1])
        order = np.argsort(-probabilities, axis=1, kind="stable")[:, :k]
        return [[Ranked(int(i), self.labels[i], float(row[i])) for i in indices]
                for row, indices in zip(probabilities, order)]


def distinct_batches(results: Sequence[BatchResult[Any]]) -> list[BatchResult[Any]]:
    """One result per distinct batch the request's images ran in, in the order they first appear."""
    return list({r.batch_id: r for r in results}.values())


def stage_ms(results: Sequence[BatchResult[Any]]) -> tuple[float, float]:
    """(queue, inference) milliseconds of one request's images: the one definition the Server-Timing header and
    the access log both report.

    inference: the wall time the request's images spent in forward passes, the sum of its distinct batches'
    ``run_s`` (by ``batch_id``: images of one batch share its forward pass). A request's images are queued together
    and a batcher runs one batch at a time, so its batches never overlap and their durations add up; the largest
    alone would leave out every batch but one, and a sum over images would count a batch once per image.
    queue: from the images' queueing to the end of the request's last batch, less that inference: the time they
    waited behind other work (and for company) while none of the request's batches ran: decode + queue + inference
    then add up to the request's time from its first decode to the end of its last forward pass.
    """
    inference_s = sum(r.run_s for r in distinct_batches(results))
    done_s = max(r.queued_s + r.run_s for r in results)
    return max(0.0, done_s - inference_s) * 1000, inference_s * 1000


@dataclass(frozen=True)
class VersionInfo:
    """One loaded version's facts, as /v1/models and the V2 metadata show them."""

    manifest: Manifest
    weights_format: str
    device: str
    dtype: str
    warmed_batch_sizes: list[int]
    alive: bool  # its batcher's thread runs
    default: bool  # requests naming no version get it
    role: str | None  # live, canary, shadow or previous while a rollout is set
    memory_bytes: int
    device_memory_bytes: int | None
    monitoring: dict[str, Any]
    batch_cap: int  # the batch size cap measured at warm-up
    current_max_batch_size: int  # lower for a while after a CUDA out-of-memory split
    queue_depth: int
    profile: dict[int, float]  # forward images/s per batch size, at warm-up

    @property
    def name(self) -> str:
        """The model's name."""
        return self.manifest.name

    @property
    def version(self) -> str:
        """The version."""
        return self.manifest.version
