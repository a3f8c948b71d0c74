"""The service and its stage runner: readiness, routing to a model version, arrivals, decoding, the deadline and
the queue.

Protocols call ``Service.run`` and nothing else of the engine's request path: they say how to read a request
(a ``Job``) and shape the answer from what comes back (``Served``); the order of the stages lives here only.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Sequence

import torch

from app.config import Settings
from app.engine.arrivals import InFlight
from app.engine.batch_types import (
    BatcherClosed,
    BatchResult,
    DeadlineExpired,
    DeadlineTooShort,
    QueueFull,
)
from app.engine.batcher import Batcher
from app.engine.decode import DecodeLimits, image_to_tensor
from app.engine.device_decode import Encoded, check_header
from app.engine.jobs import NOT_READY_RETRY_S, Job, P, Served, service_error
from app.engine.loaded_version import LoadedVersion
from app.engine.predictor import Predictor
from app.engine.reconciler import Reconciler
from app.engine.sources import GivenSource, Source
from app.engine.tensor_decode import image_to_tensor_path
from app.engine.tuning import decode_path
from app.errors import (
    BadRequest,
    ClientGone,
    DeadlineExceeded,
    InferenceFailed,
    NotReady,
    ServiceError,
    check_image_count,
    retry_after_header,
)
from app.metrics import BATCHER_EVENTS, READY, STAGE_CPU_SECONDS, STAGE_SECONDS

log = logging.getLogger(__name__)

CLIENT_CHECK_S = 0.05  # how often a waiting request looks whether its client is still connected


class Service:
    """The served models behind one stage runner, with liveness, readiness and draining.

    ``build`` loads synchronously; ``start`` answers at once and loads in the background, so a worker that is
    still loading its models says so (503 with Retry-After) instead of leaving connections in the listen backlog.
    """

    def __init__(self, settings: Settings, source: Source) -> None:
        self.settings = settings
        self.limits = DecodeLimits.from_settings(settings)
        self.in_flight = InFlight()  # requests inside run(), from readiness to answer
        self.reconciler = Reconciler(settings, source, on_change=self._update_ready_gauge)
        self._started = threading.Event()
        self._loader: threading.Thread | None = None
        self._draining = threading.Event()

    @classmethod
    def build(cls, settings: Settings, source: Source | Predictor) -> "Service":
        """A service whose models are ready when this returns."""
        service = cls(settings, GivenSource(source) if isinstance(source, Predictor) else source)
        service.reconciler.boot()
        service._started.set()
        service._update_ready_gauge()
        return service

    @classmethod
    def start(cls, settings: Settings, source: Source, on_error: Callable[[BaseException], None]) -> "Service":
        """A service that answers now and loads its models on a thread; ``on_error`` gets a failure."""
        service = cls(settings, source)

        def run() -> None:
            try:
                service.reconciler.boot()
                service._started.set()
                service._update_ready_gauge()
                log.info("ready to serve")
            except BaseException as exc:  # noqa: BLE001 - handed to on_error, which decides the worker's fate
                on_error(exc)

        service._loader = threading.Thread(target=run, name="model-loader", daemon=True)
        service._loader.start()
        return service

    def _update_ready_gauge(self) -> None:
        READY.set(int(self.ready))

    def route(self, name: str | None = None, version: str | None = None) -> LoadedVersion:
        """The loaded version a request for ``name`` and ``version`` would get now (NotReady while loading,
        NotFound)."""
        self.require_loaded()
        return self.reconciler.routes.find(name, version)

    @property
    def predictor(self) -> Predictor:
        """The only (or named-less default) model's predictor; NotReady (503) while it loads."""
        return self.route().predictor

    @property
    def batcher(self) -> Batcher[torch.Tensor, torch.Tensor]:
        """That model's batcher."""
        return self.route().batcher

    @property
    def loaded(self) -> bool:
        """The first models are loaded, warmed up and passed their canaries, and one serves at least."""
        return self._started.is_set() and bool(self.reconciler.routes.all_versions())

    @property
    def alive(self) -> bool:
        """Liveness: every serving version's batcher thread runs, or the models are still loading."""
        if self._started.is_set():
            return all(m.batcher.is_alive() for m in self.reconciler.routes.all_versions())
        return self._loader is not None and self._loader.is_alive()

    @property
    def ready(self) -> bool:
        """Models loaded, warmed up, canaries passed, batchers alive and not draining."""
        return self.loaded and not self._draining.is_set() and self.alive

    @property
    def draining(self) -> bool:
        """True once shutdown has begun."""
        return self._draining.is_set()

    def begin_drain(self) -> None:
        """Turn readiness off so load balancers stop sending; accepted work still completes."""
        self._draining.set()
        READY.set(0)

    def shutdown(self, timeout: float | None = None) -> None:
        """Drain: refuse new work, finish what is queued, stop the worker threads."""
        self.begin_drain()
        self.reconciler.close()
        for model in self.reconciler.routes.all_versions():
            model.batcher.stop(timeout)

    def wait_drained(self, min_s: float, max_s: float) -> bool:
        """After begin_drain: wait ``min_s``, then until no request is inside ``run``, ``max_s`` at most.

        The server keeps its listener open meanwhile, answering new requests 503 with Connection: close, so nothing
        waits unanswered in the listen backlog. Returns whether every request finished in time.
        """
        started = time.monotonic()
        time.sleep(min(min_s, max_s))
        while self.in_flight.count() and time.monotonic() - started < max_s:
            time.sleep(0.05)
        return self.in_flight.count() == 0

    def wait_loaded(self, timeout_s: float) -> None:
        """Wait for the first models to load (``timeout_s`` at most), then as ``require_loaded``: a repository call
        reaching a worker that is still starting waits for it instead of failing."""
        self._started.wait(timeout_s)
        self.require_loaded()

    def require_loaded(self) -> None:
        """NotReady (503 with Retry-After) while the first models load."""
        if not self._started.is_set():
            raise NotReady("the model is still loading", headers=retry_after_header(NOT_READY_RETRY_S))

    def require_ready(self) -> None:
        """Raise NotReady (503 with Retry-After) unless new work can be accepted."""
        if self.draining:  # the client should go elsewhere: this connection will not serve it again
            raise NotReady("the server is shutting down",
                           headers={**retry_after_header(NOT_READY_RETRY_S), "Connection": "close"})
        self.require_loaded()
        if not self.alive:  # no model at all is the router's to say: 503 without a name, 404 with one
            raise NotReady("the model is not ready", headers=retry_after_header(NOT_READY_RETRY_S))

    def run(self, read: Callable[[LoadedVersion], Job[P]], client_gone: Callable[[], bool] | None = None,
            name: str | None = None, version: str | None = None) -> Served[P]:
        """The stages of one request: readiness, routing to a model version, ``read`` (the protocol parses its
        body for that model), decode, queue, wait.

        The request keeps the version it was routed to until its answer, even if a newer one takes over meanwhile.
        While ``read`` and decoding run the request counts as on its way, so a forming batch may wait for it; it
        stops counting just before its images are queued. ``client_gone`` (from the web layer) is asked while the
        images wait: once the client has hung up, those still queued are dropped unrun. Raises a ServiceError for
        every refusal.
        """
        with self.in_flight.inside():
            self.require_ready()
            with self.reconciler.routes.acquire(name, version) as model, model.arrivals.arriving() as arrived:
                job = read(model)
                started_ns = time.time_ns()
                tensors, decode_s = self._inputs(job, model)
                arrived()
                results = self._infer(model, tensors, job.timeout_s, client_gone, job.names)
        return Served(job.parsed, results, decode_s, started_ns, model)

    def preprocess(self, data: bytes, model: LoadedVersion | None = None) -> torch.Tensor | Encoded:
        """One image's bytes -> ``model``'s input (default: the only model's), with the service's limits, on the
        decode path the settings choose; on the device path only its header is checked here (``Encoded``)."""
        predictor = (model or self.route()).predictor
        path = decode_path(self.settings.decode_path, predictor.device)
        if path == "device":
            return check_header(data, self.limits)
        if path == "tensor":
            return image_to_tensor_path(data, predictor.tensor_transform, self.limits)
        return image_to_tensor(data, predictor.transform, self.limits)

    @staticmethod
    def _named(exc: ServiceError, index: int, names: Sequence[str | None]) -> ServiceError:
        """``exc`` saying which image it is about, so a client knows which of its images to fix."""
        name = names[index] if index < len(names) else None
        exc.message = f"image {index}" + (f" ({name})" if name else "") + f": {exc.message}"
        exc.args = (exc.message,)
        exc.details = {"image": index, "filename": name, **(exc.details if isinstance(exc.details, dict) else {})}
        return exc

    def _preprocess_one(self, job: Job[P], index: int, model: LoadedVersion) -> torch.Tensor | Encoded:
        try:
            return self.preprocess(job.images[index], model)
        except ServiceError as exc:
            raise self._named(exc, index, job.names) from None

    def _inputs(self, job: Job[P], model: LoadedVersion) -> tuple[list[torch.Tensor | Encoded], float]:
        if bool(job.images) == bool(job.tensors):
            raise BadRequest("the request holds no images" if not job.images else "send images or tensors, not both")
        check_image_count(len(job.images) or len(job.tensors), self.settings.max_images)
        if job.tensors:
            return list(job.tensors), 0.0
        started, cpu_started = time.perf_counter(), time.thread_time()
        tensors = [self._preprocess_one(job, i, model) for i in range(len(job.images))]
        decode_s = time.perf_counter() - started
        STAGE_SECONDS.labels("decode").observe(decode_s)
        STAGE_CPU_SECONDS.labels("decode").inc(time.thread_time() - cpu_started)
        return tensors, decode_s

    def _result(self, future: "Future[BatchResult[torch.Tensor]]", index: int,
                names: Sequence[str | None]) -> BatchResult[torch.Tensor]:
        try:
            return future.result()
        except ServiceError as exc:  # an image the device path could not decode in its batch
            raise self._named(exc, index, names) from None

    def _infer(self, model: LoadedVersion, tensors: list[torch.Tensor | Encoded], timeout_s: float,
               client_gone: Callable[[], bool] | None = None,
               names: Sequence[str | None] = ()) -> list[BatchResult[torch.Tensor]]:
        """Queue the images (all or none) and wait for their rows until the deadline or the client leaves."""
        deadline = time.monotonic() + timeout_s
        try:
            futures = model.batcher.submit_many(tensors, deadline=deadline)
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
            return [self._result(f, i, names) for i, f in enumerate(futures)]
        except (FutureTimeout, DeadlineExpired):
            for f in futures:
                f.cancel()  # still queued ones are dropped before they cost a forward pass
            raise DeadlineExceeded(f"no inference result within the request's {timeout_s:g}s deadline") from None
        except ServiceError:
            raise
        except Exception as exc:
            raise InferenceFailed(f"the model failed on this request's images: {type(exc).__name__}") from exc
