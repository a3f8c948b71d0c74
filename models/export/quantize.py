"""int8 AOTInductor packages for the CPU: PT2E post-training quantization, calibrated on real photos.

``torch.export`` traces the eval-mode model; torchao's ``prepare_pt2e`` with the ``X86InductorQuantizer`` (its
default config: int8 activations per tensor, int8 weights per channel, static) inserts observers; the calibration
photos (models/export/agreement.py: 48 views of 8 scikit-image photos, through the model's own eval transform) run
through it; ``convert_pt2e`` writes the quantize/dequantize pairs; the graph is exported again with the dynamic batch
dimension and ``aoti_compile_and_package`` (freezing on, so Inductor's x86 passes fuse the pairs into oneDNN int8
convolutions) writes ``model.cpu-int8.pt2``. Its answers are then compared with the float32 model's on the agreement
photos (198 views of 9 other photos) and the figures go into the manifest; a package below ``MIN_TOP1_AGREEMENT`` is
still written, but the server's ``auto`` never serves it. A run's checkpoint whose images are at hand is calibrated
on those it trained on and compared on those it held out instead (agreement.run_images).

torchao is needed here only: the package runs on torch alone (its int8 kernels are torch's oneDNN ops).
"""
from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.nn as nn

from models.commands import python_command
from models.export.agreement import RunImages, agreement, agreement_batch, answers, calibration_batch
from models.export.manifest import MIN_TOP1_AGREEMENT, CompiledPackage, sha256_of
from models.presets import EvalPreset

log = logging.getLogger(__name__)

INT8_PACKAGE_NAME = "model.cpu-int8.pt2"
TORCHAO_HINT = (f"int8 packages are quantized with torchao: {python_command()} -m pip install torchao (0.18.0 was "
                "tested with torch 2.14)")


def _torchao() -> tuple[ModuleType, ModuleType]:
    """torchao's PT2E entry points and its x86 quantizer (importing the quantizer registers Inductor's int8 passes)."""
    try:
        from torchao.quantization.pt2e import quantize_pt2e
        from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer
    except ImportError as exc:
        raise ValueError(f"{TORCHAO_HINT} ({exc})") from exc
    return quantize_pt2e, x86_inductor_quantizer


def quantized(model: nn.Module, preset: EvalPreset, max_batch_size: int,
              run: RunImages | None = None) -> torch.export.ExportedProgram:
    """``model`` quantized to int8 (calibrated on the calibration photos, or on its ``run``'s images), exported with
    a dynamic batch."""
    pt2e, x86 = _torchao()
    module = copy.deepcopy(model).eval().cpu()
    images = calibration_batch(preset, run)
    example = (images[:2],)
    dynamic = ({0: torch.export.Dim("batch", min=1, max=max_batch_size)},)
    traced = torch.export.export(module, example, dynamic_shapes=dynamic).module()
    quantizer = x86.X86InductorQuantizer().set_global(x86.get_default_x86_inductor_quantization_config())
    prepared = pt2e.prepare_pt2e(traced, quantizer)  # type: ignore[arg-type]
    with torch.no_grad():
        for chunk in images.split(8):
            prepared(chunk)
    converted = pt2e.convert_pt2e(prepared)
    with torch.no_grad():
        return torch.export.export(converted, example, dynamic_shapes=dynamic)


def compile_int8_package(model: nn.Module, preset: EvalPreset, out_dir: Path, max_batch_size: int,
                         run: RunImages | None = None) -> CompiledPackage:
    """Quantize, compile and check ``model`` into ``out_dir/model.cpu-int8.pt2``, on the photos or on its ``run``'s
    images (agreement.run_images); ValueError without torchao."""
    started = time.perf_counter()
    program = quantized(model, preset, max_batch_size, run)
    path = out_dir / INT8_PACKAGE_NAME
    with torch.no_grad(), torch._inductor.config.patch(freezing=True):
        torch._inductor.aoti_compile_and_package(program, package_path=str(path))
    compile_s = time.perf_counter() - started
    runner = torch._inductor.aoti_load_package(str(path))
    photos = agreement_batch(preset, run)
    reference = model.eval().cpu()
    found = agreement(answers(reference, photos), answers(runner, photos, min(8, max_batch_size)))
    checked_on = run or "scikit-image photos (no run's images at hand)"
    log.info("compiled %s in %.0fs: top-1 agrees with float32 on %.2f%% of %d images (%s), probabilities within "
             "%.3g", path.name, compile_s, 100 * found.top1, found.photos, checked_on,
             found.max_probability_difference)
    if found.top1 < MIN_TOP1_AGREEMENT:
        log.warning("%s agrees with float32 on %.2f%% of images (< %.0f%%): written, but WEIGHTS_FORMAT=auto will "
                    "not serve it", path.name, 100 * found.top1, 100 * MIN_TOP1_AGREEMENT)
    return CompiledPackage(path=path.name, sha256=sha256_of(path), device="cpu", dtype="float32",
                           torch_version=torch.__version__, max_batch_size=max_batch_size,
                           compile_s=round(compile_s, 1), quantization="int8", agreement=found)
