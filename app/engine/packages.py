"""Serving an AOTInductor package (models/export/compile.py): which one fits this server, and loading it.

``WEIGHTS_FORMAT=aoti`` serves a package compiled for this device type, dtype and torch version, whose batch range
covers ``MAX_BATCH_SIZE``, or refuses to start saying why none fits. ``auto`` does the same only on the device
types where packages were measured faster than TorchScript (``FASTER_ON``), and otherwise serves TorchScript,
saying why in one log line.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn as nn

from app.engine.weights import ModelLoadError
from models.export.manifest import CompiledPackage, Manifest, sha256_of

log = logging.getLogger(__name__)

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
