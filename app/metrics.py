"""Prometheus metrics. With several gunicorn workers, PROMETHEUS_MULTIPROC_DIR (set by gunicorn.conf.py before
the fork) switches prometheus-client to its multiprocess mode and /metrics aggregates every worker."""
from __future__ import annotations

import bisect
import os
import struct
import threading
import time
from collections import Counter as Tally
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    multiprocess,
)
from prometheus_client import values as prometheus_values

from app.hosting import metrics_files
from app.hosting.procstat import WorkerCollector
from models.export.manifest import CONFIDENCE_BUCKETS  # the manifest's reference histogram has the same edges

_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))


def this_process() -> int:
    """This process's id, kept and renewed in a forked child: what prometheus-client's multiprocess values ask on
    every write to tell a fork, where its own ``os.getpid`` is a system call per write (about 0.5 of each write's
    1.6 us on the 2-core VM, and several writes a request or a loop turn); the engine's answers carry it too."""
    return _pid[0]


if getattr(prometheus_values.ValueClass, "_multiprocess", False):  # multiprocess mode, as prometheus-client chose
    prometheus_values.ValueClass = prometheus_values.MultiProcessValue(process_identifier=this_process)

# A `_created` series per counter and histogram is noise for our dashboards and alerts.
disable_created_metrics()

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)

REQUESTS = Counter("visionserve_requests_total", "HTTP requests answered (endpoint \"unparsed\": refused before "
                   "any route, from the request head or its timeouts: 400, 408, 413, 414, 431, a parser's refusal, "
                   "429 to a client over MAX_CONNECTIONS_PER_CLIENT, and 499 for one that left while it sent its "
                   "body; \"unmatched\": a path no route takes, 404; \"starting\": answered 503 while a worker "
                   "imports the app)", ["endpoint", "status"])
UNPARSED = "unparsed"  # the endpoint of requests refused before the app (app/hosting/request_framing.py)
STARTING = "starting"  # the endpoint of requests answered while a worker imports the app (app/hosting/starting.py)
REQUEST_SECONDS = Histogram("visionserve_request_duration_seconds", "Whole request time, from when its worker had "
                            "it whole (its wait for a request thread included)", ["endpoint"],
                            buckets=_LATENCY_BUCKETS)
STAGE_SECONDS = Histogram("visionserve_stage_duration_seconds", "Time per stage, by model version: decode (per "
                          "request), queue (per image), inference (per batch: the batch made and its forward pass), "
                          "forward (per batch: the forward pass alone, waited for; on a GPU from where the batch's "
                          "making ends there)", ["model", "version", "stage"], buckets=_LATENCY_BUCKETS)
# CPU time of the thread doing the stage (time.thread_time): set against the wall-time histograms above it shows
# time spent waiting for a core, and against the process's whole CPU what HTTP and Python cost per request.
STAGE_CPU_SECONDS = Counter("visionserve_stage_cpu_seconds", "CPU seconds of the thread running each stage, by model "
                            "version: decode (a request's images where it is prepared, and a batch's where it is "
                            "made: the device path decodes there, a part of inference then), inference (the thread "
                            "running the batch: collate, forward pass, monitor) and forward (the forward pass alone, "
                            "a part of inference)", ["model", "version", "stage"])
BATCH_SIZE = Histogram("visionserve_batch_size", "Images per forward pass, by model version", ["model", "version"],
                       buckets=_BATCH_BUCKETS)
QUEUE_DEPTH = Gauge("visionserve_queue_depth", "Images waiting for the inference worker (told at most 0.1 s apart "
                    "while images come, and 0 once its batches end)", ["model", "version"], multiprocess_mode="livesum")
PROBES = Counter("visionserve_probe_requests_total", "Health probes, scrapes and API-description requests, "
                 "counted apart from traffic", ["endpoint", "status"])
PREFLIGHTS = Counter("visionserve_cors_preflights_total", "CORS preflights (OPTIONS answered before any route, "
                     "CORS_ORIGINS), counted apart from traffic", ["endpoint", "status"])
