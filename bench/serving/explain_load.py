"""``python -m bench.serving.explain_load``: what explanations beside it cost /predict (#52: its p99 may rise 20%
at most).

The packaged Lite0 served as `make serve` serves it (its ONNX file, the server's defaults, ``--engine`` as given),
under a closed-loop /predict load of the benchmark's photos (raw JPEG bodies, keep-alive) at ``--concurrency``,
alone and with ``--explainers`` clients beside it each asking POST /explain of the same photos back to back; the
two settings alternate over ``--rounds`` rounds on one server. Prints per setting the median over rounds of
/predict's images/s, p50 and p99, the explanations answered (and refused, 429) per second, and the ratios.

    .venv/bin/python -m bench.serving.explain_load --rounds 3
"""
from __future__ import annotations

import argparse
import collections
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import requests

from bench import paths
from bench.serving.load import measure
from harness.photos import imagenet_workload, workload
from harness.servers import visionserve

WORK = paths.WORK / "explain_load"
ROOT = Path(__file__).resolve().parents[2]


def _explaining(url: str, bodies: tuple[bytes, ...], stop: threading.Event, counts: collections.Counter) -> None:
    """One client asking for explanations back to back until ``stop``; answers counted by status."""
    with requests.Session() as session:
        i = 0
        while not stop.is_set():
            response = session.post(url + "/explain", data=bodies[i % len(bodies)], timeout=60,
                                    headers={"Content-Type": "image/jpeg"})
            counts[response.status_code] += 1
            i += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--explainers", type=int, default=1, help="clients asking for explanations beside")
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--engine", default="auto", help="ENGINE: auto (inline on a CPU host) or process")
    args = parser.parse_args()
    weights = WORK / "weights"
    subprocess.run([sys.executable, "-m", "models.export", "--default", "--out", str(weights), "--packages", "onnx",
                    "--force"], cwd=ROOT, check=True)
    WORK.mkdir(parents=True, exist_ok=True)
    server = visionserve(weights, WORK, engine=args.engine).wait_ready()
    bodies, explained = list(workload()), imagenet_workload()
    results: dict[str, list[Any]] = collections.defaultdict(list)
    rates: dict[str, list[float]] = collections.defaultdict(list)
    try:
        for _ in range(args.rounds):
            for setting in ("alone", "explanations beside"):
                stop, counts = threading.Event(), collections.Counter()
                clients = [threading.Thread(target=_explaining, args=(server.url, explained, stop, counts))
                           for _ in range(args.explainers if setting != "alone" else 0)]
                started = time.perf_counter()
                for client in clients:
                    client.start()
                results[setting].append(measure(setting, "efficientnet_lite0", server.url, "/predict", bodies,
                                                args.concurrency, args.duration, 3.0))
                stop.set()
                for client in clients:
                    client.join()
                seconds = time.perf_counter() - started
                rates[f"{setting} ok"].append(counts[200] / seconds)
                rates[f"{setting} refused"].append(counts[429] / seconds)
    finally:
        server.stop()
    print(f"efficientnet_lite0, ENGINE={args.engine}, /predict at C={args.concurrency}, {args.explainers} "
          f"explanation client(s) beside; {args.rounds} alternating rounds of {args.duration:g} s, medians")
    print("| setting | /predict images/s | p50 ms | p99 ms | errors | explanations/s | refused/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for setting, runs in results.items():
        print(f"| {setting} | {statistics.median(r.images_per_s for r in runs):.1f} | "
              f"{statistics.median(r.p50_ms for r in runs):.1f} | {statistics.median(r.p99_ms for r in runs):.1f} | "
              f"{sum(r.errors for r in runs)} | {statistics.median(rates[f'{setting} ok']):.1f} | "
              f"{statistics.median(rates[f'{setting} refused']):.1f} |")
    alone, beside = results["alone"], results["explanations beside"]
    for key, name in (("images_per_s", "images/s"), ("p99_ms", "p99")):
        ratio = statistics.median(getattr(r, key) for r in beside) / statistics.median(getattr(r, key) for r in alone)
        print(f"/predict {name} with explanations beside / alone: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
