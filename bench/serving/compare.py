"""``python -m bench`` (or ``make bench``, through bench/__main__.py): visionserve against its limit and its peers,
same photos, one run.

For each model (the default EfficientNet-Lite0, and mobilenet_v3_small, which batching helps more): the in-process
limit and the CPU-time ceiling; a probe of the candidate settings against the defaults at C=16; then visionserve with
its defaults (what `make serve` starts) and with the best settings found, a naive one-forward-per-request Flask app
(as many workers as visionserve's default) and LitServe, each under a closed-loop load at C = 1, 4, 16, 64, every
server sent the same photos in the same form (base64 in JSON by default: the one form all three read). Prints a
table, writes bench/results/<date>-<machine>.md (+ .json) and a PNG chart.
"""
from __future__ import annotations

import argparse
import base64
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from app.hosting.host import workers_for
from bench.paths import RESULTS, WORK
from bench.serving import report
from bench.serving.limit import (LimitResult, configurations, cpu_time_bound, process_pipeline, served_config,
                                 single_image_ms)
from bench.serving.limit import measure as measure_limit
from bench.serving.load import LoadResult, measure
from bench.serving.peers import litserve, naive
from bench.serving.request_path import request_path
from harness.photos import json_bodies, workload
from harness.servers import Running, visionserve

DEFAULTS = "visionserve"  # the row for visionserve as `make serve` starts it


def has_onnx(weights: Path) -> bool:
    """An export there, with its ONNX file (exports from before ONNX are made again)."""
    from models.export.manifest import read_manifest

    return (weights / "manifest.json").exists() and read_manifest(weights).onnx is not None


def export_models(out: Path, models: Sequence[str] = ("efficientnet_lite0", "mobilenet_v3_small")) -> dict[str, Path]:
    """Weights for ``models`` (Lite0 and an untrained MobileNetV3-Small), exported by our own export command into
    ``out``; each only once."""
    from models.export.write import export_default, export_model
    from models.presets import EvalPreset
    from models.pretrained import imagenet_labels
    from models.architectures import build_model

    dirs = {"efficientnet_lite0": out / "efficientnet_lite0", "mobilenet_v3_small": out / "mobilenet_v3_small"}
    onnx = [("onnx", "float32")]  # what `make serve` exports: the server serves it on the CPU
    if "efficientnet_lite0" in models and not has_onnx(dirs["efficientnet_lite0"]):
        export_default(dirs["efficientnet_lite0"], force=True, packages=onnx)
    if "mobilenet_v3_small" in models and not has_onnx(dirs["mobilenet_v3_small"]):
        torch.manual_seed(0)  # untrained weights cost the same to run as trained ones
        export_model(build_model("mobilenet_v3_small", 1000), out_dir=dirs["mobilenet_v3_small"],
                     name="mobilenet_v3_small", version="bench", arch="mobilenet_v3_small",
                     labels=imagenet_labels(), preset=EvalPreset(resize_size=256, crop_size=224), force=True,
                     packages=onnx)
    return {name: folder for name, folder in dirs.items() if name in models}


# The settings tried against the defaults at C=16 before the run: the fastest is measured at every concurrency as
# "visionserve (best: ...)". Each is one or more VISIONSERVE_ settings without the prefix, space-separated.
# WEIGHTS_FORMAT=torchscript: the same serving design on PyTorch's fastest form of the model, the peers' model.
CANDIDATES = ("WORKERS=1", "WORKERS=3", "MAX_BATCH_SIZE=4", "WORKERS=3 MAX_BATCH_SIZE=4", "AUTO_BATCH_SIZE=false",
              "WEIGHTS_FORMAT=torchscript")


def parse_settings(candidate: str) -> dict[str, str]:
    """"WORKERS=3 MAX_BATCH_SIZE=4" -> {"workers": "3", "max_batch_size": "4"}."""
    pairs = [item.split("=", 1) for item in candidate.split()]
    if not pairs or any(len(pair) != 2 or not pair[0] for pair in pairs):
        raise ValueError(f"a candidate is SETTING=value pairs, got {candidate!r}")
    return {name.lower(): value for name, value in pairs}


