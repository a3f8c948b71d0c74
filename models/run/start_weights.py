"""What a run given ``--weights`` starts from: the weights of every layer of its network but those its class count
sizes (the head, and any auxiliary head: ``class_sized``), read from a state dict, an export (its folder or its
state dict) or another run's checkpoint, and the normalisation they were trained with where the file says it; each
file that cannot be that refused in one line saying what to give (ValueError)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from models.architectures import build_model, class_sized
from models.export.brought import aligned, read_state_dict
from models.export.checks import weights_mismatch
from models.export.manifest import MANIFEST_NAME, EvalPreset, Manifest, read_manifest

log = logging.getLogger("models.train")

CHECKPOINT_KEYS = frozenset({"model", "args", "arch", "classes"})  # what marks a models.train checkpoint


@dataclass
class StartWeights:
    """The body a run starts from (by name) and the normalisation its source was trained with (None: not said)."""

    body: dict[str, torch.Tensor]
    preset: EvalPreset | None


def read_start_weights(path: Path, arch: str) -> StartWeights:
    """``--weights path`` for a run of ``arch``: a state dict (``read_state_dict``'s forms), an export's folder or
    its state dict (its manifest's normalisation), or a models.train checkpoint of ``arch`` (its run's)."""
    if path.is_dir():
        path = _state_dict_of_export(path)
    if not path.is_file():
        raise ValueError(f"--weights {path}: no such file")
    checkpoint = _checkpoint(path)
    if checkpoint is not None:
        if checkpoint["arch"] != arch:
            raise ValueError(f"{path} is a models.train checkpoint of {checkpoint['arch']}: give --arch "
                             f"{checkpoint['arch']}")
        preset = checkpoint.get("preset")
        return StartWeights(body_of(checkpoint["model"], arch, path),
                            EvalPreset(**preset) if isinstance(preset, dict) else None)
    weights = read_state_dict(path, for_training=True)
    manifest = _manifest_beside(path)
    if manifest is not None and manifest.arch != arch:
        raise ValueError(f"{path} is the state dict of an export of {manifest.arch}: give --arch {manifest.arch}")
    return StartWeights(body_of(weights, arch, path), None if manifest is None else manifest.preprocess)


def _state_dict_of_export(folder: Path) -> Path:
    """The state dict of the export in ``folder``; ValueError when it is no export, or one without a state dict."""
    try:
        manifest = read_manifest(folder)
    except (OSError, ValueError):
        raise ValueError(f"--weights {folder} is a folder: give a weights file (an export's folder, with its "
                         f"{MANIFEST_NAME}, is read for its state dict)") from None
    weights = manifest.files.get("state_dict")
    if weights is None:
        raise ValueError(f"--weights {folder} is an export without a state dict (a TorchScript file exported "
                         f"alone): give the weights it was made from")
    return folder / weights.path


def _checkpoint(path: Path) -> dict[str, Any] | None:
    """The models.train checkpoint in ``path``, or None when it holds something else (``read_state_dict`` says
    what)."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - not torch's zip format, or not safely readable: read_state_dict's to say
        return None
    if isinstance(saved, dict) and CHECKPOINT_KEYS <= saved.keys() and isinstance(saved["model"], dict):
        return saved
    return None


def _manifest_beside(path: Path) -> Manifest | None:
    """The manifest of the export whose state dict ``path`` is, or None."""
    try:
        manifest = read_manifest(path.parent)
    except (OSError, ValueError):
        return None
    state_dict = manifest.files.get("state_dict")
    return manifest if state_dict is not None and state_dict.path == path.name else None


def body_of(weights: dict[str, torch.Tensor], arch: str, path: Path) -> dict[str, torch.Tensor]:
    """``weights`` but those sized by the class count: ValueError in one line unless the rest are every other
    weight of ``arch``, of its shapes (BatchNorm's step counters may be missing, as torch's own load takes them)."""
    sized = class_sized(arch)
    with torch.device("meta"):  # (its names and shapes alone: nothing allocated, nothing initialised)
        expected = {key: value for key, value in build_model(arch, 2).state_dict().items() if key not in sized}
    body = {key: value for key, value in aligned(weights, expected).items() if key not in sized}
    needed = {key for key in expected if not key.endswith("num_batches_tracked")}
    if not needed <= body.keys() <= expected.keys() or any(body[key].shape != expected[key].shape for key in body):
        raise ValueError(weights_mismatch(expected, body, f"{path} holds no weights of {arch}, its head aside "
                                                          "(--arch names the network they are of)"))
    return body


def with_body(model: nn.Module, body: dict[str, torch.Tensor]) -> nn.Module:
    """``model`` holding ``body`` (``read_start_weights``'): every layer but those its class count sizes, which
    keep their own (new) weights."""
    model.load_state_dict({**model.state_dict(), **body}, strict=True)
    return model
