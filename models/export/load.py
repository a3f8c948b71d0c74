"""Weights on disk -> a verified module on its device, as the server loads it: manifest, checksum, strict load,
output shape; device and dtype choice; an AOTInductor package where one is chosen (packages.py).

Shared by the server (app/engine/predictor.py) and ``python -m models.predict``, so the batch scorer runs exactly
the artefact the server would: the same format choice, checks, placement and dtype.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import pydantic
import torch
import torch.nn as nn

from models.export.compile import DTYPES
from models.export.manifest import CompiledPackage, Manifest, WeightsFormat, read_manifest, sha256_of
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
    if name == "float16" and device.type == "cpu":  # the rule app/config.py's dtype_fits_device checks at boot
        raise ModelLoadError("dtype float16 needs a CUDA device; use bfloat16 or float32 on cpu")
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


# Serving an AOTInductor package (models/export/compile.py): which one fits this server, and loading it.
# ``WEIGHTS_FORMAT=aoti`` serves a package compiled for this device type, dtype and torch version, whose batch range
# covers ``MAX_BATCH_SIZE``, or refuses to start saying why none fits. ``auto`` does the same only on the device
# types where packages were measured faster than TorchScript (``FASTER_ON``), and otherwise serves TorchScript,
# saying why in one log line.

# Where `python -m bench.serving.formats` measured packages faster than frozen TorchScript, end to end: nowhere yet. On
# the 2-core CPU the package ran 1.2-1.45x TorchScript's forward pass at batches of 4-8 but 0.87-0.97x at 1-2, and
# the server 1.02x at C=1 and 0.94-0.95x at C=16 (bench/results/2026-11-23-formats-cpu-2cpu-vm.md); on CUDA it is
# not measured. ``auto`` serves a package only where a device type is listed here.
FASTER_ON: frozenset[str] = frozenset()


def why_not(package: CompiledPackage, device: torch.device, dtype: str, max_batch_size: int) -> str | None:
    """Why ``package`` cannot serve here, or None when it can."""
    if package.device != device.type:
        return f"compiled for {package.device}, this server runs on {device.type}"
    if package.dtype != dtype:
        return f"compiled for {package.dtype}, this server computes in {dtype}"
    if package.torch_version != torch.__version__:
        return f"compiled by torch {package.torch_version}, this server has torch {torch.__version__}"
    if package.max_batch_size < max_batch_size:
        return f"compiled for batches up to {package.max_batch_size}, MAX_BATCH_SIZE is {max_batch_size}"
    return None


def choose_package(manifest: Manifest, setting: str, device: torch.device, dtype: str,
                   max_batch_size: int) -> CompiledPackage | None:
    """The package to serve under ``setting`` (auto, aoti; others: None), or ModelLoadError for ``aoti``."""
    if setting not in ("auto", "aoti"):
        return None
    if setting == "auto" and device.type not in FASTER_ON:
        log.info("serving TorchScript: AOTInductor packages were not faster on %s (docs/performance.md); "
                 "WEIGHTS_FORMAT=aoti serves a fitting one", device.type)
        return None
    reasons = []
    for package in manifest.packages:
        reason = why_not(package, device, dtype, max_batch_size)
        if reason is None:
            return package
        reasons.append(f"{package.path}: {reason}")
    why = "; ".join(reasons) or "the manifest lists none (python -m models.export compiles them)"
    if setting == "aoti":
        raise ModelLoadError(f"WEIGHTS_FORMAT=aoti but no AOTInductor package fits: {why}")
    log.info("serving TorchScript: no AOTInductor package fits (%s)", why)
    return None


class PackagedModel(nn.Module):
    """A loaded package as a module: the predictor calls it like any other (it holds no parameters of its own)."""

    def __init__(self, runner: object, package: CompiledPackage) -> None:
        super().__init__()
        self.runner = runner
        self.package = package

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.runner(batch)  # type: ignore[operator]


def load_package(weights_dir: Path, package: CompiledPackage) -> PackagedModel:
    """The package, its sha256 checked, loaded for its device; ModelLoadError if it cannot be."""
    path = weights_dir / package.path
    if not path.is_file():
        raise ModelLoadError(f"package {path} is missing")
    actual = sha256_of(path)
    if actual != package.sha256:
        raise ModelLoadError(f"package {path} has sha256 {actual}, the manifest says {package.sha256}")
    try:
        return PackagedModel(torch._inductor.aoti_load_package(str(path)), package)
    except Exception as exc:  # noqa: BLE001 - a package that does not load means "cannot serve this"
        raise ModelLoadError(f"cannot load package {path}: {exc}") from exc


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
    weights_format: str  # torchscript, state_dict or aoti
    weights_bytes: int  # what the weights take in memory (a frozen module holds them as constants: measured before)


def load_model(weights_dir: Path, *, weights_format: str = "auto", device: str = "auto", dtype: str = "float32",
               jit_optimize: bool = False, max_batch_size: int = 1) -> LoadedModel:
    """Load and verify (manifest, checksum, keys, output shape) or raise ModelLoadError. ``auto`` serves a
    fitting AOTInductor package where packages are faster (``FASTER_ON``), else the manifest's default format;
    ``jit_optimize`` freezes TorchScript for the CPU in float32."""
    manifest = read_checked_manifest(weights_dir)
    target = resolve_device(device)
    compute_dtype = resolve_dtype(dtype, target)
    package = choose_package(manifest, weights_format, target, dtype, max_batch_size)
    if package is not None:
        model: nn.Module = load_package(weights_dir, package)
        check_output_shape(model, manifest, target, compute_dtype)
        log.info("loaded %s %s (AOTInductor %s) onto %s", manifest.name, manifest.version, package.path, target)
        return LoadedModel(model, manifest, target, compute_dtype, "aoti", (weights_dir / package.path).stat().st_size)
    fmt: WeightsFormat = (manifest.default_format if weights_format == "auto"  # type: ignore[assignment]
                          else weights_format)
    path = checked_file(weights_dir, manifest, fmt)
    model = load_module(path, manifest, fmt)
    check_output_shape(model, manifest)
    weights_bytes = module_bytes(model, compute_dtype)
    if jit_optimize and target.type == "cpu" and dtype == "float32":
        model = optimize_for_cpu(model, manifest)
    log.info("loaded %s %s (%s) from %s onto %s", manifest.name, manifest.version, fmt, path, target)
    return LoadedModel(model, manifest, target, compute_dtype, fmt, weights_bytes)
