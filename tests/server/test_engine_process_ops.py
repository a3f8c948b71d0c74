"""ENGINE=process as ops see it: /metrics says ready and alive while the server serves, the engine's batches in it,
before and after the engine is killed and restarted (the killed one's series gone with it); clients on kept-alive
connections see only answers across the kill (a refusal that leaves a photo unread keeps its connection, or says it
closes it); the log says the engine was killed by SIGKILL."""
from __future__ import annotations

import functools
import http.client
import json
import os
import re
import shutil
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import requests
from PIL import Image

from harness.servers import Running
from tests.support.fakes import wait_until
from tests.support.imaging import encode

# A photo-like JPEG past the 64 KiB that gunicorn's own skip of an unread body gives up at.
PHOTO = encode(Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 400, 3), dtype=np.uint8)),
               quality=95)
JPEG = {"Content-Type": "image/jpeg"}


@pytest.fixture
def server(engine_server: Running) -> Running:
    """The session's ENGINE=process server (tests/conftest.py), shared with the other engine-process tests, once
    every process of it reads ready: its /readyz answers 200 from the first worker that serves, while the other may
    still load (visionserve_ready is the lowest of them: a scrape then read 0, on a loaded CI machine)."""
    wait_until(lambda: _metrics(engine_server).get("visionserve_ready") == 1, timeout=120)
    return engine_server


