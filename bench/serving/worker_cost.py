"""``python -m bench.serving.worker_cost``: the request-reading worker (app/hosting/worker.py) against gunicorn's own gthread.

The same server (the small mobilenet of the fault matrix, 1 worker; the benchmark's photos as bodies) started with
each worker class in turn, three alternating rounds of a 15 s closed-loop load at 16 clients with keep-alive;
prints the median images/s and p50 latency of each, and their ratio. The buffering worker reads every request in
its event loop, so this is where it would cost (the GIL it shares with the request threads).
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

from bench import paths
from bench.serving.load import measure
from harness.faults import small_weights
from harness.photos import workload
from harness.servers import Running, free_port, gunicorn_command

WORK = paths.WORK / "faults"


def _start(weights: Path, worker_class: str | None) -> Running:
    port = free_port()
    env = {"VISIONSERVE_WEIGHTS_DIR": str(weights), "VISIONSERVE_BIND": f"127.0.0.1:{port}",
           "VISIONSERVE_DEVICE": "cpu", "VISIONSERVE_LOG_LEVEL": "warning", "VISIONSERVE_AUTO_BATCH_SIZE": "false"}
    command = gunicorn_command("app.wsgi:app") + (["-k", worker_class] if worker_class else [])
    return Running(worker_class or "buffering", command, env, port, "/readyz", WORK).wait_ready()


def main() -> int:
    weights = small_weights(WORK / "small")
    bodies = list(workload())
    results: dict[str, list[tuple[float, float]]] = {"gthread": [], "buffering": []}
    for _ in range(3):
        for name, worker_class in (("gthread", "gthread"), ("buffering", None)):
            server = _start(weights, worker_class)
            try:
                r = measure(name, "small", server.url, "/predict", bodies, 16, 15.0, 3.0)
                results[name].append((r.images_per_s, r.p50_ms))
            finally:
                server.stop()
    med = {n: (statistics.median(x for x, _ in v), statistics.median(y for _, y in v)) for n, v in results.items()}
    for name, (rate, p50) in med.items():
        print(f"{name}: {rate:.0f} images/s, p50 {p50:.1f} ms (median of 3 rounds, 16 clients)")
    print(f"buffering / gthread: {med['buffering'][0] / med['gthread'][0]:.3f} images/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
