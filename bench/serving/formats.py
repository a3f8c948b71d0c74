"""``python -m bench.serving.formats``: the served model's formats and the CPU runtimes against each other on this
machine, in one run.

EfficientNet-Lite0 exported once with its CPU AOTInductor packages, float32 and int8 (PT2E, calibrated on real
photos; compiled here, about a minute each on 2 cores), and as ONNX (in bench/.venv-formats, with ONNX Runtime and
OpenVINO: bench/serving/formats_runtimes.py), then:
1. forward images/s per batch size, in process, on the same real photos (the agreement photos of
   models/export/agreement.py), for eager (the state dict), TorchScript (frozen + optimize_for_inference, what the
   server runs by default), the float32 package, the int8 package, ONNX Runtime and OpenVINO: the fastest of 5 timed
   runs per round, the median of alternating rounds (each round: the torch formats, then the runtimes in their
   venv's process), at the forward threads the server uses (half the cores);
2. each format's answers against float32 eager on those photos (198 views of 9 scikit-image photos that int8
   calibration never saw): top-1 agreement and the largest probability difference;
3. the server started with each format it serves (torchscript, aoti, int8, onnx; gunicorn, its default workers): time from start to ready, then images/s and p50 at C=1 and C=16 (the benchmark's photo mix,
   kept-alive connections), median of alternating rounds.
The report ends with the verdict the figures give: what WEIGHTS_FORMAT=auto should serve on the CPU (a format at
least MARGIN times TorchScript's images/s at both concurrencies, with top-1 agreement of at least 99%), and whether a
runtime wins clearly enough in process (CLEAR_WIN at every batch size) to be worth a serving backend.
Writes bench/results/<date>-formats-cpu-<cores>cpu.md and prints it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from app.engine.loaded.predictor import Predictor
from app.engine.batching.tuning import forward_threads
from bench import paths
from bench.serving.formats_runtimes import RUNTIMES, fastest_rate, runtimes_python
from bench.serving.load import measure
from bench.serving.report import save_result
from harness.photos import workload
from harness.servers import Running, visionserve
from models.export.agreement import agreement, agreement_batch, probabilities
from models.export.manifest import MIN_TOP1_AGREEMENT, Agreement, read_manifest
from models.export.write import export_default

WORK = paths.WORK / "formats"
ROOT = Path(__file__).resolve().parents[2]
BATCH_SIZES = (1, 2, 4, 8)
FORMATS = {"eager": "state_dict", "TorchScript (frozen)": "torchscript", "AOTInductor package": "aoti",
           "int8 package": "int8", "ONNX Runtime, as served": "onnx"}
SERVED = {"torchscript": "TorchScript (frozen)", "aoti": "AOTInductor package", "int8": "int8 package",
          "onnx": "ONNX Runtime, as served"}
MARGIN = 1.05  # faster end to end: this much more images/s than TorchScript at C=1 and at C=16 (runs vary ~3-5%)
CLEAR_WIN = 1.2  # a runtime worth a serving backend: this much faster than the best torch format at every batch


def exported() -> Path:
    """Lite0 with its CPU packages (float32 and int8) and its ONNX file, exported once into bench/.work."""
    out = WORK / "lite0"
    if (not (out / "manifest.json").is_file() or len(read_manifest(out).packages) < 2
            or read_manifest(out).onnx is None):
        export_default(out, force=True, packages=[("cpu", "float32"), ("cpu", "int8"), ("onnx", "float32")])
    return out


def onnx_model(weights: Path) -> tuple[Path, str]:
    """The state dict as ONNX (exported once, in the runtimes' venv) and how it was exported."""
    path, how = WORK / "lite0.onnx", WORK / "lite0.onnx.how"
    if not path.is_file() or not how.is_file():
        done = subprocess.run([str(runtimes_python()), "-m", "bench.serving.formats_runtimes", "export",
                               str(weights), str(path)], cwd=ROOT, check=True, capture_output=True, text=True)
        how.write_text(done.stdout.strip().splitlines()[-1])
    return path, how.read_text()


def runtimes_round(onnx: Path, photos: Path, batches: tuple[int, ...]) -> dict[str, dict[int, float]]:
    """One round of the runtimes, in their venv's process; their probabilities land in WORK/<runtime>.npy."""
    threads = forward_threads(0, torch.device("cpu"))
    subprocess.run([str(runtimes_python()), "-m", "bench.serving.formats_runtimes", "measure", str(onnx),
                    str(photos), str(WORK), str(threads), ",".join(map(str, batches)), "1"], cwd=ROOT, check=True)
    rates = json.loads((WORK / "rates.json").read_text())
    return {name: {int(b): rate for b, rate in sizes.items()} for name, sizes in rates.items()}


def forward_rates(weights: Path, photos: torch.Tensor, rounds: int, batches: tuple[int, ...],
                  onnx: Path) -> tuple[dict[str, dict[int, float]], dict[str, Agreement]]:
    """Median forward images/s per format and batch size, and each format's agreement with float32 eager."""
    torch.set_num_threads(forward_threads(0, torch.device("cpu")))
    predictors = {name: Predictor.load(weights, weights_format=fmt, device="cpu", jit_optimize=True,
                                       max_batch_size=max(batches), threads=torch.get_num_threads())
                  for name, fmt in FORMATS.items()}
    np.save(WORK / "photos.npy", photos.numpy())
    rates: dict[str, dict[int, list[float]]] = {name: {b: [] for b in batches} for name in (*FORMATS, *RUNTIMES)}
    for _ in range(rounds):
        with torch.inference_mode():
            for size in batches:
                for name, predictor in predictors.items():
                    rates[name][size].append(fastest_rate(predictor.module, photos[:size], size))
        for name, sizes in runtimes_round(onnx, WORK / "photos.npy", batches).items():
            for size, rate in sizes.items():
                rates[name][size].append(rate)
    answers = {name: probabilities(p.module, photos) for name, p in predictors.items()}
    answers |= {name: torch.from_numpy(np.load(WORK / f"{name}.npy")) for name in RUNTIMES}
    agreements = {name: agreement((answers["eager"], None), (probs, None)) for name, probs in answers.items() if name != "eager"}
    return {name: {b: statistics.median(v) for b, v in sizes.items()} for name, sizes in rates.items()}, agreements


def served(weights: Path, fmt: str, duration_s: float) -> dict[str, float]:
    """One round for one format: start-to-ready seconds, then images/s and p50 at C=1 and C=16."""
    bodies = list(workload())
    started = time.perf_counter()
    server: Running = visionserve(weights, WORK, weights_format=fmt).wait_ready()  # its default workers
    point = {"ready_s": time.perf_counter() - started}
    try:
        for concurrency in (1, 16):
            r = measure(fmt, "lite0", server.url, "/predict", bodies, concurrency, duration_s, 3.0)
            point[f"c{concurrency}_img_s"], point[f"c{concurrency}_p50_ms"] = r.images_per_s, r.p50_ms
    finally:
        server.stop()
    return point


def verdict(forward: dict[str, dict[int, float]], server: dict[str, dict[str, float]],
            agreements: dict[str, Agreement]) -> list[str]:
    """What the figures say auto should serve on the CPU, and what each runtime's in-process figures mean."""
    ts, lines, eligible = server["torchscript"], [], []
    for fmt, r in server.items():
        if fmt == "torchscript":
            continue
        ratio, agreed = min(r["c1_img_s"] / ts["c1_img_s"], r["c16_img_s"] / ts["c16_img_s"]), agreements[SERVED[fmt]]
        if ratio < MARGIN:
            lines.append(f"- `{fmt}`: not faster end to end ({ratio:.2f}x TorchScript's images/s at its worse "
                         f"concurrency; {MARGIN:.2f}x needed).")
        elif agreed.top1 < MIN_TOP1_AGREEMENT:
            lines.append(f"- `{fmt}`: {ratio:.2f}x TorchScript, but its top-1 agrees with float32 on "
                         f"{100 * agreed.top1:.1f}% of the photos (at least {100 * MIN_TOP1_AGREEMENT:.0f}% needed).")
        else:
            eligible.append((ratio, fmt))
            lines.append(f"- `{fmt}`: {ratio:.2f}x TorchScript at its worse concurrency, top-1 agreement "
                         f"{100 * agreed.top1:.1f}%.")
    lines += _runtime_lines(forward, agreements)
    if eligible:
        choice = max(eligible)[1]
        return lines + ["", f"Verdict: `WEIGHTS_FORMAT=auto` on the CPU should serve `{choice}` "
                            f"(`FASTEST_ON = {{\"cpu\": \"{choice}\"}}` in models/export/choose.py)."]
    return lines + ["", "Verdict: `WEIGHTS_FORMAT=auto` on the CPU keeps TorchScript (no package is faster end to "
                        "end by the margin with the agreement; `FASTEST_ON` stays without `cpu`)."]


def _runtime_lines(forward: dict[str, dict[int, float]], agreements: dict[str, Agreement]) -> list[str]:
    """Each runtime against the fastest servable torch format (agreeing with float32) at each batch size."""
    servable = [SERVED[f] for f in SERVED if f != "onnx" and agreements[SERVED[f]].top1 >= MIN_TOP1_AGREEMENT]
    lines = []
    for name in RUNTIMES:
        ratios = [forward[name][b] / max(forward[f][b] for f in servable) for b in forward[name]]
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}x the fastest torch format per batch size"
        agreed = agreements[name].top1
        if min(ratios) >= CLEAR_WIN and agreed >= MIN_TOP1_AGREEMENT and name == "ONNX Runtime":
            lines.append(f"- {name}: wins clearly in process ({spread}); the server serves it as "
                         "`WEIGHTS_FORMAT=onnx` (measured above).")
        elif min(ratios) >= CLEAR_WIN and agreed >= MIN_TOP1_AGREEMENT:
            lines.append(f"- {name}: wins clearly in process ({spread}); serving it would need a serving backend "
                         "of its own (not built, so not measured through the server).")
        elif min(ratios) >= CLEAR_WIN:
            lines.append(f"- {name}: faster in process ({spread}) but its top-1 agrees with float32 on "
                         f"{100 * agreed:.1f}% of the photos (at least {100 * MIN_TOP1_AGREEMENT:.0f}% needed).")
        else:
            lines.append(f"- {name}: does not win clearly in process ({spread}; {CLEAR_WIN:.1f}x at every batch "
                         "size needed): not added as a dependency.")
    return lines


