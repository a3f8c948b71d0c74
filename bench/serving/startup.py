"""``python -m bench.serving.startup``: the start-up probe. Does any request wait while the server starts?

The server with its defaults (what `make serve` starts; EfficientNet-Lite0) is started ``--runs`` times. From the
moment its port accepts a connection until /readyz answers 200, a prober sends GET /healthz, GET /readyz and
POST /predict (a photo) every 200 ms, each on a new connection as a load balancer's or kubelet's probes do, and
records how long each took and what it answered. Writes bench/results/<date>-startup-cpu-<cores>cpu-vm.md.
"""
from __future__ import annotations

import argparse
import collections
import socket
import sys
import time
from dataclasses import dataclass, field

import requests

from bench.paths import WORK
from bench.serving.compare import export_models
from bench.serving.report import save_result
from harness.photos import workload
from harness.servers import Running, visionserve

PROBED = (("GET", "/healthz"), ("GET", "/readyz"), ("POST", "/predict"))
INTERVAL_S = 0.2


@dataclass
class StartupRun:
    """One start: when the port opened and the server was ready, and every probe's (path, status, seconds it
    took, seconds after the start it was sent)."""

    port_open_s: float = 0.0
    ready_s: float = 0.0
    probes: list[tuple[str, int, float, float]] = field(default_factory=list)


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.05)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _probe(server: Running, method: str, path: str, photo: bytes) -> tuple[int, float]:
    started = time.perf_counter()
    try:
        headers = {"Connection": "close", **({"Content-Type": "image/jpeg"} if method == "POST" else {})}
        answer = requests.request(method, server.url + path, timeout=30, headers=headers,
                                  data=photo if method == "POST" else None)
        status = answer.status_code
    except requests.RequestException:
        status = 0  # refused or reset: counted, and the report says so
    return status, time.perf_counter() - started


def one_start(weights_dir, logs) -> StartupRun:  # noqa: ANN001
    """Start the server, wait for its port, probe until /readyz is 200, stop it."""
    run, photo = StartupRun(), workload()[0]
    started = time.perf_counter()
    server = visionserve(weights_dir, logs)
    try:
        while not _port_open(server.port):
            if server.process.poll() is not None:
                raise RuntimeError(server.output()[-3000:])
            time.sleep(0.01)
        run.port_open_s = time.perf_counter() - started
        ready = False
        while not ready:
            round_started = time.perf_counter()
            for method, path in PROBED:
                sent = time.perf_counter() - started
                status, took = _probe(server, method, path, photo)
                run.probes.append((path, status, took, sent))
                ready = ready or (path == "/readyz" and status == 200)
            time.sleep(max(0.0, INTERVAL_S - (time.perf_counter() - round_started)))
        run.ready_s = time.perf_counter() - started
    finally:
        server.stop()
    return run


def report(runs: list[StartupRun]) -> str:
    """The figures as markdown: per path, the answers and the longest wait over every run."""
    lines = ["# Start-up probe", "", f"`python -m bench.serving.startup`: the server with its defaults started "
             f"{len(runs)} times; from the moment the port opened until /readyz answered 200, /healthz, /readyz and "
             "/predict probed every 200 ms on new connections.", "",
             "| run | port open (s) | ready (s) | probes |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {i} | {r.port_open_s:.1f} | {r.ready_s:.1f} | {len(r.probes)} |" for i, r in enumerate(runs, 1)]
    lines += ["", "| path | answers | median wait (ms) | longest wait (ms) |", "| --- | --- | ---: | ---: |"]
    for _, path in PROBED:
        probes = [(status, took) for r in runs for p, status, took, _ in r.probes if p == path]
        statuses = collections.Counter(status for status, _ in probes)
        waits = sorted(took for _, took in probes)
        answers = ", ".join(f"{count} x {status or 'no answer'}" for status, count in sorted(statuses.items()))
        lines.append(f"| {path} | {answers} | {1000 * waits[len(waits) // 2]:.0f} | {1000 * waits[-1]:.0f} |")
    path, _, longest, sent = max((p for r in runs for p in r.probes), key=lambda p: p[2])
    refused = sum(p[1] == 0 for r in runs for p in r.probes)
    lines += ["", f"Longest wait of any probe: {1000 * longest:.0f} ms ({path}, sent {sent:.1f} s after the start); "
              f"probes with no answer: {refused}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="starts to probe")
    args = parser.parse_args(argv)
    weights = export_models(WORK / "weights", ["efficientnet_lite0"])["efficientnet_lite0"]
    logs = WORK / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    save_result("startup", report([one_start(weights, logs) for _ in range(args.runs)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