def _engine_pid(server: Running) -> int:
    """The engine's pid: a child of any of the master's threads (a restarted engine is its watcher thread's)."""
    master = server.process.pid
    children = " ".join(path.read_text() for path in Path(f"/proc/{master}/task").glob("*/children")).split()
    (pid,) = [int(pid) for pid in children if b"app.link.server" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    return pid


def _metrics(server: Running) -> dict[str, float]:
    """One scrape on a new connection (either worker may answer): series (with labels) -> value."""
    text = requests.get(f"{server.url}/metrics", headers={"Connection": "close"}, timeout=30).text
    return {name: float(value) for name, value in re.findall(r"^(\S+) (\S+)$", text, re.MULTILINE)}


def _total(metrics: dict[str, float], name: str, *labels: str) -> float:
    """A series' values over every model version (``labels``: 'stage="inference"' each), summed."""
    return sum(value for series, value in metrics.items()
               if series.partition("{")[0] == name and all(label in series for label in labels))


def _answered(metrics: dict[str, float]) -> float:
    """The requests the versions answered, as a scrape counts them."""
    return sum(value for name, value in metrics.items()
               if name.startswith("visionserve_version_requests_total{") and 'outcome="ok"' in name)


def _assert_ready_and_alive(server: Running) -> dict[str, float]:
    for _ in range(4):
        metrics = _metrics(server)
        assert metrics["visionserve_ready"] == 1 and metrics["visionserve_batcher_alive"] == 1, metrics
    return metrics


def test_ready_and_batcher_alive_read_1_and_the_engine_s_series_reach_metrics(server: Running) -> None:
    for _ in range(3):
        assert requests.post(f"{server.url}/predict", data=PHOTO, headers=JPEG, timeout=30).status_code == 200
    metrics = _assert_ready_and_alive(server)
    assert _total(metrics, "visionserve_batch_size_count") >= 1
    assert _total(metrics, "visionserve_stage_duration_seconds_count", 'stage="inference"') >= 1
    assert [value for name, value in metrics.items() if name.startswith("visionserve_model_info{")] == [1]
    assert [name for name, value in metrics.items() if name.startswith("visionserve_queue_capacity{") and value > 0]


def test_a_refusal_that_leaves_a_photo_unread_keeps_the_connection_or_says_it_closes(server: Running) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.request("POST", "/predict?model=nope", body=PHOTO, headers=JPEG)  # refused before its body
        refused = connection.getresponse()
        refused.read()
        assert refused.status == 404 and refused.getheader("Connection") == "keep-alive"
        kept = connection.sock
        connection.request("POST", "/predict", body=PHOTO, headers=JPEG)
        answer = connection.getresponse()
        answer.read()
        assert answer.status == 200 and connection.sock is kept  # the same connection, still usable
        try:
            connection.request("POST", "/predict?model=nope", body=iter([PHOTO]), headers=JPEG, encode_chunked=True)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before the body's last chunk went: its answer is still to read
        streamed = connection.getresponse()
        streamed.read()
        assert streamed.status == 404 and streamed.getheader("Connection") == "close"
    finally:
        connection.close()


def _wait(condition: Callable[[], bool], server: Running, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline and server.process.poll() is None, server.output()[-3000:]
        time.sleep(0.1)


class Clients:
    """Clients posting the photo in a loop on kept-alive connections until stopped: requests sessions (they make a
    new connection when they see the server closed theirs) and bare http.client connections (they do not look, so
    a connection the server closes after saying keep-alive fails their next request)."""

    def __init__(self, url: str, port: int) -> None:
        self.url, self.port = url, port
        self.outcomes: Counter[object] = Counter()
        self.retry_after: set[str | None] = set()
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def start(self, target: Callable[[], None]) -> None:
        self.threads.append(threading.Thread(target=target))
        self.threads[-1].start()

    def __enter__(self) -> "Clients":
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def _count(self, status: int, retry_after: str | None) -> None:
        self.outcomes[status] += 1
        if status == 503:
            self.retry_after.add(retry_after)

    def session(self) -> None:
        with requests.Session() as session:
            while not self.stop.is_set():
                try:
                    answer = session.post(f"{self.url}/predict", data=PHOTO, headers=JPEG, timeout=60)
                except requests.ConnectionError:  # a reset: what no client may see
                    self.outcomes["connection error"] += 1
                    continue
                self._count(answer.status_code, answer.headers.get("Retry-After"))

    def bare(self, path: str = "/predict") -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        while not self.stop.is_set():
            try:
                connection.request("POST", path, body=PHOTO, headers=JPEG)
                answer = connection.getresponse()
                answer.read()  # an answer saying Connection: close closes it here; the next request reconnects
            except (http.client.HTTPException, OSError):
                self.outcomes["connection error"] += 1
                connection.close()
                continue
            self._count(answer.status, answer.getheader("Retry-After"))
        connection.close()


def test_kept_alive_clients_across_an_engine_sigkill_see_answers_only_and_metrics_and_log_tell_the_truth(
        small_weights: Path, start_server: Callable[..., Running]) -> None:
    server = start_server(small_weights, engine="process", workers="2", max_wait_ms="5").wait_ready()
    # /readyz answers 200 once one worker serves; the gauge is the lowest of the two (the second one, on a loaded
    # machine, may still be reaching its engine: a suite run read 0 here once)
    _wait(lambda: _metrics(server)["visionserve_ready"] == 1, server, timeout_s=60)
    batches = _total(_assert_ready_and_alive(server), "visionserve_batch_size_count")
    with Clients(server.url, server.port) as clients:
        for client in (clients.session, clients.session, clients.bare):
            clients.start(client)
        outcomes = clients.outcomes
        _wait(lambda: outcomes[200] >= 3, server)
        engine = _engine_pid(server)
        os.kill(engine, signal.SIGKILL)
        # Asking for a model by name no worker has parsed for yet: its 503s come before the photo is read.
        clients.start(functools.partial(clients.bare, "/predict?model=small"))
        _wait(lambda: outcomes[503] >= 1, server)  # in flight, then while the engine restarts
        answered = outcomes[200]
        _wait(lambda: outcomes[200] >= answered + 6, server)  # the restarted engine answers
    assert set(outcomes) <= {200, 503} and outcomes[503] > 0, outcomes
    assert clients.retry_after == {"5"}
    assert _engine_pid(server) != engine
    # Each HTTP worker reads 0 from its engine's end until it has seen the restarted one ready (it asks every
    # 0.1 s), which on a loaded machine may come after the first answers: then 1 on every scrape.
    _wait(lambda: (lambda m: m["visionserve_ready"] == m["visionserve_batcher_alive"] == 1)(_metrics(server)), server,
          timeout_s=30)
    metrics = _assert_ready_and_alive(server)
    assert _total(metrics, "visionserve_batch_size_count") > batches  # the new engine's batches beside the old one's
    assert f"engine 0 (pid {engine}) died with status -9; restarting it" in server.output()
    assert "died with status 0" not in server.output()
    # The killed engine's info series went with it: unloaded by its restart, the model reads 0 (a "max" gauge kept
    # the dead engine's 1 for good).
    assert requests.post(f"{server.url}/v2/repository/models/small/unload", timeout=60).status_code == 200
    assert [value for name, value in _metrics(server).items() if name.startswith("visionserve_model_info{")] == [0]


def test_an_engine_that_cannot_serve_after_a_restart_stops_the_server_with_a_failure_status(
        small_weights: Path, tmp_path: Path, start_server: Callable[..., Running]) -> None:
    # Before: the master stopped itself with SIGTERM and exited 0, which systemd's Restart=on-failure, compose's
    # on-failure and a Job read as a clean end; a worker that cannot load its model at the start ends it with 3.
    weights = tmp_path / "weights"
    shutil.copytree(small_weights, weights)
    server = start_server(weights, engine="process").wait_ready()
    engine = _engine_pid(server)
    for name in ("model.torchscript.pt", "model.state_dict.pt"):  # the weights go bad while it serves
        (weights / name).write_bytes(b"garbage")
    os.kill(engine, signal.SIGKILL)  # its restart cannot load them
    assert server.process.wait(timeout=120) == 3, server.output()[-4000:]
    lines = [json.loads(line) for line in server.output().splitlines()]
    reasons = [entry for entry in lines if entry["msg"].startswith("Reason: ")]
    assert [(entry["level"], entry["msg"][:42]) for entry in reasons] == [
        ("error", "Reason: engine 0 cannot serve: small versi")], reasons


def test_a_scrape_counts_every_answer_before_it_though_the_engine_holds_its_batches_figures(
        small_weights: Path, start_server: Callable[..., Running]) -> None:
    # The engine writes its batches' figures and its loop its request counts once a METRICS_FLUSH_MS at most; the
    # worker a scrape reaches asks it to write them first. Before (without the ask) the four batches below read 0 for
    # the five seconds here.
    server = start_server(small_weights, engine="process", workers="1", metrics_flush_ms="5000").wait_ready()
    assert requests.post(f"{server.url}/predict", data=PHOTO, headers=JPEG, timeout=30).status_code == 200
    before = _metrics(server)
    for _ in range(4):  # one at a time: a batch each
        assert requests.post(f"{server.url}/predict", data=PHOTO, headers=JPEG, timeout=30).status_code == 200
    after = _metrics(server)
    assert _total(after, "visionserve_batch_size_count") - _total(before, "visionserve_batch_size_count") == 4
    assert _answered(after) == _answered(before) + 4 == 5  # every request answered, the first one too
    assert server.stop() == 0
