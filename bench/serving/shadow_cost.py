"""``python -m bench.serving.shadow_cost``: what a 100% shadow costs the live traffic.

Two real versions of Lite0 (harness/rollouts.py: the packaged model and a copy with a perturbed head, both with
their ONNX file, as `make serve` exports), served with the defaults a user gets (`make serve`'s settings: workers
per core), once without a rollout and once with `{"rollout": {"shadow_percent": 100}}`, alternating over
``--rounds`` rounds; at each concurrency a closed-loop load of the benchmark's photos (raw JPEG bodies, keep-alive).
Prints per setting and concurrency the median over rounds of images/s, p50 and p99 of the live answers, their
ratios (shadow / none), and what the shadow did: images compared and dropped (by reason).
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
from typing import Any

import requests

from bench import paths
from bench.serving.load import measure
from harness.photos import workload
from harness.rollouts import MODEL, set_rollout, two_lite0_versions
from harness.servers import Running, visionserve

WORK = paths.WORK / "rollouts"
SETTINGS = {"none": None, "shadow 100%": {"shadow_percent": 100}}


def _shadow_figures(server: Running) -> dict[str, Any]:
    body = requests.get(server.url + "/v1/models", timeout=10).json()
    rollout = next((r for r in body.get("rollouts", []) if r["model"] == MODEL), None)
    return (rollout or {}).get("comparison") or {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--duration", type=float, default=15.0)
    args = parser.parse_args()
    repository = WORK / "repository"
    if not (repository / MODEL / "2" / "manifest.json").is_file():
        two_lite0_versions(repository, packages=(("onnx", "float32"),))
    bodies = list(workload())
    results: dict[tuple[str, int], list[Any]] = collections.defaultdict(list)
    shadow: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for round_index in range(args.rounds):
        for name, rollout in SETTINGS.items():
            set_rollout(repository, rollout)
            log_dir = WORK / f"server-{round_index}-{name.split()[0]}"
            log_dir.mkdir(parents=True, exist_ok=True)
            server = visionserve(repository, log_dir, workers="0").wait_ready()
            try:
                for concurrency in args.concurrency:
                    before = _shadow_figures(server)
                    result = measure(name, MODEL, server.url, "/predict", bodies, concurrency, args.duration, 3.0)
                    results[(name, concurrency)].append(result)
                    if rollout:
                        after = _shadow_figures(server)
                        shadow[concurrency].append({
                            "compared": after.get("compared", 0) - before.get("compared", 0),
                            "dropped": sum(after.get("dropped", {}).values()) - sum(before.get("dropped", {}).values()),
                            "agreement": after.get("top1_agreement")})
            finally:
                server.stop()
    set_rollout(repository, None)
    print(f"{MODEL} 1 live, 2 shadow: {args.rounds} alternating rounds of {args.duration:g} s, medians")
    print("| concurrency | setting | images/s | p50 ms | p99 ms | errors | shadow compared | shadow dropped |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for concurrency in args.concurrency:
        for name in SETTINGS:
            runs = results[(name, concurrency)]
            extra = shadow[concurrency] if SETTINGS[name] else []
            compared = f"{statistics.median(s['compared'] for s in extra):.0f}" if extra else "-"
            dropped = f"{statistics.median(s['dropped'] for s in extra):.0f}" if extra else "-"
            print(f"| {concurrency} | {name} | {statistics.median(r.images_per_s for r in runs):.1f} | "
                  f"{statistics.median(r.p50_ms for r in runs):.1f} | {statistics.median(r.p99_ms for r in runs):.1f} "
                  f"| {sum(r.errors for r in runs)} | {compared} | {dropped} |")
        ratio = {key: statistics.median(getattr(r, key) for r in results[("shadow 100%", concurrency)])
                 / statistics.median(getattr(r, key) for r in results[("none", concurrency)])
                 for key in ("images_per_s", "p50_ms", "p99_ms")}
        print(f"C={concurrency}: shadow / none: images/s {ratio['images_per_s']:.3f}, p50 {ratio['p50_ms']:.3f}, "
              f"p99 {ratio['p99_ms']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
