"""What a protocol hands the stage runner (``Job``), what it gets back (``Served``), and what the batcher's
refusals mean to a client."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Sequence, TypeVar

import torch

from app.engine.batch_types import BatchResult, DeadlineTooShort, DeadlineUnreachable, QueueFull
from app.errors import NotReady, Overloaded, ServiceError, ShortDeadline, retry_after_header

if TYPE_CHECKING:
    from app.engine.loaded_version import LoadedVersion

P = TypeVar("P")
NOT_READY_RETRY_S = 5  # Retry-After of every 503: loading, draining, a stopped batcher


@dataclass(frozen=True)
class Job(Generic[P]):
    """What a protocol read from one request: its inputs, its deadline, and what it needs to shape the answer."""

    parsed: P  # handed back untouched in Served
    timeout_s: float  # the request's deadline, counted from the moment its images are queued
    images: Sequence[bytes] = ()  # encoded image files: decoded and preprocessed by the runner
    tensors: Sequence[torch.Tensor] = ()  # inputs the client already preprocessed
    names: Sequence[str | None] = ()  # the images' file names where the request gave them (multipart)


@dataclass(frozen=True)
class Served(Generic[P]):
    """A job's answer: one result per input, in order, and how long decoding took."""

    parsed: P
    results: list[BatchResult[torch.Tensor]]
    decode_s: float
    started_ns: int = 0  # wall clock (time.time_ns) when decoding began: traces place the stages from it
    model: LoadedVersion | None = None  # the version that answered

    def probabilities(self) -> torch.Tensor:
        """(N, classes) softmax probabilities, one row per input."""
        return torch.stack([r.value for r in self.results]).float().cpu()


def service_error(exc: Exception) -> ServiceError:
    """What the batcher's own refusals mean to a client."""
    if isinstance(exc, DeadlineTooShort):
        return ShortDeadline(str(exc))
    if isinstance(exc, QueueFull):
        error = Overloaded(str(exc), headers=retry_after_header(exc.retry_after_s))
        if isinstance(exc, DeadlineUnreachable):
            error.code = "deadline_unreachable"
        return error
    # The batcher is closed: this worker is going away, so the client should reconnect elsewhere.
    return NotReady(str(exc), headers={**retry_after_header(NOT_READY_RETRY_S), "Connection": "close"})
