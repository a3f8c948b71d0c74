"""The engine as an HTTP worker sees it when the engine runs in a process of its own (``ENGINE=process``): a
``contract.ServiceFace`` (``admit`` -> a call whose ``infer`` answers a ``Served``, ``catalog``, readiness,
draining) over the engine's Unix socket (app/link/wire.py, served by app/link/server.py). Never imports torch: the
worker keeps everything HTTP (routes, parsing, auth, drain, the access log) and nothing of the model.

A request is one exchange: the worker parses its body with the signature it keeps of the version the request asks
for (fetched once, dropped when the engine's answers say its routing changed or another engine answers), then sends
the request with its images and reads the answer, on a connection of the worker's that no other exchange holds
(``EngineConnections``); a connection that fails is closed and the next request makes a new one. Its waits are
``app/hosting/waiting.py``'s: a request thread polls, a request on the worker's loop hands the wait to the loop. The
requests on the worker's loop share one connection instead, several to a message (app/link/loop_link.py). An
engine that dies fails the requests in flight with 503 and Retry-After (the master restarts it); until it is back,
requests get 503 ``not_ready``. So do they, and catalog calls, refused at once and not sent, while the engine's
latest state query went unanswered within STATE_TIMEOUT_S (stopped, or its loop stuck): the watch of the engine then
asks again every WAIT_S, and the master kills and restarts an engine silent for STALL_S (app/link/supervisor.py). A
request sent to it before then waits for its answer its deadline and ANSWER_GRACE_S at most (504), as every
request does: the engine answers 504 at the deadline itself.

Readiness is the server's, not this worker's alone: ready once the engine is ready, this worker is not draining,
and every worker of the server reached the engine (each marks ``http-<pid>.ready`` in CONTROL_DIR; the master
removes a dead worker's mark), so after the first 200 of ``/readyz`` no worker answers ``not_ready``. A mark that
could not be written (CONTROL_DIR full) is written again every WATCH_S while the engine lives. The mark is away
from the engine's end until the restarted engine is ready, and while the engine's state queries go unanswered for
SILENT_AWAY_S until it answers again: meanwhile the worker leaves new connections to the workers whose engine
serves (app/hosting/worker.py), or, with none (one engine), takes them to answer 503.

The gauges ``visionserve_ready`` and ``visionserve_batcher_alive`` read 0 in every process from its import, and
/metrics reads their lowest over the live processes, the engines' included: a worker sets its own part, 1 while it
reaches a ready engine (it has no inference thread of its own), ready 0 while a worker's mark is missing (as
``/readyz`` says: each reading of ``ready`` sets it, and so does the watch every WATCH_S) and again from its drain.
A dead engine's own values go with it (the master marks it dead), so the worker's part follows its link
(``_follow_engine``): 0 from the engine process's end, which a pidfd of it says at once, until its restart is ready.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import select
import socket
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from app.config import Settings
from app.engine.contract import (
    CATALOG_CALLS,
    CATALOG_CHANGES,
    CLIENT_CHECK_S,
    CatalogFace,
    Explanation,
    Served,
    Signature,
)
from app.engine.lifecycle import Lifecycle, not_ready
from app.errors import (ClientGone, DeadlineExceeded, DeadlinePassedBeforeQueue, LoadFailed, LoadTimeout, NotReady,
                        ServiceError)
from app.hosting import control, waiting
from app.link import wire
from app.link.loop_link import LoopLink
from app.metrics import BATCHER_ALIVE, READY

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 2.0
ANSWER_GRACE_S = 5.0  # beyond a request's deadline, for an engine that answers nothing (it answers 504 at it)
STATE_TIMEOUT_S = 1.0  # an engine that does not say its state within this is not ready (probes never hang)
SIGNATURE_TIMEOUT_S = 5.0  # a signature is a routing-table read: an engine silent this long is stuck
CATALOG_GRACE_S = 10.0  # beyond a catalog call's waits (REPOSITORY_SYNC_TIMEOUT_S; a change's twice: _ask)
STATE_TTL_S = 0.2  # readiness asked of the engine at most this often
WAIT_S = 0.1  # while starting or restarting, how often to look for the engine
WATCH_S = 5.0  # how often the wait for the engine process's end looks whether this worker stops, and at its mark
SILENT_AWAY_S = 5.0  # an engine whose state queries go unanswered this long is taken as away until it answers (a
# pause of a second or two, a long collection, an engine's loop slowed by a busy host, is not)
SILENT_STATE_TTL_S = 5.0  # an unanswered state query stands this long for a probe or a request (the link's watch
# asks again meanwhile, every 1-3 s: its query, STATE_TIMEOUT_S, after a new connection's hello, CONNECT_TIMEOUT_S
# at most): a probe of a silent engine answers at once


def _as_service_error(exc: BaseException) -> ServiceError:
    """What ended a request on this side, for the engine to count as its outcome: a ServiceError as it is, an HTTP
    error (werkzeug's) with its status, anything else as a server error."""
    if isinstance(exc, ServiceError):
        return exc
    error = ServiceError(f"{type(exc).__name__}: {exc}")
    status = getattr(exc, "code", None)
    if isinstance(status, int) and 400 <= status < 600:
        error.status = status
    return error


class RemoteCall:
    """A request admitted here: ``model`` to parse with, ``infer`` to send it with its images and wait."""

    takes_pixels = True  # the engine routes a request of pixels, shaped with ``model``, where they fit

    def __init__(self, service: "RemoteService", model: Signature, request: tuple[str | None, str | None,
                                                                                   str | None]) -> None:
        self.model, self._service, self.request = model, service, request
        self.sent = False  # the request went to the engine (it counts its outcome there)

    def infer(self, images: Sequence[bytes] = (), tensors: Sequence[Any] = (), *, timeout_s: float,
              names: Sequence[str | None] = (), client_gone: Callable[[], bool] | None = None,
              embedding: bool = False, arrived: float | None = None) -> Served:
        """As ``Call.infer``: the request and its images go to the engine as they are, the answer comes back; a
        client that hangs up drops its queued images there (the connection closes, which the engine watches). Its
        deadline counts from ``arrived`` here: one passed already (a wait for the worker's loop) is 504 unsent, and
        on the worker's loop the answer is waited for until it passes (then 504, the request cancelled at the
        engine), and the engine counts it from then too (the message says how long before it was sent: its
        admission judges what is left; on a request thread the engine's 504 is waited for, and the grace is for an
        engine that says nothing)."""
        if embedding:
            self.model.check_embedding()  # refused here: the signature says what the version answers
        deadline = None
        if arrived is not None:
            waited = time.monotonic() - arrived
            if waited >= timeout_s:
                raise DeadlinePassedBeforeQueue.in_its_worker(timeout_s, waited)
            deadline = (arrived, timeout_s)
        if len(tensors):  # the pixels cross as one (N, C, H, W) stack: one segment, however many images
            stack = tensors if isinstance(tensors, np.ndarray) else np.stack([np.asarray(t) for t in tensors])
            specs, segments = wire.tensor_segments([np.ascontiguousarray(stack)])
        else:
            specs, segments = (), images
        self.sent = True
        message = wire.Infer(*self.request, timeout_s=timeout_s, parsed_version=self.model.version,
                             parsed_shape=tuple(self.model.input_shape), names=tuple(names), tensors=specs,
                             embedding=embedding)
        # The engine answers 504 at the deadline itself: one that answers nothing (stopped, its loop stuck) costs the
        # request its deadline and the grace, no more.
        served = self._service.infer(message, segments, timeout_s + ANSWER_GRACE_S, client_gone, deadline)
        return served.labelled(self._service.labels(served, self.model))


def _remote_call(method: str) -> Callable[..., Any]:
    def call(self: "RemoteCatalog", *args: Any, **kwargs: Any) -> Any:
        return self._ask(wire.CatalogCall(method, args, kwargs))

    call.__name__ = call.__qualname__ = method
    call.__doc__ = getattr(CatalogFace, method).__doc__
    return call


class RemoteCatalog:
    """``contract.CatalogFace``, each call answered by the engine: its methods are made from CATALOG_CALLS."""

    def __init__(self, ask: Callable[[wire.CatalogCall], Any]) -> None:
        self._ask = ask


for _method in CATALOG_CALLS:
    setattr(RemoteCatalog, _method, _remote_call(_method))


class EngineConnections:
    """The worker's connections to the engine, each greeted on connect and in one exchange at a time: an exchange
    takes an idle one (or makes one) and gives it back once whole; one whose exchange did not finish is closed, so
    no later request reads an earlier one's answer. Request threads and requests on the worker's loop (greenlets
    of one thread, app/hosting/loop_requests.py) take them alike, so there are as many as exchanges ever ran at
    once."""

    def __init__(self, connect: Callable[[], socket.socket]) -> None:
        self._connect = connect
        self._idle: list[socket.socket] = []  # (a list's pop and append are atomic: no lock)
        self._mismatch_logged = False

    def new(self) -> socket.socket:
        """A new connection, greeted and non-blocking (the caller's own: not one of the idle ones)."""
        conn = self._connect()
        conn.setblocking(False)  # every wait is wire's (a request on the worker's loop hands it to the loop)
        try:
            self._greet(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _sent(self, message: Any, segments: Sequence[bytes | memoryview]) -> socket.socket:
        """A connection with ``message`` sent on it. Idle connections the engine closed since their last exchange
        (a restart) fail the send at once, with nothing of it read there: they are all closed (the engine that
        greeted them is gone) and the message is sent on a new one (no look at a connection before each send)."""
        try:
            conn = self._idle.pop()
        except IndexError:
            return _sent_on(self.new(), message, segments)
        try:
            wire.send(conn, message, segments)
            return conn
        except OSError:
            _close(conn)
            self.close_idle()
        except BaseException:
            _close(conn)
            raise
        return _sent_on(self.new(), message, segments)

    def _greet(self, conn: socket.socket) -> None:
        try:
            wire.say_hello(conn, CONNECT_TIMEOUT_S)
        except wire.WireMismatch as exc:
            if not self._mismatch_logged:
                self._mismatch_logged = True
                log.error("the engine refused this worker: %s", exc)
            raise

    def close_idle(self) -> None:
        """Close the connections no exchange holds (the engine ends whatever it held for them)."""
        while self._idle:
            with contextlib.suppress(IndexError):
                _close(self._idle.pop())

    @contextlib.contextmanager
    def exchange(self, away: str, message: Any, segments: Sequence[bytes | memoryview] = ()) -> Iterator[socket.socket]:
        """A connection with ``message`` sent on it, for its answer, given back once the block ends; the engine
        away, silent or closing it is NotReady (503 with Retry-After) saying ``away`` (or the mismatch); anything
        that leaves the exchange unfinished closes it."""
        conn = None
        try:
            with engine_away(away):
                conn = self._sent(message, segments)
                yield conn
        except BaseException:
            _close(conn)
            raise
        self._idle.append(conn)


@contextlib.contextmanager
def engine_away(away: str) -> Iterator[None]:
    """The engine away, silent or closing the connection as NotReady (503 with Retry-After) saying ``away``, or that
    it runs other code than this worker."""
    try:
        yield
    except wire.WireMismatch as exc:
        raise not_ready(f"the engine runs other code than this worker: {exc}") from None
    except (wire.EngineGone, OSError):
        raise not_ready(away) from None


def _sent_on(conn: socket.socket, message: Any, segments: Sequence[bytes | memoryview]) -> socket.socket:
    try:
        wire.send(conn, message, segments)
    except BaseException:
        _close(conn)
        raise
    return conn


def _close(conn: socket.socket | None) -> None:
    if conn is not None:
        with contextlib.suppress(OSError):
            conn.close()


class RemoteService(Lifecycle):
    """``contract.ServiceFace`` in an HTTP worker, over the engine process at ``slot``."""

    def __init__(self, settings: Settings, slot: int, connect: Callable[[], socket.socket] | None = None) -> None:
        super().__init__()
        assert settings.control_dir is not None, "ENGINE=process needs CONTROL_DIR (gunicorn.conf.py sets it)"
        self.settings, self.slot, self.control_dir = settings, slot, settings.control_dir
        self.ready_mark = control.ready_mark(self.control_dir, os.getpid())
        path = control.socket_path(self.control_dir, slot)
        self.connections = EngineConnections(connect or functools.partial(wire.connect, path, CONNECT_TIMEOUT_S))
        self.catalog = RemoteCatalog(self._ask)
        self._state: tuple[float, wire.EngineState | None] = (0.0, None)
        self._silent_shown = False  # the engine's silence taken as its absence (its ready mark away) until it answers
        self._silent_since: float | None = None  # when its state queries began to go unanswered
        self._engine_lost = False  # the engine that answered last ended; True until one is ready again
        self._signatures: dict[tuple[str | None, str | None], Signature] = {}
        self._signatures_of: tuple[int, int] = (0, 0)  # (engine pid, routing generation) they were read at
        self.loop_link: LoopLink | None = None  # the requests on this worker's loop: one connection, made at first use
        self._stopped = threading.Event()  # this worker is going away: its link's thread ends

    @classmethod
    def start(cls, settings: Settings, slot: int, on_error: Callable[[BaseException], None]) -> "RemoteService":
        """A service that answers now and waits on a thread for the engine to be ready, then follows it there
        (``_follow_engine``); ``on_error`` gets the engine's boot failure (a model that cannot be served)."""
        service = cls(settings, slot)
        threading.Thread(target=service._link_engine, args=(on_error,), name="engine-wait", daemon=True).start()
        return service

    def _link_engine(self, on_error: Callable[[BaseException], None]) -> None:
        self._wait_for_engine(on_error)
        if self._started.is_set():
            self._follow_engine()

    def _wait_for_engine(self, on_error: Callable[[BaseException], None]) -> None:
        failure = control.engine_failure(self.control_dir, self.slot)
        while not self._started.is_set():
            if failure.is_file():
                on_error(LoadFailed(failure.read_text(encoding="utf-8")))
                return
            state = self._engine_state(fresh=True)
            if state is not None and state.ready:
                self._started.set()
                self._serving_now()
                self._show_engine(True)
                log.info("ready to serve (engine %d)", self.slot)
                return
            time.sleep(WAIT_S)

    def _follow_engine(self) -> None:
        """Until this worker stops: its gauges 0 and its ready mark away from its engine's end (``_engine_gone``)
        until an engine is ready again (the master restarts it), then 1 and the mark again. Without this the
        worker's 1s, left alone once the dead engine's values went, read ready and alive while /readyz said 503; and
        with its mark there it would take its share of the new connections, which the workers of the other engines
        serve, to answer them 503 (app/hosting/worker.py: without one it leaves them to those, or takes them when
        none serves)."""
        while not self._stopped.is_set():
            self._engine_gone()
            if self._stopped.is_set():
                return
            self._remove_ready_mark()
            self._not_answering(gone=True)
            self._show_engine(False)
            log.info("engine %d is gone: waiting for it to be ready again", self.slot)
            while not self._stopped.wait(WAIT_S):  # (a restart takes a second at least: RESTART_DELAY_S)
                state = self._engine_state(fresh=True)
                if state is not None and state.ready:
                    # (a silent engine that died meanwhile: no longer silent either)
                    self._silent_shown, self._silent_since, self._engine_lost = False, None, False
                    self._serving_now()
                    if self.draining:  # back within its drain, which answers again: it says so (its leaving mark)
                        self._mark_leaving()
                    self._show_engine(True)
                    log.info("engine %d is ready again", self.slot)
                    break

    def _engine_gone(self) -> None:
        """Return once the engine that answered last ends (or this worker stops): its process (each answer names its
        pid) watched through a pidfd, readable the moment it exits, else looked for every WAIT_S. Nothing is asked
        of the engine and no connection held open to it: its loop counts each idle connection as one a request may
        still come on, and waits for it (app/link/gathering.py)."""
        pid = self._signatures_of[0]  # of the answer that said it is ready
        if pid <= 0:
            return
        try:
            exited = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        except (AttributeError, OSError):  # no pidfd here (not Linux, or a kernel before 5.3)
            asked = time.monotonic()
            while control.process_alive(pid) and not self._stopped.wait(WAIT_S):
                asked = self._ask_when_due(asked)
            return
        try:
            poller = select.poll()
            poller.register(exited, select.POLLIN)
            asked = time.monotonic()
            while not poller.poll(WAIT_S * 1000) and not self._stopped.is_set():
                asked = self._ask_when_due(asked)
        finally:
            os.close(exited)

    def _ask_when_due(self, asked: float) -> float:
        """The watch's look every WAIT_S: the engine asked again (``_engine_serves``) WATCH_S after it was last
        asked, or at once while its latest state query went unanswered (requests are refused meanwhile: they are
        sent again within WAIT_S of its answer, whoever's query found it silent); when it was asked last."""
        now = time.monotonic()
        if self._engine_silent or now - asked >= WATCH_S:
            self._engine_serves()
            return now
        return asked

    def _engine_serves(self) -> None:
        """Every WATCH_S while the engine that answered last lives (every WAIT_S while it is silent: ``_ask_when_due``):
        its state asked; while it answers, this worker's ready mark written again if a write failed
        (``Lifecycle._keep_ready_mark``); once it does not (stopped, its loop stuck), the mark taken away until it
        answers again, as for an engine gone: readiness then says 503 on every worker behind the port (it covers
        them all), and new connections go to the workers whose engines serve (app/hosting/worker.py); and its part
        of the gauges as the marks are now."""
        asked = time.monotonic()
        answered, now = self._engine_state(fresh=True) is not None, time.monotonic()
        since = self._silent_since = None if answered else self._silent_since or asked  # (from the first unanswered)
        if answered and self._silent_shown:
            self._silent_shown = False
            self._serving_now()
            if self.draining:  # a drain that began meanwhile answers again: it says so (its leaving mark)
                self._mark_leaving()
            self._show_engine(True)
            log.info("engine %d answers again", self.slot)
        elif since is not None and not self._silent_shown and now - since >= SILENT_AWAY_S:
            self._remove_ready_mark()
            self._not_answering(gone=False)
            self._show_engine(False)
            log.warning("engine %d, this HTTP worker's, does not answer its state queries (stopped or stuck): new "
                        "connections are left to the other workers and readiness says 503 until it answers (the "
                        "master restarts it once silent for STALL_S)", self.slot)
        if answered:
            self._keep_ready_mark()
        self.ready  # noqa: B018 - its reading sets this worker's part of the ready gauge as the marks are now

    def _not_answering(self, gone: bool) -> None:
        """The engine gone (``gone``) or silent: a draining worker without it answers nothing new (503), so its
        leaving mark goes, and a drain beginning now writes none (``_answers_new``), both under the mark's lock: a
        drain that read the ready mark just before it went cannot write the leaving mark after this removed it."""
        with self._leaving_lock:
            if gone:
                self._engine_lost = True
            else:
                self._silent_shown = True
            self._remove_leaving_mark()

    def _answers_new(self) -> bool:
        return not (self._engine_lost or self._silent_shown)

    def _show_engine(self, reached: bool) -> None:
        """This worker's part of the ready and batcher_alive gauges: 1 while it reaches a ready engine (it has no
        inference thread here: whether the engine's runs is the engine's own gauge), else 0; ready 0 once draining,
        and while a worker's ready mark is missing as each reading of ``ready`` finds (``/readyz`` answers 503)."""
        BATCHER_ALIVE.set(int(reached))
        READY.set(int(reached))
        if reached and self.draining:  # a drain that began meanwhile set 0 before this
            READY.set(0)

    def _every_worker_marked(self) -> bool:
        """Every worker of the server reached the engine: as many live workers' ready marks as WORKERS."""
        return self._workers_marked() >= (self.settings.workers or 1)

    def _another_serves(self) -> bool:
        """Another HTTP worker's ready mark is there (its engine serves), or one of the master this one runs beside
        (USR2's old or new master: ``control.serving_beside``)."""
        return any(pid != os.getpid() for pid in self._marked_workers()) or control.serving_beside(self.control_dir)

    def _workers_marked(self) -> int:
        return len(self._marked_workers())

    def _marked_workers(self) -> list[int]:
        """The live workers whose ready mark is there (none where the directory cannot be read: no worker can be
        told to serve)."""
        try:
            return control.ready_workers(self.control_dir)
        except OSError:
            return []

    # -- exchanges with the engine ---------------------------------------------------------------------------------

    def _exchange(self, message: Any, timeout_s: float, away: str, segments: Sequence[bytes] = (),
                  silent: ServiceError | None = None) -> Any:
        """One question (with ``segments``) and its answer within ``timeout_s``; the answer's value, or its error
        raised. No answer in time is NotReady saying ``away``, or ``silent`` (an engine still at the work asked)."""
        with self.connections.exchange(away, message, segments) as conn:
            if not wire.readable(conn, timeout_s):
                if silent is not None:
                    raise silent  # the connection is closed: its late answer is dropped
                raise wire.EngineGone(f"no answer within {timeout_s:g}s")  # NotReady saying ``away``
            answer = wire.receive_answer(conn, timeout_s)
        return self._value(answer)

    def _value(self, answer: wire.Answer) -> Any:
        if (answer.engine, answer.routes) != self._signatures_of:  # another engine, or its routing changed
            self._signatures.clear()
            self._signatures_of = (answer.engine, answer.routes)
        if answer.error is not None:
            raise answer.error
        return answer.value

    def infer(self, message: wire.Infer, segments: Sequence[bytes | memoryview], limit_s: float,
              client_gone: Callable[[], bool] | None,
              deadline: tuple[float, float] | None = None) -> Served:
        """Send one request with its images or tensors; wait for the answer (``limit_s`` at most; on the worker's
        loop, until ``deadline`` too, when given: (when this worker had it whole, its length), then its 504) or the
        client to leave. A request on the worker's loop goes with the loop's others (``LoopLink``), any other on a
        connection it holds alone."""
        away = "the engine stopped while answering this request; it is restarting"
        loop = waiting.on_loop()
        if loop is not None:
            if self.loop_link is None:
                self.loop_link = LoopLink(self.connections.new, self.settings.link_arena_mb << 20)
            late_s = arrived = None
            if deadline is not None:  # the request's own, counted at the engine from when this worker had it too
                arrived, late_s = deadline
                limit_s = min(limit_s, arrived + late_s - time.monotonic())
            with engine_away(away):
                answer = self.loop_link.ask(loop, message, segments, limit_s, client_gone, late_s, arrived)
            return self._value(answer)
        if deadline is not None:
            message.spent_s = max(0.0, time.monotonic() - deadline[0])
        with self.connections.exchange(away, message, segments) as conn:
            _wait_for_answer(conn, limit_s, client_gone)
            answer = wire.receive_answer(conn, ANSWER_GRACE_S)  # it is arriving: never a wait without end
        return self._value(answer)

    def explain(self, image: bytes, name: str | None = None, version: str | None = None, index: int | None = None,
                png: bool = False, timeout_s: float = 30.0) -> Explanation:
        """As ``Service.explain``, in the engine: the image crosses as it is, the explanation comes back."""
        with self.in_flight.inside():  # a drain waits for it, as for a request: counted before the readiness check,
            self.require_ready()  # so a drain that stops serving meanwhile sees it (as admit does)
            return self._exchange(wire.Explain(name, version, index, png, timeout_s), timeout_s + ANSWER_GRACE_S,
                                  "the engine stopped while explaining this image; it is restarting", [image])

    def _ask(self, call: wire.CatalogCall) -> Any:
        """A catalog call answered by the engine: refused at once as a request is (NotReady) while the first models
        load or the engine's latest state query went unanswered, else sent and waited for within its limit."""
        self.require_loaded()
        self._require_serving()  # an engine that answers nothing would hold the call for its whole limit
        away = "the engine is not reachable or not answering; it is starting or restarting"
        if call.method == "settle_figures":  # a scrape's, which shows what was written rather than wait longer
            return self._exchange(call, STATE_TIMEOUT_S, away)
        if call.method not in CATALOG_CHANGES:
            return self._exchange(call, self.settings.repository_sync_timeout_s + CATALOG_GRACE_S, away)
        # A change waits REPOSITORY_SYNC_TIMEOUT_S at most to start (another change under way), then as long for the
        # other engines: an engine silent past both and the grace is still at its own load (504), not gone (503).
        limit_s = 2 * self.settings.repository_sync_timeout_s + CATALOG_GRACE_S
        silent = LoadTimeout(f"the engine has not answered this {call.method} call within {limit_s:g}s: the change "
                             "may still be applying (the repository index and /v1/models show what serves)")
        return self._exchange(call, limit_s, away, silent=silent)

    @property
    def _engine_silent(self) -> bool:
        """Its latest state query went unanswered: requests and catalog calls are refused, not sent
        (``_require_serving``)."""
        at, state = self._state
        return at > 0 and state is None

    def _engine_state(self, fresh: bool = False) -> wire.EngineState | None:
        """The engine's state as it said it within STATE_TTL_S (asked again after), None when it did not answer
        within STATE_TIMEOUT_S; ``fresh``: asked now. Once it has gone unanswered, the link's watch asks it every
        WAIT_S (``_ask_when_due``) and every other reader (a probe, a request) takes that answer for
        SILENT_STATE_TTL_S: a probe of a silent engine is answered at once, not after a wait for its state each
        time."""
        at, state = self._state
        if state is None and not fresh and self._started.is_set() and time.monotonic() - at < SILENT_STATE_TTL_S:
            return None
        if fresh or time.monotonic() - at > STATE_TTL_S:
            try:
                state = self._exchange(wire.StateQuery(), STATE_TIMEOUT_S, "the engine is away")
            except NotReady:
                state = None
            self._state = (time.monotonic(), state)
        return state

    def labels(self, served: Served, parsed_with: Signature) -> list[str]:
        """The labels of the version that answered (the engine's answer leaves them out): those of the signature the
        request was parsed with when that version answered, else that version's own (asked once, then kept)."""
        if (served.model, served.version) == (parsed_with.name, parsed_with.version):
            return parsed_with.labels
        return self.signature(served.model, served.version).labels

    def signature(self, name: str | None, version: str | None) -> Signature:
        """What a request for ``name`` at ``version`` is parsed with: kept from the engine's answer until its
        routing changes (NotFound, NotReady as the engine says)."""
        key = (name, version)
        signature = self._signatures.get(key)
        if signature is None:
            signature = self._exchange(wire.CatalogCall("signature", key), SIGNATURE_TIMEOUT_S,
                                       "the engine is not reachable or not answering; it is starting or restarting")
            self._signatures[key] = signature
        return signature

    # -- the service's face ----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def admit(self, name: str | None = None, version: str | None = None, client_key: str | None = None,
              images: int = 0, timeout_s: float | None = None, pixels: bool = False) -> Iterator[RemoteCall]:
        """As ``Service.admit``: readiness here (draining, starting) and the signature to parse with; the engine
        admits the request when it arrives (routing, its readiness, its queue's room; a request of pixels, parsed
        here with the default's signature, to a version they fit). A request refused here before it was sent is
        counted there all the same (``Unanswered``)."""
        with self.in_flight.inside():
            self.require_ready()
            call = RemoteCall(self, self.signature(name, version), (name, version, client_key))
            try:
                yield call
            except BaseException as exc:
                if not call.sent:
                    self._unanswered(call, _as_service_error(exc))
                raise
            else:
                if not call.sent:
                    self._unanswered(call, None)

    def _unanswered(self, call: RemoteCall, error: ServiceError | None) -> None:
        """Tell the engine of a request that never reached it (it has no answer); unsent, it is only uncounted."""
        with contextlib.suppress(NotReady):
            with self.connections.exchange("the engine is away", wire.Unanswered(*call.request, error=error)):
                pass

    @property
    def loaded(self) -> bool:
        """The engine loaded its first models and serves at least one."""
        state = self._engine_state() if self._started.is_set() else None
        return state is not None and state.loaded

    @property
    def alive(self) -> bool:
        """The engine's batchers run and none of its batches has run past STALL_S (an engine being restarted by the
        master, or one silent that the master restarts once silent for STALL_S, does not make this worker dead)."""
        state = self._engine_state()
        return state.alive if state is not None else True

    @property
    def stalled(self) -> str | None:
        """As ``Service.stalled``, as the engine says it: a batch of it that has run past STALL_S, else None."""
        state = self._engine_state()
        return state.stalled if state is not None else None

    def _require_serving(self) -> None:
        """NotReady (503 with Retry-After) while the engine's latest state query went unanswered (within
        STATE_TIMEOUT_S): neither a request nor a catalog call (``_ask``) is sent to an engine that is stopped, stuck
        or restarting, to wait out its whole limit for an answer (the master restarts one silent for STALL_S)."""
        if self._engine_silent:  # (Connection: close where another worker's engine serves: a client kept on this
            # worker reconnects, and may reach it)
            raise not_ready(f"engine {self.slot}, this HTTP worker's, did not answer its latest state query within "
                            f"{STATE_TIMEOUT_S:g}s: it is stopped, stuck or restarting", close=self._another_serves())

    @property
    def ready(self) -> bool:
        """The engine is ready, this worker is not draining, and every worker of the server reached the engine. Each
        reading once this worker reached its engine sets its part of the ready gauge too, so /metrics says what
        /readyz, which reads this, answers."""
        if not self._started.is_set() or self.draining:
            return False
        state = self._engine_state()
        ready = state is not None and state.ready and self._every_worker_marked()
        READY.set(int(ready and not self.draining))
        return ready

    @property
    def not_ready_reason(self) -> str | None:
        """Why it is not ready where none of /readyz's checks says it: this worker's engine that does not answer,
        serves no model yet, or is not ready for a reason of its own (another engine not serving yet), or another
        HTTP worker whose engine does not serve (readiness covers every worker behind the port); None when ready, or
        when a check says why (draining, a stalled batch)."""
        if self.draining:
            return None
        if not self._started.is_set():
            return f"this HTTP worker has not yet reached its engine (engine {self.slot}): it is starting"
        state = self._engine_state()
        if state is None:
            return (f"engine {self.slot}, this HTTP worker's, did not answer its state query within "
                    f"{STATE_TIMEOUT_S:g}s: it is stopped, stuck or restarting")
        if not state.loaded:
            return f"engine {self.slot}, this HTTP worker's, serves no model yet (loading, or every model unloaded)"
        if not state.ready and state.reason:
            return f"engine {self.slot}, this HTTP worker's: {state.reason}"
        if not self._every_worker_marked():
            return (f"{self._workers_marked()} of {self.settings.workers or 1} HTTP workers reached their engines: "
                    "readiness covers every worker behind the port, and one whose engine is starting, restarting "
                    "or not answering (stopped or stuck) has not")
        return None

    def _drain_begun(self) -> None:
        READY.set(0)

    def shutdown(self, timeout: float | None = None) -> None:
        """This worker is going away: nothing of the engine is its to stop; its link's thread ends."""
        self._stopped.set()
        self.stop_serving()


def _wait_for_answer(conn: socket.socket, limit_s: float, client_gone: Callable[[], bool] | None) -> None:
    until = time.monotonic() + limit_s
    while not wire.readable(conn, CLIENT_CHECK_S if client_gone else limit_s):
        if client_gone is not None and client_gone():
            raise ClientGone("the client closed the connection; its queued images are dropped")
        if time.monotonic() >= until:
            raise DeadlineExceeded(f"no answer from the engine within {limit_s:g}s")
