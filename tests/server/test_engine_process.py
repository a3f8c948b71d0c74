"""ENGINE=process on the CPU: the HTTP workers never load torch, each talks to its engine (two engines serve the
shared server: ENGINES_PER_DEVICE=2), an engine killed under load fails its requests in flight with 503 and
Retry-After while the other engine answers, and is restarted; meanwhile new connections go to the worker whose
engine serves; readiness holds for every worker; an engine that cannot load its model stops the server with the
message."""
from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import pytest
import requests

from harness.servers import Running
from tests.support.fakes import wait_until
from tests.support.imaging import RED, image_bytes
from tests.support.servers import serve

IMAGE = image_bytes(RED, size=(160, 120))


@pytest.fixture
def server(engine_server: Running) -> Running:
    """The session's ENGINE=process server (tests/conftest.py), shared with the other engine-process tests."""
    return engine_server


def _children(server: Running) -> dict[int, str]:
    """The master's children: pid -> command line."""
    return {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            for pid in server.worker_pids()}


def _engines(server: Running) -> dict[int, int]:
    """The engines: slot -> pid (``python -m app.link.server SLOT``)."""
    return {int(command.split()[-1]): pid for pid, command in _children(server).items() if "app.link.server" in command}


def _engine_pid(server: Running) -> int:
    (pid,) = _engines(server).values()
    return pid


def _predict(server: Running, timeout_s: float = 30) -> requests.Response:
    return requests.post(f"{server.url}/predict", data=IMAGE, headers={"Content-Type": "image/jpeg"},
                         timeout=timeout_s)


def test_http_workers_never_load_torch_and_each_talks_to_its_own_engine(server: Running) -> None:
    children = _children(server)
    workers = [pid for pid, command in children.items() if "app.link.server" not in command]
    engines = sorted(_engines(server).values())
    assert len(workers) == 2 and len(engines) == 2 and len(children) == 4
    for pid in workers:
        assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text(), f"worker {pid} loaded torch"
    for pid in engines:
        assert "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    output = server.output()
    assert "2 engine processes (ENGINES_PER_DEVICE=2)" in output and "get no HTTP worker" not in output
    assert "ready to serve (engine 0)" in output and "ready to serve (engine 1)" in output  # worker n, engine n
    answers = [_predict(server) for _ in range(6)]
    assert all(a.status_code == 200 for a in answers) and {a.json()["model"]["name"] for a in answers} == {"small"}
    models = requests.get(f"{server.url}/v1/models", timeout=30).json()
    assert [m["name"] for m in models["models"]] == ["small"]
    assert sorted(w["pid"] for w in models["workers"]) == engines  # what each engine serves
    v2 = requests.post(f"{server.url}/v2/models/small/infer", timeout=30, json={"inputs": [
        {"name": "images", "datatype": "BYTES", "shape": [1], "data": [__import__("base64").b64encode(IMAGE).decode()]}],
        "parameters": {"binary_data_output": False}})
    assert v2.status_code == 200 and v2.json()["outputs"][0]["shape"] == [1, 10]
    assert requests.post(f"{server.url}/predict?model=nope", data=IMAGE, timeout=30,
                         headers={"Content-Type": "image/jpeg"}).status_code == 404  # refused by the engine
    assert requests.post(f"{server.url}/predict", data=b"not an image", timeout=30,
                         headers={"Content-Type": "image/jpeg"}).status_code == 400
    several = requests.post(f"{server.url}/predict", timeout=30, files=[
        ("image", ("a.txt", b"not an image")), ("image", ("cat.jpg", IMAGE)), ("image", ("b.txt", b"nor this"))])
    assert several.status_code == 400 and [(i["image"], i["filename"]) for i in several.json()["error"]["details"][
        "also_refused"]] == [(2, "b.txt")]  # the engine's refusal, whole across the link
    # Every catalog read, a few times on new connections (both workers): what the engine answers unpickles in the
    # worker without importing torch (before: the prediction monitor's snapshot was a class of a module that imports
    # it, and the first /v1/models took a worker from ~55 MB to ~540 MB and stalled its requests 1.4 s)
    version = models["models"][0]["version"]
    for path in ("/", "/v1/models", "/v1/models/small", "/v2/models/small", "/v2/models/small/config",
                 f"/v2/models/small/versions/{version}", "/v2/models/small/ready", "/readyz", "/metrics"):
        for _ in range(4):
            assert requests.get(f"{server.url}{path}", timeout=30).status_code == 200, path
    assert requests.post(f"{server.url}/v2/repository/index", json={}, timeout=30).status_code == 200
    for pid in workers:
        assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text(), f"worker {pid} loaded torch"


