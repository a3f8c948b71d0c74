"""Weights on disk -> a verified module on its device, as the server loads it: the artefact choose.py picks (the
ONNX file under ONNX Runtime, an AOTInductor package, or a weights file: TorchScript frozen for the CPU, a state dict
loaded strictly), with the checks of checks.py.

Shared by the server (app/engine/loaded/predictor.py) and ``python -m models.predict``, so the batch scorer runs exactly
the artefact the server would: the same format choice, checks, placement, dtype and ONNX Runtime threads.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
import torch.nn as nn

from models.architectures import WithEmbedding
from models.export.checks import (
    CHECK_BATCH_SIZE,
    ModelLoadError,
    check_output_shape,
    checked_file,
    checked_path,
    fit_weights,
    is_torchscript,
    one_line,
    read_checked_manifest,
    resolve_device,
    resolve_dtype,
)
from models.export.choose import choose_onnx, choose_package, kind_of
from models.export.manifest import CompiledPackage, Manifest, OnnxFile, WeightsFormat
from models.export.onnx_runtime import run_session, session
from models.export.torchscript import quiet_jit

log = logging.getLogger(__name__)
Runner = TypeVar("Runner")


def load_module(path: Path, manifest: Manifest, fmt: WeightsFormat) -> nn.Module:
    """The module in ``path`` on the CPU in eval mode; state dicts are loaded strictly into the manifest's arch, which
    answers its embedding beside its logits when the manifest has one (as the export's other formats do)."""
    try:
        if fmt == "torchscript":
            return load_torchscript(path)
        from models.architectures import build_model  # timm and torchvision: only state dicts need them

        model = build_model(manifest.arch, manifest.num_classes)
        fit_weights(model, torch.load(path, map_location="cpu", weights_only=True),
                    f"they are not those of {manifest.arch} with {manifest.num_classes} classes")
        # eval() before any forward: a training-mode forward would overwrite the BatchNorm running statistics.
        if manifest.embedding is not None:
            return WithEmbedding(model.eval(), manifest.embedding.layer).eval()
        return model.eval()
    except ValueError as exc:  # ours: one line saying what to do
        raise ModelLoadError(f"cannot load {fmt} weights from {path}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - unpickling, shape and key errors all mean "cannot serve this"
        # (torch's run to paragraphs, with terminal colour codes: one line of them)
        raise ModelLoadError(f"cannot load {fmt} weights from {path}: {one_line(exc, 600)}") from exc


def load_torchscript(path: Path) -> torch.jit.ScriptModule:
    """The TorchScript module in ``path`` on the CPU; ValueError saying so when the file is none (a state dict, a
    whole pickled model: torch's message calls the file corrupted)."""
    try:
        with quiet_jit():
            return torch.jit.load(str(path), map_location="cpu")
    except RuntimeError:
        if is_torchscript(path):  # a TorchScript file torch cannot load: its own error says why
            raise
    raise ValueError(f"{path} is no TorchScript file (torch.jit.script or torch.jit.trace, then torch.jit.save, "
                     f"writes one); a state dict or a pickled model is served from its architecture's code: "
                     f"python -m models.export --state-dict FILE --arch ARCH")


def optimize_for_cpu(model: nn.Module, manifest: Manifest) -> nn.Module:
    """Freeze a TorchScript module and apply optimize_for_inference; eager modules are returned unchanged."""
    if not isinstance(model, torch.jit.ScriptModule):
        return model
    with quiet_jit(), torch.inference_mode():
        optimized = torch.jit.optimize_for_inference(torch.jit.freeze(model.eval()))
        optimized(torch.zeros(1, *manifest.preprocess.input_shape))  # the first call runs the graph passes
    return optimized


class PackagedModel(nn.Module):
    """A loaded package as a module: the predictor calls it like any other (it holds no parameters of its own)."""

    def __init__(self, runner: object, package: CompiledPackage) -> None:
        super().__init__()
        self.runner = runner
        self.package = package

    def forward(self, batch: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        outputs = self.runner(batch)  # type: ignore[operator]
        return tuple(outputs) if isinstance(outputs, list) else outputs


class OnnxModel(nn.Module):
    """An ONNX Runtime session as a module: the predictor calls it like any other (it holds no parameters)."""

    def __init__(self, onnx_session: Any, onnx: OnnxFile) -> None:
        super().__init__()
        self.session = onnx_session
        self.onnx = onnx

    def forward(self, batch: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        return run_session(self.session, batch)


def _opened(path: Path, sha256: str, what: str, open_: Callable[[Path], Runner]) -> Runner:
    """``path`` checked against the manifest's ``sha256`` and opened; ModelLoadError if it cannot be."""
    checked_path(path, sha256, what)
    try:
        return open_(path)
    except Exception as exc:  # noqa: BLE001 - a file its runtime cannot load means "cannot serve this"
        raise ModelLoadError(f"cannot load {what} {path}: {exc}") from exc


def load_package(weights_dir: Path, package: CompiledPackage, target: torch.device) -> PackagedModel:
    """The package, its sha256 checked, loaded onto ``target`` (a CUDA package onto its GPU: cuda:1 for an engine or
    a rank placed there, the thread's current GPU for ``cuda`` with no index); ModelLoadError if it cannot be."""
    # Without an index AOTInductor puts the weights and kernels on the loading thread's current GPU, whatever GPU the
    # inputs will be on.
    device_index = target.index if target.type == "cuda" and target.index is not None else -1
    runner = _opened(weights_dir / package.path, package.sha256, "package",
                     lambda path: torch._inductor.aoti_load_package(str(path), device_index=device_index))
    return PackagedModel(runner, package)


def load_onnx(weights_dir: Path, onnx: OnnxFile, threads: int) -> OnnxModel:
    """The ONNX file, its sha256 checked, in a session with ``threads`` intra-op threads; ModelLoadError if it
    cannot be."""
    return OnnxModel(_opened(weights_dir / onnx.path, onnx.sha256, "ONNX file", lambda path: session(path, threads)),
                     onnx)


def module_bytes(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of a module's parameters and buffers (floating ones counted in ``dtype`` when given)."""
    total = 0
    for tensor in model.state_dict().values():
        size = torch.empty((), dtype=dtype).element_size() if dtype and tensor.is_floating_point() else None
        total += tensor.numel() * (size or tensor.element_size())
    return total


@dataclass(frozen=True)
class LoadedModel:
    """A verified model in eval mode on the CPU (a package: on its device), and how it is to be run."""

    module: nn.Module
    manifest: Manifest
    device: torch.device
    dtype: torch.dtype
    weights_format: str  # onnx, aoti, int8, torchscript or state_dict
    weights_bytes: int  # what the weights take in memory (a frozen module holds them as constants: measured before)


def load_model(weights_dir: Path, *, weights_format: str = "auto", device: str = "auto", dtype: str = "float32",
               jit_optimize: bool = False, max_batch_size: int = 1, threads: int = 1) -> LoadedModel:
    """Load and verify (manifest, checksum, keys, output shape) or raise ModelLoadError. ``auto`` serves what was
    measured fastest on the device type (choose.py ``FASTEST_ON``): the ONNX file under ONNX Runtime with ``threads``
    intra-op threads, or a fitting AOTInductor package (float or int8); else the manifest's default format.
    ``jit_optimize`` freezes TorchScript for the CPU in float32."""
    manifest = read_checked_manifest(weights_dir)
    target = resolve_device(device)
    compute_dtype = resolve_dtype(dtype, target)
    onnx = choose_onnx(manifest, weights_format, target, dtype)
    if onnx is not None:
        return _onnx_model(weights_dir, manifest, onnx, threads, compute_dtype)
    package = choose_package(manifest, weights_format, target, dtype, max_batch_size)
    if package is not None:
        return _packaged_model(weights_dir, manifest, package, target, compute_dtype)
    fmt: WeightsFormat = (manifest.default_format if weights_format == "auto"  # type: ignore[assignment]
                          else weights_format)
    return _file_model(weights_dir, manifest, fmt, target, compute_dtype, jit_optimize)


def _onnx_model(weights_dir: Path, manifest: Manifest, onnx: OnnxFile, threads: int,
                compute_dtype: torch.dtype) -> LoadedModel:
    runtime = load_onnx(weights_dir, onnx, threads)
    check_output_shape(runtime, manifest)
    log.info("loaded %s %s (onnx) from %s onto cpu, under ONNX Runtime", manifest.name, manifest.version,
             weights_dir / onnx.path)  # the whole path, as the other formats' lines say it (before: the name alone)
    return LoadedModel(runtime, manifest, torch.device("cpu"), compute_dtype, "onnx",
                       (weights_dir / onnx.path).stat().st_size)


def _packaged_model(weights_dir: Path, manifest: Manifest, package: CompiledPackage, target: torch.device,
                    compute_dtype: torch.dtype) -> LoadedModel:
    model = load_package(weights_dir, package, target)
    # compiled for batches up to its max_batch_size: checked with two images when it takes them
    check_output_shape(model, manifest, target, compute_dtype, min(CHECK_BATCH_SIZE, package.max_batch_size))
    log.info("loaded %s %s (%s) from %s onto %s", manifest.name, manifest.version, kind_of(package),
             weights_dir / package.path, target)
    return LoadedModel(model, manifest, target, compute_dtype, kind_of(package),
                       (weights_dir / package.path).stat().st_size)


def _file_model(weights_dir: Path, manifest: Manifest, fmt: WeightsFormat, target: torch.device,
                compute_dtype: torch.dtype, jit_optimize: bool) -> LoadedModel:
    path = checked_file(weights_dir, manifest, fmt)
    model = load_module(path, manifest, fmt)
    check_output_shape(model, manifest)
    weights_bytes = module_bytes(model, compute_dtype)
    # Placed here, for every caller (the server's Predictor, models.predict): the weights on the device and in the
    # dtype their inputs will have (models.predict --device cuda once fed CUDA inputs to weights left on the CPU).
    model = model.eval().to(device=target, dtype=compute_dtype)
    if jit_optimize and target.type == "cpu" and compute_dtype == torch.float32:
        model = optimize_for_cpu(model, manifest)
    log.info("loaded %s %s (%s) from %s onto %s", manifest.name, manifest.version, fmt, path, target)
    return LoadedModel(model, manifest, target, compute_dtype, fmt, weights_bytes)
