"""ENGINE=process without a server: an HTTP worker's own part of the ready and batcher_alive gauges (0 while its
engine is gone), the engine's exit status when the master's reaping finds it first, and the keep-alive rules for a
body the app left unread."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
from gunicorn.config import Config
from gunicorn.http.parser import RequestParser
from prometheus_client import REGISTRY

from app.config import Settings
from app.engine.lifecycle import not_ready
from app.hosting.request_framing import HeldUnreader, skip_held_body
from app.link import supervisor, wire
from app.link.client import RemoteService
from app.metrics import BATCHER_ALIVE, READY
from app.web.connection import left_unread
from tests.support.fakes import wait_until

BODY = bytes(range(256)) * 800  # 200 KiB: past the 64 KiB gunicorn's own skip gives up at


def _gauges() -> tuple[float | None, float | None]:
    return REGISTRY.get_sample_value("visionserve_ready"), REGISTRY.get_sample_value("visionserve_batcher_alive")


def test_an_http_worker_reads_1_once_it_reached_a_ready_engine_and_0_from_its_drain(
        settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "control").mkdir()
    worker = RemoteService(settings.model_copy(update={"control_dir": tmp_path / "control"}), 0,
                           connect=lambda: pytest.fail("no engine connection is needed"))  # type: ignore[arg-type]
    monkeypatch.setattr(worker, "_engine_state", lambda fresh=False: wire.EngineState(True, True, True, False))
    READY.set(0)
    BATCHER_ALIVE.set(0)  # as every process's gauges read from their import
    errors: list[BaseException] = []
    worker._wait_for_engine(errors.append)  # what RemoteService.start runs on its thread
    assert not errors and _gauges() == (1.0, 1.0)
    worker.begin_drain()
    assert _gauges() == (0.0, 1.0)


class Engines:
    """The engine as a worker's link meets it: a process (a sleeping child) whose answers name its pid, ready while
    it lives; ``kill`` ends it (SIGKILL), ``start`` a new one, as the master's restart does."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.started = 0

    def start(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        self.started += 1

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def exchange(self, worker: RemoteService, message: object, timeout_s: float, away: str) -> object:
        """``RemoteService._exchange``: the engine's answer, or NotReady when it is gone."""
        if self.process is None:
            raise not_ready(away)
        return worker._value(wire.Answer(wire.EngineState(True, True, True, False), None, self.process.pid, 1))


@pytest.mark.parametrize("pidfd", [True, False])  # False: a host without pidfd_open, where the pid is looked for
def test_an_http_worker_reads_0_from_its_engine_s_end_until_the_restarted_engine_is_ready(
        settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pidfd: bool) -> None:
    # The dead engine's own values go with it (the master marks it dead): the worker's 1s, left alone, read ready
    # and alive in /metrics while /readyz said 503, until the restart's first values came.
    (tmp_path / "control").mkdir()
    if not pidfd:
        monkeypatch.delattr(os, "pidfd_open")
    engines = Engines()
    monkeypatch.setattr(RemoteService, "_exchange", lambda self, message, timeout_s, away, segments=():
                        engines.exchange(self, message, timeout_s, away))
    READY.set(0)
    BATCHER_ALIVE.set(0)  # as every process's gauges read from their import
    errors: list[BaseException] = []
    engines.start()
    worker = RemoteService.start(settings.model_copy(update={"control_dir": tmp_path / "control"}), 0, errors.append)
    try:
        wait_until(lambda: _gauges() == (1.0, 1.0))
        for _ in range(2):
            engines.kill()
            wait_until(lambda: _gauges() == (0.0, 0.0))
            engines.start()  # the master's restart, ready
            wait_until(lambda: _gauges() == (1.0, 1.0))
        assert not errors and engines.started == 3
    finally:
        worker.shutdown()
        engines.kill()


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[supervisor.Engine]:
    """An Engine whose process is a sleeping child of this one, killed with SIGKILL and left unreaped."""
    engine = supervisor.Engine(0, tmp_path, on_death=lambda pid: None)
    engine.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    monkeypatch.setattr(supervisor, "_ENGINES", [engine])
    os.kill(engine.process.pid, signal.SIGKILL)
    os.waitid(os.P_PID, engine.process.pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped
    yield engine
    if engine.process.returncode is None:
        engine.process.returncode = 0  # reaped by the test itself: nothing for Popen to wait for


class Arbiter:
    """gunicorn's arbiter as far as reaping goes: it takes every ended child (waitpid(-1); here only the engine's,
    so no other child of the test process is taken) and keeps no status of one that is not its worker."""

    def __init__(self, pid: int) -> None:
        self.pid, self.reaped = pid, 0

    def reap_workers(self) -> None:
        try:
            self.reaped += os.waitpid(self.pid, os.WNOHANG)[0] == self.pid
        except ChildProcessError:
            pass


def test_an_engine_killed_reports_minus_9_even_when_the_master_s_reaping_comes_first(
        engine: supervisor.Engine) -> None:
    arbiter = Arbiter(engine.process.pid)
    supervisor.reap_engines_first(arbiter)
    arbiter.reap_workers()  # the SIGCHLD reaches the master's loop before the watcher runs
    assert engine._ended(engine.process) == -signal.SIGKILL and arbiter.reaped == 0


def test_an_engine_killed_reports_minus_9_to_its_watcher(engine: supervisor.Engine) -> None:
    assert engine._ended(engine.process) == -signal.SIGKILL


def test_an_end_reaped_elsewhere_unseen_is_unknown_never_a_clean_exit(engine: supervisor.Engine) -> None:
    Arbiter(engine.process.pid).reap_workers()  # gunicorn's reaping without reap_engines_first
    status = engine._ended(engine.process)
    assert status is None and supervisor._said(status) == "unknown"


def test_an_engine_whose_restart_the_system_refuses_once_is_started_on_the_next_try(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A restart whose fork failed (EAGAIN, ENOMEM, EMFILE in the master) ended the watcher: the engine stayed dead,
    # and every worker answered 503 for good.
    monkeypatch.setattr(supervisor, "RESTART_DELAY_S", 0.05)
    spawned: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def popen(command: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        if len(spawned) == 1:  # the first restart: refused
            spawned.append(None)  # type: ignore[arg-type]
            raise BlockingIOError(11, "Resource temporarily unavailable")
        child = real_popen([sys.executable, "-c", f"import time; time.sleep({60 if spawned else 0})"],
                           stdin=subprocess.PIPE)
        spawned.append(child)
        return child  # the first ends at once, as an engine that crashed; the next lives

    monkeypatch.setattr(supervisor.subprocess, "Popen", popen)
    engine = supervisor.Engine(0, tmp_path, on_death=lambda pid: None).start()
    try:
        wait_until(lambda: len(spawned) == 3)
        assert spawned[1] is None and engine.process is spawned[2] and engine.restarts == 1
        assert engine.process.poll() is None  # the one the watcher watches now
    finally:
        engine.signal_stop()
        engine.wait_stopped(10)


@pytest.fixture
def sockets() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, client = socket.socketpair()
    ours.settimeout(10)  # a read of the socket where none is due fails instead of hanging
    yield ours, client
    ours.close()
    client.close()


def _held_refusal(sock: socket.socket) -> RequestParser:
    """A parser over a refused request with a large body, then the next request, all held by the loop; the refused
    request parsed and 10 bytes of its body read, as an app that refuses it from its headers leaves it."""
    parser = RequestParser(Config(), sock, ("127.0.0.1", 1))
    parser.unreader = HeldUnreader(sock)
    parser.unreader.unread(b"POST /predict?model=nope HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                           b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" % (len(BODY), BODY))
    refused = next(parser)
    assert refused.path == "/predict" and refused.body.read(10) == BODY[:10]
    return parser


def test_a_held_body_the_app_left_unread_is_skipped_in_memory_and_the_next_request_follows(sockets) -> None:
    ours, _ = sockets
    assert not _held_refusal(ours).finish_body(deadline=time.monotonic() + 10)  # gunicorn's skip: closes the connection
    parser = _held_refusal(ours)
    assert skip_held_body(parser)  # whatever its size, without reading the socket (nothing more is on it)
    assert next(parser).path == "/healthz"


def _sent_chunked(ours: socket.socket, client: socket.socket) -> dict[str, object]:
    """The WSGI environ's body of a chunked request the client sends (on a thread: it outgrows the socket's buffer)."""
    sender = threading.Thread(target=client.sendall, args=(
        b"POST /predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
        % (len(BODY), BODY),), daemon=True)
    sender.start()
    request = next(RequestParser(Config(), ours, ("127.0.0.1", 1)))
    return {"wsgi.input": request.body, "HTTP_TRANSFER_ENCODING": "chunked"}


def test_a_streamed_body_left_unread_makes_the_answer_close_the_connection(sockets) -> None:
    environ = _sent_chunked(*sockets)
    body = environ["wsgi.input"]
    assert left_unread(environ)
    body.read(1000)  # type: ignore[attr-defined]
    assert left_unread(environ)
    while body.read(65536):  # type: ignore[attr-defined]
        pass
    assert not left_unread(environ)
    assert not left_unread({"wsgi.input": body, "CONTENT_LENGTH": "9"})  # not streamed: held whole by the worker
    assert not left_unread({"wsgi.input": object(), "HTTP_TRANSFER_ENCODING": "chunked"})  # not gunicorn's body
