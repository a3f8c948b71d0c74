"""What one forward pass costs the engine's thread at each batch size the batcher runs (issue #50): the served model
as the server loads it (``Predictor.load``), its module called on a batch already on the device (no softmax, no
copy back), beside the same call captured once as a CUDA graph as the server captures it (app/engine/loaded/graphs.py
``cuda_capture``) and replayed. On a GPU the engine's thread pays for every kernel launch of a forward pass while
holding the interpreter lock; at the small batches a one-image-per-request load makes, those launches, not the GPU,
bound it.

    python3 -m bench.serving.forward_launch --device cuda --out FOLDER         # on a GPU host (the drill runs it)
    .venv/bin/python -m bench.serving.forward_launch --device cpu --batch-sizes 1 4 --seconds 0.2   # eager only

For each dtype, memory format and batch size: the calling thread's CPU per call (``time.thread_time``: the
launches, what the lock is held for) and the wall time per call, waited for (the GPU's time for the batch when it
exceeds the launches), eager and, on CUDA, graphed; the graphed output's largest difference from eager's, and the
eager logits' largest difference from the first layout's on the same pixels. ``--memory-formats contiguous
channels_last``: the module's weights and its batch also in channels_last (NHWC), whose cuDNN kernels may run a
depthwise network's convolutions faster on a GPU: on 12-04's H200 Lite0's graphed float32 forward pass took 94 us an
image of GPU time at batch 64, the bound of the device path's 6,496 images a second with the decode
(bench/results/2026-12-04-gpu-drill-h200.md). Writes ``forward-launch-<device>.json`` and ``.md`` into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Callable, Sequence, get_args

import torch

from app.config import MemoryFormat
from app.engine.loaded.graphs import cuda_capture
from bench.serving.compare import export_models
from models.architectures import split_outputs

WORK = Path(__file__).resolve().parents[1] / ".work"


def timed_call(call: Callable[[], object], sync: Callable[[], None], seconds: float) -> tuple[float, float, int]:
    """(thread CPU us per call, wall us per call waited for, calls) over about ``seconds``."""
    cpu, _, wall, calls = timed_waits(call, sync, seconds)
    return cpu, wall, calls


def timed_waits(call: Callable[[], object], sync: Callable[[], None],
                seconds: float) -> tuple[float, float, float, int]:
    """(thread CPU us in the call, thread CPU us with the wait for the device included, wall us waited for, calls),
    per call, over about ``seconds`` after one untimed call (a CUDA wait spins its thread unless told to sleep)."""
    call()
    sync()
    calls = 0
    in_call = with_wait = wall = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or calls < 3:
        wall_start, cpu_start = time.perf_counter(), time.thread_time()
        call()
        in_call += time.thread_time() - cpu_start
        sync()
        with_wait += time.thread_time() - cpu_start
        wall += time.perf_counter() - wall_start
        calls += 1
    return in_call / calls * 1e6, with_wait / calls * 1e6, wall / calls * 1e6, calls


def measure(weights: Path, device: str, dtypes: Sequence[str], batch_sizes: Sequence[int], seconds: float,
            memory_formats: Sequence[str] = ("contiguous",), weights_format: str = "auto") -> list[dict[str, object]]:
    """One row per dtype, memory format and batch size (see the module's docstring): each layout's version loaded
    as the server loads it (``MEMORY_FORMAT``), its row named by the layout it took (a module without weights of
    its own, as ONNX Runtime's, keeps the contiguous one)."""
    from app.engine.loaded.predictor import Predictor

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows: list[dict[str, object]] = []
    for dtype in dtypes:
        first_logits: dict[int, torch.Tensor] = {}  # by batch size: the first layout's, for the others to meet
        for layout in memory_formats:
            predictor = Predictor.load(weights, weights_format=weights_format, device=device, dtype=dtype,
                                       max_batch_size=max(batch_sizes), memory_format=layout)
            module = predictor.module
            for size in batch_sizes:
                pixels = torch.rand(size, *predictor.manifest.preprocess.input_shape,
                                    generator=torch.Generator().manual_seed(size))  # the same in every layout
                batch = predictor._laid_out(pixels.to(predictor.device), predictor.dtype)  # as served
                row: dict[str, object] = {"dtype": dtype, "memory_format": predictor.memory_format, "batch": size,
                                          "format": predictor.weights_format}
                with torch.inference_mode():
                    logits = split_outputs(module(batch))[0].float().cpu()
                reference = first_logits.setdefault(size, logits)
                row["layout_max_diff"] = float((logits - reference).abs().max())
                rows.append(_timed_row(row, module, batch, sync, seconds, cuda))
            del predictor, module
            if cuda:
                torch.cuda.empty_cache()
    return rows


def _timed_row(row: dict[str, object], module: Callable[[torch.Tensor], object], batch: torch.Tensor,
               sync: Callable[[], None], seconds: float, cuda: bool) -> dict[str, object]:
    """``row`` with ``module``'s forward pass on ``batch`` timed eager and, on CUDA, replayed as a CUDA graph."""
    def eager() -> object:
        with torch.inference_mode():
            return module(batch)

    row["eager_cpu_us"], row["eager_wall_us"], row["eager_calls"] = timed_call(eager, sync, seconds)
    if cuda:
        try:
            replay, output = cuda_capture(module, batch, torch.cuda.graph_pool_handle())  # as the server does
            row["graph_cpu_us"], row["graph_wall_us"], row["graph_calls"] = timed_call(replay, sync, seconds)
            expected = split_outputs(eager())[0].float()  # the logits (an embedding may follow)
            row["graph_max_diff"] = float((split_outputs(output)[0].float() - expected).abs().max())
        except Exception as exc:  # noqa: BLE001 - a module capture refuses is a finding, not a stop
            row["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return row


def report(rows: Sequence[dict[str, object]], machine: dict[str, object]) -> str:
    """The rows as a markdown table."""
    lines = [f"# One forward pass's cost to the engine's thread: {machine['device_name']}, torch {machine['torch']}",
             "", "| dtype | format | memory format | batch | eager CPU us | eager wall us | graph CPU us | "
             "graph wall us | eager/graph CPU | graph max diff | wall us / image | layout max diff |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        graph_cpu = row.get("graph_cpu_us")
        ratio = f"{row['eager_cpu_us'] / graph_cpu:.1f}x" if graph_cpu else "-"  # type: ignore[operator]
        graph = (f"{graph_cpu:.0f} | {row['graph_wall_us']:.0f}" if graph_cpu
                 else f"{row.get('graph_error', 'no CUDA')} | -")
        wall = row.get("graph_wall_us") or row["eager_wall_us"]  # the graph's where it has one: what serving runs
        lines.append(f"| {row['dtype']} | {row['format']} | {row['memory_format']} | {row['batch']} | "
                     f"{row['eager_cpu_us']:.0f} | {row['eager_wall_us']:.0f} | {graph} | {ratio} | "
                     f"{row.get('graph_max_diff', '-')} | {wall / row['batch']:.1f} | "  # type: ignore[operator]
                     f"{row['layout_max_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="efficientnet_lite0", choices=("efficientnet_lite0", "mobilenet_v3_small"))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--memory-formats", nargs="+", choices=get_args(MemoryFormat), default=["contiguous"],
                        help="the version loaded with each MEMORY_FORMAT in turn (its weights and batch so laid out)")
    parser.add_argument("--weights-format", default="auto", help="as WEIGHTS_FORMAT (auto: the server's choice)")
    parser.add_argument("--seconds", type=float, default=1.0, help="per point and path")
    parser.add_argument("--out", type=Path, default=WORK / "forward-launch")
    args = parser.parse_args(argv)
    weights = export_models(WORK / "weights", [args.model])[args.model]
    machine = {"device_name": device_name(torch.device(args.device)), "torch": torch.__version__}
    rows = measure(weights, args.device, args.dtypes, args.batch_sizes, args.seconds, args.memory_formats,
                   args.weights_format)
    write_report(args.out / f"forward-launch-{args.device.split(':')[0]}", machine, rows, report(rows, machine))


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def write_report(stem: Path, machine: dict[str, object], rows: Sequence[dict[str, object]], text: str) -> None:
    """``stem``.json (the machine and the rows) and ``stem``.md (``text``), its folder made; ``text`` printed."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")
    stem.with_suffix(".md").write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
