"""The model as ONNX, for ONNX Runtime on the CPU: written at export, its answers checked against float32 eager.

``torch.onnx.export``'s TorchScript-based exporter traces the model into ``model.onnx`` with a dynamic batch
dimension, and onnxscript's optimizer folds what depends only on the fixed image size (timm's TensorFlow-style
"same" padding is otherwise computed from the input's height and width at every call). ONNX Runtime then runs the
graph the ``torch.export``-based exporter writes (for Lite0 the same 49 convolutions after ONNX Runtime's own
optimizations), which took 25-55 s to write the default model on the 2-core VM against 3-8 s this way: it reasons
about the symbolic batch dimension in Python at every layer. It is the fallback for a model the tracing exporter
cannot take. ONNX Runtime runs the file on the agreement photos (models/export/agreement.py: 198 views of 9 real
photos) next to the eager model, and the top-1 agreement and largest probability difference go into the manifest. A
model neither exporter can take, or whose ONNX answers differ (``choose.onnx_short_of``: top-1 agreement, the
embeddings' cosine, and its probabilities beyond float32's rounding), is
exported without the file, with a warning saying why: the server then serves TorchScript.

``python -m bench.serving.formats`` measured ONNX Runtime's forward pass at about twice frozen TorchScript's on the
CPU (docs/performance.md), so the server's ``WEIGHTS_FORMAT=auto`` serves this file there.
"""
from __future__ import annotations

import copy
import logging
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn as nn

from models.commands import python_command
from models.export.agreement import Laps, agreement, agreement_batch, answers, one_thread
from models.export.choose import onnx_short_of
from models.export.manifest import EMBEDDING_OUTPUT, OnnxFile, sha256_of
from models.export.onnx_runtime import run_session, session
from models.presets import EvalPreset

if TYPE_CHECKING:
    from onnxscript import ir

log = logging.getLogger(__name__)

ONNX_NAME = "model.onnx"
OPSET = 18
SMALL_CONSTANT = 64  # elements: a ConstantOfShape up to this size is folded (padding amounts), larger ones are kept


def export_onnx(model: nn.Module, preset: EvalPreset, out_dir: Path, max_batch_size: int,
                laps: Laps | None = None) -> OnnxFile | None:
    """Write ``out_dir/model.onnx`` and measure its agreement with ``model``; None (warned, no file) when the
    exporter fails or its answers differ. Its steps' times go into ``laps`` (the export's)."""
    started = time.perf_counter()
    laps = Laps() if laps is None else laps
    module = copy.deepcopy(model).eval().cpu()
    path = out_dir / ONNX_NAME
    try:
        with one_thread():
            _write(module, preset, path, max(2, max_batch_size))
            laps.done("ONNX export")
            photos = agreement_batch(preset)
            laps.done("agreement photos")
            # Eager one image at a time: on a CPU its batches of 8 are slower per image (their activations leave
            # the cache); ONNX Runtime's are not.
            expected = answers(module, photos, batch_size=1)
            laps.done("eager on them")
            runner = session(path)
            answered = answers(lambda b: run_session(runner, b), photos)
            laps.done("ONNX Runtime on them")
        found = agreement(expected, answered)
    except Exception as exc:  # noqa: BLE001 - an architecture the exporter cannot take: serve TorchScript
        path.unlink(missing_ok=True)
        missing = (f" ({exc.name} is not installed: {python_command()} -m pip install -r requirements.txt)"
                   if isinstance(exc, ImportError) and exc.name else "")
        log.warning("no ONNX file (the server will serve TorchScript): the export failed: %s%s", exc, missing)
        return None
    export_s = time.perf_counter() - started
    if why := onnx_short_of(found):
        path.unlink()
        log.warning("no ONNX file (the server will serve TorchScript): %s", why)
        return None
    log.info("wrote %s in %.0fs: top-1 agrees with the model on %.1f%% of %d photos, probabilities within %.1e",
             path.name, export_s, 100 * found.top1, found.photos,
             float((expected[0] - answered[0]).abs().max()))  # unrounded: the manifest's 4 decimals made 4e-5 read "0"
    return OnnxFile(path=path.name, sha256=sha256_of(path), opset=OPSET, max_batch_size=max(2, max_batch_size),
                    torch_version=torch.__version__, export_s=round(export_s, 1), agreement=found)