def request_bodies(form: str) -> dict[str, tuple[list[bytes], str]]:
    """The workload's photos as each server takes them in ``form``: "json" (base64 in JSON, the form every peer
    reads, LitServe only that one) or "raw" (an image body; LitServe still gets JSON)."""
    jpegs = list(workload())
    as_text = [base64.b64encode(b).decode() for b in jpegs]
    single = ([json.dumps({"image": t}).encode() for t in as_text], "application/json")
    if form == "raw":
        return {"visionserve": (jpegs, "image/jpeg"), "naive": (jpegs, "image/jpeg"), "litserve": single}
    return {"visionserve": (json_bodies(jpegs), "application/json"),
            "naive": single, "litserve": single}


@dataclass(frozen=True)
class Contender:
    """A server to compare, and the request bodies it takes."""

    name: str
    start: Callable[[], Running]
    bodies: list[bytes]
    content_type: str


def ours(weights: Path, logs: Path, settings: dict[str, str], bodies: tuple[list[bytes], str]) -> Contender:
    """visionserve with ``settings`` over its defaults (none: what `make serve` starts)."""
    name = DEFAULTS if not settings else "visionserve (best: " + " ".join(
        f"{k.upper()}={v}" for k, v in settings.items()) + ")"

    def start() -> Running:
        server = visionserve(weights, logs, **settings)
        server.name = name
        return server

    return Contender(name, start, *bodies)


def contenders(weights: Path, logs: Path, best: dict[str, str], args: argparse.Namespace) -> list[Contender]:
    """visionserve with its defaults and with ``best`` (when not the defaults), the naive Flask app with as many
    workers as visionserve chooses by default, and LitServe (unless skipped)."""
    bodies = request_bodies(args.form)
    workers = workers_for(0, "cpu")[0]
    found = [ours(weights, logs, {}, bodies["visionserve"])]
    if best:
        found.append(ours(weights, logs, best, bodies["visionserve"]))
    found.append(Contender("naive-flask", lambda: naive(weights, logs, workers), *bodies["naive"]))
    if not args.skip_litserve:
        # One inference worker: LitServe's best here (2 workers gave 11 img/s at C=4 against about 30 with 1).
        found.append(Contender("litserve", lambda: litserve(weights, logs, 1), *bodies["litserve"]))
    return found


def probe_best(model: str, weights: Path, logs: Path, args: argparse.Namespace) -> tuple[dict[str, str], list]:
    """The defaults and each candidate at C=16 for ``args.probe_seconds``: the fastest settings ({} when the
    defaults are) and every probe's (settings, img/s, p99 ms)."""
    bodies = request_bodies(args.form)["visionserve"]
    probes = []
    for settings in [{}, *(parse_settings(c) for c in args.candidates)]:
        contender = ours(weights, logs, settings, bodies)
        try:
            server = contender.start().wait_ready()
        except RuntimeError as exc:
            print(f"[{model}] {contender.name} did not start: {exc}", file=sys.stderr)
            continue
        try:
            r = measure(contender.name, model, server.url, "/predict", contender.bodies, 16, args.probe_seconds,
                        args.warmup, content_type=contender.content_type)
        finally:
            server.stop()
        probes.append((settings, r.images_per_s, r.p99_ms))
        print(f"[{model}] probe {contender.name}: {r.images_per_s:.1f} img/s, p99 {r.p99_ms:.0f} ms", flush=True)
    return max(probes, key=lambda p: p[1])[0], probes


