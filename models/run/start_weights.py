"""What a run of models.train starts from (``start_from``, in its set-up, before the data is scanned): a network a
library names checked (``check_trainable``), and with ``--weights`` the weights of every layer of it but those its
class count sizes (the head, and any auxiliary head: ``class_sized``), read from a state dict, an export (its folder
or its state dict) or another run's checkpoint, and the normalisation they were trained with where the file says it;
each file that cannot be that refused in one line saying what to give (ValueError)."""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from models.architectures import build_model, class_sized, meta_state_dict, same_arch
from models.export.brought import aligned, is_checkpoint, load_saved, state_dict_in
from models.export.checks import weights_mismatch
from models.export.manifest import MANIFEST_NAME, EvalPreset, Manifest, read_manifest

log = logging.getLogger("models.train")

def start_from(args: argparse.Namespace) -> None:
    """The network checked (a timm or torchvision name that library has), and ``--weights`` read and checked against
    it, kept for the model's build (``args._start_body``: models/run/optim.py), with the normalisation it was trained
    with where its file says it and --mean/--std do not, before the data is scanned; a resumed run starts from its
    checkpoint's weights instead. ValueError for what cannot be trained."""
    given = getattr(args, "_given", frozenset())
    if args.resume is not None and "weights" in given:
        raise ValueError("--weights starts a run, --resume goes on from its checkpoint's weights: leave one out")
    if args.pretrained and args.weights is not None:
        if args.resume is not None and "pretrained" in given:
            raise ValueError(f"{args.resume} started from --weights {args.weights}, not the packaged weights: leave "
                             "--pretrained out")
        raise ValueError("--pretrained starts from the packaged ImageNet weights, --weights from yours: leave one out")
    if args.pretrained and (args.mean is not None or args.std is not None) and args.resume is None:
        raise ValueError("--pretrained's weights were trained with their own normalisation: leave --mean and --std "
                         "out (or start from a file of them with --weights)")
    if ":" in args.arch:  # a library's model, built by its name: one it lacks, or one answering more than logits
        check_trainable(args.arch, args.crop_size or 224)  # in training, refused now, not after the data is scanned
    if args.weights is None or args.resume is not None:
        return
    start = read_start_weights(args.weights, args.arch)
    args._start_body = start.body
    taken = []
    for name in ("mean", "std"):
        if getattr(args, name) is None and start.preset is not None:
            setattr(args, name, list(getattr(start.preset, name)))
            taken.append(f"--{name} {' '.join(f'{value:g}' for value in getattr(start.preset, name))}")
    log.info("starting from %s's weights of %s, with a new head for this data's classes%s", args.weights, args.arch,
             f" and their normalisation ({', '.join(taken)})" if taken else "")


def check_trainable(arch: str, crop_size: int) -> None:
    """ValueError unless timm or torchvision has ``arch`` and its training forward pass answers one row of logits an
    image (GoogLeNet's and Inception's answer their auxiliary heads' beside), run on the meta device (shapes alone:
    nothing allocated; a model whose steps the meta device cannot run is taken as it is)."""
    with torch.device("meta"):
        model = build_model(arch, 2).train()
        try:
            answer = model(torch.empty(2, 3, crop_size, crop_size))
        except Exception:  # noqa: BLE001 - a step meta tensors cannot run (data-dependent): training will tell
            return
    if not isinstance(answer, torch.Tensor):
        raise ValueError(f"{arch} answers {type(answer).__name__} while it trains (its auxiliary heads' logits "
                         "beside its own), not one row of logits an image: models.train trains models that answer "
                         "their logits alone")


@dataclass
class StartWeights:
    """The body a run starts from (by name) and the normalisation its source was trained with (None: not said)."""

    body: dict[str, torch.Tensor]
    preset: EvalPreset | None


def read_start_weights(path: Path, arch: str) -> StartWeights:
    """``--weights path`` for a run of ``arch``: a state dict (``state_dict_in``'s forms), an export's folder or
    its state dict (its manifest's normalisation), or a models.train checkpoint of ``arch`` (its run's)."""
    if path.is_dir():
        path = _state_dict_of_export(path)
    if not path.is_file():
        raise ValueError(f"--weights {path}: no such file")
    saved = load_saved(path, for_training=True)  # (read once: a checkpoint, or a state dict in its forms)
    if is_checkpoint(saved) and isinstance(saved["model"], dict):
        checkpoint = saved
        if not same_arch(checkpoint["arch"], arch):
            raise ValueError(f"{path} is a models.train checkpoint of {checkpoint['arch']}: give --arch "
                             f"{checkpoint['arch']}")
        preset = checkpoint.get("preset")
        return StartWeights(body_of(checkpoint["model"], arch, path),
                            EvalPreset(**preset) if isinstance(preset, dict) else None)
    weights = state_dict_in(saved, path)
    manifest = _manifest_beside(path)
    if manifest is not None and not same_arch(manifest.arch, arch):
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
    expected = {key: value for key, value in meta_state_dict(arch, 2).items() if key not in sized}
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