def test_an_engine_killed_under_load_fails_its_requests_with_503_the_other_answers_and_it_comes_back(
        server: Running) -> None:
    statuses: list[int | str] = []  # in the order the answers came
    retry_after: set[str | None] = set()
    stop = threading.Event()

    def load(_: int) -> None:
        while not stop.is_set():  # a new connection each time: both workers, so both engines, take some
            try:
                answer = _predict(server, timeout_s=60)
            except requests.RequestException as exc:  # nothing may hang or drop the connection
                statuses.append(type(exc).__name__)
                continue
            statuses.append(answer.status_code)
            if answer.status_code != 200:
                retry_after.add(answer.headers.get("Retry-After"))

    engines = _engines(server)
    starts = _engine_starts(server)
    with ThreadPoolExecutor(8) as pool:
        running = [pool.submit(load, i) for i in range(8)]
        time.sleep(1.0)
        os.kill(engines[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while 503 not in statuses and time.monotonic() < deadline:
            time.sleep(0.05)
        # engine 1 restarts meanwhile (its interpreter, torch, the model: seconds): /readyz says why on both workers
        # (before: 503 with no reason on the worker of engine 0, which serves, as on engine 1's)
        probes = [requests.get(f"{server.url}/readyz", timeout=10) for _ in range(8)]
        reasons = {p.json().get("reason") for p in probes if p.status_code == 503}
        assert None not in reasons, reasons
        time.sleep(0.5)
        stop.set()
        for future in running:
            future.result(timeout=120)
    assert set(statuses) <= {200, 503}, Counter(statuses)  # only answers: no 500, no hang, no reset
    assert retry_after == {"5"}
    first, last = statuses.index(503), len(statuses) - 1 - statuses[::-1].index(503)
    # engine 0 answered on: before, and after the 503s of engine 1's requests (those in flight, and those its worker
    # took before it knew; then its worker leaves new connections to engine 0's while engine 1 restarts)
    assert 200 in statuses[:first] and 200 in statuses[last:], Counter(statuses)
    _serving_again(server)
    now = _engines(server)
    assert now[0] == engines[0] and now[1] != engines[1]
    assert all(_predict(server).status_code == 200 for _ in range(4))
    assert f"engine 1 (pid {engines[1]}) died with status -9; restarting it" in server.output()
    # /metrics says it too (before: only the log did): engine 1 started once more, both serve again
    assert _engine_starts(server) == {"0": starts["0"], "1": starts["1"] + 1}
    lines = requests.get(f"{server.url}/metrics", timeout=10).text.splitlines()
    assert 'visionserve_engine_up{engine="0"} 1.0' in lines and 'visionserve_engine_up{engine="1"} 1.0' in lines


def _engine_starts(server: Running) -> dict[str, float]:
    """visionserve_engine_starts_total by engine slot, as /metrics says it."""
    text = requests.get(f"{server.url}/metrics", timeout=10).text
    return {slot: float(count) for slot, count in
            re.findall(r'^visionserve_engine_starts_total\{engine="(\d+)"\} (\S+)$', text, flags=re.M)}


def _serving_again(server: Running) -> None:
    """Wait until the master's restart of an engine serves: /readyz 200, then /metrics' readiness, which follows
    within a second (each engine's gauge is refreshed with its report, and the other engine said not ready while
    this one was gone): the later tests of this server read it."""
    deadline = time.monotonic() + 120
    while requests.get(f"{server.url}/readyz", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, server.output()[-3000:]
        time.sleep(0.5)
    while "visionserve_ready 1.0" not in requests.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        assert time.monotonic() < deadline, server.output()[-3000:]
        time.sleep(0.2)


def _held_back(server: Running) -> int:
    """How many HTTP workers leave new connections to the others now: each says when it starts, and when it takes
    them again (app/hosting/worker.py; no worker of this server drains)."""
    output = server.output()
    return (output.count("takes new connections once it serves") - output.count("serves: taking new connections")
            - output.count("takes new connections: no worker serves"))


@pytest.mark.slow
def test_new_connections_go_to_the_worker_whose_engine_serves_while_the_other_engine_restarts(
        server: Running) -> None:
    # Before: the worker of the killed engine went on taking its share of the new connections for the whole
    # restart and answered them 503 not_ready (572 of 864 in 4 s) while the worker of engine 0 served.
    wait_until(lambda: _held_back(server) == 0, timeout=30)  # after an earlier kill: its loop asks a second apart
    gone, back, held = ("engine 1 is gone: waiting for it to be ready again", "engine 1 is ready again",
                        "takes new connections once it serves")
    said = {line: server.output().count(line) for line in (gone, back, held)}

    def more(line: str) -> bool:
        return server.output().count(line) > said[line]

    os.kill(_engines(server)[1], signal.SIGKILL)
    wait_until(lambda: more(gone), timeout=60)  # its worker's ready mark went before it said so
    statuses: list[int] = []
    while not more(back) and len(statuses) < 40:  # engine 1 restarts meanwhile (torch, the model: seconds)
        statuses.append(requests.post(f"{server.url}/predict", data=IMAGE, timeout=30, headers={
            "Content-Type": "image/jpeg", "Connection": "close"}).status_code)  # a new connection each
    assert len(statuses) >= 10 and set(statuses) == {200}, (Counter(statuses), server.output()[-3000:])
    wait_until(lambda: more(held), timeout=30)  # the worker of engine 1 left them in the listen backlog
    wait_until(lambda: more(back), timeout=120)
    wait_until(lambda: _held_back(server) == 0, timeout=30)  # and takes them again once its engine serves
    _serving_again(server)


def test_after_the_first_ready_no_request_is_refused_as_not_ready(small_weights: Path,
                                                                  start_server: Callable[..., Running]) -> None:
    for engine in ("process", "inline"):
        server = start_server(small_weights, engine=engine, workers="3")
        deadline = time.monotonic() + 180
        while True:
            try:
                if requests.get(f"{server.url}/readyz", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline and server.process.poll() is None, server.output()[-3000:]
            time.sleep(0.05)
        with ThreadPoolExecutor(8) as pool:  # new connections, so every worker takes some
            codes = Counter(pool.map(lambda _: requests.post(
                f"{server.url}/predict", data=IMAGE, headers={"Content-Type": "image/jpeg", "Connection": "close"},
                timeout=60).status_code, range(60)))
        assert codes == Counter({200: 60}), (engine, codes)
        server.stop()


def test_an_engine_that_cannot_load_its_model_stops_the_server_with_the_reason(
        tmp_path: Path, start_server: Callable[..., Running]) -> None:
    broken = tmp_path / "weights"
    broken.mkdir()
    (broken / "manifest.json").write_text("{not json", encoding="utf-8")
    server = start_server(broken, engine="process", workers="2")
    assert server.process.wait(timeout=120) != 0
    assert "manifest" in server.output() and "cannot serve" in server.output()


def test_one_thread_serves_refusals_hang_ups_and_answers_in_step(small_weights: Path,
                                                                 start_server: Callable[..., Running]) -> None:
    # One worker thread, so every request below travels on the same pooled engine connection: a refusal after the
    # admission (a bad body), a client that hangs up mid-inference, then answers that must be this request's own.
    server = start_server(small_weights, engine="process", workers="1", threads="1", max_wait_ms="5").wait_ready()
    bad = requests.post(f"{server.url}/predict", data=b"not an image", headers={"Content-Type": "image/jpeg"},
                        timeout=30)
    assert bad.status_code == 400
    # a client that hangs up once its request is sent, its answer unread (was a 1 ms timeout, which a client
    # preempted past the inference read as an answer: "DID NOT RAISE" on a loaded machine)
    host, port = server.url.split("//")[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as gone:
        gone.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(IMAGE), IMAGE))
    for _ in range(5):
        answer = _predict(server)
        assert answer.status_code == 200 and answer.json()["predictions"][0]["label"].startswith("class")
    v2 = requests.get(f"{server.url}/v2/models/small", timeout=30)
    assert v2.status_code == 200 and v2.json()["name"] == "small"


def test_the_engine_ends_with_the_master_after_a_reload_and_after_a_kill(small_weights: Path,
                                                                         start_server: Callable[..., Running]) -> None:
    server = start_server(small_weights, engine="process", workers="1").wait_ready()
    engine = _engine_pid(server)
    os.kill(server.process.pid, signal.SIGHUP)  # new workers; the engine keeps serving
    deadline = time.monotonic() + 60
    while _predict(server).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert _engine_pid(server) == engine
    assert server.stop() == 0
    _gone(engine)
    killed = start_server(small_weights, engine="process", workers="1").wait_ready()
    engine = _engine_pid(killed)
    os.kill(killed.process.pid, signal.SIGKILL)  # no on_exit: the engine sees its pipe from the master close
    _gone(engine)


def _gone(pid: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, f"engine {pid} outlived its master"
        time.sleep(0.1)


def _threads(pid: int) -> int:
    """The process's threads, once their number held for half a second (a start-up thread may still be ending)."""
    seen = [-1]
    while len(seen) < 6 or len(set(seen[-5:])) > 1:
        seen.append(len(os.listdir(f"/proc/{pid}/task")))
        time.sleep(0.1)
    return seen[-1]


def test_requests_run_on_the_workers_loop_a_chunked_body_too_and_a_client_that_stops_reading_stalls_no_one(
        small_weights: Path, start_server: Callable[..., Running]) -> None:
    # THREADS=2: at most two requests run on the loop at once, and a client that stops reading holds none of them
    server = start_server(small_weights, engine="process", workers="1", threads="2", max_wait_ms="5").wait_ready()
    (worker,) = [pid for pid, command in _children(server).items() if "app.link.server" not in command]
    assert _predict(server).status_code == 200
    threads = _threads(worker)
    with ThreadPoolExecutor(24) as pool:  # 24 requests at once, each waiting for the engine on the worker's loop
        codes = Counter(pool.map(lambda _: _predict(server).status_code, range(96)))
    assert codes == Counter({200: 96}) and _threads(worker) == threads  # not one request thread started
    chunked = requests.post(f"{server.url}/predict", data=iter([IMAGE[:100], IMAGE[100:]]), timeout=30,
                            headers={"Content-Type": "image/jpeg"})  # its body arrives after its headers
    assert chunked.status_code == 200 and _threads(worker) == threads  # the loop read it whole, then ran it
    host, port = server.url.split("//")[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as pipelined:  # each answer starts the next
        pipelined.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 600)
        answers = b""
        while answers.count(b"HTTP/1.1 ") < 600 and (chunk := pipelined.recv(1 << 20)):
            answers += chunk
    assert answers.count(b"HTTP/1.1 200 ") == 600  # 320-578 before: nested 600 deep, the connection dropped

    stalled = [socket.socket() for _ in range(3)]  # more than THREADS: each holds its connection, not a slot
    for client in stalled:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect((host, int(port)))
        client.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n" * 400)  # megabytes of answers, none read
    time.sleep(0.5)
    started = time.monotonic()
    assert _predict(server, timeout_s=10).status_code == 200 and time.monotonic() - started < 5
    for client in stalled:
        client.close()

    # answers that close their connection, to clients that keep their end open: each close lingers up to 2 s for
    # them, and no longer on the loop (before, 3 such closes held every other request 6 s)
    kept = [socket.create_connection((host, int(port)), timeout=30) for _ in range(3)]
    for client in kept:
        client.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    started = time.monotonic()
    assert requests.get(f"{server.url}/healthz", timeout=10).status_code == 200 and time.monotonic() - started < 3
    assert all(client.recv(4096).startswith(b"HTTP/1.1 200 ") for client in kept)
    for client in kept:
        client.close()
    assert _predict(server).status_code == 200