TRACE_SPANS_UNSENT = Counter("visionserve_trace_spans_unsent_total", "Spans the trace exporter could not send "
                             "(TRACING: a collector away, refusing or too slow), which are lost; 0 while every "
                             "export goes out", [])
REJECTED = Counter("visionserve_rejected_total", "Requests refused for the server's capacity before inference, "
                   "answered 429 or 503 (reason: the error code; a deadline too short for any server, 400 "
                   "deadline_too_short, is the client's and counts in visionserve_requests_total only)", ["reason"])
BATCHER_EVENTS = Counter("visionserve_batcher_events_total", "deadline_dropped: images dropped in the queue; "
                         "client_gone: queued images dropped because their client hung up; batch_split: "
                         "out-of-memory batches split and retried; batch_failed: forward passes that raised (a "
                         "failed batch runs again one image at a time); by model version",
                         ["model", "version", "event"])
BATCHER_EVENT_NAMES = ("deadline_dropped", "client_gone", "batch_split", "batch_failed")
STAGES = ("decode", "queue", "inference", "forward")  # a version's stages (STAGE_SECONDS, STAGE_CPU_SECONDS)
MODEL_INFO = Gauge("visionserve_model_info", "Each loaded model version (1; 0 once unloaded; with several "
                   "processes the highest live one's)", ["name", "version", "device", "dtype"],
                   multiprocess_mode="livemax")
MODEL_MEMORY = Gauge("visionserve_model_memory_bytes", "Memory each loaded version's weights take, as /v1/models' "
                     "memory_bytes says, summed over the processes that hold a copy (each worker inline, each engine "
                     "under ENGINE=process); 0 once unloaded", ["model", "version"], multiprocess_mode="livesum")
READY = Gauge("visionserve_ready", "1 while the worker is ready: model loaded, warmed up, canary passed, batcher "
              "running, not draining (with several workers: the lowest)", multiprocess_mode="livemin")
BATCHER_ALIVE = Gauge("visionserve_batcher_alive", "1 while the inference thread of every served version runs "
                      "(with several workers: the lowest)", multiprocess_mode="livemin")
QUEUE_CAPACITY = Gauge("visionserve_queue_capacity", "Images the inference queue holds (QUEUE_SIZE resolved)",
                       ["model", "version"], multiprocess_mode="livesum")
GPU_MEMORY = Gauge("visionserve_gpu_memory_bytes", "CUDA memory of this worker", ["kind"],
                   multiprocess_mode="liveall")
# Prediction monitoring (app/engine/loaded/monitor.py): only predictions made for requests, not warm-up or the canary;
# a shadow candidate's on the requests mirrored to it count under its version (its class mix and confidence on live
# traffic are what a rollout weighs), so a sum over versions is no count of requests (visionserve_requests_total is).
PREDICTED_CLASS = Counter("visionserve_predicted_class_total", "Predictions made for requests, by top-1 class (a "
                          "shadow candidate's on the requests mirrored to it too)", ["model", "version", "label"])
TOP1_CONFIDENCE = Histogram("visionserve_top1_confidence", "Top-1 probability of each prediction made for "
                            "requests (a shadow candidate's on the requests mirrored to it too)", ["model", "version"],
                            buckets=CONFIDENCE_BUCKETS)
# Each worker has its own window, so with several workers these read the highest live worker's figure.
LOW_CONFIDENCE_RATIO = Gauge("visionserve_low_confidence_ratio", "Share of the last MONITOR_WINDOW predictions "
                             "whose top-1 probability is below MONITOR_LOW_CONFIDENCE (none before "
                             "MONITOR_MIN_PREDICTIONS; 0 once unloaded)", ["model", "version"],
                             multiprocess_mode="livemax")
