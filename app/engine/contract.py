"""The engine as the HTTP side knows it, torch-free, so the protocols and the web layer can run in processes that
never import torch (under ENGINE=process, reaching an engine process through app/link/client.py) and the same types
serve when the engine runs inside the worker:

- the data that crosses: ``Signature`` (what a protocol parses a request with), ``Served`` and ``Ranked`` (a
  request's answer, its stage times: ``stage_ms``), ``VersionInfo`` (one loaded version's facts), ``VersionState``
  (a row of the repository index);
- the faces: ``ServiceFace`` (what protocols and the web layer use of a service: ``admit`` -> a ``CallFace``, the
  ``catalog``, readiness, draining), ``CatalogFace`` (every catalog call, the one list the remote catalog is made
  from: ``CATALOG_CALLS``), implemented by the engine's ``Service`` and the link's ``RemoteService``;
- ``Lifecycle``: what both services do alike (started, draining, requests in flight, the waits and checks).
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, NamedTuple, Protocol, Sequence

import numpy as np

from app.config import Settings
from app.engine.batching.arrivals import InFlight
from app.engine.batching.types import BatchRun
from app.engine.ranking import top_indices
from app.errors import NoEmbedding, NotReady, retry_after_header
from app.hosting import control
from models.export.manifest import Manifest

log = logging.getLogger(__name__)

NOT_READY_RETRY_S = 5  # Retry-After of every 503: loading, draining, a stopped batcher, an engine away
CLIENT_CHECK_S = 0.05  # how often a waiting request looks whether its client is still connected
DRAINING = ("the server is shutting down, or reloading its workers (a HUP): retry; its other workers, or the new ones "
            "once they serve, answer")  # a draining worker's 503: it cannot tell a stop from a reload


@dataclass(frozen=True)
class Signature:
    """What a protocol parses a request and shapes its answer with: the version that answers, its classes in output
    order, and the input a client may send preprocessed."""

    name: str
    version: str
    labels: list[str]
    input_shape: tuple[int, ...]  # (C, H, W) of one preprocessed image
    embedding_dim: int = 0  # the length of the embedding it answers when asked (0: its export has none)

    def check_embedding(self) -> None:
        """NoEmbedding (400) unless this version answers embeddings."""
        if not self.embedding_dim:
            raise NoEmbedding(f"{self.name} version {self.version} was exported without an embedding: export it "
                              f"again with this release's python -m models.export (every export since records one)")

    @property
    def num_classes(self) -> int:
        """How many classes the model tells apart (the width of its output)."""
        return len(self.labels)


class Ranked(NamedTuple):
    """One class of an image's top k: its index in the output, its label, its probability."""

    index: int
    label: str
    score: float


@dataclass(slots=True)
class Served:
    """A request's answer: its ``rows``, one per input in order (float32 probabilities, followed by the image's
    embedding when it was asked for: ``embedding_dim`` columns), the batches they ran in (a run of consecutive
    inputs per batch, in input order: ``Group.runs``), which version gave it, and how long decoding took. Never
    changed once made, but not frozen: made on both sides of every request (app/link/wire.py ``_Message``)."""

    rows: np.ndarray
    batches: tuple[BatchRun, ...]
    model: str
    version: str
    labels: list[str]  # class names in output order
    decode_s: float
    started_ns: int = 0  # wall clock (time.time_ns) when decoding began: traces place the stages from it
    embedding_dim: int = 0  # the rows' last columns that are the embedding (0: none asked)

    def labelled(self, labels: list[str]) -> "Served":
        """This answer with ``labels`` (an answer crosses the link without them): made directly, where
        ``dataclasses.replace`` looks the fields up again each time (about 10 us a request)."""
        return Served(self.rows, self.batches, self.model, self.version, labels, self.decode_s, self.started_ns,
                      self.embedding_dim)

    def between(self, start: int, stop: int) -> "Served":
        """The answer of rows ``start`` to ``stop`` alone (a bundle's requests on one connection: theirs of its
        rows): those rows (a view) and the runs they ran in, cut to them."""
        if start == 0 and stop == len(self.rows):
            return self
        runs, at = [], 0
        for run in self.batches:
            first, last = max(at, start), min(at + run.rows, stop)
            if first < last:
                runs.append(run if last - first == run.rows else run._replace(rows=last - first))
            at += run.rows
        return Served(self.rows[start:stop], tuple(runs), self.model, self.version, self.labels, self.decode_s,
                      self.started_ns, self.embedding_dim)

    def batch_sizes(self) -> list[int]:
        """The size of the batch each input ran in, in input order."""
        return [size for run in self.batches for size in (run.batch_size,) * run.rows]

    def probabilities(self) -> np.ndarray:
        """(N, classes) float32 softmax probabilities, one row per input."""
        rows = self.rows
        return rows[:, :rows.shape[1] - self.embedding_dim] if self.embedding_dim else rows

    def embeddings(self) -> np.ndarray:
        """(N, embedding_dim) float32 L2-normalised embeddings, one row per input (asked for: ``embedding_dim``)."""
        assert self.embedding_dim, "no embedding was asked for"
        return np.ascontiguousarray(self.rows[:, -self.embedding_dim:])

    def top_k(self, k: int) -> list[list[Ranked]]:
        """Each image's ``k`` most probable classes (at most every class), most probable first (ties: the lower
        index first)."""
        probabilities = self.probabilities()
        order = top_indices(probabilities, min(k, probabilities.shape[1]))
        labels = self.labels
        return [[Ranked(i, labels[i], score) for i, score in zip(indices, row[indices].tolist())]
                for row, indices in zip(probabilities, order.tolist())]


