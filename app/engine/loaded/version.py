"""A loaded model version: its predictor, its decoder and its running batcher, started, warmed up and canaried on
the batcher's thread; counted while requests use it, so an unloaded version stops only after its last request is
answered. ``run_batch`` is a batch's steps, in order, in one place."""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from app.config import Settings
from app.engine.batching.arrivals import Arrivals, InFlight
from app.engine.batching.batcher import Batcher
from app.engine.batching.types import PrepareTimeout
from app.engine.contract import Signature
from app.engine.batching.tuning import cap_share, choose_batch_cap, forward_threads, inline_batches, loop_batches
from app.engine.decoding.decoders import Decoder, Prepared, decoder_for
from app.engine.decoding.image import DecodeLimits, canary_jpeg
from app.engine.loaded.explainer import Explainer
from app.engine.loaded.monitor import PredictionMonitor, TakenReference
from app.engine.loaded.predictor import OUT_OF_MEMORY_ERRORS, NonFiniteOutput, Predictor
from app.errors import ServiceError
from app.hosting import control
from app.metrics import MetricsObserver
from models.export.checks import ModelLoadError

log = logging.getLogger(__name__)
# The stream pool a serving version's batches run on (PyTorch's: 32 streams a priority, in turn): the high-priority
# side, so never the stream a loading version's graphs are captured on (graphs.py CAPTURE_PRIORITY) nor a JPEG
# decoding one (the default priority); serving batches come first on the device too.
BATCH_STREAM_PRIORITY = -1


