"""Weights on disk -> a verified module: manifest, checksum, strict load, output shape; device and dtype choice."""
from __future__ import annotations

import logging
from pathlib import Path

import pydantic
import torch
import torch.nn as nn

from app.config import dtype_fits_device
from models.export.compile import DTYPES
from models.export.manifest import Manifest, WeightsFormat, read_manifest, sha256_of
from models.architectures import build_model
from models.export.torchscript import quiet_jit

log = logging.getLogger(__name__)



class ModelLoadError(RuntimeError):
    """The weights directory cannot be served; the message says why and what to do."""


def resolve_device(name: str) -> torch.device:
    """auto -> cuda when available else cpu; an explicit cuda device must exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {name!r} was asked for but CUDA is not available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ModelLoadError(f"device {name!r} does not exist ({torch.cuda.device_count()} CUDA devices)")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The compute dtype, checked against the device it will run on (``auto`` resolved)."""
    problem = dtype_fits_device(name, device.type)
    if problem:
        raise ModelLoadError(problem)
    return DTYPES[name]


def read_checked_manifest(weights_dir: Path) -> Manifest:
    """The directory's manifest, or ModelLoadError saying how to make one."""
    try:
        return read_manifest(weights_dir)
    except FileNotFoundError as exc:
        raise ModelLoadError(f"no manifest.json in {weights_dir}: run `make weights` "
                             f"(python -m models.export --default --out {weights_dir})") from exc
    except (ValueError, pydantic.ValidationError) as exc:
        raise ModelLoadError(f"{weights_dir}/manifest.json is invalid: {exc}") from exc


def checked_file(weights_dir: Path, manifest: Manifest, fmt: WeightsFormat) -> Path:
    """The weights file of ``fmt``, present and with the manifest's sha256."""
    entry = manifest.files.get(fmt)
    if entry is None:
        raise ModelLoadError(f"the manifest in {weights_dir} lists no {fmt} file (has: {', '.join(manifest.files)})")
    path = weights_dir / entry.path
    if not path.is_file():
        raise ModelLoadError(f"weights file {path} is missing")
    actual = sha256_of(path)
    if actual != entry.sha256:
        raise ModelLoadError(f"weights file {path} has sha256 {actual}, the manifest says {entry.sha256}: "
                             "the file is corrupt or belongs to another export")
    return path


def load_module(path: Path, manifest: Manifest, fmt: WeightsFormat) -> nn.Module:
    """The module in ``path`` on the CPU in eval mode; state dicts are loaded strictly into the manifest's arch."""
    try:
        if fmt == "torchscript":
            with quiet_jit():
                return torch.jit.load(str(path), map_location="cpu")
        model = build_model(manifest.arch, manifest.num_classes)
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True), strict=True)
        # eval() before any forward: a training-mode forward would overwrite the BatchNorm running statistics.
        return model.eval()
    except Exception as exc:  # noqa: BLE001 - unpickling, shape and key errors all mean "cannot serve this"
        raise ModelLoadError(f"cannot load {fmt} weights from {path}: {exc}") from exc


def check_output_shape(model: nn.Module, manifest: Manifest, device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.float32) -> None:
    """Raise ModelLoadError unless the model gives one column per label."""
    with torch.inference_mode():
        out = model(torch.zeros(1, *manifest.preprocess.input_shape, device=device, dtype=dtype))
    if out.ndim != 2 or out.shape[1] != manifest.num_classes:
        raise ModelLoadError(f"model outputs shape {tuple(out.shape)} but the manifest has "
                             f"{manifest.num_classes} labels")


def optimize_for_cpu(model: nn.Module, manifest: Manifest) -> nn.Module:
    """Freeze a TorchScript module and apply optimize_for_inference; eager modules are returned unchanged."""
    if not isinstance(model, torch.jit.ScriptModule):
        return model
    with quiet_jit(), torch.inference_mode():
        optimized = torch.jit.optimize_for_inference(torch.jit.freeze(model.eval()))
        optimized(torch.zeros(1, *manifest.preprocess.input_shape))  # the first call runs the graph passes
    return optimized