def stage_ms(runs: Sequence[BatchRun]) -> tuple[float, float]:
    """(queue, inference) milliseconds of one request's images: the one definition the Server-Timing header and
    the access log both report.

    inference: the wall time the request's images spent in forward passes, the sum of its batch runs' ``run_s`` (one
    run per batch: images of one batch share its forward pass). A request's images are queued together and a
    batcher runs one batch at a time, so its batches never overlap and their durations add up; the largest alone
    would leave out every batch but one, and a sum over images would count a batch once per image.
    queue: from the images' queueing to the end of the request's last batch, less that inference: the time they
    waited behind other work (and for company) while none of the request's batches ran: decode + queue + inference
    then add up to the request's time from its first decode to the end of its last forward pass.
    """
    inference_s = sum(run.run_s for run in runs)
    done_s = max(run.queued_s + run.run_s for run in runs)
    return max(0.0, done_s - inference_s) * 1000, inference_s * 1000


@dataclass(frozen=True)
class Explanation:
    """Why a version chose a class for one image: its Grad-CAM map (``grid``: rows of 0..1 values over ``crop``, the
    region (left, top, right, bottom) of the photo the model saw), from the feature map of ``layer``, computed on its
    ``weights`` (the format that gave the gradients), and the overlay PNG when asked for."""

    model: str
    version: str
    index: int
    label: str
    score: float
    method: str
    layer: str
    weights: str
    grid: list[list[float]]
    crop: tuple[int, int, int, int]
    explain_ms: float
    png: bytes | None = None


@dataclass(frozen=True)
class VersionInfo:
    """One loaded version's facts, as /v1/models and the V2 metadata show them."""

    manifest: Manifest
    weights_format: str
    device: str
    dtype: str
    memory_format: str  # contiguous or channels_last: the layout its forward passes run in
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


@dataclass(frozen=True)
class ModelsOverview:
    """What /v1/models shows, read in one catalog call (one exchange with an engine process, not four): every loaded
    version, what each worker serves, the default model, the rollouts."""

    versions: list[VersionInfo]
    workers: list[dict[str, Any]]
    default_model: str | None
    rollouts: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class VersionState:
    """One row of the repository index: a version and what this process does with it."""

    name: str
    version: str
    state: str  # READY, LOADING, UNLOADING, UNAVAILABLE (Triton's words)
    reason: str = ""


@dataclass(frozen=True)
class RepositoryOverview:
    """What the V2 repository index shows, read in one catalog call (one exchange with an engine process, not
    five): every version's state, the default model and its default version, each version's role and the
    rollouts."""

    index: list[VersionState]
    default_model: str | None
    default_version: str | None
    roles: dict[tuple[str, str], str]
    rollouts: dict[str, dict[str, Any]]


