"""The model as ONNX, for ONNX Runtime on the CPU: written at export, its answers checked against float32 eager.

``torch.onnx.export`` (the ``torch.export``-based exporter) writes ``model.onnx`` with a dynamic batch dimension;
ONNX Runtime then runs it on the agreement photos (models/export/agreement.py: 198 views of 9 real photos) next to
the eager model, and the top-1 agreement and largest probability difference go into the manifest. An export whose
answers differ (top-1 agreement under ``MIN_TOP1_AGREEMENT``) is not written: the exporter got the model wrong.

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


def export_onnx(model: nn.Module, preset: EvalPreset, out_dir: Path, max_batch_size: int) -> OnnxFile:
    """Write ``out_dir/model.onnx`` and measure its agreement with ``model``; RuntimeError if they disagree."""
    started = time.perf_counter()
    module = copy.deepcopy(model).eval().cpu()
    path = out_dir / ONNX_NAME
    example = (torch.randn(2, *preset.input_shape),)
    batch = torch.export.Dim("batch", min=1, max=max(2, max_batch_size))
    for noisy in ("onnx_ir", "onnxscript", "torch.onnx"):  # one INFO line per graph pass otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the exporter's deprecation and tracing notes
        torch.onnx.export(module, example, str(path), dynamo=True, input_names=["input"], output_names=["logits"],
                          dynamic_shapes=({0: batch},), external_data=False, opset_version=OPSET, verbose=False)
    export_s = time.perf_counter() - started
    photos = agreement_batch(preset)
    runner = session(path)
    found = agreement(probabilities(module, photos), probabilities(lambda b: run_session(runner, b), photos))
    if found.top1 < MIN_TOP1_AGREEMENT:
        path.unlink()
        raise RuntimeError(f"the ONNX export's top-1 agrees with the model on {100 * found.top1:.1f}% of "
                           f"{found.photos} photos: the exporter changed the model (not written)")
    log.info("wrote %s in %.0fs: top-1 agrees with the model on %.1f%% of %d photos, probabilities within %.2g",
             path.name, export_s, 100 * found.top1, found.photos, found.max_probability_difference)
    return OnnxFile(path=path.name, sha256=sha256_of(path), opset=OPSET, max_batch_size=max(2, max_batch_size),
                    torch_version=torch.__version__, export_s=round(export_s, 1), agreement=found)