PREDICTION_DRIFT_PSI = Gauge("visionserve_prediction_drift_psi", "Population stability index of the top-1 class mix "
                             "of the last MONITOR_WINDOW predictions against the version's reference: < 0.1 stable, "
                             "0.1-0.2 watch, > 0.2 drifted (none before the reference and MONITOR_MIN_PREDICTIONS; "
                             "0 once unloaded)", ["model", "version"], multiprocess_mode="livemax")

ENGINE_STARTS = Counter("visionserve_engine_starts", "Engine processes started (ENGINE=process), by engine slot: "
                        "more than one a slot is a restart (it died, or was killed for a stall: the log says how) "
                        "or a USR2 upgrade's (the new master's engines count on in the metrics directory it is handed)",
                        ["engine"])
ENGINE_UP = Gauge("visionserve_engine_up", "1 while an engine process (ENGINE=process) serves, by engine slot: from "
                  "when its models are loaded and it listens until its stop; a dead one's series goes with it (a "
                  "slot missing, or sum() under the start-up log's count: one is restarting)", ["engine"],
                  multiprocess_mode="livemax")


_SERIES: dict[tuple[object, ...], Any] = {}


def series(metric: Any, *labels: str) -> Any:
    """``metric.labels(*labels)``, looked up once per process: ``labels()`` takes a lock and checks its values on
    every call, and a request or a batch writes the same few series each time. Two threads may both look one up
    first: ``labels()`` gives both the same series."""
    key = (metric, *labels)
    found = _SERIES.get(key)
    if found is None:
        found = _SERIES[key] = metric.labels(*labels)
    return found


BUCKETED_ONE_BY_ONE = 48  # a histogram's values written together up to this many are put in their buckets one by
# one (a bisect each); more (a busy engine's settle: a value an image since its last write) by numpy, a few calls for
# all of them (measured: numpy 10.6 us against 12.2 at 64 values, 9.2 against 7.2 at 32; a value costs a bisect
# about 0.16 us, numpy 0.04)


class Increments:
    """Counters' increments and histograms' observations written together (``write``): in multiprocess mode under
    prometheus-client's one lock with one look for a fork, each value's two doubles put in its file's map directly,
    where ``inc`` took the lock, the look and three calls for each (a lone request's engine turn writes about 20:
    docs/performance.md); without it, each value's own ``inc``. Several values of a histogram as one increment per
    bucket they fall in and one of the sum (a batch's or a loop turn's values land in few buckets). Reads
    prometheus-client's own fields (pinned; tests compare it with ``inc`` and ``observe`` one by one, and across a
    fork)."""

    __slots__ = ("_pairs",)

    def __init__(self) -> None:
        self._pairs: list[tuple[Any, float]] = []  # (a prometheus-client value, what to add to it)

    def inc(self, counter: Counter, amount: float) -> None:
        """``counter.inc(amount)`` (a labelled child; ``amount`` >= 0)."""
        counter._raise_if_not_observable()
        self._pairs.append((counter._value, amount))

    def observe(self, histogram: Histogram, values: Sequence[float]) -> None:
        """``histogram.observe`` of each of ``values`` (a labelled child)."""
        if not values:
            return
        if len(values) == 1:
            self.observe_times(histogram, values[0], 1)
            return
        histogram._raise_if_not_observable()
        bounds, buckets, pairs = histogram._upper_bounds, histogram._buckets, self._pairs
        pairs.append((histogram._sum, sum(values)))  # as observe() adds them: inf and -inf make NaN, no exception
        # NaN is below no bound: observe() adds it to the sum and to no bucket
        if len(values) <= BUCKETED_ONE_BY_ONE:
            for index, count in Tally(bisect.bisect_left(bounds, value) for value in values if value == value).items():
                pairs.append((buckets[index], count))
            return
        numbers = np.asarray(values, dtype=np.float64)
        counts = np.bincount(np.searchsorted(bounds, numbers[numbers == numbers]))  # (bisect_left's index)
        for index in counts.nonzero()[0].tolist():
            pairs.append((buckets[index], int(counts[index])))

    def observe_times(self, histogram: Histogram, value: float, times: int) -> None:
        """``histogram.observe(value)`` ``times`` times (a labelled child): its bucket and its sum once each."""
        if times < 1:
            return
        histogram._raise_if_not_observable()
        self._pairs.append((histogram._sum, value * times))
        if value == value:  # (NaN: in the sum alone, as observe() adds it)
            self._pairs.append((histogram._buckets[bisect.bisect_left(histogram._upper_bounds, value)], times))

    def write(self) -> None:
        """Everything added since the last write, written."""
        pairs, self._pairs = self._pairs, []
        if not pairs:
            return
        first = pairs[0][0]
        if not getattr(first, "_multiprocess", False):
            for value, amount in pairs:
                value.inc(amount)
            return
        with _multiprocess_lock(type(first)):
            first._MmapedValue__check_for_pid_change()  # a forked child's values move to files of its own first
            for value, amount in pairs:
                value._value += amount
                value._timestamp = 0.0
                file = value._file
                at = file._positions.get(value._key)
                if at is None:  # its first write in this file: placed there by the client
                    file.write_value(value._key, value._value, 0.0)
                else:  # as the client writes it: both doubles in one slice assignment, never a zero between
                    file._m[at:at + 16] = _TWO_DOUBLES(value._value, 0.0)


