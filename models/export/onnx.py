"""The model as ONNX, for ONNX Runtime on the CPU: written at export, its answers checked against float32 eager.

``torch.onnx.export`` (the ``torch.export``-based exporter) writes ``model.onnx`` with a dynamic batch dimension;
ONNX Runtime then runs it on the agreement photos (models/export/agreement.py: 198 views of 9 real photos) next to
the eager model, and the top-1 agreement and largest probability difference go into the manifest. A model the
exporter cannot take, or whose ONNX answers differ (top-1 agreement under ``MIN_TOP1_AGREEMENT``), is exported
without the file, with a warning saying why: the server then serves TorchScript.

``python -m bench.serving.formats`` measured ONNX Runtime's forward pass at about twice frozen TorchScript's on the
CPU (docs/performance.md), so the server's ``WEIGHTS_FORMAT=auto`` serves this file there.
"""
from __future__ import annotations

import copy
import logging
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from models.export.agreement import agreement, agreement_batch, probabilities
from models.export.manifest import MIN_TOP1_AGREEMENT, OnnxFile, sha256_of
from models.export.onnx_runtime import run_session, session
from models.presets import EvalPreset

log = logging.getLogger(__name__)

ONNX_NAME = "model.onnx"
OPSET = 18


def export_onnx(model: nn.Module, preset: EvalPreset, out_dir: Path, max_batch_size: int) -> OnnxFile | None:
    """Write ``out_dir/model.onnx`` and measure its agreement with ``model``; None (warned, no file) when the
    exporter fails or its answers differ."""
    started = time.perf_counter()
    module = copy.deepcopy(model).eval().cpu()
    path = out_dir / ONNX_NAME
    try:
        _write(module, preset, path, max(2, max_batch_size))
        photos = agreement_batch(preset)
        runner = session(path)
        # Eager one image at a time: on a CPU its batches of 8 are slower per image (their activations leave the
        # cache); ONNX Runtime's are not.
        expected = probabilities(module, photos, batch_size=1)
        answered = probabilities(lambda b: run_session(runner, b), photos)
        found = agreement(expected, answered)
    except Exception as exc:  # noqa: BLE001 - an architecture the exporter cannot take: serve TorchScript
        path.unlink(missing_ok=True)
        log.warning("no ONNX file (the server will serve TorchScript): the export failed: %s", exc)
        return None
    export_s = time.perf_counter() - started
    if found.top1 < MIN_TOP1_AGREEMENT:
        path.unlink()
        log.warning("no ONNX file (the server will serve TorchScript): its top-1 agreed with the model on %.1f%% "
                    "of %d photos", 100 * found.top1, found.photos)
        return None
    log.info("wrote %s in %.0fs: top-1 agrees with the model on %.1f%% of %d photos, probabilities within %.1e",
             path.name, export_s, 100 * found.top1, found.photos,
             float((expected - answered).abs().max()))  # unrounded: the manifest's 4 decimals made 4e-5 read "0"
    return OnnxFile(path=path.name, sha256=sha256_of(path), opset=OPSET, max_batch_size=max(2, max_batch_size),
                    torch_version=torch.__version__, export_s=round(export_s, 1), agreement=found)


def _write(module: nn.Module, preset: EvalPreset, path: Path, max_batch_size: int) -> None:
    example = (torch.randn(2, *preset.input_shape),)
    batch = torch.export.Dim("batch", min=1, max=max_batch_size)
    for noisy in ("onnx_ir", "onnxscript", "torch.onnx"):  # one INFO line per graph pass otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the exporter's deprecation and tracing notes
        torch.onnx.export(module, example, str(path), dynamo=True, input_names=["input"], output_names=["logits"],
                          dynamic_shapes=({0: batch},), external_data=False, opset_version=OPSET, verbose=False)
