"""The fault matrix: the real server (gunicorn, bin/serve) under load, one fault each.

For every fault: how many requests were sent, how they were answered (by status), how many connections were
reset with no answer (the client cannot know whether such a request ran), how many were refused (never sent: safe
to retry), and how long the service took to recover. tests/server/test_faults.py runs the scenarios and asserts on
them; ``python -m bench.serving.faults`` prints the table that docs/deployment.md quotes.
"""
from __future__ import annotations

import contextlib
import io
import os
import select
import signal
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import requests
import torch
from PIL import Image
from torch import nn

from harness.servers import Running, metric_sum


def _jpeg(color: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (160, 120), color).save(out, "JPEG")
    return out.getvalue()


IMAGE = _jpeg((220, 30, 30))
POISON = _jpeg((255, 255, 255))  # the choosy model below raises on it
NON_JSON = "non_json"  # the error code send() gives an answer whose body is not the service's JSON error
Start = Callable[..., Running]  # start(weights, **settings) -> a server, not yet ready


@dataclass(frozen=True)
class Outcome:
    """One request: when it ended, and ("response", status, error code), ("reset", ...) or ("refused", ...)."""
    at: float
    kind: str
    status: int | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    detail: str = ""  # for a reset: what the client library said


def send(session: requests.Session, url: str, body: bytes = IMAGE, timeout_s: float = 30) -> Outcome:
    """POST one image once, no retry. A body cut off mid-way (shorter than its Content-Length, or its chunks
    unfinished) is a reset; an error answered whole in a body that is not JSON (an HTML 500 page) is an answer with
    its status and the code "non_json"."""
    try:
        r = session.post(f"{url}/predict", data=body, headers={"Content-Type": "image/jpeg"}, timeout=timeout_s)
    except requests.Timeout:
        return Outcome(time.monotonic(), "timeout")
    except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as exc:
        refused = "NewConnectionError" in repr(exc) or "ConnectionRefusedError" in repr(exc)
        return Outcome(time.monotonic(), "refused" if refused else "reset", detail=repr(exc)[:300])
    code = None
    if r.status_code != 200:
        try:
            code = r.json().get("error", {}).get("code")
        except ValueError:  # read whole (a cut-off body raised above), and not JSON
            code = NON_JSON
    return Outcome(time.monotonic(), "response", r.status_code, code, dict(r.headers))