@dataclass(eq=False)
class LoadedVersion:
    """A model version ready to serve: its predictor, decoder and running batcher, its forward rate per batch
    size."""

    predictor: Predictor
    decoder: Decoder
    monitor: PredictionMonitor  # its predictions for requests: class mix against its reference, confidence
    observer: MetricsObserver = field(default_factory=MetricsObserver)
    arrivals: Arrivals = field(default_factory=Arrivals)  # requests decoding for this version's next batch
    in_use: InFlight = field(default_factory=InFlight)  # requests holding this version, from routing to answer
    batch_profile: dict[int, float] = field(default_factory=dict)  # forward images/s per batch size, at warm-up
    device_memory_bytes: int | None = None  # CUDA memory the load and warm-up took (None on the CPU)
    batcher: Batcher[Prepared, np.ndarray] = field(init=False)
    # CUDA, where an engine's loop may run its batches: the stream they run on, whichever thread runs them, so one
    # waits for no other thread's work queued on the default stream (another version's warm-up, an explanation)
    batch_stream: torch.cuda.Stream | None = None
    serving: threading.Event = field(default_factory=threading.Event)  # warmed up and canaried: batches monitored
    _unmonitored: list[np.ndarray] = field(default_factory=list, init=False)  # requests' rows since the last settle
    _settling: threading.Lock = field(default_factory=threading.Lock, init=False)
    _explainer: Explainer | None = field(default=None, init=False)  # made in its load (EXPLAIN_AT_START) or on
    # the first explanation
    _explainer_made: threading.Lock = field(default_factory=threading.Lock, init=False)

    def explainer(self) -> Explainer:
        """Its explanations' Explainer (a copy of its weights with gradients), made on first use; NoGradients when
        it has none."""
        with self._explainer_made:
            if self._explainer is None:
                self._explainer = Explainer(self.predictor, self.decoder)
            return self._explainer

    @functools.cached_property
    def name(self) -> str:
        """The model's name (its manifest's, fixed while it is loaded: read for every request)."""
        return self.predictor.manifest.name

    @functools.cached_property
    def version(self) -> str:
        """The version (its manifest's, fixed while it is loaded)."""
        return self.predictor.manifest.version

    @functools.cached_property
    def signature(self) -> Signature:
        """What a request this version answers is parsed with: name, version, classes, input shape (its manifest's,
        fixed while it is loaded)."""
        manifest = self.predictor.manifest
        return Signature(manifest.name, manifest.version, manifest.labels, tuple(manifest.preprocess.input_shape),
                         manifest.embedding.dim if manifest.embedding is not None else 0)

    def run_batch(self, prepared: Sequence[Prepared]) -> np.ndarray:
        """One batch, on the batcher's thread or an engine's loop (on ``batch_stream`` where there is one): collate
        (the device path decodes here), the forward pass (softmax probabilities, one row per image; its time and CPU
        told to the observer, which counts them with the batch's); a request's batch's probabilities are held for the
        monitor (``settle``). The rows come back as one float32 array (its rows are views: a request's answer takes
        them as they are, no per-request tensor steps), each the image's probabilities followed by its embedding when
        the version has one."""
        if self.batch_stream is None:
            return self._run_batch(prepared)
        with torch.cuda.stream(self.batch_stream):
            return self._run_batch(prepared)

    def _run_batch(self, prepared: Sequence[Prepared]) -> np.ndarray:
        decoding = self.decoder.decodes_in_batch(prepared)  # then making the batch is its images' decode stage
        making_cpu_started = time.thread_time() if decoding else 0.0
        try:
            batch = self.decoder.collate(prepared)
        except Exception:  # an image the device path could not decode: the batch's decoding so far was spent
            self._failed(0.0, time.thread_time() - making_cpu_started if decoding else 0.0)
            raise
        device = self.predictor.device
        made = device_mark(device)  # on a GPU the batch's making may still run there: the forward's time starts after
        started, cpu_started = time.perf_counter(), time.thread_time()
        decode_cpu_s = cpu_started - making_cpu_started if decoding else 0.0
        try:
            rows = self.predictor.predict_batch(batch).numpy()
        except NonFiniteOutput as failed:  # its finite rows are answered (the batcher), so they are monitored too
            self._ran(made, started, cpu_started, failed.outputs[failed.finite], decode_cpu_s)
            raise
        except Exception:  # out of memory (the batcher splits the batch) or a failure
            self._failed(time.thread_time() - cpu_started, decode_cpu_s)
            raise
        self._ran(made, started, cpu_started, rows, decode_cpu_s)
        return rows

    def _failed(self, cpu_s: float, decode_cpu_s: float) -> None:
        """A pass that raised: its CPU and its batch's decoding's to the metrics all the same, as no forward pass's
        time (not the canary's, run before the version serves)."""
        if self.serving.is_set():
            self.observer.forward_ran(None, cpu_s, decode_cpu_s)

    def _ran(self, made: object, started: float, cpu_started: float, answered: np.ndarray,
             decode_cpu_s: float) -> None:
        """A forward pass's time and its batch's decoding's CPU (the device path's) to the metrics, and the rows it
        answers to the drift monitor's next settle (not the canary's, run before the version serves)."""
        if not self.serving.is_set():
            return
        cpu_s = time.thread_time() - cpu_started
        device = self.predictor.device
        wall_s = time.perf_counter() - started if made is None else device_seconds_since(made, device)
        self.observer.forward_ran(wall_s, cpu_s, decode_cpu_s)
        if len(answered):
            with self._settling:
                self._unmonitored.append(answered[:, :self.predictor.num_classes])

    def settle(self) -> None:
        """The batcher's ``settle``: the requests' predictions since the last call to the monitor in one step, then
        they, the monitor's figures and the batches' to the metrics in one write each."""
        with self._settling:
            started = time.thread_time()
            held, self._unmonitored = self._unmonitored, []
            if held:
                seen = self.monitor.observe_batches(held)
                self.observer.predictions(seen.labels, seen.confidences, seen.low_confidence_ratio, seen.psi)
            self.observer.settle(time.thread_time() - started)

    def _info_labels(self) -> tuple[str, str, str, str]:
        return self.name, self.version, str(self.predictor.device), self.predictor.dtype_name

    def retire(self, timeout_s: float) -> bool:
        """Stop once unrouted: wait (``timeout_s`` at most) for the requests holding it, finish what is queued, end
        the batcher. Returns whether every request had left in time."""
        self.observer.retire()
        drained = self.in_use.wait_empty(timeout_s)
        self.batcher.stop(timeout_s)
        self.observer.gone(self._info_labels())  # its info series 0, unless a copy loaded again serves it
        return drained