class CatalogFace(Protocol):
    """What protocols read about the served models and the calls that change them (app/engine/catalog.py):
    plain data out. Every public method here is a catalog call; an engine process answers the same ones."""

    def versions(self) -> list[VersionInfo]: ...
    def overview(self) -> ModelsOverview: ...
    def repository_overview(self) -> RepositoryOverview: ...
    def version(self, name: str | None, version: str | None = None) -> VersionInfo: ...
    def signature(self, name: str | None, version: str | None = None) -> Signature: ...
    def routes_generation(self) -> int: ...
    def default_model(self) -> str | None: ...
    def serving(self) -> dict[str, Any]: ...
    def workers(self) -> list[dict[str, Any]]: ...
    def index(self) -> list[VersionState]: ...
    def in_repository(self, name: str, version: str | None = None) -> bool: ...
    def roles(self) -> dict[tuple[str, str], str]: ...
    def rollouts(self) -> dict[str, dict[str, Any]]: ...
    def settle_figures(self) -> None: ...
    def load(self, name: str, config: Any = None) -> dict[str, Any]: ...
    def unload(self, name: str) -> dict[str, Any]: ...
    def promote(self, name: str, version: str | None = None) -> dict[str, Any]: ...
    def rollback(self, name: str, version: str | None = None) -> dict[str, Any]: ...


# The catalog's calls, from the face itself: a new call is one method on CatalogFace and its implementation.
CATALOG_CALLS = tuple(name for name, _ in inspect.getmembers(CatalogFace, inspect.isfunction)
                      if not name.startswith("_"))
# Those that change what is served (each waits for every engine to apply it); every other one reads.
CATALOG_CHANGES = frozenset({"load", "unload", "promote", "rollback"})


class PixelsForTheDefault(Exception):
    """Raised in an admission (``ServiceFace.admit``) whose call cannot take the request's pixels (``takes_pixels``
    False: a canary whose input differs from the default's, for which a request naming no version shapes them): the
    admission ends uncounted, and the request is admitted again with ``pixels=True``, which routes it to the
    default."""


class CallFace(Protocol):
    """One admitted request: ``model`` to parse its body with, ``infer`` to run its images; ``takes_pixels``: False
    when pixels (not images) must go to the default (PixelsForTheDefault)."""

    model: Signature
    takes_pixels: bool

    def infer(self, images: Sequence[bytes] = (), tensors: Sequence[Any] = (), *, timeout_s: float,
              names: Sequence[str | None] = (), client_gone: Callable[[], bool] | None = None,
              embedding: bool = False) -> Served: ...


class ServiceFace(Protocol):
    """What protocols and the web layer use of a service, in the worker (``Service``) or across the link
    (``RemoteService``)."""

    settings: Settings
    catalog: CatalogFace
    in_flight: InFlight

    def admit(self, name: str | None = None, version: str | None = None, client_key: str | None = None,
              images: int = 0, timeout_s: float | None = None, pixels: bool = False) -> ContextManager[CallFace]: ...
    @property
    def loaded(self) -> bool: ...
    @property
    def alive(self) -> bool: ...
    @property
    def ready(self) -> bool: ...
    @property
    def draining(self) -> bool: ...
    @property
    def refusing(self) -> bool: ...
    @property
    def stalled(self) -> str | None: ...
    def begin_drain(self, within_s: float | None = None) -> None: ...
    def deadline_limit_s(self, request_timeout_s: float) -> float: ...
    def stop_serving(self) -> None: ...
    def shutdown(self, timeout: float | None = None) -> None: ...
    def wait_drained(self, min_s: float, max_s: float, answer_on: Callable[[], bool] | None = None) -> bool: ...
    def wait_loaded(self, timeout_s: float) -> None: ...
    def require_loaded(self) -> None: ...
    def require_ready(self) -> None: ...
    def explain(self, image: bytes, name: str | None = None, version: str | None = None, index: int | None = None,
                png: bool = False, timeout_s: float = 30.0) -> Explanation: ...


ANSWER_ON_POLL_S = 0.1  # how often a drain that answers on looks whether it still should (``wait_drained``)
ANSWER_ON_FIRST_LOOK_S = 1.0  # how long after its SIGTERM a drain looks for a new worker loading, whatever its window
ANSWER_ON_LEAVES_S = 5.0  # what answering on leaves of the drain's limit (SHUTDOWN_DRAIN_S when longer): the
# deadline of the last requests it admits (``deadline_limit_s``)
DRAIN_LEAST_DEADLINE_S = 1.0  # less than this left of a drain: a new request goes elsewhere (503), not in a hurry


def not_ready(why: str, close: bool = False) -> NotReady:
    """503 with Retry-After saying ``why``; ``close``: the client should reconnect elsewhere (Connection: close)."""
    headers = retry_after_header(NOT_READY_RETRY_S)
    return NotReady(why, headers={**headers, "Connection": "close"} if close else headers)


