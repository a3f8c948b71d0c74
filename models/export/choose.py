"""Which of an export's artefacts serves here: the ONNX file, an AOTInductor package, or a weights file.

``WEIGHTS_FORMAT=onnx`` serves the export's ONNX file (models/export/onnx.py) under ONNX Runtime, or refuses to start
saying why (no file in the manifest, a GPU server, a dtype other than float32). A package is of one of two kinds:
``aoti`` (float, compiled from the model as it is) or ``int8`` (PT2E-quantized for the CPU, with its top-1 agreement
with float32 on real photos measured at export); ``WEIGHTS_FORMAT=aoti`` or ``int8`` serves a package of that kind
compiled for this device type, dtype and torch version, whose batch range covers ``MAX_BATCH_SIZE``, or refuses to
start saying why none fits. ``auto`` serves what was measured fastest end to end on this device type (``FASTEST_ON``)
when it may (ONNX and int8 also need ``MIN_TOP1_AGREEMENT``; ONNX its probabilities within float32's rounding
too), and otherwise the manifest's default format (TorchScript), saying why in one log line.
"""
from __future__ import annotations

import logging

import torch

from models.commands import module_command
from models.export.checks import ModelLoadError
from models.export.manifest import (
    MAX_ONNX_PROBABILITY_DIFFERENCE,
    MIN_EMBEDDING_COSINE,
    MIN_TOP1_AGREEMENT,
    Agreement,
    CompiledPackage,
    Manifest,
    OnnxFile,
)

log = logging.getLogger(__name__)

KINDS = {"aoti": "AOTInductor", "int8": "int8 AOTInductor"}

# Device type -> what `python -m bench.serving.formats` measured fastest end to end there, among a package kind
# (aoti, int8) and ``onnx`` (the export's ONNX file under ONNX Runtime). On the 2-core CPU: ONNX Runtime, about 2x
# frozen TorchScript's forward pass and agreeing with float32 on every photo; the int8 package agreed on 75% only and
# the float package was no faster than TorchScript at the server's small batches
# (bench/results/2026-11-24-formats-cpu-2cpu-vm.md). On CUDA nothing is measured yet.
FASTEST_ON: dict[str, str] = {"cpu": "onnx"}


def why_not_onnx(manifest: Manifest, device: torch.device, dtype: str) -> str | None:
    """Why the export's ONNX file cannot serve here, or None when it can."""
    if manifest.onnx is None:
        if manifest.torchscript_alone:
            return "the manifest lists no ONNX file (a TorchScript file exported alone: its state dict's export has one)"
        return f"the manifest lists no ONNX file ({module_command('models.export', ['--packages', 'onnx'])} writes one)"
    if device.type != "cpu":
        return f"ONNX Runtime serves on the CPU here, this server runs on {device.type}"
    if dtype != "float32":
        return f"the ONNX file computes in float32, this server computes in {dtype}"
    return None


def choose_onnx(manifest: Manifest, setting: str, device: torch.device, dtype: str) -> OnnxFile | None:
    """The ONNX file to serve under ``setting`` (onnx, auto; others: None); ModelLoadError for ``onnx`` when it
    cannot."""
    if setting not in ("onnx", "auto") or (setting == "auto" and FASTEST_ON.get(device.type) != "onnx"):
        return None
    why = why_not_onnx(manifest, device, dtype)
    if setting == "onnx" and why:
        raise ModelLoadError(f"WEIGHTS_FORMAT=onnx but {why}")
    agreement = manifest.onnx.agreement if manifest.onnx else None
    if not why and agreement is not None:
        why = onnx_short_of(agreement)
    if why and setting == "onnx":  # asked for by name: no start, saying why (not a search for a file named onnx)
        raise ModelLoadError(f"WEIGHTS_FORMAT=onnx but {why}")
    if why:
        log.info("not serving ONNX: %s", why)
        return None
    return manifest.onnx


def kind_of(package: CompiledPackage) -> str:
    """``int8`` for a quantized package, ``aoti`` for a float one (the WEIGHTS_FORMAT that asks for it)."""
    return "int8" if package.quantization == "int8" else "aoti"


