"""The benchmark's load generator against a tiny stdlib HTTP server: what it counts and how it survives closes."""
from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

from app.hosting import procstat
from bench.serving.load import closed_loop, measure
from bench.usage import engine_pids, process_tree_cpu
from harness.servers import free_port
from tests.support.fakes import SERVER_POLL_S, wait_until


class _Handler(BaseHTTPRequestHandler):
    """200 for the body b"ok", 503 for anything else; b"close" also closes the connection after answering; b"slow"
    answers 200 after 1 s."""

    protocol_version = "HTTP/1.1"  # keep-alive, as the servers under test speak it
    connections: list[tuple[str, int]] = []  # each connection accepted (a closed one's port may come again)

    def setup(self) -> None:
        super().setup()
        _Handler.connections.append(self.client_address)

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if body == b"slow":
            time.sleep(1.0)
        self.send_response(200 if body in (b"ok", b"close", b"slow") else 503)
        self.send_header("Content-Length", "2")
        if body == b"close":
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        """Quiet."""


@pytest.fixture
def url() -> Iterator[str]:
    _Handler.connections = []
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Handler)
    thread = threading.Thread(target=server.serve_forever, args=(SERVER_POLL_S,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/predict"
    finally:
        server.shutdown()
        server.server_close()


def test_counts_200_as_latency_and_other_statuses_as_errors(url: str) -> None:
    latencies, errors, answered = closed_loop(url, [b"ok", b"bad"], concurrency=1, duration_s=0.5, warmup_s=0.0)
    assert latencies and errors
    # One client alternates the two bodies; only the last request can fall outside the window.
    assert abs(len(latencies) - errors) <= 1
    assert all(0 < x < 0.5 for x in latencies)
    assert answered in (len(latencies), len(latencies) + 1)  # the last request may end after the window


def test_keeps_one_connection_per_client(url: str) -> None:
    latencies, errors, answered = closed_loop(url, [b"ok"], concurrency=3, duration_s=0.3, warmup_s=0.0)
    assert errors == 0 and len(latencies) > 3
    assert len(_Handler.connections) == 3


def test_reconnects_after_the_server_closes(url: str) -> None:
    latencies, errors, answered = closed_loop(url, [b"close"], concurrency=2, duration_s=0.3, warmup_s=0.0)
    assert errors == 0 and len(latencies) > 2
    assert len(_Handler.connections) >= len(latencies)  # a new connection for every request


def test_no_server_counts_errors_without_raising() -> None:
    latencies, errors, answered = closed_loop(f"http://127.0.0.1:{free_port()}/predict", [b"ok"], concurrency=2,
                                    duration_s=0.2, warmup_s=0.0)
    assert latencies == [] and errors > 0 and answered == 0


@pytest.mark.slow  # a load window of 2 s
def test_counts_the_answers_that_came_in_the_window_whenever_they_were_sent(url: str) -> None:
    # One client, 1 s an answer: sent at 0 (in the warm-up) and answered at 1, inside the window [0.5, 1.5] (half a
    # second to spare each side); the next one, sent at 1, is answered at 2, after it. A count of only what was
    # sent in the window would count neither: it loses the work in flight at the window's start, which grows with
    # the latency.
    statuses: collections.Counter[int] = collections.Counter()
    latencies, errors, answered = closed_loop(url, [b"slow"], concurrency=1, duration_s=1.0, warmup_s=0.5,
                                              statuses=statuses)
    assert errors == 0 and len(latencies) == 1 and statuses == {200: 1}
    assert 1.0 <= latencies[0] < 1.5
    assert answered == 2  # every 200 of the call, the one after the window too


# A server whose "engine" runs in a session of its own, as ENGINE=process's does: the server answers {} to every
# POST; the engine (its command line names app.link.server) spends CPU until the server is gone.
_SERVER_WITH_AN_ENGINE = """
import os, subprocess, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass

burn = "import os, sys\\nwhile os.getppid() == int(sys.argv[1]): sum(range(10000))"  # until the server is gone
engine = subprocess.Popen([sys.executable, "-c", burn, str(os.getpid()), "app.link" + ".server"],  # the name in the
                          start_new_session=True)  # engine's command line only
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_a_process_s_children_are_listed_while_its_threads_end(monkeypatch: pytest.MonkeyPatch) -> None:
    # a server's thread per connection may end between the listing of its threads and the read of its children: that
    # thread's list goes, not every other one's (the engine below a threading server went missing from its tree)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        listed = Path.glob

        def with_a_thread_gone(self: Path, pattern: str) -> list[Path]:
            return [self / "999999999" / "children", *listed(self, pattern)]

        monkeypatch.setattr(Path, "glob", with_a_thread_gone)
        assert child.pid in procstat.children(os.getpid())
    finally:
        child.kill()
        child.wait()


def test_a_process_that_ends_while_its_threads_are_listed_has_no_children(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: its /proc folder gone between the check that it is one and its listing, the listing raised, and the
    # GPU drill's smoke run, which follows each step's processes, failed (a suite run)
    def gone(self: Path, pattern: str) -> Iterator[Path]:
        raise FileNotFoundError(2, "No such file or directory", str(self))
        yield  # (a generator, as Path.glob is: it raises as it is read)

    monkeypatch.setattr(Path, "glob", gone)
    assert procstat.children(os.getpid()) == []


def test_a_served_point_counts_the_cpu_of_an_engine_in_a_session_of_its_own_and_each_request_s_images() -> None:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", _SERVER_WITH_AN_ENGINE, str(port)])
    try:
        # listed once it runs its command (its session is its own from then on; a fork not yet exec'd is not)
        wait_until(lambda: len(engine_pids(process_tree_cpu(server.pid))) == 1, timeout=30)
        (engine,) = engine_pids(process_tree_cpu(server.pid))
        assert os.getpgid(engine) != os.getpgid(server.pid)  # not in the server's process group
        started = time.perf_counter()
        result = measure("fake", "m", f"http://127.0.0.1:{port}", "/predict", [b"four images"], 2, 0.5, 0.1,
                         server_pid=server.pid, images_per_request=4)
        elapsed = time.perf_counter() - started
    finally:
        server.terminate()  # the engine ends once it is gone
        server.wait()
    answered = result.requests - result.errors
    assert result.errors == 0 and answered > 0
    assert result.images_per_s == pytest.approx(4 * answered / 0.5)
    # CPU per image: the server's CPU over every answer of the call, 4 images each; at most what the whole call's
    # time and the window's answers alone allow (a quarter of it per request: counted per request, it would exceed it)
    assert result.server_cores is not None and result.cpu_ms_per_image is not None
    assert 0 < result.cpu_ms_per_image <= 1000 * result.server_cores * elapsed / (4 * answered)
    # the engine's busy loop, counted in the server's CPU (its process group alone would leave it out)
    assert result.engine_cores is not None and 0.1 < result.engine_cores <= result.server_cores
    assert result.batch_cpu_ms is result.batch_wall_ms is result.forward_wall_ms is None  # no /metrics here