def run_model(model: str, weights: Path, args: argparse.Namespace, logs: Path) -> dict[str, object]:
    """The limit, the best settings, and every server at every concurrency, for one model."""
    from app.engine.loaded.predictor import Predictor
    from app.engine.batching.tuning import forward_threads

    predictor, configs = configurations(weights, args.compile)
    served_name = served_config(configs)
    limit = measure_limit(predictor, configs, workload(), (1, 8), args.limit_seconds)
    ceiling = cpu_time_bound(predictor, configs, workload())
    workers = workers_for(0, "cpu")[0]  # the service's default: the process pipeline has as many processes
    # The service's own request path without HTTP or concurrency: about what any server running it pays per image.
    path = request_path(weights, workers, *request_bodies(args.form)["visionserve"])

    def pipeline(batch_size: int) -> LimitResult:  # the same work without HTTP, one process per worker
        return process_pipeline(weights, workload(), ceiling.forward_config or served_name, batch_size,
                                2 * args.limit_seconds, workers)

    pipelines_at_start = [pipeline(size) for size in sorted({1, ceiling.batch_size})]
    limit += pipelines_at_start
    best_batch = max(pipelines_at_start, key=lambda r: r.images_per_s).batch_size
    # The module the service serves by default, already built by configurations().
    served = Predictor(configs[served_name], predictor.manifest, device="cpu",
                       weights_format=predictor.weights_format)
    threads = forward_threads(0, torch.device("cpu"), workers=workers)  # what each worker gives its forward pass
    single_ms = single_image_ms(served, workload(), threads)
    print(f"[{model}] limit: " + ", ".join(f"{r.config} b{r.batch_size} {r.images_per_s:.1f}" for r in limit)
          + f"; ceiling {ceiling.images_per_s:.1f}; request path {path.cpu_ms_per_image:.1f} ms per image", flush=True)
    best, probes = probe_best(model, weights, logs, args) if args.candidates else ({}, [])
    loads: list[LoadResult] = []
    bounds: dict[int, dict[str, object]] = {}
    pipelines: dict[int, dict[str, object]] = {}
    for contender in contenders(weights, logs, best, args):
        try:
            server = contender.start().wait_ready()
        except RuntimeError as exc:
            print(f"[{model}] {contender.name} did not start: {exc}", file=sys.stderr)
            continue
        try:
            for concurrency in args.concurrency:
                if contender.name == DEFAULTS:  # limit and ceiling from this minute, for this point
                    bounds[concurrency] = asdict(cpu_time_bound(predictor, configs, workload()))
                    pipelines[concurrency] = asdict(pipeline(best_batch))
                result = measure(contender.name, model, server.url, "/predict", contender.bodies, concurrency,
                                 args.seconds, args.warmup, content_type=contender.content_type,
                                 server_pid=server.process.pid)
                loads.append(result)
                print(f"[{model}] {report.row(result)}", flush=True)
        finally:
            server.stop()
    return {"limit": [asdict(r) for r in limit], "ceiling": asdict(ceiling), "bound_at": bounds,
            "request_path": {**asdict(path), "images_per_s": path.images_per_s(torch.get_num_threads())},
            "pipeline_at": pipelines, "single_image_ms": single_ms, "forward_threads": threads, "workers": workers,
            "probes": [{"settings": s, "images_per_s": rate, "p99_ms": p99} for s, rate, p99 in probes],
            "loads": [asdict(r) for r in loads]}


def main() -> None:
    """Run the comparison and write the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["efficientnet_lite0", "mobilenet_v3_small"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per point")
    parser.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds per point")
    parser.add_argument("--limit-seconds", type=float, default=3.0)
    parser.add_argument("--compile", action="store_true", help="also try torch.compile for the limit")
    parser.add_argument("--skip-litserve", action="store_true")
    parser.add_argument("--form", choices=("json", "raw"), default="json",
                        help="how images are posted: base64 in JSON (every server reads it) or raw bodies")
    parser.add_argument("--candidates", nargs="*", default=list(CANDIDATES),
                        help="settings tried against the defaults at C=16 (none: only the defaults are measured)")
    parser.add_argument("--probe-seconds", type=float, default=6.0, help="measured seconds per candidate probe")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the report goes")
    args = parser.parse_args()
    logs = WORK / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    weights = export_models(WORK / "weights", args.models)
    started = time.time()
    results = {model: run_model(model, weights[model], args, logs) for model in args.models}
    machine = {"platform": platform.platform(), "cpus": torch.get_num_threads(), "torch": torch.__version__,
               "device": "cpu", "seconds": round(time.time() - started)}
    print(report.write(results, machine, args, args.out))


if __name__ == "__main__":
    main()