def _write(module: nn.Module, preset: EvalPreset, path: Path, max_batch_size: int) -> None:
    """``module`` as ONNX in ``path``: traced and optimized, or by the ``torch.export``-based exporter when the
    tracing exporter fails."""
    example = (torch.randn(2, *preset.input_shape),)
    with torch.inference_mode():
        answered = module(*example)
    names = ["logits", EMBEDDING_OUTPUT] if isinstance(answered, tuple) else ["logits"]
    for noisy in ("onnx_ir", "onnxscript", "torch.onnx"):  # one INFO line per graph pass otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the exporter's deprecation and tracing notes
        try:
            _traced(module, example, path, names)
        except Exception as exc:  # noqa: BLE001 - e.g. a torch without the tracing exporter: the other one
            log.info("the tracing ONNX exporter failed (%s); exporting with torch.export instead", exc)
            batch = torch.export.Dim("batch", min=1, max=max_batch_size)
            torch.onnx.export(module, example, str(path), dynamo=True, input_names=["input"],
                              output_names=names, dynamic_shapes=({0: batch},), external_data=False,
                              opset_version=OPSET, verbose=False)


def _traced(module: nn.Module, example: tuple[torch.Tensor, ...], path: Path, names: list[str]) -> None:
    """The TorchScript-based exporter's graph, with what depends only on the fixed image size folded away."""
    from onnxscript import ir, optimizer  # here: about 2 s to import, for ONNX exports only

    torch.onnx.export(module, example, str(path), dynamo=False, input_names=["input"], output_names=names,
                      dynamic_axes={name: {0: "batch"} for name in ["input", *names]}, opset_version=OPSET)
    model = ir.load(path)
    _slice_dimensions(model)
    optimizer.optimize_ir(model, should_fold=_small_constant_of_shape)
    ir.save(model, path)


def _slice_dimensions(model: ir.Model) -> None:
    """Rewrite ``Gather(Shape(x), k)`` (one dimension, as tracing records ``x.size(k)``) as
    ``Squeeze(Shape(x, start=k, end=k+1))``, which the optimizer folds to a constant where dimension ``k`` is
    fixed (it folds a gathered dimension only when the index is a list)."""
    from onnxscript import ir

    for node in list(model.graph):
        shape = node.inputs[0].producer() if node.op_type == "Gather" and node.inputs[0] is not None else None
        index = _constant(node.inputs[1]) if shape is not None else None
        if (shape is None or shape.op_type != "Shape" or shape.attributes or index is None or index.ndim != 0
                or index < 0 or node.attributes.get_int("axis", 0) != 0):
            continue
        k = int(index)
        one = ir.node("Shape", [shape.inputs[0]], attributes={"start": k, "end": k + 1})
        axes = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([0], dtype=np.int64))})
        squeezed = ir.node("Squeeze", [one.outputs[0], axes.outputs[0]])
        model.graph.insert_before(node, [one, axes, squeezed])
        ir.convenience.replace_all_uses_with(node.outputs[0], squeezed.outputs[0])


def _constant(value: ir.Value | None) -> np.ndarray | None:
    """The value of an initializer or a ``Constant`` node's output, else None."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
        return producer.attributes["value"].as_tensor().numpy()
    return None


def _small_constant_of_shape(node: ir.Node) -> bool | None:
    """Fold a ``ConstantOfShape`` of at most ``SMALL_CONSTANT`` elements (the optimizer keeps them all, so that
    no large tensor is written into the file); the optimizer's own rule for every other node."""
    if node.op_type != "ConstantOfShape":
        return None
    shape = _constant(node.inputs[0])
    return shape is not None and int(np.prod(shape)) <= SMALL_CONSTANT
