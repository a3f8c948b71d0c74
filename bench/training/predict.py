"""models.predict against the in-process limit: images/s of ``python -m models.predict`` over a folder of the
benchmark's photos, beside the limit ``python -m bench`` measures for the same model and photos.

    python -m bench.training.predict --weights weights            # CPU: the target is 0.9 of the limit
    python -m bench.training.predict --weights weights --device cuda --dtype float16  # beside bench.serving.gpu's limit
    python -m bench.training.predict --weights weights --save     # also writes bench/results/<date>-predict-*.md

The limit is the best of bench/serving/limit.py's in-process pipelines with the served module (one process
decoding in threads while it runs the forward pass, each thread count tried; and one pipeline per core, as the
service's workers), at ``--batch-size``. models.predict runs as a user runs it, in a subprocess, on two folders of
the photos (``--images`` and three times as many); its rate is the difference of images over the difference of
seconds, so loading the model and starting the workers (paid once per run) is left out, as the limit leaves it out.
The two are measured in alternating ``--rounds`` (a shared machine's load moves both); the table gives each round and
the medians, and the ratio is the median of the rounds' ratios.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.paths import WORK
from bench.serving.limit import configurations, measure, process_pipeline, served_config
from bench.serving.report import save_result
from harness.photos import workload

ROOT = Path(__file__).resolve().parents[2]


def photo_folder(out: Path, count: int) -> Path:
    """``count`` files cycling through the benchmark's photos (every size: native, 1920x1080, 4000x3000)."""
    out.mkdir(parents=True, exist_ok=True)
    photos = workload()
    for i in range(count):
        (out / f"{i:06d}.jpg").write_bytes(photos[i % len(photos)])
    return out


def predict_seconds(weights: Path, folder: Path, extra: list[str]) -> float:
    """Wall seconds of one ``python -m models.predict`` run over ``folder``."""
    out = folder.with_suffix(".jsonl")
    out.unlink(missing_ok=True)
    command = [sys.executable, "-m", "models.predict", "--weights", str(weights), "--data", str(folder),
               "--out", str(out), *extra]
    started = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
    return time.perf_counter() - started


def predict_rate(weights: Path, images: int, extra: list[str]) -> tuple[float, float, float]:
    """models.predict's images/s with its start-up left out, and the two runs' seconds."""
    with tempfile.TemporaryDirectory(dir=WORK) as scratch:
        small = photo_folder(Path(scratch) / "small", images)
        large = photo_folder(Path(scratch) / "large", 3 * images)
        predict_seconds(weights, small, extra)  # warm the page cache and the imports
        short, long = predict_seconds(weights, small, extra), predict_seconds(weights, large, extra)
    return 2 * images / max(long - short, 1e-9), short, long


def cpu_limit(weights: Path, batch_size: int, seconds: float) -> tuple[float, str]:
    """The in-process limit with the served module (ONNX Runtime when the export has its ONNX file, as
    models.predict and the server load it): the best of the threaded pipeline and one per core."""
    predictor, configs = configurations(weights, compile_too=False)
    served = served_config(configs)
    threaded = measure(predictor, {served: configs[served]}, workload(), (batch_size,), seconds)[0]
    processes = process_pipeline(weights, workload(), served, batch_size, 2 * seconds, os.cpu_count() or 1)
    best = max((threaded.images_per_s, f"1 process, {threaded.threads}, batch {batch_size}"),
               (processes.images_per_s, processes.config + f", batch {batch_size}"))
    return best


def gpu_limit(weights: Path, device: str, dtype: str, batch_size: int, seconds: float) -> tuple[float, str]:
    """bench.serving.gpu's in-process limit: the served predictor, decode threads beside it, one process."""
    result = process_pipeline(weights, workload(), f"{device}/{dtype}", batch_size, seconds, 1,
                              decode_threads=os.cpu_count() or 1)
    return result.images_per_s, result.config + f", batch {batch_size}"


def report(args: argparse.Namespace, rounds: list[tuple[float, float, float, float, str]]) -> str:
    """The rounds' table, the medians and the ratio, as Markdown."""
    command = (f"python -m bench.training.predict --weights {args.weights} --device {args.device} --dtype {args.dtype}"
               f" --images {args.images} --rounds {args.rounds}"
               + (f" --predict-args {args.predict_args!r}" if args.predict_args else ""))
    lines = [f"# models.predict against the in-process limit ({args.device}, {args.dtype}, {os.cpu_count()} cores)\n",
             f"`{command}`, torch {torch.__version__}; the benchmark's {len(workload())} photos (native, 1920x1080, "
             f"4000x3000) cycled; models.predict over {args.images} and {3 * args.images} images, its rate the "
             "difference of images over the difference of seconds (start-up left out).\n",
             "| round | limit img/s | limit's pipeline | models.predict img/s | seconds (small, large) | ratio |",
             "|---:|---:|---|---:|---|---:|"]
    for i, (rate, short, long, limit, config) in enumerate(rounds, 1):
        lines.append(f"| {i} | {limit:.1f} | {config} | {rate:.1f} | {short:.1f}, {long:.1f} | {rate / limit:.2f} |")
    rates, limits = [rate for rate, *_ in rounds], [limit for *_, limit, _ in rounds]
    ratio = statistics.median(rate / limit for rate, limit in zip(rates, limits))
    lines.append(f"| median | {statistics.median(limits):.1f} | | {statistics.median(rates):.1f} | | "
                 f"**{ratio:.2f}** (target 0.9) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", type=Path, default=Path("weights"))
    parser.add_argument("--images", type=int, default=96, help="the smaller folder (the larger: three times)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating measurements of both")
    parser.add_argument("--batch-size", type=int, default=8, help="the limit's batch size")
    parser.add_argument("--seconds", type=float, default=3.0, help="per limit measurement")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--predict-args", default="", help="more options for models.predict, e.g. '--workers 1'")
    parser.add_argument("--save", action="store_true", help="write the table to bench/results/")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    extra = ["--device", args.device, "--dtype", args.dtype, *args.predict_args.split()]
    on_cuda = torch.device(args.device).type == "cuda"
    rounds = []
    for _ in range(args.rounds):
        rate, short, long = predict_rate(args.weights, args.images, extra)
        if on_cuda:
            limit, config = gpu_limit(args.weights, args.device, args.dtype, 4 * args.batch_size, args.seconds)
        else:
            limit, config = cpu_limit(args.weights, args.batch_size, args.seconds)
        rounds.append((rate, short, long, limit, config))
    text = report(args, rounds)
    if args.save:
        save_result("predict", text, f"gpu-{torch.cuda.get_device_name().split()[1].lower()}" if on_cuda else None)
    else:
        print(text)


if __name__ == "__main__":
    main()
