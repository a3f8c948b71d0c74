"""One admitted request's inference (``Call``): its images checked and counted, decoded on the way its version's
decoder says, queued, and waited for until the deadline or the client hangs up; what comes back (``Served``); and
what the batcher's refusals mean to a client.

A protocol gets a ``Call`` from ``Service.admit`` (readiness, then the version the request keeps to its answer),
parses its body with ``call.model`` and calls ``call.infer``; the stages run in this order and nowhere else.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import Callable, Sequence

import numpy as np
import torch

from app.engine.batching.types import (
    BatcherClosed,
    BatchResult,
    DeadlineExpired,
    DeadlineTooShort,
    DeadlineUnreachable,
    QueueFull,
)
from app.engine.contract import CLIENT_CHECK_S, NOT_READY_RETRY_S, Served
from app.engine.decoding.decoders import Prepared
from app.engine.loaded.version import LoadedVersion
from app.errors import (
    BadRequest,
    ClientGone,
    DeadlineExceeded,
    InferenceFailed,
    NotReady,
    Overloaded,
    ServiceError,
    ShortDeadline,
    check_image_count,
    retry_after_header,
)
from app.metrics import BATCHER_EVENTS, STAGE_CPU_SECONDS, STAGE_SECONDS


ShadowOffer = Callable[[Sequence[bytes], Sequence[torch.Tensor], Sequence[Prepared],
                        Sequence[BatchResult[torch.Tensor]]], None]


class Call:
    """A request admitted and routed to a loaded version; ``model`` is what the protocol parses and shapes with
    (its name, version, classes, input shape), ``infer`` runs its images. While the call is open the request counts
    as on its way to the version's next batch (``arrived`` ends that just before its images are queued). ``shadow``
    (a rollout's shadow share) gets the images and the answer once it is ready, off the response path."""

    def __init__(self, version: LoadedVersion, arrived: Callable[[], None], max_images: int,
                 shadow: ShadowOffer | None = None) -> None:
        self._version, self._arrived, self._max_images, self._shadow = version, arrived, max_images, shadow
        self.model = version.signature

    def infer(self, images: Sequence[bytes] = (), tensors: Sequence[np.ndarray | torch.Tensor] = (), *,
              timeout_s: float, names: Sequence[str | None] = (),
              client_gone: Callable[[], bool] | None = None) -> Served:
        """Encoded ``images`` (decoded here) or preprocessed ``tensors`` (float32 (C, H, W) arrays or tensors), with
        the request's deadline (counted from
        queueing) and, where the request gave them, the images' file names (errors say which image). Once
        ``client_gone`` says the client hung up, the images still queued are dropped unrun. Raises a ServiceError
        for every refusal."""
        if bool(images) == bool(tensors):
            raise BadRequest("the request holds no images" if not images else "send images or tensors, not both")
        count = len(images) or len(tensors)
        check_image_count(count, self._max_images)
        check_room(self._version, count, timeout_s)  # before any decode: what the queue would refuse costs nothing
        started_ns = time.time_ns()
        pixels = [torch.as_tensor(t) for t in tensors]
        prepared, decode_s = self._prepare(images, names) if images else (list(pixels), 0.0)
        self._arrived()
        results = self._run(prepared, timeout_s, client_gone, names)
        if self._shadow is not None:
            self._shadow(images, pixels, prepared, results)
        rows = [replace(r, value=r.value.float().cpu().numpy()) for r in results]
        return Served(rows, self.model.name, self.model.version, self.model.labels, decode_s, started_ns)

    def _prepare(self, images: Sequence[bytes], names: Sequence[str | None]) -> tuple[list[Prepared], float]:
        started, cpu_started = time.perf_counter(), time.thread_time()
        prepared = []
        for index, data in enumerate(images):
            try:
                prepared.append(self._version.decoder.prepare(data))
            except ServiceError as exc:
                raise _named(exc, index, names) from None
        decode_s = time.perf_counter() - started
        STAGE_SECONDS.labels("decode").observe(decode_s)
        STAGE_CPU_SECONDS.labels("decode").inc(time.thread_time() - cpu_started)
        return prepared, decode_s

    def _run(self, prepared: list[Prepared], timeout_s: float, client_gone: Callable[[], bool] | None,
             names: Sequence[str | None]) -> list[BatchResult[torch.Tensor]]:
        """Queue the images (all or none) and wait for their rows until the deadline or the client leaves."""
        deadline = time.monotonic() + timeout_s
        try:
            futures = self._version.batcher.submit_many(prepared, deadline=deadline)
        except (QueueFull, BatcherClosed, DeadlineTooShort) as exc:
            raise service_error(exc) from None
        try:
            while not all(f.done() for f in futures):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise FutureTimeout()
                # Without a client to watch, one wait to the deadline; else look every CLIENT_CHECK_S.
                wait(futures, timeout=remaining if client_gone is None else min(remaining, CLIENT_CHECK_S))
                if client_gone is not None and client_gone():
                    dropped = sum(f.cancel() for f in futures)  # the queued ones cost no forward pass
                    BATCHER_EVENTS.labels("client_gone").inc(dropped)
                    raise ClientGone(f"the client closed the connection; {dropped} queued images dropped")
            return [_result(f, i, names) for i, f in enumerate(futures)]
        except (FutureTimeout, DeadlineExpired):
            for f in futures:
                f.cancel()  # still queued ones are dropped before they cost a forward pass
            raise DeadlineExceeded(f"no inference result within the request's {timeout_s:g}s deadline") from None
        except ServiceError:
            raise
        except Exception as exc:
            raise InferenceFailed(f"the model failed on this request's images: {type(exc).__name__}") from exc


def _named(exc: ServiceError, index: int, names: Sequence[str | None]) -> ServiceError:
    """``exc`` saying which image it is about, so a client knows which of its images to fix."""
    name = names[index] if index < len(names) else None
    exc.message = f"image {index}" + (f" ({name})" if name else "") + f": {exc.message}"
    exc.args = (exc.message,)
    exc.details = {"image": index, "filename": name, **(exc.details if isinstance(exc.details, dict) else {})}
    return exc


def _result(future: "Future[BatchResult[torch.Tensor]]", index: int,
            names: Sequence[str | None]) -> BatchResult[torch.Tensor]:
    try:
        return future.result()
    except ServiceError as exc:  # an image the device path could not decode in its batch
        raise _named(exc, index, names) from None


def check_room(version: LoadedVersion, count: int, timeout_s: float) -> None:
    """Overloaded (429 with Retry-After), ShortDeadline or NotReady unless ``version``'s queue can take ``count``
    images to be answered within ``timeout_s`` from now."""
    try:
        version.batcher.check_room(count, time.monotonic() + timeout_s)
    except (QueueFull, BatcherClosed, DeadlineTooShort) as exc:
        raise service_error(exc) from None


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
