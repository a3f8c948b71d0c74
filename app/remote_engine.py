"""The engine as an HTTP worker sees it when the engine runs in a process of its own (``ENGINE=process``, the default
under gunicorn): the same face as ``app.engine.service.Service`` (``admit`` -> a call whose ``infer`` answers a
``Served``, ``catalog``, readiness, draining), reached over the engine's Unix socket (app/engine/wire.py,
app/engine/process.py). Never imports torch: the worker keeps everything HTTP (routes, parsing, auth, admission,
drain, the access log) and nothing of the model.

Each request thread keeps one connection; a connection that fails is dropped and the next request makes a new one.
An engine that dies fails the requests in flight with 503 and Retry-After (the master restarts it); until it is
back, requests get 503 ``not_ready``.

Readiness is the server's, not this worker's alone: ready once the engine is ready, this worker is not draining,
and every worker of the server reached the engine (each marks ``http-<pid>.ready`` in CONTROL_DIR; the master
removes a dead worker's mark), so after the first 200 of ``/readyz`` no worker answers ``not_ready``.
"""
from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from app.config import Settings
from app.engine.batching.arrivals import InFlight
from app.engine.contract import NOT_READY_RETRY_S, Served, Signature
from app.engine.wire import (
    CATALOG_CALLS,
    READY_MARKS,
    EngineGone,
    connect,
    engine_failure,
    ready_mark,
    receive,
    send,
    socket_path,
)
from app.errors import ClientGone, DeadlineExceeded, LoadFailed, NotReady, ServiceError, retry_after_header
from app.host import process_alive

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 2.0
CLIENT_CHECK_S = 0.05  # how often a waiting request looks whether its client is still connected
ANSWER_GRACE_S = 5.0  # beyond twice a request's deadline (the engine's counts from queueing, after the decode)
STATE_TIMEOUT_S = 1.0  # an engine that does not say its state within this is not ready (probes never hang)
ADMIT_TIMEOUT_S = 5.0  # admission is routing and a queue check: an engine silent this long is stuck
CATALOG_GRACE_S = 10.0  # beyond REPOSITORY_SYNC_TIMEOUT_S, for a catalog call (a load waits for every engine)
STATE_TTL_S = 0.2  # readiness asked of the engine at most this often
WAIT_S = 0.1  # while starting, how often to look for the engine


def _as_service_error(exc: BaseException) -> ServiceError:
    """What ended an admission on this side, for the engine to count as the request's outcome: a ServiceError as it
    is, an HTTP error (werkzeug's) with its status, anything else as a server error."""
    if isinstance(exc, ServiceError):
        return exc
    error = ServiceError(f"{type(exc).__name__}: {exc}")
    status = getattr(exc, "code", None)
    if isinstance(status, int) and 400 <= status < 600:
        error.status = status
    return error


def _unavailable(why: str) -> NotReady:
    return NotReady(why, headers=retry_after_header(NOT_READY_RETRY_S))


@contextlib.contextmanager
def _whole_exchange(drop: Callable[[], None], away: str) -> Iterator[None]:
    """An exchange that does not finish drops the connection (no later request may read its answer); the engine
    away, silent or closing it is NotReady (503 with Retry-After) saying ``away``."""
    try:
        yield
    except (EngineGone, OSError):
        drop()
        raise _unavailable(away) from None
    except BaseException:
        drop()
        raise


class RemoteCall:
    """A request admitted by the engine: ``model`` to parse with, ``infer`` to run its images there."""

    def __init__(self, conn: socket.socket, model: Signature, drop: Callable[[], None]) -> None:
        self.model, self.conn, self._drop = model, conn, drop
        self.sent = False  # the images went to the engine (the admission then ends with its answer)

    def infer(self, images: Sequence[bytes] = (), tensors: Sequence[Any] = (), *, timeout_s: float,
              names: Sequence[str | None] = (), client_gone: Callable[[], bool] | None = None) -> Served:
        """As ``Call.infer``: the images go to the engine as they are, the answer comes back; a client that hangs
        up drops its queued images there (the connection closes, which the engine watches). Anything that leaves
        the exchange unfinished drops the connection, so no later request reads this one's answer."""
        options = {"timeout_s": timeout_s, "names": list(names), "tensors": list(tensors)}
        self.sent = True  # from here the engine ends the admission itself (answer, or a closed connection)
        with _whole_exchange(self._drop, "the engine stopped while answering this request; it is restarting"):
            send(self.conn, ("infer", options), images)
            self._wait(2 * timeout_s + ANSWER_GRACE_S, client_gone)
            self.conn.settimeout(ANSWER_GRACE_S)  # the answer is arriving: never a wait without end
            status, value = receive(self.conn)[0]
            self.conn.settimeout(None)
        if status == "error":
            raise value
        return value

    def _wait(self, limit_s: float, client_gone: Callable[[], bool] | None) -> None:
        until = time.monotonic() + limit_s
        while not _readable(self.conn, CLIENT_CHECK_S if client_gone else limit_s):
            if client_gone is not None and client_gone():
                raise ClientGone("the client closed the connection; its queued images are dropped")
            if time.monotonic() >= until:
                raise DeadlineExceeded(f"no answer from the engine within {limit_s:g}s")


