"""A closed-loop load generator: C threads, each with its own keep-alive connection, posting raw JPEG bodies."""
from __future__ import annotations

import collections
import http.client
import re
import resource
import statistics
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Sequence

import requests

from bench.usage import process_tree_cpu, tree_cpu_spent


@dataclass(frozen=True)
class LoadResult:
    """One server, one model, one concurrency: throughput, latency percentiles, errors and batching."""

    server: str
    model: str
    concurrency: int
    images_per_s: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    errors: int
    requests: int
    mean_batch: float | None
    server_cores: float | None = None  # CPU the server's processes used over the measured call (ramp, window, tail)
    client_cores: float | None = None  # the same for this load generator
    cpu_ms_per_image: float | None = None  # the server's CPU per answered image: what "faster per core" means
    decode_cpu_ms: float | None = None  # of which decode + preprocess, per image (visionserve's own counters)
    forward_cpu_ms: float | None = None  # and the forward pass, per image (a server counting none apart: its batches')
    engine_cores: float | None = None  # of server_cores, its engine processes' (ENGINE=process; None: it has none)
    batch_cpu_ms: float | None = None  # a batch's whole CPU per image: the batch made (the device path decodes
    # there) and its forward pass; visionserve's counters
    batch_wall_ms: float | None = None  # a batch's mean wall time (made and run; on a GPU, the wait for it too)
    forward_wall_ms: float | None = None  # of which its forward pass's (waited for)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


_COUNTERS = re.compile(r'^visionserve_(batch_size_sum|batch_size_count|stage_cpu_seconds_total|'
                       r'stage_duration_seconds_sum|stage_duration_seconds_count)'
                       r'(?:\{([^}]*)\})? ([0-9.e+-]+)$', re.M)
_STAGE = re.compile(r'(?:^|,)stage="(\w+)"')


def server_counters(base_url: str) -> dict[str, float]:
    """visionserve's images run, batches run, CPU seconds per stage and each stage's time (sum and count) from
    /metrics; empty for other servers."""
    try:
        text = requests.get(f"{base_url}/metrics", timeout=5).text
    except requests.RequestException:
        return {}
    counters: dict[str, float] = collections.defaultdict(float)  # summed over model versions (each its series)
    for name, labels, value in _COUNTERS.findall(text):
        stage = _STAGE.search(labels)
        counters[f"{name}:{stage.group(1)}" if stage else name] += float(value)
    return dict(counters)