def device_mark(device: torch.device) -> torch.cuda.Event | None:
    """On CUDA, an event recorded on the device's stream now: it completes where the work queued so far ends (a
    batch's decoding and resizing, which the host does not wait for); None on the CPU, where that work is done."""
    if device.type != "cuda":
        return None
    mark = torch.cuda.Event(enable_timing=True)
    mark.record(torch.cuda.current_stream(device))
    return mark


def device_seconds_since(mark: torch.cuda.Event, device: torch.device) -> float:
    """The device's seconds from ``mark`` (``device_mark``) to now, waited for: the work queued after it."""
    now = torch.cuda.Event(enable_timing=True)
    now.record(torch.cuda.current_stream(device))
    now.synchronize()
    return mark.elapsed_time(now) / 1000


def check_canary(probabilities: np.ndarray, num_classes: int) -> None:
    """ModelLoadError unless the canary's answer is one row of ``num_classes`` finite probabilities summing to 1."""
    total = float(probabilities.sum(dtype=np.float64))
    if (probabilities.shape != (1, num_classes) or not np.isfinite(probabilities).all()
            or abs(total - 1.0) > 1e-3):
        raise ModelLoadError(f"canary inference failed: shape {tuple(probabilities.shape)}, sum {total}")


def _ready_to_explain(loaded: LoadedVersion) -> None:
    """``EXPLAIN_AT_START``: the version's Explainer made and the canary photo explained once, in its load, so its
    first explanation costs what the next ones do and its memory is what it holds once it serves (made on a thread
    after the load, it grew after /readyz, and on CUDA outside the load's measure and lock). A version that cannot
    be explained serves all the same (its explanations answer why: NoGradients, 422), as does one whose
    explanation fails here (tried again on the first ``/explain``, which answers what failed)."""
    try:
        loaded.explainer().explain(canary_jpeg())
    except ServiceError as exc:
        log.info("%s %s: no explanations: %s", loaded.name, loaded.version, exc.message)
    except Exception:  # noqa: BLE001 - explanations are beside what the version serves
        log.warning("%s %s: its explanations could not be made ready; /explain will try again", loaded.name,
                    loaded.version, exc_info=True)


def _place_loop_batches(loaded: LoadedVersion) -> None:
    """Once warm-up captured the forward's graphs (or did not): whether an engine's loop may run the version's short
    batches (``tuning.loop_batches``), and on CUDA then the stream, not the default one, they run on."""
    predictor, batcher = loaded.predictor, loaded.batcher
    batcher.runs_queued_on_caller = loop_batches(predictor.device,
                                                 predictor.replays_batches_up_to(batcher.max_batch_size))
    if predictor.device.type != "cuda":
        return
    if batcher.runs_queued_on_caller:
        loaded.batch_stream = torch.cuda.Stream(predictor.device, priority=BATCH_STREAM_PRIORITY)
        # an image the batch would decode on the CPU (not a JPEG, on the device path) keeps its batch off the loop,
        # which would hold every connection while it decodes
        decoder = loaded.decoder
        batcher.caller_may_run = lambda item: not decoder.decodes_on_host_in_batch(item)
        log.info("%s %s: every batch replays a CUDA graph: under ENGINE=process the engine's loop may run the short "
                 "ones itself", loaded.name, loaded.version)
    else:
        log.info("%s %s: batches run on the batcher's thread (its forward passes do not all replay CUDA graphs: "
                 "CUDA_GRAPHS, WARMUP, or a capture that failed)", loaded.name, loaded.version)


UNSTEADY_WARMUP = 0.1  # a warm-up whose runs differ by this much (``Predictor.warmup_noise``) is said in the log


