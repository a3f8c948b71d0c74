"""The fault matrix (harness/faults.py) and hostile clients against the real server: nothing accepted is lost, bad
requests get their 4xx before they cost a worker, and the service recovers.

Each test of a fault prints its row of the table in docs/deployment.md.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import pytest
import requests

from visionserve_client import Client
from harness import faults
from harness.servers import Running

Start = Callable[..., Running]


def _report(row: faults.Row) -> None:
    print(f"\n{faults.HEADER}\n{row.line()}")


def _responses(row: faults.Row) -> list[faults.Outcome]:
    return [o for o in row.outcomes if o.kind == "response"]


@pytest.fixture(scope="module")
def choosy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return faults.choosy_weights(tmp_path_factory.mktemp("choosy"))


TWO_ENGINES = {"engine": "process", "engines_per_device": "2"}


@pytest.mark.parametrize("workers, keepalive, settings", [(1, False, {}), (1, True, {}), (2, False, {}),
                                                          (2, True, TWO_ENGINES)])
def test_sigterm_mid_burst_resets_no_connection(small_weights: Path, start_server: Start, workers: int,
                                                keepalive: bool, settings: dict[str, str]) -> None:
    # Before: gunicorn stopped accepting at SIGTERM and closed its listener only after the requests in flight,
    # so connections arriving meanwhile waited in the backlog and were reset (24 of 96 in the report).
    # Two workers on kept-alive connections run ENGINE=process with two engines: the workers drain as inline ones
    # (the same drain), and each engine finishes what its worker sent before the master stops it, after the workers.
    started: list[Running] = []
    row = faults.sigterm(lambda *a, **k: started.append(start_server(*a, **k)) or started[-1], small_weights, workers,
                         keepalive, **settings)
    _report(row)
    # 0 resets in most runs; with 2 workers, runs with 1 and once 6 in about 1,900 requests remain (see
    # docs/architecture.md), hence the bound of 1%.
    assert row.kinds["reset"] <= len(row.outcomes) // 100
    assert row.kinds["timeout"] == 0
    for o in _responses(row):
        assert o.status in (200, 503), o
        if o.status == 503:  # draining, or with 2 workers one still loading when the burst starts
            assert o.code == "not_ready" and o.headers["Retry-After"] == "5"
    assert row.statuses[503], "no request met the drain: the test proved nothing"
    assert row.kinds["refused"], "the listener never closed within the test"
    assert row.note.startswith("exit 0 ")
    assert [o for o in _responses(row) if o.status == 200 and o.at > row.fault_at], \
        "no request was in flight at SIGTERM: the test proved nothing"
    # Every answer the server logged reached its client, or is one of the resets counted above.
    logged = Counter(json.loads(line)["status"] for line in started[0].output().splitlines()
                     if '"visionserve.access"' in line and '"/predict"' in line)
    assert not row.statuses - logged, "the client got an answer the server never logged"
    assert sum((logged - row.statuses).values()) <= row.kinds["reset"], "an answer the client never got"


@pytest.mark.parametrize("workers", [1, 2])
def test_sigkill_of_a_worker_mid_batch(small_weights: Path, start_server: Start, workers: int) -> None:
    row = faults.sigkill_worker(start_server, small_weights, workers)
    _report(row)
    # Only the killed worker's requests in flight (at most one per client) are cut; every answer is clean.
    assert row.kinds["reset"] <= 16 and row.kinds["timeout"] == 0
    for o in _responses(row):
        assert o.status == 200 or (o.status == 503 and o.code == "not_ready" and "Retry-After" in o.headers), o
    assert row.recover_s is not None


def test_a_killed_workers_replacement_leaves_new_connections_to_the_worker_that_serves(
        small_weights: Path, start_server: Start) -> None:
    # Before: the replacement took connections from its first second and answered 503 not_ready while it imported
    # the app and loaded its model (a new user's trial, a new connection for each request: 43 of 308; this test got
    # 63). Now they wait in the shared backlog for the worker that serves, and the replacement takes them once it
    # serves. Inline, where the replacement loads a model: under ENGINE=process it only reaches the running engine
    # (2 503s before), by the same ready marks (tests/unit/test_host.py), so the suite runs the mode that shows it.
    server = start_server(small_weights, workers="2", max_batch_size="4").wait_ready()
    faults.wait_ready_workers(server, 2)
    before = server.http_worker_pids()
    os.kill(before[0], signal.SIGKILL)
    outcomes: list[faults.Outcome] = []
    while faults.ready_workers(server) < 3:  # until the replacement serves, one request at a time
        with requests.Session() as session:  # a new connection for each
            outcomes.append(faults.send(session, server.url))
        assert len(outcomes) < 5000, server.output()[-2000:]
    held_back = len(outcomes)
    replacement, = set(server.http_worker_pids()) - set(before)
    taking = f"worker {replacement} serves: taking new connections"
    deadline = time.monotonic() + 10  # its loop looks again within a second
    while taking not in server.output() and time.monotonic() < deadline:
        with requests.Session() as session:
            outcomes.append(faults.send(session, server.url))
    for _ in range(40):  # both workers take them now
        with requests.Session() as session:
            outcomes.append(faults.send(session, server.url))
    assert Counter(o.status for o in outcomes) == Counter({200: len(outcomes)}), [
        o for o in outcomes if o.status != 200][:3]
    assert held_back > 5, "the replacement served before any request met it: the test proved nothing"
    log = server.output()  # gunicorn's lines: the replacement held back, then took its share
    assert f"worker {replacement} takes new connections once it serves" in log and taking in log, log[-3000:]


def test_the_client_library_retries_what_a_killed_worker_dropped(small_weights: Path, start_server: Start) -> None:
    # A reset is retried by visionserve's client (prediction is idempotent), and so are the 503s while gunicorn's
    # replacement worker loads: a caller using it loses nothing.
    server = start_server(small_weights, max_batch_size="4").wait_ready()
    results: list[object] = []

    def call(client: Client) -> None:
        for _ in range(30):
            try:
                results.append(client.predict(faults.IMAGE))
            except Exception as exc:  # noqa: BLE001 - counted below
                results.append(exc)

    with Client(server.url, retries=8, max_backoff_s=2) as client, faults.Load(server.url, 8) as load:
        callers = [threading.Thread(target=call, args=(client,)) for _ in range(4)]
        for thread in callers:
            thread.start()
        time.sleep(0.5)
        os.kill(server.worker_pids()[0], signal.SIGKILL)
        for thread in callers:
            thread.join(120)
        load.stop(0)
    failures = [r for r in results if isinstance(r, Exception)]
    assert len(results) == 120 and not failures, failures[:3]


def test_a_reload_with_hup_answers_every_request(small_weights: Path, start_server: Start) -> None:
    # Documented, not gapless: the new worker answers 503 not_ready while it loads (rolling replicas is the
    # reload without 503s, tests/deploy/test_k8s.py); what must hold is that no request hangs or is cut off.
    row = faults.reload(start_server, small_weights)
    _report(row)
    assert row.kinds == Counter(response=len(row.outcomes))
    for o in _responses(row):
        assert o.status == 200 or (o.status == 503 and o.code == "not_ready" and "Retry-After" in o.headers), o


def test_a_forward_pass_that_raises_fails_only_its_own_request(choosy: Path, start_server: Start) -> None:
    row = faults.forward_raises(start_server, choosy)
    _report(row)
    assert row.kinds == Counter(response=len(row.outcomes))
    good = [o for o in _responses(row) if o.code is None]
    bad = [o for o in _responses(row) if o.code is not None]
    assert good and all(o.status == 200 for o in good)
    assert bad and all((o.status, o.code) == (500, "inference_failed") for o in bad)
    assert row.recover_s is not None


def test_clients_that_hang_up_while_queued_cost_no_forward_pass(small_weights: Path, start_server: Start) -> None:
    row = faults.client_disconnect(start_server, small_weights)
    _report(row)
    assert row.statuses == Counter({200: len(row.outcomes)})  # the others' requests are untouched
    assert int(row.note.split()[0]) > 0, row.note


def test_slowloris_does_not_starve_other_requests(small_weights: Path, start_server: Start) -> None:
    # Before: 200 clients sending a byte a second held all 32 threads; other requests got no answer at all.
    row = faults.slowloris(start_server, small_weights)
    _report(row)
    assert row.kinds["timeout"] == 0 and len(row.outcomes) >= 20
    assert row.statuses == Counter({200: len(row.outcomes)})
    timeouts, senders = (int(word) for word in row.note.split()[:3:2])
    assert timeouts == senders, row.note  # every slow header sender was told 408, none left hanging


def test_a_burst_of_ten_times_the_queue_is_answered_200_or_429(small_weights: Path, start_server: Start) -> None:
    row = faults.burst(start_server, small_weights)
    _report(row)
    assert len(row.outcomes) == 80 and row.kinds == Counter(response=80)
    assert set(row.statuses) <= {200, 429} and row.statuses[200] and row.statuses[429]
    for o in _responses(row):
        if o.status == 429:
            assert o.code == "overloaded" and int(o.headers["Retry-After"]) >= 1
    rejected = re.search(r'^visionserve_rejected_total\{reason="overloaded"\} (\S+)$', row.metrics, re.M)
    assert rejected and float(rejected.group(1)) == row.statuses[429]


def test_the_event_loop_answers_stalled_requests_408_and_oversized_ones_413_unread(small_weights: Path,
                                                                                   start_server: Start) -> None:
    server = start_server(small_weights, client_header_timeout_s="1", client_body_timeout_s="1",
                          max_body_bytes="100000").wait_ready()
    for sent in (b"POST /predict HTTP/1.1\r\nHost: x\r\n",  # headers never finished
                 b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc"):  # body stalls
        started = time.monotonic()
        answer, closed = _exchange(server.port, sent, wait_s=10)  # the server closes after its answer
        assert closed and time.monotonic() - started < 10
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and b"Connection: close" in head and b"X-Request-ID: " in head
        assert json.loads(body)["error"]["code"] == "request_timeout"
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:  # sends nothing at all
        assert sock.recv(4096) == b""  # closed quietly: there is no request to answer
    huge = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nContent-Length: 1000000000\r\n\r\n"
    answer, closed = _exchange(server.port, huge)  # no body sent at all: the answer comes from the header alone
    assert answer.startswith(b"HTTP/1.1 413") and b'"request_entity_too_large"' in answer
    assert b"Connection: close" in answer and closed  # the unread body is never parsed as a next request
    answer = requests.post(f"{server.url}/predict", data=faults.IMAGE, headers={"Content-Type": "image/jpeg"},
                           timeout=10)
    assert answer.status_code == 200


@pytest.mark.parametrize("linger_ms", ["2", "0"])
def test_pipelined_and_lingered_requests_are_each_answered_and_a_stall_after_the_linger_is_408(
        small_weights: Path, start_server: Start, linger_ms: str) -> None:
    # Before: requests pipelined on one connection (sent before the answer of the one ahead) were read by the loop
    # together, and only the first was answered: the rest waited in the parser for bytes that never came.
    server = start_server(small_weights, client_header_timeout_s="1", keepalive_linger_ms=linger_ms).wait_ready()
    health = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    photo = (b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
             + f"Content-Length: {len(faults.IMAGE)}\r\n\r\n".encode() + faults.IMAGE)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(health + photo + health + photo[:20])  # three whole, the fourth begun ...
        time.sleep(0.2)  # ... and finished after any linger
        sock.sendall(photo[20:])
        answers = _answers(sock, 4)
        assert [a.split(b"\r\n", 1)[0] for a in answers] == [b"HTTP/1.1 200 OK"] * 4
        assert [b'"predictions"' in a for a in answers] == [False, True, False, True]
        sock.sendall(photo[:50])  # begun right after an answer, then stalled past the header timeout
        started = time.monotonic()
        [timeout] = _answers(sock, 1)
        assert timeout.startswith(b"HTTP/1.1 408") and b"request_timeout" in timeout
        assert 0.5 < time.monotonic() - started < 5 and sock.recv(1) == b""  # closed after it


def _answers(sock: socket.socket, count: int) -> list[bytes]:
    """``count`` whole HTTP answers read from ``sock`` (each with a Content-Length)."""
    data, answers = b"", []
    while len(answers) < count:
        head_end = data.find(b"\r\n\r\n")
        if head_end >= 0:
            length = int(re.search(rb"Content-Length: (\d+)", data[:head_end], re.I).group(1))
            if len(data) >= head_end + 4 + length:
                answers.append(data[:head_end + 4 + length])
                data = data[head_end + 4 + length:]
                continue
        chunk = sock.recv(65536)
        assert chunk, f"closed after {len(answers)} answers"
        data += chunk
    return answers


def _exchange(port: int, head: bytes, body: bytes = b"", wait_s: float = 15) -> tuple[bytes, bool]:
    """Send raw bytes; return what came back and whether the server closed the connection within ``wait_s``."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        try:
            sock.sendall(head + body)
        except (BrokenPipeError, ConnectionResetError):  # the server answered and closed before reading it all
            pass
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except TimeoutError:
            return b"".join(chunks), False
        except ConnectionResetError:
            pass
        return b"".join(chunks), True


