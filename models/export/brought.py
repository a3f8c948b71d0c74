"""A model trained elsewhere, as ``python -m models.export --state-dict`` / ``--torchscript`` reads it: its weights
(a state dict of a named architecture, or a TorchScript file), its labels (a text file, one a line) and how its
pictures were prepared (EvalPreset), each refused in one line saying what to give instead (also how
``python -m models.train --weights`` reads a state dict: models/run/start_weights.py)."""
from __future__ import annotations

import logging
import pickle
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
import torch.nn as nn

from models.export.checks import fit_weights, is_torchscript, one_line
from models.export.manifest import EvalPreset

log = logging.getLogger("models.export")

# Where a saved state dict commonly sits inside what was saved: Lightning's and many scripts' {"state_dict": ...},
# a training loop's {"model": ...}
NESTED_KEYS = ("state_dict", "model", "model_state_dict")
DDP_PREFIX = "module."  # DistributedDataParallel's (and DataParallel's) wrapper names every key with it


CHECKPOINT_KEYS = frozenset({"model", "args", "arch", "classes"})  # what marks a models.train checkpoint


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The tensors saved in ``path`` by their names (``load_saved``, then ``state_dict_in``)."""
    return state_dict_in(load_saved(path), path)


def load_saved(path: Path, for_training: bool = False) -> Any:
    """What torch.save wrote in ``path``, read safely; ValueError in one line for anything else, saying what to give
    (``for_training``: as models.train --weights takes them): an empty file, an ONNX file, a file torch.save did not
    write, a pickled model (which torch's safe load refuses), a TorchScript file."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if is_torchscript(path):  # (torch.load would warn, then hand it to torch.jit.load)
        raise ValueError(f"{path} is a TorchScript file: " + (
            "give its state dict (an export's model.state_dict.pt beside it; yours saved with "
            "torch.save(model.state_dict(), path))" if for_training else f"give it with --torchscript {path}"))
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a pickled model, text: not a state dict
        other = "" if for_training else ", or give a TorchScript file with --torchscript"
        raise ValueError(f"{path} is no state dict torch can read safely ({_unreadable(path, exc)}): save the "
                         f"weights alone with torch.save(model.state_dict(), path) (torch.save(model) pickles the "
                         f"code){other}") from None


def is_checkpoint(saved: Any) -> bool:
    """Whether ``saved`` (``load_saved``'s) is a models.train checkpoint."""
    return isinstance(saved, dict) and CHECKPOINT_KEYS <= saved.keys()


def state_dict_in(saved: Any, path: Path) -> dict[str, torch.Tensor]:
    """The state dict in what ``path`` held (``load_saved``'s): ``torch.save(model.state_dict(), path)``'s, also
    nested under one of NESTED_KEYS or named with DDP's ``module.``; ValueError in one line for anything else (a
    models.train checkpoint: --checkpoint takes it)."""
    if is_checkpoint(saved):
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


def _unreadable(path: Path, exc: Exception) -> str:
    """What ``path`` is, that torch's safe load failed on with ``exc``."""
    with path.open("rb") as file:
        head = file.read(4)
    if not head:
        return "an empty file"
    if path.suffix.lower() == ".onnx":
        return "an ONNX file, which is not taken"
    if head[:2] not in (b"PK", b"\x80\x02"):  # (torch.save's zip, its older pickle)
        return "no file torch.save wrote"
    if isinstance(exc, pickle.UnpicklingError):
        return "a pickled object, which torch's safe load refuses"
    return one_line(exc, 120)


def aligned(weights: dict[str, torch.Tensor], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """``weights`` named as ``names`` are: without the first part every name shares (``model.``: Lightning's
    module attribute, a wrapper's) where that makes more of them match; else as they are."""
    wanted = set(names)
    firsts = {key.partition(".")[0] for key in weights}
    if len(firsts) != 1 or all("." not in key for key in weights):
        return weights
    stripped = {key.partition(".")[2]: value for key, value in weights.items()}
    return stripped if len(wanted & stripped.keys()) > len(wanted & weights.keys()) else weights


def _tensors(saved: dict[Any, Any]) -> bool:
    return all(isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in saved.items())


def brought_model(path: Path, arch: str, labels: Sequence[str]) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``arch`` with one output a label, holding the weights in ``path``, and those weights; ValueError in one line
    when they are not that model's (another architecture, another class count)."""
    from models.architectures import build_model

    model = build_model(arch, len(labels))
    weights = aligned(read_state_dict(path), model.state_dict())
    fit_weights(model, weights, f"{path} is no state dict of {arch} with {len(labels)} classes (one a label)")
    return model.eval(), weights


def read_labels(path: Path) -> list[str]:
    """The labels in ``path``, one a line, in the order of the model's outputs (blank lines at its end left out;
    ValueError for one before)."""
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # (a byte-order mark, as Windows editors write)
    except UnicodeDecodeError:
        raise ValueError(f"{path} is no text file of labels (UTF-8, one a line)") from None
    while lines and not lines[-1].strip():
        lines.pop()
    blank = [number for number, line in enumerate(lines, 1) if not line.strip()]
    if blank:  # said here, where a count that then differs from the model's outputs would hide it
        raise ValueError(f"{path}: line{'s' if len(blank) > 1 else ''} {', '.join(map(str, blank))} "
                         f"{'are' if len(blank) > 1 else 'is'} blank: each line names the class of one of the model's "
                         "outputs, in their order")
    labels = [line.strip() for line in lines]
    repeated = {label: [i for i, other in enumerate(labels) if other == label]
                for label, count in Counter(labels).items() if count > 1}
    if repeated:  # allowed (ImageNet's 'crane' is a bird and a machine): the index tells them apart
        log.warning("%s names a class more than once (%s): answers give those classes the same label, only their "
                    "index tells them apart; is that meant?", path, "; ".join(
                        f"{label!r} at outputs {', '.join(map(str, at))}" for label, at in list(repeated.items())[:5]))
    return labels


def brought_preset(resize_size: int | None, crop_size: int | None, interpolation: str | None,
                   mean: Sequence[float] | None, std: Sequence[float] | None) -> EvalPreset:
    """How the model's pictures were prepared: the short side resized to ``resize_size``, the centre ``crop_size``
    square, scaled to 0..1 and normalised by ``mean`` and ``std``; torchvision's ImageNet recipe (256, 224,
    bilinear, ImageNet's mean and std) where not given, the resize in the recipe's proportion to a crop given
    alone. ValueError (pydantic's, one a field) for values the server cannot serve. A warning where none of the
    sizes and normalisation is given (the recipe is then a guess), or where the crop is larger than the resize
    (served padded with black, as torchvision's CenterCrop pads: a model trained so is served as it was)."""
    preset = EvalPreset(resize_size=256, crop_size=224).given(resize_size, crop_size, interpolation, mean, std)
    if resize_size is crop_size is mean is std is None:
        log.warning("no --resize-size, --crop-size, --mean or --std: the export says the model takes torchvision's "
                    "ImageNet recipe (short side resized to 256, the centre 224 square, ImageNet's mean and std); "
                    "give them if it was trained otherwise, or its answers are made from other pixels")
    if preset.crop_size > preset.resize_size:
        log.warning("--crop-size %d is larger than --resize-size %d: each image is served padded with black around "
                    "its resize, as torchvision's CenterCrop pads it; give a --resize-size of at least the crop "
                    "unless the model was trained so", preset.crop_size, preset.resize_size)
    return preset