class _Client:
    """One keep-alive HTTP/1.1 connection. http.client, not requests: requests spends about 1 ms of Python per call,
    which would be counted as server latency at C=1 and takes CPU from the server under test at high C."""

    def __init__(self, url: str, headers: dict[str, str], method: str = "POST") -> None:
        parts = urllib.parse.urlsplit(url)
        self._host, self._port, self._path = parts.hostname or "127.0.0.1", parts.port or 80, parts.path or "/"
        self._headers, self._method = headers, method
        self._conn: http.client.HTTPConnection | None = None

    def post(self, body: bytes) -> int:
        """Send one request and read the whole answer; its status (0: no answer). A failed connection is dropped
        and opened again on the next call."""
        try:
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self._host, self._port, timeout=120)
            self._conn.request(self._method, self._path, body=body or None, headers=self._headers)
            response = self._conn.getresponse()
            response.read()
            if response.will_close:
                self.close()
            return response.status
        except (OSError, http.client.HTTPException):
            self.close()
            return 0

    def close(self) -> None:
        """Close the connection, if open."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def closed_loop(url: str, bodies: Sequence[bytes], concurrency: int, duration_s: float, warmup_s: float,
                content_type: str = "image/jpeg", statuses: collections.Counter[int] | None = None,
                headers: dict[str, str] | None = None, method: str = "POST") -> tuple[list[float], int, int]:
    """Run C clients for warm-up + duration; returns latencies (s) and errors of the answers that came inside the
    measured window (whenever they were sent: with the clients running through the warm-up, the window counts the
    steady state's rate; counted from a cold start it would lose the work still in flight at its end, which grows
    with the latency and so with overload), and every answered request (200) until the last client stopped, for
    CPU per request over the whole call; ``statuses`` counts the window's answers by status (0: none). Each client
    sends its next request as soon as the previous answer arrives (a 429's Retry-After is not waited for: the
    overload a client that retries makes). ``headers`` (all of them, Content-Type included) replace
    ``content_type``; ``method`` GET sends no body."""
    start = time.perf_counter()
    measure_from, stop_at = start + warmup_s, start + warmup_s + duration_s
    latencies: list[float] = []
    errors, answered = [0], [0]
    lock = threading.Lock()

    def client(index: int) -> None:
        connection = _Client(url, headers or {"Content-Type": content_type}, method)
        i = index
        while True:
            sent = time.perf_counter()
            if sent >= stop_at:
                break
            status = connection.post(bodies[i % len(bodies)])
            ok, done = status == 200, time.perf_counter()
            i += concurrency
            with lock:
                answered[0] += ok
                if measure_from <= done <= stop_at:
                    if statuses is not None:
                        statuses[status] += 1
                    if ok:
                        latencies.append(done - sent)
                    else:
                        errors[0] += 1
        connection.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies, errors[0], answered[0]


def measure(server: str, model: str, base_url: str, path: str, bodies: Sequence[bytes], concurrency: int,
            duration_s: float, warmup_s: float, content_type: str = "image/jpeg",
            server_pid: int | None = None, images_per_request: int = 1) -> LoadResult:
    """One point of the comparison: a warm-up run (a worker's first answers are slow), then the measured run (batch
    sizes and CPU use over it only), whose clients run ``warmup_s`` again before its window (the window's rate is
    then the steady state's, whatever the latency: ``closed_loop``). ``server_pid``: the server's first process, whose
    tree's CPU is read (its workers and an engine process included; a process started during the call, such as a
    restarted engine, is not counted); ``images_per_request``: what each body holds."""
    closed_loop(base_url + path, bodies, concurrency, warmup_s, 0.0, content_type)
    before = server_counters(base_url)
    tree_before = process_tree_cpu(server_pid) if server_pid else {}
    client_cpu, started = _own_cpu_s(), time.perf_counter()
    latencies, errors, answered = closed_loop(base_url + path, bodies, concurrency, duration_s, warmup_s,
                                              content_type)
    wall = time.perf_counter() - started
    tree_after = process_tree_cpu(server_pid) if server_pid else {}
    server_s, engine_s = tree_cpu_spent(tree_before, tree_after)
    server_cores = server_s / wall if server_pid else None
    engine_cores = engine_s / wall if engine_s is not None else None
    client_cores = (_own_cpu_s() - client_cpu) / wall
    delta = {k: v - before.get(k, 0.0) for k, v in server_counters(base_url).items()}
    images, batches = delta.get("batch_size_sum", 0.0), delta.get("batch_size_count", 0.0)

    def per_image_ms(key: str) -> float | None:
        return 1000 * delta[key] / images if images and key in delta else None

    def per_batch_ms(stage: str) -> float | None:
        runs = delta.get(f"stage_duration_seconds_count:{stage}")
        return 1000 * delta[f"stage_duration_seconds_sum:{stage}"] / runs if runs else None

    ms = sorted(x * 1000 for x in latencies)
    answered_images = answered * images_per_request
    return LoadResult(server, model, concurrency, len(latencies) * images_per_request / duration_s,
                      percentile(ms, 50), percentile(ms, 95), percentile(ms, 99), errors, len(latencies) + errors,
                      images / batches if batches else None, server_cores, client_cores,
                      1000 * server_cores * wall / answered_images if server_cores and answered_images else None,
                      per_image_ms("stage_cpu_seconds_total:decode"),
                      # the forward pass alone where the server counts it apart, else its batch's whole stage
                      per_image_ms("stage_cpu_seconds_total:forward")
                      or per_image_ms("stage_cpu_seconds_total:inference"),
                      engine_cores, per_image_ms("stage_cpu_seconds_total:inference"), per_batch_ms("inference"),
                      per_batch_ms("forward"))