_TWO_DOUBLES = struct.Struct("dd").pack  # prometheus-client's mmap_dict layout: a value, then its timestamp
_LOCKS: dict[type, Any] = {}


def _multiprocess_lock(value_class: type) -> Any:
    """The one lock prometheus-client's multiprocess values of ``value_class`` write under (its ``inc``'s)."""
    lock = _LOCKS.get(value_class)
    if lock is None:
        inc = value_class.inc  # type: ignore[attr-defined]
        lock = _LOCKS[value_class] = inc.__closure__[inc.__code__.co_freevars.index("lock")].cell_contents
    return lock


def observe_many(histogram: Histogram, values: Sequence[float]) -> None:
    """``histogram.observe`` of each of ``values`` (a labelled child), written together (``Increments``)."""
    increments = Increments()
    increments.observe(histogram, values)
    increments.write()


@dataclass
class _HeldBatches:
    """Batches' figures held until they are written together."""

    sizes: list[int] = field(default_factory=list)
    run_s: list[float] = field(default_factory=list)
    queued_s: list[float] = field(default_factory=list)
    forward_s: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    forward_cpu_s: float = 0.0
    decode_cpu_s: float = 0.0  # the images a batch decoded as it was made (the device path's)


# The GPU memory gauges' freshness: torch.cuda.memory_allocated and memory_reserved each build the allocator's whole
# statistics dict, which at every settle was 5% of an engine's interpreter lock on an H200 (11-30's drill).
MEMORY_READ_S = 1.0


def show_gpu_memory(stats: dict[str, int]) -> None:
    """visionserve_gpu_memory_bytes from ``stats`` ({kind: bytes}): at a settle, and once a retired version is freed
    (no batch of it settles again, and there may be no other)."""
    for kind, value in stats.items():
        GPU_MEMORY.labels(kind).set(value)


# The copies of each (model, version) serving in this process, from their ``serving`` to their ``retire``: a
# version loaded again (a rollback to it) serves while its replaced copy still drains the requests that held it.
# The series both write (model info, queue capacity and depth, drift and low confidence) are the serving copy's:
# the draining one's retire and end write none of them.
_SERVING: Tally[tuple[str, str]] = Tally()
_SERVING_LOCK = threading.Lock()  # a copy's end and another's start write the same series: one after the other