def _apply_batch_cap(settings: Settings, loaded: LoadedVersion) -> None:
    """Cap batches where the forward pass measured at warm-up starts to slow (when ``auto_batch_size``), saying why
    in the log. The cap a start of the version in this server measured first is kept (CONTROL_DIR), and a later
    start takes it: an engine or a worker restarted under load, or a reload, warms up beside busy work, whose curve
    capped a restarted engine at 3 where its first start had measured 8, for the rest of its life (an operator's
    trial)."""
    profile, ceiling = loaded.batch_profile, loaded.batcher.max_batch_size  # the batcher was started at the ceiling
    if not (profile and settings.auto_batch_size):
        return
    predictor = loaded.predictor  # the version's files by their checksums: a version written again is measured
    kept = None if settings.control_dir is None else control.batch_cap(settings.control_dir, "/".join(map(str, (
        loaded.name, loaded.version, predictor.device, predictor.dtype, ceiling,
        *sorted(file.sha256 for file in predictor.manifest.files.values())))))
    first = _cap_kept(kept)
    if first is not None:
        if first < ceiling:
            log.info("%s %s: batch cap %d, as its first start in this server measured it (this start's warm-up "
                     "ran beside whatever the server was doing)", loaded.name, loaded.version, first)
            loaded.batcher.set_max_batch_size(first)
        return
    _measured_cap(loaded, profile, ceiling)
    if kept is not None:
        with contextlib.suppress(OSError):  # (unkept: the next start measures again, as before)
            control.write_json(kept, loaded.batcher.max_batch_size)


def _reference_kept_at(settings: Settings, predictor: Predictor) -> Path | None:
    """Where the drift reference a start of this version takes from its first predictions is kept (CONTROL_DIR:
    a worker restarted, a reload, a server whose CONTROL_DIR is kept judge by it), by its files' checksums (a
    version written again takes its own); None without a CONTROL_DIR."""
    if settings.control_dir is None:
        return None
    manifest = predictor.manifest
    return control.monitor_reference(settings.control_dir, "/".join(
        (manifest.name, manifest.version, *sorted(file.sha256 for file in manifest.files.values()))))