def _readable(conn: socket.socket, timeout_s: float) -> bool:
    """Whether ``conn`` has data or its end within ``timeout_s`` (poll: no limit on the descriptor's number)."""
    poller = select.poll()
    poller.register(conn, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(max(0, int(timeout_s * 1000))))


class RemoteCatalog:
    """``Catalog``'s calls (app/engine/catalog.py), answered by the engine."""

    def __init__(self, ask: Callable[[tuple[Any, ...]], Any]) -> None:
        self._ask = ask

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method not in CATALOG_CALLS:
            raise AttributeError(method)
        return lambda *args, **kwargs: self._ask(("catalog", method, args, kwargs))


class RemoteService:
    """``Service``'s face in an HTTP worker, over the engine process at ``slot``."""

    def __init__(self, settings: Settings, slot: int) -> None:
        assert settings.control_dir is not None, "ENGINE=process needs CONTROL_DIR (gunicorn.conf.py sets it)"
        self.settings, self.slot = settings, slot
        self.control_dir: Path = settings.control_dir
        self.path = socket_path(self.control_dir, slot)
        self.in_flight = InFlight()  # requests admitted here and not yet answered
        self.catalog = RemoteCatalog(self._ask)
        self._local = threading.local()  # each request thread's connection
        self._started = threading.Event()  # the engine answered ready once
        self._draining = threading.Event()
        self._state: tuple[float, dict[str, bool]] = (0.0, {})

    @classmethod
    def start(cls, settings: Settings, slot: int, on_error: Callable[[BaseException], None]) -> "RemoteService":
        """A service that answers now and waits on a thread for the engine to be ready; ``on_error`` gets the
        engine's boot failure (a model that cannot be served)."""
        service = cls(settings, slot)
        threading.Thread(target=service._wait_for_engine, args=(on_error,), name="engine-wait", daemon=True).start()
        return service

    def _wait_for_engine(self, on_error: Callable[[BaseException], None]) -> None:
        failure = engine_failure(self.control_dir, self.slot)
        while not self._started.is_set():
            if failure.is_file():
                on_error(LoadFailed(failure.read_text(encoding="utf-8")))
                return
            if self._engine_state(fresh=True).get("ready"):
                if not self._draining.is_set():
                    ready_mark(self.control_dir, os.getpid()).touch()
                self._started.set()
                log.info("ready to serve (engine %d)", self.slot)
                return
            time.sleep(WAIT_S)

    # -- talking to the engine -------------------------------------------------------------------------------------

    def _connection(self) -> socket.socket:
        conn = getattr(self._local, "conn", None)
        if conn is not None and _readable(conn, 0):  # between exchanges only its end can be there: a restart
            self._drop()
            conn = None
        if conn is None:
            conn = self._local.conn = connect(self.path, CONNECT_TIMEOUT_S)
        return conn

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.close()

    def _exchange(self, header: tuple[Any, ...], timeout_s: float) -> Any:
        """One question and its answer on this thread's connection, ``timeout_s`` at most; NotReady when the engine
        is away or silent. Anything that leaves the exchange unfinished drops the connection."""
        with _whole_exchange(self._drop, "the engine is not reachable or not answering; it is starting or restarting"):
            conn = self._connection()
            conn.settimeout(timeout_s)
            send(conn, header)
            status, value = receive(conn)[0]
            conn.settimeout(None)
        if status == "error":
            raise value
        return value

    def _ask(self, header: tuple[Any, ...]) -> Any:
        self.require_loaded()
        return self._exchange(header, self.settings.repository_sync_timeout_s + CATALOG_GRACE_S)

    def _engine_state(self, fresh: bool = False) -> dict[str, bool]:
        at, state = self._state
        if fresh or time.monotonic() - at > STATE_TTL_S:
            try:
                state = self._exchange(("state",), STATE_TIMEOUT_S)
            except NotReady:
                state = {}
            self._state = (time.monotonic(), state)
        return state

    # -- Service's face --------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def admit(self, name: str | None = None, version: str | None = None, client_key: str | None = None,
              images: int = 0, timeout_s: float | None = None) -> Iterator[RemoteCall]:
        """As ``Service.admit``: readiness here (draining, starting), then the engine's (routing, its readiness);
        the request stays admitted there until its images are sent or the protocol refuses its body."""
        with self.in_flight.inside():
            self.require_ready()
            model = self._exchange(("admit", name, version, client_key, images, timeout_s), ADMIT_TIMEOUT_S)
            call = RemoteCall(self._local.conn, model, self._drop)
            try:
                yield call
            except BaseException as exc:
                if not call.sent:
                    self._abort(call, _as_service_error(exc))
                raise
            else:
                if not call.sent:
                    self._abort(call, None)

    def _abort(self, call: RemoteCall, error: ServiceError | None) -> None:
        """End an admission whose images were never sent (the protocol refused the body, or asked nothing), on the
        call's own connection; if that is gone, the engine ended the admission when it closed."""
        if getattr(self._local, "conn", None) is not call.conn:
            return
        try:
            send(call.conn, ("abort", error))
        except Exception:  # noqa: BLE001 - unsent: the connection goes, and with it the admission there
            self._drop()

    @property
    def loaded(self) -> bool:
        """The engine loaded its first models and serves at least one."""
        return self._started.is_set() and bool(self._engine_state().get("loaded"))

    @property
    def alive(self) -> bool:
        """The engine's batchers run (an engine being restarted by the master does not make this worker dead)."""
        state = self._engine_state()
        return state.get("alive", True) if state else True

    @property
    def ready(self) -> bool:
        """The engine is ready, this worker is not draining, and every worker of the server reached the engine."""
        return (self._started.is_set() and not self._draining.is_set() and bool(self._engine_state().get("ready"))
                and self._all_workers_ready())

    def _all_workers_ready(self) -> bool:
        workers = self.settings.workers or 1
        # A mark left by a killed worker (of an earlier start of a kept CONTROL_DIR) must not count.
        pids = [path.name[len("http-"):-len(".ready")] for path in self.control_dir.glob(READY_MARKS)]
        marks = [pid for pid in pids if pid.isdigit() and process_alive(int(pid))]
        return len(marks) >= workers

    @property
    def draining(self) -> bool:
        """True once this worker's shutdown has begun."""
        return self._draining.is_set()

    def begin_drain(self) -> None:
        """Turn this worker's readiness off; its accepted requests still complete."""
        self._draining.set()
        ready_mark(self.control_dir, os.getpid()).unlink(missing_ok=True)

    def shutdown(self, timeout: float | None = None) -> None:
        """This worker is going away: nothing of the engine is its to stop."""
        self.begin_drain()

    def wait_drained(self, min_s: float, max_s: float) -> bool:
        """As ``Service.wait_drained``, for this worker's requests."""
        time.sleep(min(min_s, max_s))
        return self.in_flight.wait_empty(max(0.0, max_s - min_s), poll_s=0.05)

    def wait_loaded(self, timeout_s: float) -> None:
        """Wait for the engine (``timeout_s`` at most), then as ``require_loaded``."""
        self._started.wait(timeout_s)
        self.require_loaded()

    def require_loaded(self) -> None:
        """NotReady (503 with Retry-After) until the engine has answered ready once."""
        if not self._started.is_set():
            raise _unavailable("the model is still loading")

    def require_ready(self) -> None:
        """NotReady unless new work can be accepted here (the engine checks its own readiness at admission)."""
        if self.draining:  # the client should go elsewhere: this connection will not serve it again
            raise NotReady("the server is shutting down",
                           headers={**retry_after_header(NOT_READY_RETRY_S), "Connection": "close"})
        self.require_loaded()
