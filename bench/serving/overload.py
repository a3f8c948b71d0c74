"""Overload, bar style: clients that retry at once, at 8x the concurrency that saturates the server, against the
server at that saturating concurrency, in each engine layout (issue #50, item 3).

    .venv/bin/python -m bench.serving.overload                      # Lite0, inline and process, 16 and 1 image(s)
    .venv/bin/python -m bench.serving.overload --model small --seconds 6 --points 16x2 1x4
    python3 -m bench.serving.overload --device cuda --points 1x64 16x16   # on a GPU host

Each point is IMAGES (images per request: the saturating concurrency found here) or IMAGESxC (C given). Finding it:
C = 1, 2, 4, ... clients for half of ``--seconds`` each, until the goodput gains less than 5% over the best so far
(or C reaches ``--max-concurrency``); the saturating C is the one that gave the best, the smallest within 5% of it.
Then C clients, then 8 x C clients, each for ``--seconds``, their clients going on from a warm-up into the window,
on one server start per engine. Printed per run: goodput (images/s of 200 answers), the answers by status, p50/p99
of the 200s and the longest, and the ratio of the overloaded goodput to the saturated one (the bar: >= 0.9, answers
only 200/429/503).
"""
from __future__ import annotations

import argparse
import collections
import json
import tempfile
from pathlib import Path

from bench.serving.load import closed_loop, percentile
from harness.photos import imagenet_workload, request_bodies
from harness.servers import visionserve

OVERLOAD = 8


def point(url: str, per_request: int, concurrency: int, seconds: float, warmup: float) -> dict[str, object]:
    """One closed-loop run, its clients going on from the warm-up into the measured window: goodput, answers by
    status and latencies of the 200s that came within it (the steady state's: a window started cold would lose the
    work still in flight at its end, the more under overload, where admitted requests wait longer)."""
    bodies, content_type = request_bodies(imagenet_workload(), per_request)
    statuses: collections.Counter[int] = collections.Counter()
    latencies, _, _ = closed_loop(url + "/predict", bodies, concurrency, seconds, warmup, content_type, statuses)
    ms = [x * 1000 for x in latencies]
    return {"per_request": per_request, "concurrency": concurrency, "img_s": statuses[200] * per_request / seconds,
            "statuses": dict(sorted(statuses.items())), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99),
            "max_ms": max(ms, default=float("nan"))}


def saturating(url: str, per_request: int, seconds: float, warmup: float, limit: int) -> tuple[int, list[dict]]:
    """The concurrency that saturates the server with ``per_request`` images a request (doubling from 1 until the
    goodput gains less than 5% over the best so far, or ``limit``), and the points tried."""
    tried: list[dict[str, object]] = []
    best: dict[str, object] | None = None
    concurrency = 1
    while concurrency <= limit:
        row = point(url, per_request, concurrency, seconds, warmup)
        tried.append(row)
        if best is not None and row["img_s"] < 1.05 * best["img_s"]:  # type: ignore[operator]
            break
        best = row if best is None or row["img_s"] > best["img_s"] else best  # type: ignore[operator]
        concurrency *= 2
    assert best is not None, "limit below 1"
    return int(best["concurrency"]), tried  # type: ignore[arg-type]


def weights_for(model: str, work: Path) -> Path:
    if model == "small":
        from harness.faults import small_weights

        return small_weights(work / "small")
    from bench.paths import WORK
    from bench.serving.compare import export_models

    return export_models(WORK / "weights", [model])[model]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="efficientnet_lite0", choices=("efficientnet_lite0", "small"))
    parser.add_argument("--engines", nargs="+", default=["inline", "process"], choices=("inline", "process"))
    parser.add_argument("--points", nargs="+", default=["16", "1"],
                        help="IMAGES (the saturating concurrency found) or IMAGESxC (given): images per request")
    parser.add_argument("--max-concurrency", type=int, default=128, help="the search for saturation stops here")
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workers", default="0", help="WORKERS (0: the server's automatic count)")
    parser.add_argument("--queue-sizes", nargs="+", default=["0"],
                        help="QUEUE_SIZE, a server start per value (0: the automatic size; 128: the count before)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    points = [(int(images), int(given) if given else 0) for images, _, given in (p.partition("x") for p in args.points)]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        weights = weights_for(args.model, Path(folder))
        for engine, queue_size in ((e, q) for e in args.engines for q in args.queue_sizes):
            server = visionserve(weights, Path(folder), engine=engine, device=args.device, workers=args.workers,
                                 queue_size=queue_size, max_images=str(max(n for n, _ in points))).wait_ready()
            try:
                for per_request, given in points:
                    found = given
                    if not given:
                        found, tried = saturating(server.url, per_request, args.seconds / 2, args.warmup / 2,
                                                  args.max_concurrency)
                        for row in tried:
                            print(json.dumps({"engine": engine, "queue_size": queue_size, "search": True, **row}),
                                  flush=True)
                    for concurrency in (found, OVERLOAD * found):
                        row = {"engine": engine, "queue_size": queue_size,
                               **point(server.url, per_request, concurrency, args.seconds, args.warmup)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
            finally:
                server.stop()
    print(f"\n{args.model} on {args.device}, {args.seconds:g} s per point; goodput = images/s of 200 answers")
    print(f"{'engine':<8} {'queue':>5} {'img/req':>7} {'C':>5} {'goodput':>9} {'of peak':>8} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'max ms':>8}  answers")
    for row in rows:
        peak = next(r["img_s"] for r in rows if r["engine"] == row["engine"]
                    and r["queue_size"] == row["queue_size"] and r["per_request"] == row["per_request"])
        ratio = row["img_s"] / peak if peak else float("nan")
        print(f"{row['engine']:<8} {row['queue_size']:>5} {row['per_request']:>7} {row['concurrency']:>5} "
              f"{row['img_s']:>9.1f} {ratio:>8.2f} {row['p50_ms']:>8.0f} {row['p99_ms']:>8.0f} "
              f"{row['max_ms']:>8.0f}  {row['statuses']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