def report(forward: dict[str, dict[int, float]], agreements: dict[str, Agreement], server: dict[str, dict[str, float]],
           setup: dict[str, str], args: argparse.Namespace) -> str:
    """The results as markdown, ending with the verdict."""
    batches = list(next(iter(forward.values())))
    lines = [f"# Model formats on the CPU ({os.cpu_count()} cores), {time.strftime('%Y-%m-%d')}", "",
             f"`python -m bench.serving.formats {' '.join(setup['argv'])}`".replace(" `", "`"),
             f"torch {torch.__version__}; EfficientNet-Lite0; {setup['packages']}; ONNX by {setup['onnx']}; "
             f"{setup['runtimes']}.", "",
             f"Forward images/s, in process, on the same real photos, {forward_threads(0, torch.device('cpu'))} "
             f"intra-op thread(s) (the server's default), median of {args.forward_rounds} alternating rounds, and "
             f"each format's answers against float32 eager on {next(iter(agreements.values())).photos} photo views "
             "int8 calibration never saw:", "",
             "| format | " + " | ".join(f"batch {b}" for b in batches) + " | top-1 agreement | max prob. diff. |",
             "| --- |" + " ---: |" * (len(batches) + 2)]
    for name, rates in forward.items():
        agreed = agreements.get(name)
        tail = f"{100 * agreed.top1:.1f}% | {agreed.max_probability_difference:.4f}" if agreed else "(reference) | -"
        lines.append(f"| {name} | " + " | ".join(f"{rates[b]:.1f}" for b in batches) + f" | {tail} |")
    base = forward["TorchScript (frozen)"]
    lines += [""] + [f"{name} / TorchScript: " + ", ".join(f"batch {b} {forward[name][b] / base[b]:.2f}x"
                                                          for b in batches)
                     for name in forward if name not in ("eager", "TorchScript (frozen)")]
    lines += ["", f"The server (gunicorn, its default workers, the benchmark's photo mix, {args.duration:g} s per point, median "
              f"of {args.rounds} alternating rounds):", "",
              "| WEIGHTS_FORMAT | start to ready (s) | C=1 images/s | C=1 p50 (ms) | C=16 images/s | C=16 p50 (ms) |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {fmt} | {r['ready_s']:.1f} | {r['c1_img_s']:.1f} | {r['c1_p50_ms']:.1f} | {r['c16_img_s']:.1f} | "
              f"{r['c16_p50_ms']:.1f} |" for fmt, r in server.items()]
    ts = server["torchscript"]
    lines += [""] + [f"{fmt} / torchscript: C=1 {r['c1_img_s'] / ts['c1_img_s']:.2f}x, "
                     f"C=16 {r['c16_img_s'] / ts['c16_img_s']:.2f}x images/s" for fmt, r in server.items()
                     if fmt != "torchscript"]
    return "\n".join(lines + ["", *verdict(forward, server, agreements)]) + "\n"


