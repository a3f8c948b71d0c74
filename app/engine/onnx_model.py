"""Serving an export's ONNX file (models/export/onnx.py) with ONNX Runtime on the CPU: when, and loading it.

``WEIGHTS_FORMAT=onnx`` serves it or refuses to start saying why (no file in the manifest, a GPU server, a dtype
other than float32). ``auto`` serves it where ``FASTEST_ON`` names it for the device type (the CPU) and its answers
agreed with the float32 model at export; otherwise it says why in one log line and the next choice follows.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from app.engine.packages import FASTEST_ON
from app.engine.weights import ModelLoadError
from models.export.manifest import MIN_TOP1_AGREEMENT, Manifest, OnnxFile, sha256_of
from models.export.onnx_runtime import run_session, session

log = logging.getLogger(__name__)


class OnnxModel(nn.Module):
    """An ONNX Runtime session as a module: the predictor calls it like any other (it holds no parameters)."""

    def __init__(self, onnx_session: Any, onnx: OnnxFile) -> None:
        super().__init__()
        self.session = onnx_session
        self.onnx = onnx

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return run_session(self.session, batch)


def why_not_onnx(manifest: Manifest, device: torch.device, dtype: str) -> str | None:
    """Why the export's ONNX file cannot serve here, or None when it can."""
    if manifest.onnx is None:
        return "the manifest lists no ONNX file (python -m models.export --packages onnx writes one)"
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
    if not why and agreement is not None and agreement.top1 < MIN_TOP1_AGREEMENT:
        why = f"its top-1 agreed with float32 on {100 * agreement.top1:.1f}% of {agreement.photos} photos"
    if why:
        log.info("not serving ONNX: %s", why)
        return None
    return manifest.onnx


def load_onnx(weights_dir: Path, onnx: OnnxFile, threads: int) -> OnnxModel:
    """The ONNX file, its sha256 checked, in a session with ``threads`` intra-op threads; ModelLoadError if it
    cannot be."""
    path = weights_dir / onnx.path
    if not path.is_file():
        raise ModelLoadError(f"ONNX file {path} is missing")
    actual = sha256_of(path)
    if actual != onnx.sha256:
        raise ModelLoadError(f"ONNX file {path} has sha256 {actual}, the manifest says {onnx.sha256}")
    try:
        return OnnxModel(session(path, threads), onnx)
    except Exception as exc:  # noqa: BLE001 - a file ONNX Runtime cannot load means "cannot serve this"
        raise ModelLoadError(f"cannot load ONNX file {path}: {exc}") from exc