def _chunked(path: str, content_type: str, body: bytes, close: bool = False) -> tuple[bytes, bytes]:
    """A chunked request's head and body; ``close`` asks the server to close the connection after its answer."""
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
            + ("Connection: close\r\n" if close else "") + "Transfer-Encoding: chunked\r\n\r\n").encode()
    step = 65536
    chunks = [f"{len(body[i:i + step]):x}\r\n".encode() + body[i:i + step] + b"\r\n"
              for i in range(0, len(body), step)]
    return head, b"".join(chunks) + b"0\r\n\r\n"


def test_a_chunked_body_over_the_limit_is_413_and_closes_the_connection(small_weights: Path,
                                                                        start_server: Callable[..., Running]) -> None:
    # Before: a chunked raw body was cut at the limit and answered 400 invalid_image, its rest left unread.
    server = start_server(small_weights, max_body_bytes="100000", keepalive_s="60").wait_ready()
    over = b"\xff\xd8" + b"\0" * 300_000
    boundary = "b0undary"
    multipart = (f"--{boundary}\r\nContent-Disposition: form-data; name=image; filename=x.jpg\r\n"
                 f"Content-Type: image/jpeg\r\n\r\n").encode() + over + f"\r\n--{boundary}--\r\n".encode()
    bodies = {"/predict": [("image/jpeg", over), (f"multipart/form-data; boundary={boundary}", multipart),
                           ("application/json", b'{"images": ["' + b"A" * 300_000 + b'"]}')],
              "/v2/models/small/infer": [("application/json", b'{"inputs": [' + b" " * 300_000 + b"]}")]}
    for path, forms in bodies.items():
        for content_type, body in forms:
            answer, closed = _exchange(server.port, *_chunked(path, content_type, body), wait_s=20)
            status_line = answer.split(b"\r\n", 1)[0]
            assert b" 413 " in status_line, (path, content_type, answer[:300])
            assert b"Connection: close" in answer and closed, (path, content_type)
            assert b"over the 100000 byte limit" in answer or b"request_entity_too_large" in answer
    # Within the limit it is read whole and answered (Connection: close: the answer ends the exchange, not wait_s).
    answer, closed = _exchange(server.port, *_chunked("/predict", "image/jpeg", faults.IMAGE, close=True), wait_s=20)
    assert answer.startswith(b"HTTP/1.1 200") and closed, answer[:300]
