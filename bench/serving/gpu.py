"""GPU figures: visionserve on CUDA against an in-process GPU pipeline, and CPU vs GPU JPEG decoding.

    python -m bench.serving.gpu              # on a CUDA machine (about 9 minutes on an H100 with 16 cores); writes
                                             # bench/results/<date>-gpu-<gpu>.md and .json, rewritten after each
                                             # served point, and .jsonl, a line per point as it is measured
    python -m bench.serving.gpu --device cpu --dtype float32 --seconds 1 --concurrency 1 --workers 1 --processes 2
                                             # a smoke run of the same code without a GPU
                                             # (tests/server/test_bench_gpu.py)

Served points: per decode path (``--decode-paths``: pil, device) x images per request (1, 16) x C, with the GPU's
utilisation (nvidia-smi) and the load generator's own CPU beside the server's.

For each model: the limit, i.e. the fastest in-process pipeline (decode threads on every core, batched forward in the
chosen dtype on the device, no HTTP; also one such pipeline per process, several processes sharing the GPU), the
single-image latency, then visionserve on the same device under the closed-loop load, once per worker count.
Decoding, on the served workload's photos: PIL + the eval transform in a thread pool, the service's tensor path
(libjpeg-turbo and the transform on tensors on every core, as an engine's decode threads run it, the batch uploaded)
and its device path (``app/engine/decoding/device.decode_batch``: nvJPEG on the batch, resize, crop and normalise on
the GPU), alone and with the forward pass (the device path's in-process limit). ``--loads-only``: the served points
alone (a variant's settings through the environment, e.g. ``VISIONSERVE_CUDA_GRAPHS=false``).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Sequence

import torch

from app.engine.decoding.image import decode_image
from app.engine.loaded.version import decoder_of
from app.engine.loaded.predictor import Predictor
from bench.paths import RESULTS, WORK
from bench.serving.compare import export_models
from bench.serving.limit import LIMITS, best_threads, intra_op_threads, process_pipeline, single_image_ms, timed_rate
from bench.serving.load import measure
from bench.serving.report import fixed
from bench.usage import GpuUtilisation
from harness.photos import imagenet_workload, request_bodies, workload
from harness.servers import visionserve


def decode_rates(predictor: Predictor, photos: Sequence[bytes], batch_size: int, seconds: float,
                 device: torch.device) -> dict[str, float]:
    """Images/s of CPU decode + preprocess (a thread per core; 1 and all intra-op threads) and of GPU decode +
    preprocess, per batch."""
    cores = os.cpu_count() or 1
    chunk = [photos[i % len(photos)] for i in range(batch_size)]
    def on_cpu(photo: bytes) -> torch.Tensor:
        return predictor.transform(decode_image(photo, LIMITS))

    rates = {}
    with ThreadPoolExecutor(cores) as pool:
        for torch_threads in sorted({1, torch.get_num_threads()}):
            with intra_op_threads(torch_threads):
                rates[f"CPU: PIL + eval transform, {cores} threads, {torch_threads} intra-op"] = timed_rate(
                    lambda: len(list(pool.map(on_cpu, chunk))), seconds)
    tensor_path = decoder_of("tensor", predictor, LIMITS)  # the service's tensor path, as an engine runs it
    with ThreadPoolExecutor(cores) as decoders, intra_op_threads(1):
        def on_cpu_threads() -> int:  # libjpeg-turbo and the transform on tensors on every core, stacked, uploaded
            batch = tensor_path.collate(list(decoders.map(tensor_path.prepare, chunk)))
            if device.type == "cuda":
                batch.pin_memory().to(device, non_blocking=True)
                torch.cuda.synchronize(device)
            return len(chunk)

        rates[f"tensor path: decode + preprocess on {cores} CPU threads, batch {batch_size}, to {device.type}"] = (
            timed_rate(on_cpu_threads, seconds))
    decoder = decoder_of("device", predictor, LIMITS)  # the service's device path
    encoded = [decoder.prepare(photo) for photo in chunk]  # headers once: the request threads' share

    def on_device() -> int:  # the service's device path: decode + preprocess in the batch, on the device
        decoder.collate(encoded)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return len(chunk)

    def with_forward() -> int:  # and the forward pass: the in-process limit of the device path
        predictor.predict_batch(decoder.collate(encoded))  # returns on the CPU: the device's work is done
        return len(chunk)

    rates[f"device path: decode + preprocess on {device.type}, batch {batch_size}"] = timed_rate(on_device, seconds)
    rates[f"device path + forward ({predictor.dtype_name}), batch {batch_size}: the limit"] = timed_rate(
        with_forward, seconds)
    return rates


def serve(weights: Path, args: argparse.Namespace, workers: int, torch_threads: int,
          decode_path: str, engine: str, on_row: Callable[[dict[str, object]], None] = lambda row: None
          ) -> list[dict[str, object]]:
    """visionserve on the device with ``workers`` gunicorn workers, ``torch_threads`` intra-op threads (0: the
    service's default), ``decode_path`` and ``engine`` (ENGINE: the model in engine processes, ``process-k`` for
    ENGINES_PER_DEVICE=k, or in every worker), at each images-per-request and C; images/s count images. Each point
    is printed and given to ``on_row`` as it is measured."""
    started = time.perf_counter()
    mode, _, per_device = engine.partition("-")
    server = visionserve(weights, WORK / "logs", device=args.device, dtype=args.dtype, workers=str(workers),
                         engine=mode, engines_per_device=per_device or "1",
                         max_batch_size=str(max(args.batch_sizes)), threads="64",
                         torch_threads=str(torch_threads), decode_path=decode_path,
                         max_images=str(max(args.images_per_request)), max_body_bytes=str(256 * 1024 * 1024),
                         max_connections_per_client="0")  # (the load generator is one client of C connections)
    rows: list[dict[str, object]] = []
    try:  # (a server that never gets ready is stopped by wait_ready)
        server.wait_ready()
        ready_s = time.perf_counter() - started
        photos = served_photos(args.workload)
        for per_request in args.images_per_request:
            bodies, content_type = request_bodies(photos, per_request)
            for c in args.concurrency:
                with GpuUtilisation() as gpu:
                    r = asdict(measure("visionserve", weights.name, server.url, "/predict", bodies, c, args.seconds,
                                       args.warmup, content_type, server_pid=server.process.pid,
                                       images_per_request=per_request))
                rows.append({**r, "workers": workers, "torch_threads": torch_threads, "ready_s": ready_s,
                             "decode_path": decode_path, "per_request": per_request, "gpu_util": gpu.mean,
                             "engine": engine})
                print(json.dumps(rows[-1]), flush=True)  # as it comes: a run stopped at its limit keeps its points
                on_row(rows[-1])
    finally:
        server.stop()
    return rows


def served_photos(name: str) -> tuple[bytes, ...]:
    """The photos of ``--workload``: imagenet (500x375) or mix (native, 1920x1080, 4000x3000)."""
    return imagenet_workload() if name == "imagenet" else workload()


def run_model(weights: Path, args: argparse.Namespace, data: dict[str, object],
              written: Callable[[dict[str, object] | None], None] = lambda row: None) -> None:
    """The in-process limit, decode rates (on the served workload's photos) and visionserve's load points for one
    model, into ``data`` as they come (``written`` called after the in-process figures with None, and after each
    load point with its row); the load points only with ``args.loads_only``."""
    def loads() -> None:
        rows: list[dict[str, object]] = []
        data["loads"] = rows

        def on_row(row: dict[str, object]) -> None:
            rows.append(row)
            written(row)

        for engine, path, workers, threads in itertools.product(args.engines, args.decode_paths, args.workers,
                                                                args.torch_threads):
            serve(weights, args, workers, threads, path, engine, on_row)

    if args.loads_only:
        loads()
        return
    device = torch.device(args.device)
    photos = served_photos(args.workload)
    # as the server runs it: CUDA graphs captured at warm-up for every padded batch size
    predictor = Predictor.load(weights, device=args.device, dtype=args.dtype, max_batch_size=max(args.batch_sizes),
                               cuda_graphs=True)
    predictor.warmup(max(args.batch_sizes), repeats=1)
    cores = torch.get_num_threads()
    limit = {}
    for size in args.batch_sizes:  # end_to_end_rate leaves its first forward pass per shape untimed
        limit[size] = best_threads(predictor.predict_batch, predictor, photos, size, args.limit_seconds, cores)
    for processes in args.processes:  # one pipeline per process, as many as the served workers
        result = process_pipeline(weights, photos, f"{args.device}/{args.dtype}", args.process_batch,
                                  args.limit_seconds, processes, decode_threads=max(1, cores // processes))
        limit[f"{args.process_batch} x {processes} processes"] = (result.images_per_s, result.config)
    single_ms = single_image_ms(predictor, photos, cores)
    decode = decode_rates(predictor, photos, max(args.batch_sizes), args.limit_seconds, device)
    del predictor
    if device.type == "cuda":
        torch.cuda.empty_cache()
    data.update(limit_by_batch=limit, decode=decode, single_ms=single_ms)
    written(None)
    loads()


# Each point's later columns (rows from before they were measured show "-"): the engine processes' share of the
# server's cores, the server's CPU per image (every process, the engine's included), a batch's mean wall time with
# its forward pass's (waited for: the rest is the batch being made, where the device path decodes), and a batch's CPU
# per image with its forward pass's.
LOAD_FIGURES = (("engine_cores", 2), ("cpu_ms_per_image", 2), ("batch_wall_ms", 1), ("forward_wall_ms", 1),
                ("batch_cpu_ms", 3), ("forward_cpu_ms", 3))


def _load_row(r: dict, limit: float | None, single_ms: float | None) -> str:
    """One served load point as a table row, with its efficiency and its p50 against the in-process latency (when
    they were measured)."""
    util, client = r.get("gpu_util"), r.get("client_cores")
    cells = [r.get("engine", "inline"), r.get("decode_path", "pil"), r.get("per_request", 1), r.get("workers", 1),
             r["torch_threads"] or "default",
             f"{r['ready_s']:.0f}", r["concurrency"], f"{r['images_per_s']:.1f}", f"{r['p50_ms']:.1f}",
             f"{r['p99_ms']:.1f}", r["errors"], f"{r['mean_batch'] or 0:.2f}", f"{r['server_cores'] or 0:.2f}",
             "-" if client is None else f"{client:.2f}", "-" if util is None else f"{util:.0f}",
             "-" if limit is None else f"{r['images_per_s'] / limit:.2f}",
             "-" if single_ms is None else f"{r['p50_ms'] / single_ms:.2f}",
             *(fixed(r.get(key), digits) for key, digits in LOAD_FIGURES)]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def report(results: dict[str, dict], machine: dict[str, object]) -> str:
    """Markdown: per model the limit per batch size, the decode comparison and the load table with efficiency."""
    lines = [f"# GPU benchmark {time.strftime('%Y-%m-%d %H:%M')}", "",
             f"Machine: {machine['gpu']}, {machine['cpus']} CPU cores, torch {machine['torch']}, dtype "
             f"{machine['dtype']}. visionserve: gunicorn workers as in the tables, 64 request threads each, "
             f"{machine['photos']}, closed loop.", ""]
    for model, data in results.items():
        lines += [f"## {model}", ""]
        best = single_ms = None
        if "limit_by_batch" in data:  # not with --loads-only
            best = max(rate for rate, _ in data["limit_by_batch"].values())
            single_ms = data["single_ms"]
            lines += ["| in-process pipeline batch | img/s | threads |", "| --- | --- | --- |"]
            lines += [f"| {b} | {r:.1f} | {threads} |" for b, (r, threads) in data["limit_by_batch"].items()]
            lines += ["", f"In-process latency of one image (decode + preprocess + forward), median: "
                          f"{single_ms:.1f} ms.", "", "| decode + preprocess | img/s |", "| --- | --- |"]
            lines += [f"| {name} | {r:.1f} |" for name, r in data["decode"].items()]
            lines.append("")
        lines += ["| engine | decode path | images / request | workers | intra-op threads | ready s | C | img/s | "
                  "p50 ms | p99 ms | errors | mean batch | server cores | client cores | GPU util % | efficiency | "
                  "p50 / in-process | engine cores | server CPU ms / image | batch wall ms | of which forward | "
                  "batch CPU ms / image | of which forward |", "|" + " --- |" * 23]
        lines += [_load_row(r, best, single_ms) for r in data.get("loads", [])]
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
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
    parser.add_argument("--decode-paths", nargs="+", default=["pil", "device"], help="serve once per DECODE_PATH")
    parser.add_argument("--engines", nargs="+", default=["process", "inline"],
                        choices=["process", "process-2", "inline"],
                        help="serve once per ENGINE: one engine process per GPU (process-2: two, "
                             "ENGINES_PER_DEVICE=2), or the model in every worker")
    parser.add_argument("--images-per-request", type=int, nargs="+", default=[1, 16],
                        help="1: the raw JPEG as the body; more: one multipart request")
    parser.add_argument("--workload", choices=["mix", "imagenet"], default="mix",
                        help="mix: 6 photos at native, 1920x1080, 4000x3000; imagenet: the photos at 500x375")
    parser.add_argument("--loads-only", action="store_true",
                        help="the served load points only, without the in-process limit and decode rates")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    (WORK / "logs").mkdir(parents=True, exist_ok=True)
    weights = export_models(WORK / "weights", args.models)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    photos = ("6 photos at 500x375, about ImageNet's size" if args.workload == "imagenet" else
              "6 photos at native size, 1920x1080 and 4000x3000, as the CPU benchmark's")
    machine = {"gpu": name, "cpus": os.cpu_count(), "torch": torch.__version__, "dtype": args.dtype, "photos": photos}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{time.strftime('%Y-%m-%d')}-gpu-{name.replace(' ', '-').lower()}"
    results: dict[str, dict] = {}
    points = stem.with_suffix(".jsonl")
    points.write_text("")

    def write(model: str, row: dict[str, object] | None) -> None:
        """The report rewritten, and a load point's row appended to the .jsonl: the run may be stopped mid-way (at
        the drill step's limit) and keeps what it measured."""
        if row is not None:
            with points.open("a") as out:
                out.write(json.dumps({"model": model, **row}) + "\n")
        stem.with_suffix(".md").write_text(report(results, machine))
        stem.with_suffix(".json").write_text(json.dumps({"machine": machine, "results": results}, indent=1))

    for model in args.models:
        results[model] = {}
        run_model(weights[model], args, results[model], lambda row, model=model: write(model, row))
        write(model, None)
        print(report(results, machine), flush=True)


if __name__ == "__main__":
    main()
