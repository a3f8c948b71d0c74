"""``python -m bench.serving.embedding_cost``: what embeddings cost /predict (#52).

Every export now answers its embedding beside the logits from one forward pass, so a request that does not ask for
it still runs a forward pass whose output is wider (the rows are cut back to the probabilities before they are
answered). This serves the packaged Lite0 as `make serve` does (its ONNX file, the server's defaults) and, with
``--checkout BASE``, another checkout (e.g. the commit before embeddings, in a git worktree) on its own export of the
same model, alternating over ``--rounds`` rounds; at each concurrency a closed-loop load of the benchmark's photos
(raw JPEG bodies, keep-alive), on ``/predict`` and on ``/predict?outputs=labels,embedding``. Prints the median over
rounds of images/s, p50 and p99 per server and path, and their ratios against BASE's ``/predict``.

    .venv/bin/python -m bench.serving.embedding_cost --checkout ../base --rounds 3
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import paths
from bench.serving.load import measure
from harness.photos import workload
from harness.servers import Running, visionserve

WORK = paths.WORK / "embedding_cost"
ROOT = Path(__file__).resolve().parents[2]
PATHS = {"/predict": "/predict", "/predict + embedding": "/predict?outputs=labels,embedding"}


def _weights(checkout: Path, out: Path) -> Path:
    """The packaged Lite0 exported by ``checkout``'s own code (an older checkout cannot read a newer manifest), as
    `make weights` exports it, afresh on every run."""
    subprocess.run([sys.executable, "-m", "models.export", "--default", "--out", str(out), "--packages", "onnx",
                    "--force"], cwd=checkout, check=True, env={**os.environ, "PYTHONPATH": str(checkout)})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", type=Path, default=None, help="another checkout to serve beside (BASE)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16])
    parser.add_argument("--duration", type=float, default=12.0)
    args = parser.parse_args()
    checkouts = {"this": ROOT, **({"BASE": args.checkout.resolve()} if args.checkout else {})}
    weights = {name: _weights(checkout, WORK / f"weights-{name}") for name, checkout in checkouts.items()}
    bodies = list(workload())
    results: dict[tuple[str, str, int], list[Any]] = collections.defaultdict(list)
    for round_index in range(args.rounds):
        for name, checkout in checkouts.items():
            log_dir = WORK / f"server-{round_index}-{name}"
            log_dir.mkdir(parents=True, exist_ok=True)
            server: Running = visionserve(weights[name], log_dir, checkout).wait_ready()
            try:
                for concurrency in args.concurrency:
                    for label, path in PATHS.items():
                        if name == "BASE" and "embedding" in path:
                            continue  # BASE has no embeddings
                        results[(name, label, concurrency)].append(
                            measure(name, "efficientnet_lite0", server.url, path, bodies, concurrency, args.duration,
                                    3.0))
            finally:
                server.stop()
    print(f"efficientnet_lite0 (ONNX Runtime, the server's defaults): {args.rounds} alternating rounds of "
          f"{args.duration:g} s, medians")
    print("| concurrency | server | path | images/s | p50 ms | p99 ms | errors | images/s vs BASE | p99 vs BASE |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for concurrency in args.concurrency:
        base = results.get(("BASE", "/predict", concurrency))
        for (name, label, c), runs in results.items():
            if c != concurrency:
                continue
            rate = statistics.median(r.images_per_s for r in runs)
            p99 = statistics.median(r.p99_ms for r in runs)
            versus = ("-", "-") if not base else (
                f"{rate / statistics.median(r.images_per_s for r in base):.3f}",
                f"{p99 / statistics.median(r.p99_ms for r in base):.3f}")
            print(f"| {concurrency} | {name} | {label} | {rate:.1f} | {statistics.median(r.p50_ms for r in runs):.1f} "
                  f"| {p99:.1f} | {sum(r.errors for r in runs)} | {versus[0]} | {versus[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
