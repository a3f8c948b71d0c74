"""A model trained elsewhere, as ``python -m models.export --state-dict`` / ``--torchscript`` reads it: its weights
(a state dict of a named architecture, or a TorchScript file), its labels (a text file, one a line) and how its
pictures were prepared (EvalPreset), each refused in one line saying what to give instead; and the weights
``python -m models.train --weights`` starts a run from (every layer but the head: ``body_weights``)."""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn as nn

from models.export.checks import fit_weights, is_torchscript, one_line, weights_mismatch
from models.export.manifest import EvalPreset

# Where a saved state dict commonly sits inside what was saved: Lightning's and many scripts' {"state_dict": ...},
# a training loop's {"model": ...}
NESTED_KEYS = ("state_dict", "model", "model_state_dict")
DDP_PREFIX = "module."  # DistributedDataParallel's (and DataParallel's) wrapper names every key with it


def read_state_dict(path: Path, checkpoint_of: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors saved in ``path`` by their names: ``torch.save(model.state_dict(), path)``'s, also nested under
    one of NESTED_KEYS or named with DDP's ``module.``, and with ``checkpoint_of`` (an arch) the model of a
    models.train checkpoint of that arch; ValueError in one line for anything else (a pickled model, which torch's
    safe load refuses, a TorchScript file, a models.train checkpoint of another arch, or where --checkpoint takes
    it)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    training = checkpoint_of is not None
    if is_torchscript(path):  # (torch.load would warn, then hand it to torch.jit.load)
        raise ValueError(f"{path} is a TorchScript file: " + (
            "give its state dict (an export's model.state_dict.pt beside it; yours saved with "
            "torch.save(model.state_dict(), path))" if training else f"give it with --torchscript {path}"))
    try:
        saved: Any = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a pickled model, text: not a state dict
        why = ("a pickled object, which torch's safe load refuses" if isinstance(exc, pickle.UnpicklingError)
               else one_line(exc, 160))
        raise ValueError(f"{path} is no state dict torch can read safely ({why}): save the weights alone with "
                         f"torch.save(model.state_dict(), path) (torch.save(model) pickles the code)" + (
                             "" if training else ", or give a TorchScript file with --torchscript")) from None
    if isinstance(saved, dict) and {"model", "args", "arch", "classes"} <= saved.keys():
        if training and saved["arch"] != checkpoint_of:
            raise ValueError(f"{path} is a models.train checkpoint of {saved['arch']}: give --arch {saved['arch']}")
        if training and isinstance(saved["model"], dict):
            return saved["model"]
        raise ValueError(f"{path} is a models.train checkpoint: export it with --checkpoint {path}")
    for key in NESTED_KEYS:
        if isinstance(saved, dict) and isinstance(saved.get(key), dict) and not _tensors(saved):
            saved = saved[key]
            break
    if not isinstance(saved, dict) or not saved or not _tensors(saved):
        raise ValueError(f"{path} holds no state dict (a dict of tensors by name), but {type(saved).__name__}: save "
                         f"the weights with torch.save(model.state_dict(), path)")
    if all(key.startswith(DDP_PREFIX) for key in saved):
        saved = {key.removeprefix(DDP_PREFIX): value for key, value in saved.items()}
    return saved


def _tensors(saved: dict[Any, Any]) -> bool:
    return all(isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in saved.items())


def brought_model(path: Path, arch: str, labels: Sequence[str]) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``arch`` with one output a label, holding the weights in ``path``, and those weights; ValueError in one line
    when they are not that model's (another architecture, another class count)."""
    from models.architectures import build_model

    weights = read_state_dict(path)
    model = build_model(arch, len(labels))
    fit_weights(model, weights, f"{path} is no state dict of {arch} with {len(labels)} classes (one a label)")
    return model.eval(), weights


def body_weights(path: Path, arch: str) -> dict[str, torch.Tensor]:
    """The weights in ``path`` (``read_state_dict``'s, a models.train checkpoint's too) of every layer of ``arch``
    but its head (a new head, one output a class, is made for the data it trains on: ``with_body``); ValueError in
    one line when they are not that model's."""
    from models.architectures import build_model, head_name

    weights = read_state_dict(path, checkpoint_of=arch)
    with torch.device("meta"):  # (its names and shapes alone: nothing allocated, nothing initialised)
        model = build_model(arch, 2)
    head = f"{head_name(model)}."
    body = {key: value for key, value in weights.items() if not key.startswith(head)}
    expected = {key: value for key, value in model.state_dict().items() if not key.startswith(head)}
    if body.keys() != expected.keys() or any(body[key].shape != value.shape for key, value in expected.items()):
        raise ValueError(weights_mismatch(expected, body, f"{path} holds no weights of {arch}, its head aside "
                                                          "(--arch names the network they are of)"))
    return body


def with_body(model: nn.Module, body: dict[str, torch.Tensor]) -> nn.Module:
    """``model`` holding ``body`` (``body_weights``') in every layer but its head, which keeps its own."""
    from models.architectures import head_name

    head = f"{head_name(model)}."
    model.load_state_dict({**body, **{key: value for key, value in model.state_dict().items()
                                      if key.startswith(head)}}, strict=True)
    return model


def read_labels(path: Path) -> list[str]:
    """The labels in ``path``, one a line, in the order of the model's outputs (blank lines at its end left out)."""
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # (a byte-order mark, as Windows editors write)
    except UnicodeDecodeError:
        raise ValueError(f"{path} is no text file of labels (UTF-8, one a line)") from None
    while lines and not lines[-1].strip():
        lines.pop()
    return [line.strip() for line in lines]


def brought_preset(resize_size: int | None, crop_size: int | None, interpolation: str | None,
                   mean: Sequence[float] | None, std: Sequence[float] | None) -> EvalPreset:
    """How the model's pictures were prepared: the short side resized to ``resize_size``, the centre ``crop_size``
    square, scaled to 0..1 and normalised by ``mean`` and ``std``; torchvision's ImageNet recipe (256, 224,
    bilinear, ImageNet's mean and std) where not given, the resize in the recipe's proportion to a crop given
    alone. ValueError (pydantic's, one a field) for values the server cannot serve."""
    return EvalPreset(resize_size=256, crop_size=224).given(resize_size, crop_size, interpolation, mean, std)
