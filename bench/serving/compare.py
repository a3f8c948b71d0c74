"""``python -m bench`` (or ``make bench``, through bench/__main__.py): visionserve against its limit and its peers,
same photos, one run.

For each model (the default EfficientNet-Lite0, and mobilenet_v3_small, which batching helps more): the in-process
limit, then visionserve, a naive one-forward-per-request Flask app and LitServe, each under a closed-loop load at
C = 1, 4, 16, 64. Prints a table, writes bench/results/<date>-<machine>.md (+ .json) and a PNG chart.
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
from typing import Callable

import torch

from bench.paths import RESULTS, WORK
from bench.serving import report
from bench.serving.limit import SERVED, LimitResult, configurations, cpu_time_bound, process_pipeline, single_image_ms
from bench.serving.limit import measure as measure_limit
from bench.serving.load import LoadResult, measure
from bench.serving.peers import litserve, naive
from harness.photos import workload
from harness.servers import Running, visionserve


def export_models(out: Path) -> dict[str, Path]:
    """Weights for both models, exported by our own export command into ``out``."""
    from models.export.write import export_default, export_model
    from models.presets import EvalPreset
    from models.pretrained import imagenet_labels
    from models.architectures import build_model

    dirs = {"efficientnet_lite0": out / "efficientnet_lite0", "mobilenet_v3_small": out / "mobilenet_v3_small"}
    if not (dirs["efficientnet_lite0"] / "manifest.json").exists():
        export_default(dirs["efficientnet_lite0"])
    if not (dirs["mobilenet_v3_small"] / "manifest.json").exists():
        torch.manual_seed(0)  # untrained weights cost the same to run as trained ones
        export_model(build_model("mobilenet_v3_small", 1000), out_dir=dirs["mobilenet_v3_small"],
                     name="mobilenet_v3_small", version="bench", arch="mobilenet_v3_small",
                     labels=imagenet_labels(), preset=EvalPreset(resize_size=256, crop_size=224))
    return dirs


@dataclass(frozen=True)
class Contender:
    """A server to compare, and the request bodies it takes (LitServe reads JSON, not raw image bodies)."""

    start: Callable[[], Running]
    bodies: list[bytes]
    content_type: str


def contenders(weights: Path, logs: Path, args: argparse.Namespace) -> list[Contender]:
    """visionserve and the naive Flask app with ``args.workers`` worker processes, and LitServe (unless skipped)."""
    jpegs = list(workload())
    found = [Contender(lambda: visionserve(weights, logs, workers=str(args.workers)), jpegs, "image/jpeg"),
             Contender(lambda: naive(weights, logs, args.workers), jpegs, "image/jpeg")]
    if not args.skip_litserve:
        as_json = [json.dumps({"image": base64.b64encode(b).decode()}).encode() for b in jpegs]
        # One inference worker: LitServe's best here (2 workers gave 11 img/s at C=4 against about 30 with 1).
        found.append(Contender(lambda: litserve(weights, logs, 1), as_json, "application/json"))
    return found


def run_model(model: str, weights: Path, args: argparse.Namespace, logs: Path) -> dict[str, object]:
    """The limit and every server at every concurrency, for one model."""
    from app.engine.predictor import Predictor
    from app.engine.tuning import forward_threads

    predictor, configs = configurations(weights, args.compile)
    limit = measure_limit(predictor, configs, workload(), (1, 8), args.limit_seconds)
    ceiling = cpu_time_bound(predictor, configs, workload())

    def pipeline(batch_size: int) -> LimitResult:  # the same work without HTTP, one process per worker
        return process_pipeline(weights, workload(), ceiling.forward_config or SERVED, batch_size,
                                2 * args.limit_seconds, args.workers)

    pipelines_at_start = [pipeline(size) for size in sorted({1, ceiling.batch_size})]
    limit += pipelines_at_start
    best_batch = max(pipelines_at_start, key=lambda r: r.images_per_s).batch_size
    # The module the service serves (frozen + optimize_for_inference), already built by configurations().
    served = Predictor(configs[SERVED], predictor.manifest, device="cpu", weights_format=predictor.weights_format)
    threads = forward_threads(0, torch.device("cpu"))  # what each worker gives its forward pass
    single_ms = single_image_ms(served, workload(), threads)
    print(f"[{model}] limit: " + ", ".join(f"{r.config} b{r.batch_size} {r.images_per_s:.1f}" for r in limit)
          + f"; ceiling {ceiling.images_per_s:.1f}", flush=True)
    loads: list[LoadResult] = []
    bounds: dict[int, dict[str, object]] = {}
    pipelines: dict[int, dict[str, object]] = {}
    for contender in contenders(weights, logs, args):
        try:
            server = contender.start().wait_ready()
        except RuntimeError as exc:
            print(f"[{model}] a server did not start: {exc}", file=sys.stderr)
            continue
        try:
            for concurrency in args.concurrency:
                if server.name == "visionserve":  # limit and ceiling from this minute, for this point
                    bounds[concurrency] = asdict(cpu_time_bound(predictor, configs, workload()))
                    pipelines[concurrency] = asdict(pipeline(best_batch))
                result = measure(server.name, model, server.url, "/predict", contender.bodies, concurrency,
                                 args.seconds, args.warmup, content_type=contender.content_type,
                                 server_pgid=server.process.pid)
                loads.append(result)
                print(f"[{model}] {report.row(result)}", flush=True)
        finally:
            server.stop()
    return {"limit": [asdict(r) for r in limit], "ceiling": asdict(ceiling), "bound_at": bounds,
            "pipeline_at": pipelines,
            "single_image_ms": single_ms,
            "forward_threads": threads, "loads": [asdict(r) for r in loads]}


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
    parser.add_argument("--workers", type=int, default=2,
                        help="worker processes for every server (2 x 1 thread beat 1 x 2 threads on a 2-core CPU)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the report goes")
    args = parser.parse_args()
    logs = WORK / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    weights = export_models(WORK / "weights")
    started = time.time()
    results = {model: run_model(model, weights[model], args, logs) for model in args.models}
    machine = {"platform": platform.platform(), "cpus": torch.get_num_threads(), "torch": torch.__version__,
               "device": "cpu", "seconds": round(time.time() - started)}
    print(report.write(results, machine, args, args.out))


if __name__ == "__main__":
    main()
