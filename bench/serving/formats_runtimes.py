"""The CPU runtimes users pick for a CNN, measured for ``bench.serving.formats`` in their own venv
(bench/.venv-formats, made by ``runtimes_python``): ONNX Runtime and OpenVINO are not dependencies of the project.

    python -m bench.serving.formats_runtimes export WEIGHTS_DIR MODEL.onnx      # the state dict, as ONNX
    python -m bench.serving.formats_runtimes measure MODEL.onnx PHOTOS.npy OUT_DIR THREADS BATCHES ROUNDS

``measure`` writes OUT_DIR/rates.json (images/s per runtime and batch size, each the fastest of 5 timed runs, the
median of ROUNDS alternating rounds) and OUT_DIR/<runtime>.npy (the probabilities on every photo, 8 at a time).
ONNX Runtime: CPUExecutionProvider, THREADS intra-op threads, 1 inter-op thread, every graph optimization.
OpenVINO: the CPU plugin, THREADS inference threads, the LATENCY hint (one stream: THROUGHPUT would split the same
threads into several streams, which a batch of 1 to 8 cannot use), the model's batch dimension left dynamic; once
in float32 (INFERENCE_PRECISION_HINT f32, the comparison with the other formats) and once at the plugin's default
precision (bf16 on a CPU with AMX or AVX-512 BF16, which lowers its agreement with float32).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

RUNTIMES = ("ONNX Runtime", "OpenVINO", "OpenVINO (its default precision)")
REQUIREMENTS = ["onnxruntime==1.32.0", "openvino==2026.4.1", "onnx==1.23.2", "onnxscript==0.7.2"]
VENV = Path(__file__).resolve().parents[1] / ".venv-formats"


def runtimes_python() -> Path:
    """The python of bench/.venv-formats (made on first use: our packages through a .pth, the runtimes pinned)."""
    from bench.serving.peers import side_venv

    return side_venv(VENV, REQUIREMENTS)


def fastest_rate(forward: Callable[[object], object], batch: object, size: int, runs: int = 5) -> float:
    """Images/s of ``forward`` on ``batch`` (``size`` images): the fastest of ``runs`` timed calls after one."""
    forward(batch)
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        forward(batch)
        best = min(best, time.perf_counter() - started)
    return size / best


def export(weights: Path, onnx_path: Path) -> str:
    """The weights directory's state dict as ONNX with a dynamic batch dimension; which exporter worked."""
    import torch

    from models.architectures import build_model
    from models.export.manifest import read_manifest

    manifest = read_manifest(weights)
    model = build_model(manifest.arch, manifest.num_classes)
    model.load_state_dict(torch.load(weights / manifest.files["state_dict"].path, weights_only=True))
    example = (torch.randn(2, *manifest.preprocess.input_shape),)
    try:
        torch.onnx.export(model.eval(), example, str(onnx_path), dynamo=True, input_names=["input"],
                          dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},), external_data=False)
        return f"torch.onnx.export(dynamo=True), torch {torch.__version__}"
    except Exception as exc:  # noqa: BLE001 - the TorchScript-based exporter is the documented fallback
        print(f"dynamo exporter failed ({type(exc).__name__}: {exc}); the TorchScript exporter", file=sys.stderr)
        torch.onnx.export(model.eval(), example, str(onnx_path), dynamo=False, input_names=["input"],
                          dynamic_axes={"input": {0: "batch"}}, opset_version=17)
        return f"torch.onnx.export(dynamo=False), torch {torch.__version__}"


def sessions(onnx_path: Path, threads: int) -> dict[str, Callable[[np.ndarray], np.ndarray]]:
    """Each runtime's forward pass: float32 NCHW in, logits out."""
    import onnxruntime as ort
    import openvino as ov

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    forwards = {"ONNX Runtime": lambda x: session.run(None, {name: x})[0]}
    core = ov.Core()
    for runtime, precision in (("OpenVINO", {"INFERENCE_PRECISION_HINT": "f32"}),
                               ("OpenVINO (its default precision)", {})):
        compiled = core.compile_model(str(onnx_path), "CPU", {"INFERENCE_NUM_THREADS": threads,
                                                              "PERFORMANCE_HINT": "LATENCY", **precision})
        forwards[runtime] = lambda x, request=compiled.create_infer_request(): request.infer({0: x})[0].copy()
    return forwards


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def measure(onnx_path: Path, photos: np.ndarray, out: Path, threads: int, batches: list[int], rounds: int) -> None:
    """Rates per runtime and batch size (alternating runtimes within each round), then probabilities."""
    forwards = sessions(onnx_path, threads)
    rates: dict[str, dict[int, list[float]]] = {name: {b: [] for b in batches} for name in forwards}
    for _ in range(rounds):
        for size in batches:
            batch = np.ascontiguousarray(photos[:size])
            for name, forward in forwards.items():
                rates[name][size].append(fastest_rate(forward, batch, size))
    medians = {name: {b: statistics.median(v) for b, v in sizes.items()} for name, sizes in rates.items()}
    (out / "rates.json").write_text(json.dumps(medians))
    for name, forward in forwards.items():
        chunks = [softmax(forward(np.ascontiguousarray(photos[i:i + 8]))) for i in range(0, len(photos), 8)]
        np.save(out / f"{name}.npy", np.concatenate(chunks))


def main(argv: list[str]) -> int:
    if argv[0] == "export":
        print(export(Path(argv[1]), Path(argv[2])))
        return 0
    onnx_path, photos, out, threads, batches, rounds = argv[1:7]
    measure(Path(onnx_path), np.load(photos), Path(out), int(threads), [int(b) for b in batches.split(",")],
            int(rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
