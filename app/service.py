"""The per-process service: settings, predictor, batcher and readiness, kept in ``app.extensions``."""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from app.batch_types import BatchResult, DeadlineExpired
from app.batcher import Batcher
from app.config import Settings
from app.decode import DecodeLimits, image_to_tensor
from app.errors import DeadlineExceeded, InferenceFailed, NotReady
from app.inference import OUT_OF_MEMORY_ERRORS, Predictor, choose_batch_cap
from app.metrics import MODEL_INFO, STAGE_CPU_SECONDS, STAGE_SECONDS, MetricsObserver

log = logging.getLogger(__name__)

EXTENSION_KEY = "visionserve"


class Arrivals:
    """Requests between their start and the moment their images are queued: what a batch could still wait for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def count(self) -> int:
        """Requests on their way to the queue now."""
        return self._count

    @contextlib.contextmanager
    def arriving(self) -> Iterator[Callable[[], None]]:
        """Count one request until it calls the yielded ``arrived`` (just before queueing) or leaves, whichever
        comes first (a request that fails to decode leaves without queueing)."""
        pending = [True]

        def arrived() -> None:
            with self._lock:
                if pending[0]:
                    pending[0] = False
                    self._count -= 1

        with self._lock:
            self._count += 1
        try:
            yield arrived
        finally:
            arrived()


def forward_threads(setting: int, device: torch.device, cores: int | None = None) -> int:
    """Intra-op threads for the forward pass (0: leave torch's default). See Settings.torch_threads."""
    if setting or device.type != "cpu":
        return setting
    return max(1, (cores or os.cpu_count() or 1) // 2)


def inline_batches(setting: bool, device: torch.device) -> bool:
    """Whether a lone request may run its batch on its own thread (Settings.inline_when_idle): on the CPU only.

    On CUDA every thread that runs a forward pass has its own cuDNN handles and tuned plans (see Batcher.start):
    measured on an H100, each of gunicorn's request threads took 1.2-3.6 s for its first batch, against 5 ms on the
    batcher thread, which warm-up has already tuned.
    """
    return setting and device.type == "cpu"


@dataclass
class Service:
    """Everything a request needs, wired once by ``create_app``."""

    settings: Settings
    predictor: Predictor
    batcher: Batcher[torch.Tensor, torch.Tensor]
    limits: DecodeLimits
    api_key: str | None = None
    batch_profile: dict[int, float] = field(default_factory=dict)  # forward images/s per batch size, at warm-up
    arrivals: Arrivals = field(default_factory=Arrivals)
    _ready: threading.Event = field(default_factory=threading.Event)
    _draining: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def build(cls, settings: Settings, predictor: Predictor) -> "Service":
        """Start the batcher, warm up, pass the canary; readiness turns on only after all of that."""
        threads = forward_threads(settings.torch_threads, predictor.device)
        if threads:
            torch.set_num_threads(threads)
        observer = MetricsObserver(predictor.memory_stats if predictor.device.type == "cuda" else None)
        arrivals = Arrivals()
        batcher: Batcher[torch.Tensor, torch.Tensor] = Batcher(
            predictor.predict_list, max_batch_size=settings.max_batch_size, max_wait_ms=settings.max_wait_ms,
            queue_size=settings.queue_size, split_on=OUT_OF_MEMORY_ERRORS, shrink_s=settings.oom_shrink_s,
            observer=observer, incoming=arrivals.count,
            inline_when_idle=inline_batches(settings.inline_when_idle, predictor.device))
        profile: dict[int, float] = {}

        def prepare() -> None:  # on the thread that will run the batches: cuDNN's tuned plans are per thread
            if settings.warmup:
                profile.update(predictor.warmup(settings.max_batch_size))
            predictor.canary()

        batcher.start(prepare)
        cap = choose_batch_cap(profile) if profile and settings.auto_batch_size else settings.max_batch_size
        if cap < settings.max_batch_size:
            log.info("batch cap %d: larger batches were no faster (%s)", cap,
                     ", ".join(f"{size}: {rate:.0f} img/s" for size, rate in profile.items()))
            batcher.set_max_batch_size(cap)
        limits = DecodeLimits.from_settings(settings)
        service = cls(settings, predictor, batcher, limits, api_key=settings.resolved_api_key(),
                      batch_profile=profile, arrivals=arrivals)
        MODEL_INFO.labels(predictor.manifest.name, predictor.manifest.version, str(predictor.device),
                          predictor.dtype_name).set(1)
        service._ready.set()
        return service

    @property
    def warmed_up(self) -> bool:
        """Warm-up and canary have passed."""
        return self._ready.is_set()

    @property
    def ready(self) -> bool:
        """Model loaded, warmed up, canary passed, batcher alive and not draining."""
        return self._ready.is_set() and not self._draining.is_set() and self.batcher.is_alive()

    @property
    def draining(self) -> bool:
        """True once shutdown has begun."""
        return self._draining.is_set()

    def begin_drain(self) -> None:
        """Turn readiness off so load balancers stop sending; accepted work still completes."""
        self._draining.set()

    def shutdown(self, timeout: float | None = None) -> None:
        """Drain: refuse new work, finish what is queued, stop the worker thread."""
        self.begin_drain()
        self.batcher.stop(timeout)

    def require_ready(self) -> None:
        """Raise NotReady (503 with Retry-After) unless new work can be accepted."""
        if not self.ready:
            raise NotReady("the model is not ready" if not self.draining else "the server is shutting down",
                           headers={"Retry-After": "5"})

    def preprocess(self, data: bytes) -> torch.Tensor:
        """One image's bytes -> model input, with the service's limits."""
        return image_to_tensor(data, self.predictor.transform, self.limits)

    def preprocess_all(self, images: list[bytes]) -> tuple[list[torch.Tensor], float]:
        """Decode and transform every image (all must succeed); also returns the seconds it took."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        tensors = [self.preprocess(data) for data in images]
        decode_s = time.perf_counter() - started
        STAGE_SECONDS.labels("decode").observe(decode_s)
        STAGE_CPU_SECONDS.labels("decode").inc(time.thread_time() - cpu_started)
        return tensors, decode_s

    def infer(self, tensors: list[torch.Tensor], timeout_s: float,
              arrived: Callable[[], None] | None = None) -> list[BatchResult[torch.Tensor]]:
        """Queue the images (all or none) and wait for their rows until the deadline.

        ``arrived`` (from ``arrivals.arriving()``) is called just before queueing. Raises the batcher's QueueFull /
        DeadlineUnreachable at once, DeadlineExceeded when the deadline passes, InferenceFailed when the batch's
        forward pass raised.
        """
        deadline = time.monotonic() + timeout_s
        if arrived is not None:
            arrived()
        futures = self.batcher.submit_many(tensors, deadline=deadline)
        try:
            return [f.result(timeout=max(0.0, deadline - time.monotonic())) for f in futures]
        except (FutureTimeout, DeadlineExpired):
            for f in futures:
                f.cancel()  # still queued ones are dropped before they cost a forward pass
            raise DeadlineExceeded(f"no inference result within the request's {timeout_s:g}s deadline") from None
        except Exception as exc:
            raise InferenceFailed(f"inference failed for this batch: {type(exc).__name__}") from exc
