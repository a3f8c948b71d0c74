"""``python -m bench.serving.formats``: the served model's formats against each other on this machine, in one run.

EfficientNet-Lite0 exported once with its CPU AOTInductor package (compiled here, about a minute on 2 cores), then:
1. forward images/s per batch size, in process, for eager (the state dict), TorchScript (frozen +
   optimize_for_inference, what the server ran until now) and the package: the fastest of 5 timed runs per round,
   the median of 3 alternating rounds, at the forward threads the server uses (half the cores);
2. the server started with each format (gunicorn, WORKERS=2, the CPU recommendation): time from start to ready,
   then images/s and p50 at C=1 and C=16 (the benchmark's photo mix, kept-alive connections), median of 2
   alternating rounds.
Writes the table to bench/results/<date>-formats-cpu-<cores>cpu.md and prints it.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from app.engine.predictor import Predictor
from app.engine.tuning import forward_threads
from bench import paths
from bench.serving.load import measure
from bench.serving.report import save_result
from harness.photos import workload
from harness.servers import Running, visionserve
from models.export.write import export_default
from models.export.manifest import read_manifest

WORK = paths.WORK / "formats"
BATCH_SIZES = (1, 2, 4, 8)
FORMATS = {"eager": "state_dict", "TorchScript (frozen)": "torchscript", "AOTInductor package": "aoti"}


def exported() -> Path:
    """Lite0 with its CPU package, exported once into bench/.work."""
    out = WORK / "lite0"
    if not (out / "manifest.json").is_file() or not read_manifest(out).packages:
        export_default(out, force=True, packages=[("cpu", "float32")])
    return out


def _fastest_rate(forward: Callable[[torch.Tensor], torch.Tensor], batch: torch.Tensor, runs: int = 5) -> float:
    forward(batch)
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        forward(batch)
        best = min(best, time.perf_counter() - started)
    return batch.shape[0] / best


def forward_rates(weights: Path, rounds: int = 3) -> dict[str, dict[int, float]]:
    """Median forward images/s per format and batch size."""
    torch.set_num_threads(forward_threads(0, torch.device("cpu")))
    predictors = {name: Predictor.load(weights, weights_format=fmt, device="cpu", jit_optimize=True,
                                       max_batch_size=max(BATCH_SIZES)) for name, fmt in FORMATS.items()}
    shape = read_manifest(weights).preprocess.input_shape
    rates: dict[str, dict[int, list[float]]] = {name: {b: [] for b in BATCH_SIZES} for name in FORMATS}
    with torch.inference_mode():
        for _ in range(rounds):
            for size in BATCH_SIZES:
                batch = torch.randn(size, *shape)
                for name, predictor in predictors.items():
                    rates[name][size].append(_fastest_rate(predictor.module, batch))
    return {name: {b: statistics.median(v) for b, v in sizes.items()} for name, sizes in rates.items()}


def served(weights: Path, fmt: str, duration_s: float) -> dict[str, float]:
    """One round for one format: start-to-ready seconds, then images/s and p50 at C=1 and C=16."""
    bodies = list(workload())
    started = time.perf_counter()
    server: Running = visionserve(weights, WORK, weights_format=fmt, workers="2").wait_ready()
    point = {"ready_s": time.perf_counter() - started}
    try:
        for concurrency in (1, 16):
            r = measure(fmt, "lite0", server.url, "/predict", bodies, concurrency, duration_s, 3.0)
            point[f"c{concurrency}_img_s"], point[f"c{concurrency}_p50_ms"] = r.images_per_s, r.p50_ms
    finally:
        server.stop()
    return point


def report(forward: dict[str, dict[int, float]], server: dict[str, dict[str, float]], compile_s: float,
           rounds: int) -> str:
    """The results as markdown."""
    cores = os.cpu_count()
    lines = [f"# Model formats on the CPU ({cores} cores), {datetime.date.today()}", "",
             f"`python -m bench.serving.formats`; torch {torch.__version__}; EfficientNet-Lite0; the package "
             f"compiled in {compile_s:.0f} s. Forward images/s, in process, {forward_threads(0, torch.device('cpu'))} "
             "intra-op thread(s) (the server's default), median of 3 rounds:", "",
             "| format | " + " | ".join(f"batch {b}" for b in BATCH_SIZES) + " |",
             "| --- |" + " ---: |" * len(BATCH_SIZES)]
    lines += [f"| {name} | " + " | ".join(f"{rates[b]:.1f}" for b in BATCH_SIZES) + " |"
              for name, rates in forward.items()]
    base, package = forward["TorchScript (frozen)"], forward["AOTInductor package"]
    lines += ["", "package / TorchScript: " + ", ".join(f"batch {b} {package[b] / base[b]:.2f}x" for b in BATCH_SIZES),
              "", f"The server (gunicorn, 2 workers, the benchmark's photo mix, median of {rounds} rounds):", "",
              "| WEIGHTS_FORMAT | start to ready (s) | C=1 images/s | C=1 p50 (ms) | C=16 images/s | C=16 p50 (ms) |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {fmt} | {r['ready_s']:.1f} | {r['c1_img_s']:.1f} | {r['c1_p50_ms']:.1f} | {r['c16_img_s']:.1f} | "
              f"{r['c16_p50_ms']:.1f} |" for fmt, r in server.items()]
    ts, aoti = server["torchscript"], server["aoti"]
    lines += ["", f"aoti / torchscript: C=1 {aoti['c1_img_s'] / ts['c1_img_s']:.2f}x, "
              f"C=16 {aoti['c16_img_s'] / ts['c16_img_s']:.2f}x images/s"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per measured load point")
    parser.add_argument("--rounds", type=int, default=2, help="alternating server rounds per format")
    args = parser.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    weights = exported()
    forward = forward_rates(weights)
    rounds: dict[str, list[dict[str, float]]] = {"torchscript": [], "aoti": []}
    for _ in range(args.rounds):  # alternate, so a drifting machine slows both alike
        for fmt, points in rounds.items():
            points.append(served(weights, fmt, args.duration))
    medians = {fmt: {key: statistics.median(p[key] for p in points) for key in points[0]}
               for fmt, points in rounds.items()}
    text = report(forward, medians, read_manifest(weights).packages[0].compile_s, args.rounds)
    save_result("formats", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
