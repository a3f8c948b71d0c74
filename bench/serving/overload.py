"""Overload, bar style: clients that retry at once, at 8x the concurrency that saturates the server, against the
server at that saturating concurrency, in each engine layout (issue #50, item 3).

    .venv/bin/python -m bench.serving.overload                      # Lite0, inline and process, 16 and 1 image(s)
    .venv/bin/python -m bench.serving.overload --model small --seconds 6 --points 16x2 1x4
    python3 -m bench.serving.overload --device cuda --points 1x64 16x16   # on a GPU host

Each point is IMAGES (images per request: the saturating concurrency found here) or IMAGESxC (C given). Finding it:
C = 1, 2, 4, ... clients for half of ``--seconds`` each, until two doublings in a row gain less than 5% over the
best so far (or C reaches ``--max-concurrency`` still gaining: said as not saturated); the saturating C is the
best's. Then C, 2 x C and 8 x C clients, each for ``--seconds``, their clients going on from a warm-up into the
window, on one server start per engine (warmed first). Printed per run: goodput (images/s of 200
answers), the answers by status, p50/p99 of the 200s and the longest, and the ratio of each goodput to the peak, the
better of C and 2 x C (the bar: 8 x C at >= 0.9 of it, answers only 200/429/503). With ``--rounds`` N the three are
measured N times in turn and each is told by its median round (this VM's 8-s points swing by 15-20%).
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


def saturating(url: str, per_request: int, seconds: float, warmup: float, limit: int) -> tuple[dict, bool, list]:
    """The point that saturates the server with ``per_request`` images a request (C doubling from 1 until two
    doublings in a row gain less than 5% over the best so far: one low reading of a noisy host does not end the
    search), whether it stopped gaining before ``limit`` (else the best is the last C tried, still gaining), and
    the points tried."""
    if limit < 1:
        raise ValueError(f"the search's limit must be at least 1, got {limit}")
    tried: list[dict[str, object]] = []
    best: dict[str, object] | None = None
    short, concurrency = 0, 1
    while concurrency <= limit:
        row = point(url, per_request, concurrency, seconds, warmup)
        tried.append(row)
        gained = best is None or row["img_s"] >= 1.05 * best["img_s"]  # type: ignore[operator]
        short = 0 if gained else short + 1
        if short == 2:
            return best, True, tried  # type: ignore[return-value]
        if gained:
            best = row
        concurrency *= 2
    return best, short > 0, tried  # type: ignore[return-value]


def weights_for(model: str, work: Path) -> Path:
    if model == "small":
        from harness.faults import small_weights

        return small_weights(work / "small")
    from bench.paths import WORK
    from bench.serving.compare import export_models

    return export_models(WORK / "weights", [model])[model]


def _median_row(taken: list[dict[str, object]]) -> dict[str, object]:
    """The round whose goodput is the median of ``taken`` (the lower of the two middle ones), with every round's
    goodput beside it."""
    ordered = sorted(taken, key=lambda row: float(row["img_s"]))  # type: ignore[arg-type]
    return {**ordered[(len(ordered) - 1) // 2], "rounds_img_s": [row["img_s"] for row in taken]}


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="efficientnet_lite0", choices=("efficientnet_lite0", "small"))
    parser.add_argument("--engines", nargs="+", default=["inline", "process"], choices=("inline", "process"))
    parser.add_argument("--points", nargs="+", default=["16", "1"],
                        help="IMAGES (the saturating concurrency found) or IMAGESxC (given): images per request")
    parser.add_argument("--max-concurrency", type=_at_least_one, default=128,
                        help="the search for saturation stops here")
    parser.add_argument("--rounds", type=_at_least_one, default=1,
                        help="C, 2C and 8C measured this many times in turn; the table shows each one's median")
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
                # a worker's first answers are slow: none of them in a point's window
                closed_loop(server.url + "/predict", request_bodies(imagenet_workload(), 1)[0], 8, args.warmup, 0.0)
                for per_request, given in points:
                    saturated = True
                    if given:
                        found = given
                    else:
                        searched, saturated, tried = saturating(server.url, per_request, args.seconds / 2,
                                                                args.warmup / 2, args.max_concurrency)
                        found = int(searched["concurrency"])  # type: ignore[arg-type]
                        for row in tried:
                            print(json.dumps({"engine": engine, "queue_size": queue_size, "search": True, **row}),
                                  flush=True)
                    # the peak: the better of C and 2C at full length (one low reading that stopped the search
                    # early must not flatter the ratio, and a short point's noise must not set the peak)
                    runs: dict[int, list[dict[str, object]]] = {c: [] for c in (found, 2 * found, OVERLOAD * found)}
                    for _ in range(args.rounds):  # in turn, so a slow minute of the host falls on all three
                        for concurrency, taken in runs.items():
                            row = {"engine": engine, "queue_size": queue_size, "found": not given,
                                   "saturated": saturated,
                                   **point(server.url, per_request, concurrency, args.seconds, args.warmup)}
                            taken.append(row)
                            print(json.dumps(row), flush=True)
                    measured = [_median_row(taken) for taken in runs.values()]
                    peak = max(float(row["img_s"]) for row in measured[:2])  # type: ignore[arg-type]
                    for row in measured:
                        rows.append({**row, "peak_img_s": peak})
            finally:
                server.stop()
    print(f"\n{args.model} on {args.device}, {args.seconds:g} s per point; goodput = images/s of 200 answers")
    print(f"{'engine':<8} {'queue':>5} {'img/req':>7} {'C':>5} {'goodput':>9} {'of peak':>8} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'max ms':>8}  answers")
    for row in rows:
        peak = row["peak_img_s"]
        ratio = row["img_s"] / peak if peak else float("nan")
        note = "" if row["saturated"] else "  (still gaining at --max-concurrency: not saturated)"
        print(f"{row['engine']:<8} {row['queue_size']:>5} {row['per_request']:>7} {row['concurrency']:>5} "
              f"{row['img_s']:>9.1f} {ratio:>8.2f} {row['p50_ms']:>8.0f} {row['p99_ms']:>8.0f} "
              f"{row['max_ms']:>8.0f}  {row['statuses']}{note}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
