"""A loaded model version: its predictor and running batcher, started, warmed up and canaried on the batcher's
thread; counted while requests use it, so an unloaded version stops only after its last request is answered."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from app.config import Settings
from app.engine.arrivals import Arrivals, InFlight
from app.engine.batcher import Batcher
from app.engine.decode import DecodeLimits
from app.engine.device_decode import canary_jpeg, check_header
from app.engine.predictor import OUT_OF_MEMORY_ERRORS, Predictor
from app.engine.tuning import choose_batch_cap, decode_path, forward_threads, inline_batches
from app.metrics import MODEL_INFO, QUEUE_CAPACITY, MetricsObserver

log = logging.getLogger(__name__)


@dataclass(eq=False)
class LoadedVersion:
    """A model version ready to serve: its predictor, its running batcher, its forward rate per batch size."""

    predictor: Predictor
    batcher: Batcher[torch.Tensor, torch.Tensor]
    batch_profile: dict[int, float]  # forward images/s per batch size, measured at warm-up
    observer: MetricsObserver = field(default_factory=MetricsObserver)
    arrivals: Arrivals = field(default_factory=Arrivals)  # requests decoding for this version's next batch
    in_use: InFlight = field(default_factory=InFlight)  # requests holding this version, from routing to answer
    device_memory_bytes: int | None = None  # CUDA memory the load and warm-up took (None on the CPU)

    @property
    def name(self) -> str:
        """The model's name (its manifest's)."""
        return self.predictor.manifest.name

    @property
    def version(self) -> str:
        """The version (its manifest's)."""
        return self.predictor.manifest.version

    def _info_labels(self) -> tuple[str, str, str, str]:
        return self.name, self.version, str(self.predictor.device), self.predictor.dtype_name

    def retire(self, timeout_s: float) -> bool:
        """Stop once unrouted: wait (``timeout_s`` at most) for the requests holding it, finish what is queued, end
        the batcher. Returns whether every request had left in time."""
        self.observer.retire()
        drained = self.in_use.wait_empty(timeout_s)
        self.batcher.stop(timeout_s)
        MODEL_INFO.labels(*self._info_labels()).set(0)
        return drained


def start_version(settings: Settings, predictor: Predictor) -> LoadedVersion:
    """Start the batcher, warm up and pass the canary on its thread, apply the measured batch cap."""
    threads = forward_threads(settings.torch_threads, predictor.device)
    if threads:
        torch.set_num_threads(threads)
    name, version = predictor.manifest.name, predictor.manifest.version
    observer = MetricsObserver(predictor.memory_stats if predictor.device.type == "cuda" else None, name, version)
    arrivals = Arrivals()
    batcher: Batcher[torch.Tensor, torch.Tensor] = Batcher(
        predictor.predict_list, max_batch_size=settings.max_batch_size, max_wait_ms=settings.max_wait_ms,
        queue_size=settings.resolved_queue_size(), split_on=OUT_OF_MEMORY_ERRORS, shrink_s=settings.oom_shrink_s,
        observer=observer, incoming=arrivals.count, name=f"batcher-{name}-{version}",
        inline_when_idle=inline_batches(settings.inline_when_idle, predictor.device))
    profile: dict[int, float] = {}

    on_device = decode_path(settings.decode_path, predictor.device) == "device"

    def prepare() -> None:  # on the thread that will run the batches: cuDNN's tuned plans are per thread
        if settings.warmup:
            profile.update(predictor.warmup(settings.max_batch_size))
        predictor.canary()
        if on_device:  # the decoder the batches will use, started and checked on this thread too
            predictor.canary(check_header(canary_jpeg(), DecodeLimits.from_settings(settings)))

    batcher.start(prepare)
    cap = choose_batch_cap(profile) if profile and settings.auto_batch_size else settings.max_batch_size
    if cap < settings.max_batch_size:
        log.info("%s %s: batch cap %d: larger batches were no faster (%s)", name, version, cap,
                 ", ".join(f"{size}: {rate:.0f} img/s" for size, rate in profile.items()))
        batcher.set_max_batch_size(cap)
    loaded = LoadedVersion(predictor, batcher, profile, observer, arrivals)
    MODEL_INFO.labels(*loaded._info_labels()).set(1)
    QUEUE_CAPACITY.labels(name, version).set(batcher.queue_size)
    return loaded
