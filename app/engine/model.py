"""A loaded model: its predictor and running batcher, started, warmed up and canaried on the batcher's thread."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from app.config import Settings
from app.engine.arrivals import Arrivals
from app.engine.batcher import Batcher
from app.engine.predictor import OUT_OF_MEMORY_ERRORS, Predictor
from app.engine.tuning import choose_batch_cap, forward_threads, inline_batches
from app.metrics import MODEL_INFO, QUEUE_CAPACITY, READY, MetricsObserver

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Model:
    """A loaded model ready to serve: its predictor, its running batcher, its forward rate per batch size."""

    predictor: Predictor
    batcher: Batcher[torch.Tensor, torch.Tensor]
    batch_profile: dict[int, float]  # forward images/s per batch size, measured at warm-up


def start_model(settings: Settings, predictor: Predictor, arrivals: Arrivals) -> Model:
    """Start the batcher, warm up and pass the canary on its thread, apply the measured batch cap."""
    threads = forward_threads(settings.torch_threads, predictor.device)
    if threads:
        torch.set_num_threads(threads)
    observer = MetricsObserver(predictor.memory_stats if predictor.device.type == "cuda" else None)
    batcher: Batcher[torch.Tensor, torch.Tensor] = Batcher(
        predictor.predict_list, max_batch_size=settings.max_batch_size, max_wait_ms=settings.max_wait_ms,
        queue_size=settings.resolved_queue_size(), split_on=OUT_OF_MEMORY_ERRORS, shrink_s=settings.oom_shrink_s,
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
    MODEL_INFO.labels(predictor.manifest.name, predictor.manifest.version, str(predictor.device),
                      predictor.dtype_name).set(1)
    QUEUE_CAPACITY.set(batcher.queue_size)
    READY.set(1)
    return Model(predictor, batcher, profile)