class MetricsObserver:
    """Feeds one model version's batcher reports and its monitored predictions into the metrics. A batch's figures
    are held until ``settle`` (the batcher's, through its version) writes every batch's since the last one together:
    one increment per bucket and series, not several per batch; ``memory_stats`` is read then (CUDA only), once a
    ``MEMORY_READ_S`` at most. Once
    ``retire``d (its version unloaded), its stopping batcher no longer counts as a dead one and its drift and
    low-confidence gauges read 0, unless another copy of its version serves in this process (``_SERVING``)."""

    def __init__(self, memory_stats: Callable[[], dict[str, int]] | None = None, model: str = "",
                 version: str = "") -> None:
        self._memory_stats = memory_stats
        self._memory_read_at = float("-inf")  # when memory_stats was last read (at most once a MEMORY_READ_S)
        self._labels = (model, version)
        self.retired = False
        # this version's series, looked up once (labels() takes a lock and checks its values on every call)
        self._queue_depth, self._depth_written = QUEUE_DEPTH.labels(model, version), -1
        self._series: dict[tuple[Any, str], Any] = {}  # its stages' and batcher events' (``_of``)
        self._confidence: Histogram | None = None  # from the first prediction made for a request
        self._predicted: dict[str, Counter] = {}
        self._figures_lock = threading.Lock()  # a batch's figures never land after the version's retire()
        self._figures: dict[Gauge, Gauge] = {}  # each figure's series, once it was set
        # the running batch's forward passes (one batch runs at a time; one split for memory runs several): their
        # wall times (not those that raised), their CPU, and their images' decoding's CPU as they were made
        self._pass_walls: list[float] = []
        self._pass_cpu_s = self._pass_decode_cpu_s = 0.0
        self._held_lock = threading.Lock()
        self._held = _HeldBatches()  # the batches' figures since the last settle
        self._serving = 0  # 1 from ``serving`` to ``retire``: this copy counted in _SERVING

    def serving(self, info_labels: Sequence[str], queue_size: int, memory_bytes: int) -> None:
        """The version serves: its info series (``info_labels``: name, version, device, dtype) reads 1 until
        ``gone``, its queue's capacity ``queue_size`` and its weights' ``memory_bytes`` until ``retire``."""
        with _SERVING_LOCK:
            if not self._serving:
                self._serving = 1
                _SERVING[self._labels] += 1
            MODEL_INFO.labels(*info_labels).set(1)
            QUEUE_CAPACITY.labels(*self._labels).set(queue_size)
            MODEL_MEMORY.labels(*self._labels).set(memory_bytes)
        # at 0 from the start: "none yet" never reads as "no data" to an alert, nor a rate() misses the first batch
        for name in BATCHER_EVENT_NAMES:
            self._of(BATCHER_EVENTS, name)
        for stage in STAGES:
            self._of(STAGE_SECONDS, stage)
            self._of(STAGE_CPU_SECONDS, stage)
        series(BATCH_SIZE, *self._labels)

    def _of(self, metric: Any, label: str) -> Any:
        """``metric``'s series of this version and ``label`` (a stage, a batcher event), looked up once."""
        found = self._series.get((metric, label))
        if found is None:
            found = self._series[(metric, label)] = metric.labels(*self._labels, label)
        return found

    def _another_copy_serves(self) -> bool:
        """Another copy of this version serves in this process: the series they share are its."""
        return _SERVING[self._labels] > self._serving

    def _stop_serving(self) -> None:
        """Under _SERVING_LOCK: this copy no longer counts as serving its version."""
        if self._serving:
            self._serving = 0
            _SERVING[self._labels] -= 1
            if not _SERVING[self._labels]:
                del _SERVING[self._labels]

    def retire(self) -> None:
        """The version is being unloaded: its queue series and the figures it reported read 0 (unless another copy
        of it serves: they are that copy's), and its batcher's end is no failure."""
        with _SERVING_LOCK, self._figures_lock:
            self.retired = True
            self._stop_serving()
            if self._another_copy_serves():
                return
            for figure in self._figures.values():
                figure.set(0)
            self._queue_depth.set(0)
            self._depth_written = -1  # unknown: a report racing this one may land after it; the next one writes 0
            QUEUE_CAPACITY.labels(*self._labels).set(0)
            MODEL_MEMORY.labels(*self._labels).set(0)

    def gone(self, info_labels: Sequence[str]) -> None:
        """The retired version stopped: its info series reads 0, unless another copy of it serves."""
        with _SERVING_LOCK:
            if not self._another_copy_serves():
                MODEL_INFO.labels(*info_labels).set(0)

    def predictions(self, labels: Sequence[str], confidences: Sequence[float], low_confidence_ratio: float | None,
                    psi: float | None) -> None:
        """Record a batch's predictions made for requests (top-1 label and probability of each) and the
        monitor's figures after it (None: not reported yet)."""
        writes = Increments()
        for label, count in Tally(labels).items():
            predicted = self._predicted.get(label)
            if predicted is None:
                predicted = self._predicted[label] = PREDICTED_CLASS.labels(*self._labels, label)
            writes.inc(predicted, count)
        if self._confidence is None:
            self._confidence = TOP1_CONFIDENCE.labels(*self._labels)
        writes.observe(self._confidence, confidences)
        writes.write()
        with self._figures_lock:
            for gauge, value in ((LOW_CONFIDENCE_RATIO, low_confidence_ratio), (PREDICTION_DRIFT_PSI, psi)):
                if value is not None and not self.retired:
                    figure = self._figures.get(gauge)
                    if figure is None:
                        figure = self._figures[gauge] = gauge.labels(*self._labels)
                    figure.set(value)

    def forward_ran(self, wall_s: float | None, cpu_s: float, decode_cpu_s: float = 0.0) -> None:
        """The wall time and CPU of a forward pass of the batch running now, and the CPU of decoding its images as
        it was made (the device path's), counted with it when it is done (``batch_done``; a shadow's images run as
        batches of the candidate's and count there). A batch split for memory tells each pass: the whole one that
        raised (``wall_s`` None: its CPU and decoding were spent, its time is no forward pass's) and each part's; a
        failed batch's, whose items run again alone, counts with the next batch done."""
        if wall_s is not None:
            self._pass_walls.append(wall_s)
        self._pass_cpu_s += cpu_s
        self._pass_decode_cpu_s += decode_cpu_s

    def batch_done(self, size: int, run_s: float, queued_s: Sequence[float], cpu_s: float) -> None:
        """Hold one batch's figures for ``settle``: its size, its time, its thread's CPU and its forward pass's
        (``forward_ran``), and how long its images waited."""
        walls, forward_cpu_s, decode_cpu_s = self._pass_walls, self._pass_cpu_s, self._pass_decode_cpu_s
        self._pass_walls, self._pass_cpu_s, self._pass_decode_cpu_s = [], 0.0, 0.0
        with self._held_lock:
            held = self._held
            held.sizes.append(size)
            held.run_s.append(run_s)
            held.queued_s.extend(queued_s)
            held.cpu_s += cpu_s
            held.forward_s += walls
            held.forward_cpu_s += forward_cpu_s
            held.decode_cpu_s += decode_cpu_s

    def settle(self, accounting_cpu_s: float = 0.0) -> None:
        """Write the batches' figures held since the last call; ``accounting_cpu_s``: the CPU their monitoring took
        (``LoadedVersion.settle``), counted with their inference stage as when it ran in each batch."""
        with self._held_lock:
            held, self._held = self._held, _HeldBatches()
        held.cpu_s += accounting_cpu_s
        if held.sizes:
            of = self._of
            writes = Increments()
            writes.observe(series(BATCH_SIZE, *self._labels), held.sizes)
            writes.observe(of(STAGE_SECONDS, "inference"), held.run_s)
            writes.inc(of(STAGE_CPU_SECONDS, "inference"), held.cpu_s)
            if held.forward_s:
                writes.observe(of(STAGE_SECONDS, "forward"), held.forward_s)
                writes.inc(of(STAGE_CPU_SECONDS, "forward"), held.forward_cpu_s)
            if held.decode_cpu_s:
                writes.inc(of(STAGE_CPU_SECONDS, "decode"), held.decode_cpu_s)
            writes.observe(of(STAGE_SECONDS, "queue"), held.queued_s)
            writes.write()
        if self._memory_stats is not None and (now := time.monotonic()) - self._memory_read_at >= MEMORY_READ_S:
            self._memory_read_at = now
            show_gpu_memory(self._memory_stats())

    def event(self, name: str, count: int = 1) -> None:
        """Count a batcher event of this version."""
        self._of(BATCHER_EVENTS, name).inc(count)

    def decoded(self, seconds: float, cpu_s: float, requests: int = 1) -> None:
        """A request's images decoded (or their headers read) in ``seconds``, its thread's ``cpu_s``: a bundle of
        ``requests`` counts the time once for each (its decode stage) and the CPU once."""
        writes = Increments()
        writes.observe_times(self._of(STAGE_SECONDS, "decode"), seconds, requests)
        writes.inc(self._of(STAGE_CPU_SECONDS, "decode"), cpu_s)
        writes.write()

    def queue_depth(self, depth: int) -> None:
        """Publish the queue depth (written when it changed: the batcher reports it when none was reported lately,
        as items are queued or a batch is taken, and as its batches' figures are settled, 0 once they end)."""
        if self.retired:
            if self._another_copy_serves():
                return
            depth = 0
        if depth != self._depth_written:
            self._depth_written = depth
            self._queue_depth.set(depth)

    def running(self, alive: bool) -> None:
        """The inference thread started or ended: one that ends unretired (a worker without it cannot be ready)
        reads 0 at once. A start writes nothing: the gauge is every served version's (another's thread may have
        ended), which the service sets as it reports (``Service.alive``). A copy whose thread ended (a crash, its
        service's shutdown) no longer counts as serving its version (_SERVING)."""
        if self.retired or alive:
            return
        with _SERVING_LOCK:
            self._stop_serving()
        BATCHER_ALIVE.set(0)
        READY.set(0)

