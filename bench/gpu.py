"""GPU figures: visionserve on CUDA against an in-process GPU pipeline, and CPU vs GPU JPEG decoding.

    python -m bench.gpu                      # on a CUDA machine (about 9 minutes on an H100 with 16 cores); writes
                                             # bench/results/<date>-gpu-<gpu>.md and .json
    python -m bench.gpu --device cpu --dtype float32 --seconds 1 --concurrency 1 --workers 1 --processes 2
                                             # a smoke run of the same code without a GPU

For each model: the limit, i.e. the fastest in-process pipeline (decode threads on every core, batched forward in the
chosen dtype on the device, no HTTP; also one such pipeline per process, several processes sharing the GPU), the
single-image latency, then visionserve on the same device under the closed-loop load, once per worker count.
Decoding: PIL + the eval transform in a thread pool (what the service does) against
``torchvision.io.decode_jpeg(device="cuda")`` on the whole batch followed by resize, crop and normalise on the GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import torch
from torchvision.io import decode_jpeg
from torchvision.transforms.v2 import functional as F

from app.engine.decode import decode_image
from app.engine.predictor import Predictor
from bench.__main__ import RESULTS, WORK, export_models
from bench.limit import LIMITS, best_threads, intra_op_threads, process_pipeline, single_image_ms, timed_rate
from bench.load import measure
from bench.photos import workload
from bench.servers import visionserve
from models.presets import EvalPreset


def gpu_preprocess(photos: Sequence[bytes], preset: EvalPreset, device: torch.device) -> torch.Tensor:
    """JPEG bytes -> decoded on ``device`` -> resize, centre crop, normalise there: an (N, C, H, W) float batch."""
    data = [torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in photos]
    images = decode_jpeg(data, device=device)
    mode = {"bicubic": F.InterpolationMode.BICUBIC, "bilinear": F.InterpolationMode.BILINEAR,
            "nearest": F.InterpolationMode.NEAREST}.get(preset.interpolation, F.InterpolationMode.BILINEAR)
    # Resized as floats: antialiased bicubic on CUDA takes no uint8; clamped like PIL's 8-bit result.
    out = [F.center_crop(F.resize(img.float(), [preset.resize_size], interpolation=mode, antialias=True),
                         [preset.crop_size]) for img in images]
    batch = torch.stack(out).clamp_(0, 255).div_(255)
    return F.normalize(batch, list(preset.mean), list(preset.std))


def decode_rates(predictor: Predictor, photos: Sequence[bytes], batch_size: int, seconds: float,
                 device: torch.device) -> dict[str, float]:
    """Images/s of CPU decode + preprocess (a thread per core; 1 and all intra-op threads) and of GPU decode +
    preprocess, per batch."""
    cores = os.cpu_count() or 1
    chunk = [photos[i % len(photos)] for i in range(batch_size)]
    preset = predictor.manifest.preprocess
    def on_cpu(photo: bytes) -> torch.Tensor:
        return predictor.transform(decode_image(photo, LIMITS))

    rates = {}
    with ThreadPoolExecutor(cores) as pool:
        for torch_threads in sorted({1, torch.get_num_threads()}):
            with intra_op_threads(torch_threads):
                rates[f"CPU: PIL + eval transform, {cores} threads, {torch_threads} intra-op"] = timed_rate(
                    lambda: len(list(pool.map(on_cpu, chunk))), seconds)
    if device.type == "cuda":
        def on_gpu() -> int:
            gpu_preprocess(chunk, preset, device)
            torch.cuda.synchronize(device)
            return len(chunk)

        rates[f"GPU: decode_jpeg(device=cuda) + resize/crop/normalise on the GPU, batch {batch_size}"] = timed_rate(
            on_gpu, seconds)
    return rates


def serve(weights: Path, args: argparse.Namespace, workers: int, torch_threads: int) -> list[dict[str, object]]:
    """visionserve on the device with ``workers`` gunicorn workers and ``torch_threads`` intra-op threads (0: the
    service's default), at each C."""
    started = time.perf_counter()
    server = visionserve(weights, WORK / "logs", device=args.device, dtype=args.dtype, workers=str(workers),
                         max_batch_size=str(max(args.batch_sizes)), threads="64",
                         torch_threads=str(torch_threads)).wait_ready()
    ready_s = time.perf_counter() - started
    try:
        return [{**asdict(measure("visionserve", weights.name, server.url, "/predict", list(workload()), c,
                                  args.seconds, args.warmup, server_pgid=server.process.pid)),
                 "workers": workers, "torch_threads": torch_threads, "ready_s": ready_s} for c in args.concurrency]
    finally:
        server.stop()


def run_model(weights: Path, args: argparse.Namespace) -> dict[str, object]:
    """The in-process limit, decode rates and visionserve's load points for one model."""
    device = torch.device(args.device)
    predictor = Predictor.load(weights, device=args.device, dtype=args.dtype)
    cores = torch.get_num_threads()
    limit = {}
    for size in args.batch_sizes:  # end_to_end_rate leaves its first forward pass per shape untimed
        limit[size] = best_threads(predictor.predict_batch, predictor, workload(), size, args.limit_seconds, cores)
    for processes in args.processes:  # one pipeline per process, as many as the served workers
        result = process_pipeline(weights, workload(), f"{args.device}/{args.dtype}", args.process_batch,
                                  args.limit_seconds, processes, decode_threads=max(1, cores // processes))
        limit[f"{args.process_batch} x {processes} processes"] = (result.images_per_s, result.config)
    single_ms = single_image_ms(predictor, workload(), cores)
    decode = decode_rates(predictor, workload(), max(args.batch_sizes), args.limit_seconds, device)
    del predictor
    if device.type == "cuda":
        torch.cuda.empty_cache()
    loads = [row for workers in args.workers for threads in args.torch_threads
             for row in serve(weights, args, workers, threads)]
    return {"limit_by_batch": limit, "decode": decode, "loads": loads, "single_ms": single_ms}


def _load_row(r: dict, limit: float, single_ms: float) -> str:
    """One served load point as a table row, with its efficiency and its p50 against the in-process latency."""
    cells = [r.get("workers", 1), r["torch_threads"] or "default", f"{r['ready_s']:.0f}", r["concurrency"],
             f"{r['images_per_s']:.1f}", f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}", r["errors"],
             f"{r['mean_batch'] or 0:.2f}", f"{r['server_cores'] or 0:.2f}", f"{r['images_per_s'] / limit:.2f}",
             f"{r['p50_ms'] / single_ms:.2f}"]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def report(results: dict[str, dict], machine: dict[str, object]) -> str:
    """Markdown: per model the limit per batch size, the decode comparison and the load table with efficiency."""
    lines = [f"# GPU benchmark {time.strftime('%Y-%m-%d %H:%M')}", "",
             f"Machine: {machine['gpu']}, {machine['cpus']} CPU cores, torch {machine['torch']}, dtype "
             f"{machine['dtype']}. visionserve: gunicorn workers as in the tables, 64 request threads each, same "
             f"photos as the CPU benchmark (6 photos at native size, 1920x1080, 4000x3000), closed loop.", ""]
    for model, data in results.items():
        best = max(rate for rate, _ in data["limit_by_batch"].values())
        lines += [f"## {model}", "", "| in-process pipeline batch | img/s | threads |", "| --- | --- | --- |"]
        lines += [f"| {b} | {r:.1f} | {threads} |" for b, (r, threads) in data["limit_by_batch"].items()]
        lines += ["", f"In-process latency of one image (decode + preprocess + forward), median: "
                      f"{data['single_ms']:.1f} ms.", "", "| decode + preprocess | img/s |", "| --- | --- |"]
        lines += [f"| {name} | {r:.1f} |" for name, r in data["decode"].items()]
        lines += ["", "| workers | intra-op threads | ready s | C | img/s | p50 ms | p99 ms | errors | mean batch | "
                  "server cores | efficiency | p50 / in-process |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [_load_row(r, best, data["single_ms"]) for r in data["loads"]]
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run the GPU benchmark and write its report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--models", nargs="+", default=["efficientnet_lite0", "mobilenet_v3_small"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--torch-threads", type=int, nargs="+", default=[0],
                        help="serve once per value: the service's intra-op threads (0: its default)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4], help="serve once per value")
    parser.add_argument("--processes", type=int, nargs="*", default=[4],
                        help="also measure the pipeline in this many processes sharing the GPU (per value)")
    parser.add_argument("--process-batch", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--limit-seconds", type=float, default=3.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    (WORK / "logs").mkdir(parents=True, exist_ok=True)
    weights = export_models(WORK / "weights")
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    machine = {"gpu": name, "cpus": os.cpu_count(), "torch": torch.__version__, "dtype": args.dtype}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{time.strftime('%Y-%m-%d')}-gpu-{name.replace(' ', '-').lower()}"
    results: dict[str, dict] = {}
    for model in args.models:  # the report is rewritten after each model: device time may run out mid-way
        results[model] = run_model(weights[model], args)
        markdown = report(results, machine)
        stem.with_suffix(".md").write_text(markdown)
        stem.with_suffix(".json").write_text(json.dumps({"machine": machine, "results": results}, indent=1))
        print(markdown, flush=True)


if __name__ == "__main__":
    main()