class Load:
    """``clients`` closed-loop threads posting until ``stop``; keep-alive or a new connection per request."""

    def __init__(self, url: str, clients: int, keepalive: bool = True, body: bytes = IMAGE,
                 timeout_s: float = 30) -> None:
        self.url, self.keepalive, self.body, self.timeout_s = url, keepalive, body, timeout_s
        self.outcomes: list[Outcome] = []
        self._stop_at = float("inf")
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    def __enter__(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(0)

    def stop(self, after_s: float) -> list[Outcome]:
        """Stop sending ``after_s`` from now, wait for the last answers, and return every outcome."""
        self._stop_at = min(self._stop_at, time.monotonic() + after_s)
        for thread in self._threads:
            thread.join(self.timeout_s + after_s + 5)
        return self.outcomes

    def _client(self) -> None:
        session = requests.Session()
        while time.monotonic() < self._stop_at:
            if not self.keepalive:
                session.close()
            outcome = send(session, self.url, self.body, self.timeout_s)
            self.outcomes.append(outcome)
            if outcome.kind == "refused":
                time.sleep(0.05)


@dataclass
class Row:
    """One line of the matrix."""
    fault: str
    outcomes: list[Outcome]
    recover_s: float | None
    note: str = ""
    fault_at: float | None = None  # time.monotonic() when the fault struck, where one moment does
    metrics: str = ""  # the server's /metrics after it recovered, where the scenario reads them
    metrics_before: str = ""  # and before the fault, where it counts what happened during it
    connections_cut: int | None = None  # the client connections a killed process held when it died (SIGKILL)
    by_client: dict[str, list[Outcome]] = field(default_factory=dict)  # each kind of client's outcomes, where
    # a scenario's clients differ (forward_raises: "good" and "bad"); ``outcomes`` holds them all

    @property
    def kinds(self) -> Counter[str]:
        return Counter(o.kind for o in self.outcomes)

    @property
    def statuses(self) -> Counter[int]:
        return Counter(o.status for o in self.outcomes if o.kind == "response")

    def line(self) -> str:
        answered = ", ".join(f"{status}: {n}" for status, n in sorted(self.statuses.items())) or "-"
        recover = "-" if self.recover_s is None else f"{self.recover_s:.1f}"
        k = self.kinds
        return (f"| {self.fault} | {len(self.outcomes)} | {answered} | {k['reset']} | {k['refused']} | "
                f"{k['timeout']} | {recover} | {self.note} |")


HEADER = ("| fault | sent | answered, by status | reset | refused | timed out | recovered after (s) | note |\n"
          "|---|---:|---|---:|---:|---:|---:|---|")


def until_served(url: str, since: float, limit_s: float = 120) -> float:
    """Seconds from ``since`` until /readyz and a /predict both answer 200."""
    deadline = time.monotonic() + limit_s
    with requests.Session() as session:
        while time.monotonic() < deadline:
            try:
                if (session.get(f"{url}/readyz", timeout=5).status_code == 200
                        and send(session, url, timeout_s=10).status == 200):
                    return time.monotonic() - since
            except requests.RequestException:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not recover within {limit_s}s")


def ready_workers(server: Running) -> int:
    """How many HTTP workers have said "ready to serve" so far (replacements included); under ENGINE=process, "ready
    to serve (engine N)" once they reach their engine (the engines' own "ready to serve" is not a worker's)."""
    output = server.output()
    if server.engine_process:
        return output.count('"ready to serve (engine ')
    return output.count('"ready to serve"')


def wait_ready_workers(server: Running, count: int, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while ready_workers(server) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} workers not ready: {server.output()[-2000:]}")
        time.sleep(0.1)


def sigterm(start: Start, weights: Path, workers: int, keepalive: bool, **settings: str) -> Row:
    """SIGTERM after 1 s of a 24-client burst; clients go on 4 s more, past the drain, into a closed listener.
    ``settings`` (e.g. ENGINE=process with two engines) are said in the row's name."""
    server = start(weights, workers=str(workers), shutdown_drain_s="1.5", max_batch_size="4",
                   **settings).wait_ready()
    wait_ready_workers(server, workers)
    with Load(server.url, 24, keepalive=keepalive) as load:
        time.sleep(1.0)
        term_at = time.monotonic()
        server.terminate()
        outcomes = load.stop(4.0)
    exit_code = server.stop()
    exited_s = time.monotonic() - term_at
    connection = "keep-alive" if keepalive else "new connections"
    said = "".join(f", {name.upper()}={value}" for name, value in settings.items())
    return Row(f"SIGTERM mid-burst, {workers} worker(s){said}, {connection}", outcomes, None,
               f"exit {exit_code} after {exited_s:.1f} s; the drain answers 1.5 s, then 503 until it closes",
               fault_at=term_at)


def client_connections(pid: int, port: int) -> int:
    """How many established TCP connections on ``port`` (the server's side of them) process ``pid`` holds."""
    sockets = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            sockets.add(target[len("socket:["):-1])
    held = 0
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()  # sl, local address:port (hex), remote, state (01: established), ..., inode
            if fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port and fields[9] in sockets:
                held += 1
    return held


def sigkill_worker(start: Start, weights: Path, workers: int) -> Row:
    """SIGKILL one worker under a 16-client load (it is mid-batch: the load keeps it busy). The clients keep their
    connections alive, so those the worker holds when it dies are the requests it can cut: one each at most."""
    server = start(weights, workers=str(workers), max_batch_size="4").wait_ready()
    wait_ready_workers(server, workers)
    try:
        with Load(server.url, 16) as load:
            time.sleep(1.0)
            # the worker holding the most of the clients' connections: the one that began taking them last (held
            # back while the other served, a loop turn after its model loaded) may hold none of them
            held = {pid: client_connections(pid, server.port) for pid in server.http_worker_pids()}
            victim = max(held, key=held.__getitem__)
            connections = held[victim]
            killed_at = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            wait_ready_workers(server, workers + 1)  # gunicorn's replacement has loaded its model
            recover_s = until_served(server.url, killed_at)
            outcomes = load.stop(1.0)
    finally:
        assert server.stop() == 0
    return Row(f"SIGKILL of a worker mid-batch, {workers} worker(s)", outcomes, recover_s,
               "resets: the killed worker's requests in flight; replacement ready", connections_cut=connections)


RELOAD_DRAIN_S = "1"  # the reload's SHUTDOWN_DRAIN_S: shorter than the new worker's load under the load


def reload(start: Start, weights: Path) -> Row:
    """``kill -HUP`` (gunicorn's reload) under a 16-client load: the new worker loads while the old one drains,
    answering for RELOAD_DRAIN_S (SHUTDOWN_DRAIN_S), and on while the new one loads (shorter than the load takes)."""
    server = start(weights, workers="1", max_batch_size="4", shutdown_drain_s=RELOAD_DRAIN_S).wait_ready()
    try:
        with Load(server.url, 16) as load:
            time.sleep(1.0)
            ready_before = ready_workers(server)  # (the new worker's "ready to serve" comes after these)
            hup_at = time.monotonic()
            server.process.send_signal(signal.SIGHUP)
            wait_ready_workers(server, ready_before + 1)
            recover_s = until_served(server.url, hup_at)
            outcomes = load.stop(1.0)
    finally:
        assert server.stop() == 0
    return Row("kill -HUP (gunicorn reload), 1 worker", outcomes, recover_s,
               f"the old worker answers while the new one loads (past its {RELOAD_DRAIN_S} s drain)",
               fault_at=hup_at)


class Choosy(nn.Module):
    """A model that raises on a near-white image: the forward pass fails for some inputs, not for others."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x.flatten(1).mean(1) > 1.5).any()):
            raise RuntimeError("this model cannot take a white image")
        return self.inner(x)


def choosy_weights(out: Path) -> Path:
    """Export a Choosy mobilenet_v3_small (10 classes, 64x64) with the project's own export."""
    from models.export.write import export_model
    from models.presets import EvalPreset
    from models.architectures import build_model

    if not (out / "manifest.json").exists():
        torch.manual_seed(0)
        export_model(Choosy(build_model("mobilenet_v3_small", 10)), out_dir=out, name="choosy", version="test",
                     arch="mobilenet_v3_small", labels=[f"class{i}" for i in range(10)],
                     preset=EvalPreset(resize_size=72, crop_size=64))
    return out


def forward_raises(start: Start, choosy: Path) -> Row:
    """10 clients, 2 of them sending an image the model raises on; batches mix both kinds."""
    server = start(choosy, max_batch_size="8", max_wait_ms="5").wait_ready()
    try:
        with Load(server.url, 8) as good, Load(server.url, 2, body=POISON) as bad:
            time.sleep(3.0)
            by_client = {"good": good.stop(0), "bad": bad.stop(0)}
        started = time.monotonic()
        recover_s = until_served(server.url, started)
        metrics = requests.get(f"{server.url}/metrics", timeout=5).text
    finally:
        assert server.stop() == 0
    passes = metric_sum(metrics, "visionserve_batcher_events_total", event="batch_failed")
    return Row("forward pass raises on some images (2 of 10 clients)", by_client["good"] + by_client["bad"],
               recover_s, f"500 inference_failed for the bad image only; {passes:.0f} failed passes",
               metrics=metrics, by_client=by_client)


def _post_and_hang_up(port: int, images: int) -> None:
    boundary = "hangup"
    parts = b"".join(f"--{boundary}\r\nContent-Disposition: form-data; name=image; filename=i{i}.jpg\r\n"
                     f"Content-Type: image/jpeg\r\n\r\n".encode() + IMAGE + b"\r\n" for i in range(images))
    body = parts + f"--{boundary}--\r\n".encode()
    head = (f"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary={boundary}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + body)
        time.sleep(0.02)  # long enough to be read and queued behind the load, not to be answered


def client_disconnect(start: Start, weights: Path, hang_ups: int = 20, images: int = 16) -> Row:
    """Under a 16-client load, ``hang_ups`` clients send ``images`` images each and hang up while they are queued."""
    server = start(weights, max_batch_size="2", max_wait_ms="2", queue_size="1024").wait_ready()
    try:
        before = requests.get(f"{server.url}/metrics", timeout=5).text
        with Load(server.url, 16) as load:
            time.sleep(0.5)
            clients = [threading.Thread(target=_post_and_hang_up, args=(server.port, images)) for _ in range(hang_ups)]
            for thread in clients:
                thread.start()
            for thread in clients:
                thread.join()
            time.sleep(1.0)
            outcomes = load.stop(0)
        recover_s = until_served(server.url, time.monotonic())
        metrics = requests.get(f"{server.url}/metrics", timeout=5).text
    finally:
        assert server.stop() == 0
    dropped = metric_sum(metrics, "visionserve_batcher_events_total", event="client_gone")
    return Row(f"clients hang up while their images are queued ({hang_ups} x {images} images)", outcomes,
               recover_s, f"{dropped:.0f} queued images dropped unrun (client_gone)",
               metrics=metrics, metrics_before=before)


def _slow_client(port: int, payload: bytes, until: float, answers: list[bytes]) -> None:
    """Send ``payload`` one byte a second until ``until`` or until the server answers; keep the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        try:
            for byte in payload:
                if time.monotonic() > until or select.select([sock], [], [], 0)[0]:
                    break  # an answer waits: read it before a byte sent to a closed socket resets it
                sock.sendall(bytes([byte]))
                time.sleep(1.0)
            answers.append(sock.recv(4096))
        except OSError:
            answers.append(b"")


def slowloris(start: Start, weights: Path, slow: int = 200, seconds: float = 8) -> Row:
    """``slow`` connections: half dribble headers, half a body, one byte a second; 4 clients meanwhile."""
    server = start(weights, client_header_timeout_s="4", client_body_timeout_s="30").wait_ready()
    until = time.monotonic() + seconds
    head = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nContent-Length: 1000\r\n\r\n"
    answers: list[bytes] = []
    threads = [threading.Thread(target=_slow_client, args=(server.port, head, until, answers), daemon=True)
               for _ in range(slow // 2)]
    body_sockets = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(slow - slow // 2)]
    try:
        for sock in body_sockets:
            sock.sendall(head + b"\xff")  # headers at once, then the body one byte a second
        for thread in threads:
            thread.start()
        with Load(server.url, 4, timeout_s=10) as load:
            _dribble(body_sockets, until)
            outcomes = load.stop(0)
        for thread in threads:
            thread.join(15)
        recover_s = until_served(server.url, time.monotonic())
    finally:
        for sock in body_sockets:
            sock.close()
        assert server.stop() == 0
    timeouts = sum(a.startswith(b"HTTP/1.1 408") for a in answers)
    return Row(f"slowloris: {slow} connections at 1 byte/s (headers or body)", outcomes, recover_s,
               f"{timeouts} of {len(threads)} slow header senders got 408 after the 4 s header timeout")


FLOODER = "127.0.0.2"  # one client of the flood (on loopback as 127.0.0.1, the other clients', is another host)


def one_client_floods(start: Start, weights: Path, slow: int = 2500, seconds: float = 8, **settings: str) -> Row:
    """One client (FLOODER) opens ``slow`` connections, each sending its request's head a byte a second; 4 other
    clients meanwhile, each request on a new connection. ``settings``: the server's (``max_connections_per_client="0"``: as before the limit)."""
    server = start(weights, **settings).wait_ready()
    until = time.monotonic() + seconds
    flood: list[socket.socket] = []
    try:
        with Load(server.url, 4, keepalive=False, timeout_s=10) as load:  # a new connection a request
            for _ in range(slow):
                sock = socket.create_connection(("127.0.0.1", server.port), timeout=5,
                                                source_address=(FLOODER, 0))
                sock.setblocking(False)
                flood.append(sock)
            told = _dribble_heads(flood, until)
            outcomes = load.stop(0)
        recover_s = until_served(server.url, time.monotonic())
    finally:
        for sock in flood:
            sock.close()
        assert server.stop() == 0
    return Row(f"one client's {slow} connections at 1 byte/s (headers)", outcomes, recover_s,
               f"{told} of {slow} of its connections answered 429 (MAX_CONNECTIONS_PER_CLIENT), the rest held")


def _dribble_heads(sockets: list[socket.socket], until: float) -> int:
    """A request head sent a byte a second on each of ``sockets`` (non-blocking) until ``until``; how many were
    answered 429 meanwhile."""
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    told, sent, open_ = 0, 0, set(sockets)
    while time.monotonic() < until and open_:
        for sock in list(open_):
            try:
                answer = sock.recv(4096)
            except BlockingIOError:
                answer = None
            except OSError:
                answer = b""
            if answer is not None:  # answered (or closed): nothing more to send on it
                told += answer.startswith(b"HTTP/1.1 429")
                open_.discard(sock)
                continue
            with contextlib.suppress(OSError):
                sock.send(head[sent:sent + 1])
        sent = min(sent + 1, len(head) - 3)  # never the head's end: held, not answered
        time.sleep(1.0)
    return told


def _dribble(sockets: list[socket.socket], until: float) -> None:
    while time.monotonic() < until:
        for sock in sockets:
            try:
                sock.sendall(b"\0")
            except OSError:
                pass
        time.sleep(1.0)


def burst(start: Start, weights: Path, queue: int = 8) -> Row:
    """10x the queue at once: 80 single-image requests, each on its own connection, released together."""
    # a queue holds a whole request at least (MAX_IMAGES, 16 by default): the burst's requests are single images
    server = start(weights, queue_size=str(queue), max_images=str(queue), max_batch_size="4",
                   inline_when_idle="false").wait_ready()
    gate = threading.Barrier(10 * queue)
    outcomes: list[Outcome] = []

    def one() -> None:
        with requests.Session() as session:
            gate.wait()
            outcomes.append(send(session, server.url))

    try:
        threads = [threading.Thread(target=one) for _ in range(10 * queue)]
        for thread in threads:
            thread.start()
        started = time.monotonic()
        for thread in threads:
            thread.join(60)
        recover_s = until_served(server.url, started)
        metrics = requests.get(f"{server.url}/metrics", timeout=5).text
    finally:
        assert server.stop() == 0
    return Row(f"burst of 10x the queue ({10 * queue} requests, queue {queue})", outcomes, recover_s,
               "429s carry Retry-After; nothing queued is lost", metrics=metrics)


def small_weights(out: Path) -> Path:
    """An untrained mobilenet_v3_small (10 classes, 64x64): cheap to run, so the faults, not the model, show."""
    from models.export.write import export_model
    from models.presets import EvalPreset
    from models.architectures import build_model

    if not (out / "manifest.json").exists():
        torch.manual_seed(0)
        export_model(build_model("mobilenet_v3_small", 10), out_dir=out, name="small", version="test",
                     arch="mobilenet_v3_small", labels=[f"class{i}" for i in range(10)],
                     preset=EvalPreset(resize_size=72, crop_size=64))
    return out


def matrix(start: Start, weights: Path, choosy: Path) -> list[Row]:
    """Every fault, in the order of the table."""
    rows = [sigterm(start, weights, workers, keepalive) for workers in (1, 2) for keepalive in (False, True)]
    rows += [sigkill_worker(start, weights, workers) for workers in (1, 2)] + [reload(start, weights)]
    rows += [forward_raises(start, choosy), client_disconnect(start, weights), slowloris(start, weights),
             one_client_floods(start, weights), burst(start, weights)]
    return rows
