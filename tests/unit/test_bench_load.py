"""The benchmark's load generator against a tiny stdlib HTTP server: what it counts and how it survives closes."""
from __future__ import annotations

import collections
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

from bench.serving.load import closed_loop
from harness.servers import free_port


class _Handler(BaseHTTPRequestHandler):
    """200 for the body b"ok", 503 for anything else; b"close" also closes the connection after answering; b"slow"
    answers 200 after 1 s."""

    protocol_version = "HTTP/1.1"  # keep-alive, as the servers under test speak it
    connections: set[tuple[str, int]] = set()

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Handler.connections.add(self.client_address)
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
    _Handler.connections = set()
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
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