def _reference_kept(kept: Path | None) -> TakenReference | None:
    """The reference kept in ``kept``, or None: none kept, or unreadable (the monitor checks it fits)."""
    try:
        data = json.loads(kept.read_text(encoding="utf-8")) if kept is not None else None
        return None if data is None else TakenReference([int(n) for n in data["class_counts"]],
                                                        float(data["low_confidence_share"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _keep_reference(kept: Path, taken: TakenReference) -> TakenReference:
    """``taken`` kept in ``kept`` unless a reference is kept there already (another worker's, taken first): the one
    kept is returned, so every worker judges by the same."""
    first = _reference_kept(kept)
    if first is not None:
        return first
    control.write_json(kept, {"class_counts": taken.class_counts, "low_confidence_share": taken.low_confidence_share})
    return taken


def _cap_kept(kept: Path | None) -> int | None:
    """The batch cap kept in ``kept`` (a whole number at least 1), or None: none kept, or unreadable."""
    try:
        cap = int(kept.read_text()) if kept is not None else None
    except (OSError, ValueError):
        return None
    return cap if cap is not None and cap >= 1 else None


def _measured_cap(loaded: LoadedVersion, profile: dict[int, float], ceiling: int) -> None:
    """``_apply_batch_cap``'s measure: the cap from this warm-up's curve, set and said."""
    noise = loaded.predictor.warmup_noise
    cap = choose_batch_cap(profile, noise=noise)
    if noise >= UNSTEADY_WARMUP:
        share = cap_share(noise)
        log.info("%s %s: the warm-up's runs differed by %.0f%% (a busy machine): %s", loaded.name, loaded.version,
                 100 * noise, f"only a batch size slower than {100 * share:.0f}% of the best caps the batches" if share
                 else f"too much to cap the batches by: they stay at the ceiling, {ceiling}")
    if cap < ceiling:
        log.info("%s %s: batch cap %d, the largest batch within %d%% of the best images/s; larger ones were slower "
                 "(%s)%s", loaded.name, loaded.version, cap, round(100 * (1 - cap_share(noise))),
                 ", ".join(f"{size}: {rate:.0f} img/s" for size, rate in profile.items()),
                 f"; the warm-up's runs differed by {noise:.0%}" if noise >= 0.005 else "")
        loaded.batcher.set_max_batch_size(cap)


def decoder_of(setting: str, predictor: Predictor, limits: DecodeLimits) -> Decoder:
    """The decoder ``setting`` (auto, pil, tensor or device) picks for ``predictor``'s device, dtype and transforms."""
    return decoder_for(setting, limits, device=predictor.device, dtype=predictor.dtype,
                       transform=predictor.transform, tensor_transform=predictor.tensor_transform)


def _start_within(batcher: Batcher, prepare: Callable[[], None], timeout_s: float) -> None:
    """Start ``batcher`` with ``prepare`` (the warm-up and canary) on its thread; ModelLoadError once it has not
    ended within ``timeout_s`` (WARMUP_TIMEOUT_S; 0: as long as it takes)."""
    try:
        batcher.start(prepare, timeout_s=timeout_s or None)
    except PrepareTimeout:
        raise ModelLoadError(f"its warm-up and canary did not end within WARMUP_TIMEOUT_S ({timeout_s:g}s): a forward "
                             "pass that does not return (left running; the version is not served)") from None


def start_version(settings: Settings, predictor: Predictor) -> LoadedVersion:
    """Choose the decoder, start the batcher, warm up and pass the canary on its thread, apply the measured batch
    cap; from then on every batch's predictions go to the version's monitor and metrics."""
    threads = forward_threads(settings.torch_threads, predictor.device, workers=settings.model_processes())
    if threads:
        torch.set_num_threads(threads)
    name, version = predictor.manifest.name, predictor.manifest.version
    decoder = decoder_of(settings.decode_path, predictor, DecodeLimits.from_settings(settings))
    observer = MetricsObserver(predictor.memory_stats if predictor.device.type == "cuda" else None, name, version)
    kept = _reference_kept_at(settings, predictor)
    monitor = PredictionMonitor.for_version(settings, predictor.manifest, _reference_kept(kept),
                                            None if kept is None else functools.partial(_keep_reference, kept))
    loaded = LoadedVersion(predictor, decoder, monitor, observer)
    ceiling = settings.batch_ceiling(predictor.device.type)
    loaded.batcher = Batcher(
        loaded.run_batch, max_batch_size=ceiling, max_wait_ms=settings.max_wait_ms,
        queue_size=settings.resolved_queue_size(predictor.device.type), split_on=OUT_OF_MEMORY_ERRORS,
        shrink_s=settings.oom_shrink_s,
        observer=observer, incoming=loaded.arrivals.count, name=f"batcher-{name}-{version}",
        inline_when_idle=inline_batches(settings.inline_when_idle, predictor.device), settle=loaded.settle,
        settle_s=settings.metrics_flush_ms / 1000)

    def prepare() -> None:  # on the thread that will run the batches: cuDNN's tuned plans are per thread
        if settings.warmup:
            loaded.batch_profile.update(predictor.warmup(ceiling, timing_s=settings.warmup_timing_s))
            smallest = min(loaded.batch_profile, default=None)
            if smallest is not None:  # the time an image of the smallest batch: a lone image's own inference
                loaded.batcher.expect_item_s(1 / loaded.batch_profile[smallest])
        # A synthetic photo through the decoder the batches will use (starting the device's decoder there) and
        # the model.
        try:
            canary = loaded.run_batch([decoder.prepare(canary_jpeg())])
        except NonFiniteOutput as failed:
            raise ModelLoadError(f"canary inference failed: {failed}") from None
        check_canary(canary[:, :predictor.num_classes], predictor.num_classes)

    _start_within(loaded.batcher, prepare, settings.warmup_timeout_s)
    if settings.explain_at_start:  # before it serves: on CUDA its copy is device memory, which the load measures
        _ready_to_explain(loaded)  # and its lock guards (app/engine/versions/apply.py)
    _place_loop_batches(loaded)
    loaded.serving.set()
    _apply_batch_cap(settings, loaded)
    observer.serving(loaded._info_labels(), loaded.batcher.queue_size, predictor.weights_bytes)
    return loaded