class Lifecycle:
    """A service's life, alike in the worker and across the link: started once its first models serve, draining
    from ``begin_drain`` (not ready, its answers closing their connections, still answering new requests), refusing
    them once its drain's window ends (``stop_serving``), its admitted requests counted in ``in_flight`` (what a
    drain waits for)."""

    def __init__(self) -> None:
        self.in_flight = InFlight()  # requests admitted and not yet answered
        self._started = threading.Event()
        self._draining = threading.Event()
        self._refusing = threading.Event()
        self._drain_ends: float | None = None  # time.monotonic() by which a drain must be over (begin_drain's within_s)
        self._leaving_lock = threading.Lock()  # the leaving mark's write against stop_serving's refusal and removal
        # An HTTP worker's file saying it serves (CONTROL_DIR's http-<pid>.ready): there from its first models (or
        # its engine reached) until its drain, and away while its engine restarts (app/link/client.py). A worker
        # without one leaves new connections to the workers that have one (app/hosting/worker.py); None: no file
        # (an engine process, a test's app).
        self.ready_mark: Path | None = None
        self._mark_unwritten = False  # the last try to write the ready mark failed (warned of once)

    @property
    def draining(self) -> bool:
        """True once this process's shutdown has begun."""
        return self._draining.is_set()

    @property
    def refusing(self) -> bool:
        """True once its drain stopped answering new requests (``stop_serving``)."""
        return self._refusing.is_set()

    @property
    def leaving_mark(self) -> Path | None:
        """Beside the ready mark: the file saying this worker drains and still answers (CONTROL_DIR's
        http-<pid>.leaving), or None without a ready mark."""
        return None if self.ready_mark is None else control.leaving_mark(self.ready_mark.parent, os.getpid())

    def begin_drain(self, within_s: float | None = None) -> None:
        """Turn readiness off so load balancers stop sending; accepted work still completes, and new requests are
        still answered (each answer closing its connection) until ``stop_serving``. ``within_s``: the drain must be
        over by then (its worker is stopped after it), so a request admitted from now on gets at most what is left
        of it for its deadline (``deadline_limit_s``). A worker that served says it leaves (its leaving mark, made
        before its ready mark goes: a HUP's new worker, still loading, leaves the new connections to it meanwhile).
        Never raises (a worker's SIGTERM handler calls it): a mark that cannot be written or removed (CONTROL_DIR
        read-only) is warned of."""
        if within_s is not None and self._drain_ends is None:
            self._drain_ends = time.monotonic() + within_s
        self._draining.set()
        if self.ready_mark is not None:
            try:
                served = self.ready_mark.exists()
            except OSError:
                served = False
            if served:
                self._mark_leaving()
        self._remove_ready_mark()
        self._remove_loading_mark()  # (told to stop while it loads: no replacement on its way)
        self._drain_begun()

    def _mark_leaving(self) -> None:
        """The leaving mark written, unless the drain's window is over."""
        leaving = self.leaving_mark
        if leaving is None:
            return
        with self._leaving_lock:
            if self.refusing:
                return
            try:
                leaving.touch()
            except OSError as exc:
                log.warning("could not write the leaving mark %s: %s; a worker still loading takes new connections "
                            "meanwhile (503 until it serves)", leaving, exc)

    def deadline_limit_s(self, request_timeout_s: float) -> float:
        """The longest deadline a request admitted now may have: ``request_timeout_s``, or during a drain that must
        end sooner (``begin_drain``'s ``within_s``) what is left of it, so that its answer (a 504 at worst) comes
        before its worker is stopped; NotReady (503, the connection closing) once less than DRAIN_LEAST_DEADLINE_S
        is left."""
        ends = self._drain_ends
        if ends is None:
            return request_timeout_s
        left_s = ends - time.monotonic()
        if left_s < min(DRAIN_LEAST_DEADLINE_S, request_timeout_s):
            raise not_ready(DRAINING, close=True)
        return min(request_timeout_s, left_s)

    def stop_serving(self) -> None:
        """The drain's window is over: new requests are answered 503 (``require_ready``), and the leaving mark goes.
        Never raises."""
        if not self.draining:
            self.begin_drain()
        with self._leaving_lock:
            self._refusing.set()
            self._remove_leaving_mark()

    def _remove_loading_mark(self) -> None:
        if self.ready_mark is not None:
            with contextlib.suppress(OSError):  # (the master removes it when the worker ends)
                control.loading_mark(self.ready_mark.parent, os.getpid()).unlink(missing_ok=True)

    def _remove_leaving_mark(self) -> None:
        leaving = self.leaving_mark
        if leaving is not None:
            try:
                leaving.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("could not remove the leaving mark %s: %s", leaving, exc)

    def _remove_ready_mark(self) -> None:
        if self.ready_mark is None:
            return
        try:
            self.ready_mark.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not remove the ready mark %s: %s; the other workers take this worker for one that "
                        "serves while it is there (a drain goes on all the same)", self.ready_mark, exc)

    def _serving_now(self) -> None:
        """The first models serve (or the engine was reached): the ready mark made, unless a drain began (one that
        began meanwhile takes it away again). A mark that cannot be written leaves this worker serving: the others
        then hold back new connections longer (until they serve), readiness waits for it in process mode, and
        ``_keep_ready_mark`` writes it again. The first failure is warned of, the next ones until a write succeeds
        are at debug."""
        if self.ready_mark is None or self.draining:
            return
        self._remove_loading_mark()
        try:
            self.ready_mark.touch()
        except OSError as exc:
            log.log(logging.DEBUG if self._mark_unwritten else logging.WARNING, "could not write the ready mark %s: %s "
                    "(tried again while this worker serves)", self.ready_mark, exc)
            self._mark_unwritten = True
            return
        if self._mark_unwritten:
            log.info("wrote the ready mark %s", self.ready_mark)
            self._mark_unwritten = False
        if self.draining:  # began between the look and the touch: its look and unlink may have come first
            self._mark_leaving()
            self._remove_ready_mark()

    def _keep_ready_mark(self) -> None:
        """The ready mark written again where it is missing while this process serves and is not draining (a write
        that failed: CONTROL_DIR full during a HUP). Called on a path that follows this process's state anyway (the
        engine's reports, the link's watch of its engine); a stat when the mark is there. Never raises."""
        if self.ready_mark is None or not self._started.is_set() or self.draining:
            return
        try:
            missing = not self.ready_mark.exists()
        except OSError:  # the directory cannot be looked into: the touch says why
            missing = True
        if missing:
            self._serving_now()

    def _drain_begun(self) -> None:
        """What else a drain turns off (a gauge)."""

    def wait_drained(self, min_s: float, max_s: float, answer_on: Callable[[], bool] | None = None) -> bool:
        """After begin_drain: wait ``min_s``, then until no admitted request is left unanswered, ``max_s`` at most.

        The server keeps its listener open meanwhile, so nothing waits unanswered in the listen backlog: for
        ``min_s`` new requests are answered as before (each with Connection: close), and on while ``answer_on`` says
        so (a HUP's new worker still loading: ``_answer_on``), as long as that leaves ``min_s``, and
        ANSWER_ON_LEAVES_S at least, for what is admitted last, then 503 (``stop_serving``). Returns whether every
        request finished in time.
        """
        started = time.monotonic()
        time.sleep(min(min_s, max_s))
        if answer_on is not None:
            self._answer_on(started, max_s - max(min_s, ANSWER_ON_LEAVES_S), answer_on)
        self.stop_serving()
        return self.in_flight.wait_empty(max(0.0, max_s - (time.monotonic() - started)), poll_s=0.05)

    @staticmethod
    def _answer_on(started: float, last_s: float, answer_on: Callable[[], bool]) -> None:
        """``wait_drained``'s answering past its window: while ``answer_on`` says so, until ``last_s`` after
        ``started``; looked at for ANSWER_ON_FIRST_LOOK_S at least (a HUP's new worker writes its loading mark just
        after its fork, which may come just after the old worker's SIGTERM)."""
        told = False
        while (elapsed := time.monotonic() - started) < last_s:
            if answer_on():
                if not told:
                    told = True
                    log.info("draining: a new worker is still loading and none serves; answering on until one does "
                             "(%.1f s at most)", last_s - elapsed)
            elif elapsed >= ANSWER_ON_FIRST_LOOK_S:
                return
            time.sleep(ANSWER_ON_POLL_S)

    def wait_loaded(self, timeout_s: float) -> None:
        """Wait for the first models (``timeout_s`` at most), then as ``require_loaded``: a repository call reaching
        a process that is still starting waits for it instead of failing."""
        self._started.wait(timeout_s)
        self.require_loaded()

    def require_loaded(self) -> None:
        """NotReady (503 with Retry-After) while the first models load."""
        if not self._started.is_set():
            raise not_ready("the model is still loading")

    def require_ready(self) -> None:
        """NotReady (503 with Retry-After) unless new work can be accepted."""
        if self.refusing:  # the client should go elsewhere: this connection will not serve it again
            raise not_ready(DRAINING, close=True)
        self.require_loaded()
        self._require_serving()

    def _require_serving(self) -> None:
        """What else must hold before a request is admitted (the engine: its batchers run)."""
