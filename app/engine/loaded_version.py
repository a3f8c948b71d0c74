"""A loaded model version: its predictor, its decoder and its running batcher, started, warmed up and canaried on
the batcher's thread; counted while requests use it, so an unloaded version stops only after its last request is
answered."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Sequence

import torch

from app.config import Settings
from app.engine.arrivals import Arrivals, InFlight
from app.engine.batcher import Batcher
from app.engine.decode import DecodeLimits, canary_jpeg
from app.engine.decoders import Decoder, Prepared, decoder_for
from app.engine.monitor import PredictionMonitor
from app.engine.predictor import OUT_OF_MEMORY_ERRORS, Predictor
from app.engine.tuning import choose_batch_cap, decode_path, forward_threads, inline_batches
from app.metrics import MODEL_INFO, QUEUE_CAPACITY, MetricsObserver
from models.export.checks import ModelLoadError

log = logging.getLogger(__name__)


@dataclass(eq=False)
class LoadedVersion:
    """A model version ready to serve: its predictor, decoder and running batcher, its forward rate per batch
    size."""

    predictor: Predictor
    decoder: Decoder
    batcher: Batcher[Prepared, torch.Tensor]
    batch_profile: dict[int, float]  # forward images/s per batch size, measured at warm-up
    monitor: PredictionMonitor  # its predictions for requests: class mix against its reference, confidence
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


def check_canary(probabilities: torch.Tensor, num_classes: int) -> None:
    """ModelLoadError unless the canary's answer is one row of ``num_classes`` finite probabilities summing to 1."""
    total = float(probabilities.sum())
    if (probabilities.shape != (1, num_classes) or not torch.isfinite(probabilities).all()
            or abs(total - 1.0) > 1e-3):
        raise ModelLoadError(f"canary inference failed: shape {tuple(probabilities.shape)}, sum {total}")


def _apply_batch_cap(settings: Settings, batcher: Batcher[Prepared, torch.Tensor], profile: dict[int, float],
                     described: str) -> None:
    """Cap batches where the forward pass measured at warm-up starts to slow (when ``auto_batch_size``), saying why in the log."""
    cap = choose_batch_cap(profile) if profile and settings.auto_batch_size else settings.max_batch_size
    if cap < settings.max_batch_size:
        log.info("%s: batch cap %d: larger batches were slower (%s)", described, cap,
                 ", ".join(f"{size}: {rate:.0f} img/s" for size, rate in profile.items()))
        batcher.set_max_batch_size(cap)


def start_version(settings: Settings, predictor: Predictor) -> LoadedVersion:
    """Choose the decoder, start the batcher, warm up and pass the canary on its thread, apply the measured batch
    cap; from then on every batch's predictions go to the version's monitor and metrics."""
    threads = forward_threads(settings.torch_threads, predictor.device, workers=settings.workers or 1)
    if threads:
        torch.set_num_threads(threads)
    name, version = predictor.manifest.name, predictor.manifest.version
    decoder = decoder_for(decode_path(settings.decode_path, predictor.device), predictor,
                          DecodeLimits.from_settings(settings))
    observer = MetricsObserver(predictor.memory_stats if predictor.device.type == "cuda" else None, name, version)
    monitor = PredictionMonitor.for_version(settings, predictor.manifest)
    serving = threading.Event()  # set once warmed up and canaried: only requests' batches are monitored

    def run_batch(prepared: Sequence[Prepared]) -> torch.Tensor:
        probabilities = predictor.predict_batch(decoder.collate(prepared))
        if serving.is_set():
            seen = monitor.observe(probabilities)
            observer.predictions(seen.labels, seen.confidences, seen.low_confidence_ratio, seen.psi)
        return probabilities

    arrivals = Arrivals()
    batcher: Batcher[Prepared, torch.Tensor] = Batcher(
        run_batch, max_batch_size=settings.max_batch_size, max_wait_ms=settings.max_wait_ms,
        queue_size=settings.resolved_queue_size(), split_on=OUT_OF_MEMORY_ERRORS, shrink_s=settings.oom_shrink_s,
        observer=observer, incoming=arrivals.count, name=f"batcher-{name}-{version}",
        inline_when_idle=inline_batches(settings.inline_when_idle, predictor.device))
    profile: dict[int, float] = {}

    def prepare() -> None:  # on the thread that will run the batches: cuDNN's tuned plans are per thread
        if settings.warmup:
            profile.update(predictor.warmup(settings.max_batch_size))
        # A synthetic photo through the decoder the batches will use (starting the device's decoder there) and
        # the model.
        check_canary(run_batch([decoder.prepare(canary_jpeg())]), predictor.num_classes)

    batcher.start(prepare)
    serving.set()
    _apply_batch_cap(settings, batcher, profile, f"{name} {version}")
    loaded = LoadedVersion(predictor, decoder, batcher, profile, monitor, observer, arrivals)
    MODEL_INFO.labels(*loaded._info_labels()).set(1)
    QUEUE_CAPACITY.labels(name, version).set(batcher.queue_size)
    return loaded