def why_not(package: CompiledPackage, device: torch.device, dtype: str, max_batch_size: int) -> str | None:
    """Why ``package`` cannot serve here, or None when it can."""
    if package.device != device.type:
        return f"compiled for {package.device}, this server runs on {device.type}"
    if package.dtype != dtype:
        return f"compiled for {package.dtype}, this server computes in {dtype}"
    if package.torch_version != torch.__version__:
        return f"compiled by torch {package.torch_version}, this server has torch {torch.__version__}"
    if package.max_batch_size < max_batch_size:
        return (f"compiled for batches up to {package.max_batch_size}, this server batches up to {max_batch_size} "
                "(MAX_BATCH_SIZE, or its automatic value for the device)")
    return None


def disagrees(package: CompiledPackage) -> str | None:
    """Why ``auto`` may not serve a quantized ``package`` for its answers, or None when they agree enough."""
    if package.quantization is None:
        return None
    if package.agreement is None:
        return "its agreement with float32 was not measured at export"
    return short_of(package.agreement)


def onnx_short_of(agreement: Agreement) -> str | None:
    """How an ONNX file's ``agreement`` falls short of what is served: ``short_of``, and its probabilities within
    ``MAX_ONNX_PROBABILITY_DIFFERENCE`` of float32's (it computes in float32: top-1 alone would pass answers at
    another scale)."""
    if why := short_of(agreement):
        return why
    if agreement.max_probability_difference > MAX_ONNX_PROBABILITY_DIFFERENCE:
        return (f"its probabilities differ from the model's by up to {agreement.max_probability_difference:.1e}, "
                f"beyond {MAX_ONNX_PROBABILITY_DIFFERENCE:g}")
    return None


def short_of(agreement: Agreement) -> str | None:
    """How ``agreement`` falls short of what ``auto`` serves (top-1, and the embeddings' cosine when measured),
    or None."""
    if agreement.top1 < MIN_TOP1_AGREEMENT:
        return (f"its top-1 agrees with float32 on {100 * agreement.top1:.1f}% of {agreement.photos} photos, below "
                f"{100 * MIN_TOP1_AGREEMENT:.0f}%")
    cosine = agreement.min_embedding_cosine
    if cosine is not None and cosine < MIN_EMBEDDING_COSINE:
        return f"its embeddings' cosine with float32's fell to {cosine:.3f}, below {MIN_EMBEDDING_COSINE}"
    return None


def fitting(manifest: Manifest, kind: str, device: torch.device, dtype: str,
            max_batch_size: int) -> tuple[CompiledPackage | None, str]:
    """The first package of ``kind`` that fits, or None and why none does."""
    reasons = []
    for package in (p for p in manifest.packages if kind_of(p) == kind):
        reason = why_not(package, device, dtype, max_batch_size)
        if reason is None:
            return package, ""
        reasons.append(f"{package.path}: {reason}")
    option = "cpu-int8" if kind == "int8" else device.type
    dtype_option = ["--package-dtype", dtype] if option == "cuda" and dtype != "float32" else []
    command = module_command("models.export", ["--checkpoint", "runs/NAME/best.pt", "--out", "runs/NAME/export",
                                               "--packages", f"onnx,{option}", *dtype_option, "--force"])
    return None, "; ".join(reasons) or f"the manifest lists none (export it again with one: {command})"


def choose_package(manifest: Manifest, setting: str, device: torch.device, dtype: str,
                   max_batch_size: int) -> CompiledPackage | None:
    """The package to serve under ``setting`` (auto, aoti, int8; others: None); ModelLoadError for aoti or int8
    when none fits."""
    if setting in KINDS:
        package, why = fitting(manifest, setting, device, dtype, max_batch_size)
        if package is None:
            raise ModelLoadError(f"WEIGHTS_FORMAT={setting} but no {KINDS[setting]} package fits: {why}")
        return package
    if setting != "auto":
        return None
    kind = FASTEST_ON.get(device.type)
    if kind == "onnx":  # not a package: choose_onnx chose before, or said why it did not
        return None
    if kind is None:
        log.info("serving TorchScript: no AOTInductor package (float or int8) was measured faster on %s "
                 "(docs/performance.md); WEIGHTS_FORMAT=aoti or int8 serves a fitting one", device.type)
        return None
    package, why = fitting(manifest, kind, device, dtype, max_batch_size)
    why = why if package is None else (disagrees(package) or "")
    if why:
        log.info("serving TorchScript: no %s package fits (%s)", KINDS[kind], why)
        return None
    return package