# Rollouts (app/engine/rollouts/evidence.py, app/engine/service.py): a candidate against the live version of its model (the
# dashboard's shadow panels read these).
SHADOW_COMPARED = Counter("visionserve_shadow_compared_total", "Images a shadow candidate answered beside the live "
                          "version", ["model", "version", "live_version"])
SHADOW_AGREED = Counter("visionserve_shadow_agreed_total", "Shadow comparisons whose top-1 class agreed with the "
                        "live version's", ["model", "version", "live_version"])
SHADOW_DROPPED = Counter("visionserve_shadow_dropped_total", "Shadow work not run: busy (live work queued), full, "
                         "stale, retired, incompatible", ["model", "version", "reason"])
SHADOW_ERRORS = Counter("visionserve_shadow_errors_total", "Images the shadow candidate failed on",
                        ["model", "version"])
SHADOW_PROBABILITY_DIFFERENCE = Histogram(
    "visionserve_shadow_probability_difference", "Per image, the largest difference between the live and the "
    "candidate's probability of one class", ["model", "version"],
    buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0))
VERSION_REQUESTS = Counter("visionserve_version_requests_total", "Requests per model version, by how they reached "
                           "it (role: live, the default answered a request naming no version; canary, the rollout's "
                           "candidate answered its share of those; named, the request named the version) and by "
                           "outcome (ok; failed: 500, or 504 once its images queued; refused: any other error, a 504 "
                           "whose deadline the decode spent before its images queued among them)",
                           ["model", "version", "role", "outcome"])