def setup_line(weights: Path) -> str:
    """The packages as the manifest records them (compile time, int8 agreement at export)."""
    parts = []
    for package in read_manifest(weights).packages:
        agreed = package.agreement
        parts.append(f"{package.path} compiled in {package.compile_s:.0f} s" + (
            f" (top-1 as float32 on {100 * agreed.top1:.1f}% of {agreed.photos} photos at export, probabilities "
            f"within {agreed.max_probability_difference:.4f})" if agreed else ""))
    onnx = read_manifest(weights).onnx
    if onnx is not None:
        parts.append(f"{onnx.path} exported in {onnx.export_s:.0f} s (top-1 as float32 on {100 * onnx.agreement.top1:.1f}% "
                     f"of {onnx.agreement.photos} photos at export)")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per measured load point")
    parser.add_argument("--rounds", type=int, default=2, help="alternating server rounds per format")
    parser.add_argument("--forward-rounds", type=int, default=3, help="alternating in-process rounds")
    parser.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)),
                        help="in-process batch sizes, comma-separated (a quick check: 1,8)")
    args = parser.parse_args(argv)
    batches = tuple(int(b) for b in args.batch_sizes.split(","))
    WORK.mkdir(parents=True, exist_ok=True)
    weights = exported()
    onnx, how = onnx_model(weights)
    photos = agreement_batch(read_manifest(weights).preprocess)
    forward, agreements = forward_rates(weights, photos, args.forward_rounds, batches, onnx)
    rounds: dict[str, list[dict[str, float]]] = {fmt: [] for fmt in SERVED}
    for _ in range(args.rounds):  # alternate, so a drifting machine slows all alike
        for fmt, points in rounds.items():
            points.append(served(weights, fmt, args.duration))
    medians = {fmt: {key: statistics.median(p[key] for p in points) for key in points[0]}
               for fmt, points in rounds.items()}
    versions = subprocess.run([str(runtimes_python()), "-c", "import onnxruntime, openvino; print(f'onnxruntime "
                               "{onnxruntime.__version__}, openvino {openvino.__version__}')"],
                              capture_output=True, text=True, check=True).stdout.strip()
    setup = {"argv": sys.argv[1:] if argv is None else argv, "packages": setup_line(weights), "onnx": how,
             "runtimes": versions}
    save_result("formats", report(forward, agreements, medians, setup, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