VERSION_REQUEST_SECONDS = Histogram("visionserve_version_request_duration_seconds", "Time a request spent in the "
                                    "engine (decode, queue, forward), per model version", ["model", "version"],
                                    buckets=_LATENCY_BUCKETS)
ROLLOUT_ROLE = Gauge("visionserve_rollout_role", "1 for each loaded version's role in its model's rollout: live, "
                     "canary, shadow, previous", ["model", "version", "role"], multiprocess_mode="livemax")
EXPLANATIONS = Counter("visionserve_explanations_total", "Explanations (POST /explain) by model, version and "
                       "outcome: ok, refused (the lane full, no gradients, a bad image) or failed",
                       ["model", "version", "outcome"])
EXPLAIN_SECONDS = Histogram("visionserve_explain_duration_seconds", "An explanation's time in its lane: decode, "
                            "forward and backward pass, map (and overlay)", ["model"],
                            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
ROLLOUT_CHANGES = Counter("visionserve_rollout_changes_total", "Promotions and rollbacks, by call or by the rules "
                          "(action promote or rollback), a watched new default's first requests found within "
                          "the rollback rule's bounds (settle: it is watched no longer), and a canary the rules took "
                          "out of its rollout, its own requests past those bounds (abort)", ["model", "action"])
ROLLOUT_CANDIDATE_REFUSED = Gauge("visionserve_rollout_candidate_refused", "1 while a model's rollout goes on "
                                  "without this candidate because it cannot load (the live version serves alone, "
                                  "or beside the next newest version as the candidate where none was named; "
                                  "/v1/models rollouts[].candidate_refused says why); 0 once it loads or is no "
                                  "longer the candidate", ["model", "version"], multiprocess_mode="livemax")


class RequestTally:
    """Requests' outcomes and times per version (``visionserve_version_requests_total`` and
    ``visionserve_version_request_duration_seconds``), held and written together: one increment per series for all
    the requests counted since the last write, not several per request. An engine's loop writes them once they have
    been held ``flush_s`` (METRICS_FLUSH_MS, as a version's batch figures; ``due_at`` says when) and whenever a
    reader asks (a scrape's ``settle_figures``, the engine's stop): a busy loop writes them once for many turns.
    Not thread-safe: one thread counts and flushes."""

    def __init__(self, flush_s: float = 0.0) -> None:
        self.flush_s = flush_s
        self.due_at: float | None = None  # when what is held is to be written (None: nothing held)
        self._outcomes: Tally[tuple[str, str, str, str]] = Tally()
        self._seconds: dict[tuple[str, str], list[float]] = {}

    def count(self, model: str, version: str, role: str, outcome: str, requests: int,
              seconds: Sequence[float] | None) -> None:
        """``requests`` of one version, role and outcome, and their times where they count (None: refusals' do
        not)."""
        if self.due_at is None:
            self.due_at = time.monotonic() + self.flush_s
        self._outcomes[model, version, role, outcome] += requests
        if seconds is not None:
            self._seconds.setdefault((model, version), []).extend(seconds)

    def flush_when_due(self, now: float) -> None:
        """``flush`` once what is held has been held ``flush_s``."""
        if self.due_at is not None and now >= self.due_at:
            self.flush()

    def flush(self) -> None:
        """Write what was counted since the last flush."""
        if not self._outcomes:
            return
        outcomes, self._outcomes = self._outcomes, Tally()
        seconds, self._seconds = self._seconds, {}
        self.due_at = None
        writes = Increments()
        for labels, count in outcomes.items():
            writes.inc(series(VERSION_REQUESTS, *labels), count)
        for (model, version), times in seconds.items():
            writes.observe(series(VERSION_REQUEST_SECONDS, model, version), times)
        writes.write()


# Every series an alert or a dashboard reads exists at 0 from the start, so "none yet" never reads as "no data".
for _reason in ("overloaded", "deadline_unreachable", "not_ready"):
    REJECTED.labels(_reason)
# (a version's batcher events and stages from when it serves: MetricsObserver.serving)


def render() -> tuple[bytes, str]:
    """The exposition text for /metrics: every worker's values in multiprocess mode, else this process's."""
    if folder := os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        registry.register(WorkerCollector())  # multiprocess mode has no process_* series of its own
        with metrics_files.reading(Path(folder)):  # an ended process's counts once, folded or not yet
            return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
