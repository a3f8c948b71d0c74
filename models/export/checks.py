"""The checks every served artefact passes, and the error that says why one cannot serve: the manifest, a file's
sha256, the output shape; the device and dtype asked for.

Shared by the format choice (choose.py) and the load (load.py), so the server and ``python -m models.predict``
refuse the same exports with the same messages.
"""
from __future__ import annotations

from pathlib import Path

import pydantic
import torch
import torch.nn as nn

from models.architectures import split_outputs
from models.export.compile import DTYPES
from models.export.manifest import Manifest, WeightsFormat, read_manifest, sha256_of


# The folder `make weights` fills with the bundled default model (the Makefile's DEFAULT_WEIGHTS, in the checkout).
DEFAULT_WEIGHTS_DIR = Path(__file__).resolve().parents[2] / "weights"


class ModelLoadError(RuntimeError):
    """The weights directory cannot be served; the message says why and what to do."""


def device_type(name: str) -> str:
    """The type of the device ``name`` (auto, cpu, cuda, cuda:N) means here, cuda or cpu, without checking that it
    exists (``resolve_device`` does)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name).type


def resolve_device(name: str) -> torch.device:
    """auto -> cuda when available else cpu; an explicit cuda device must exist."""
    if name == "auto":
        return torch.device(device_type(name))
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


def no_export_message(weights_dir: Path) -> str:
    """The one line that says ``weights_dir`` holds no export (no manifest.json) and what to do: ``make weights``
    only for the checkout's default weights/ folder, which it fills; for any other folder, which to name in
    VISIONSERVE_WEIGHTS_DIR (the Makefile never exports the default model into it, so a typo fails loudly)."""
    found = "it holds no export" if weights_dir.is_dir() else "the folder does not exist"
    served = "an export's folder (e.g. runs/NAME/export) or a model repository"
    if weights_dir.resolve() == DEFAULT_WEIGHTS_DIR:
        return (f"no manifest.json in {weights_dir}: {found}; run `make weights` to export the bundled default model "
                f"into it, or set VISIONSERVE_WEIGHTS_DIR to {served}")
    return (f"no manifest.json in {weights_dir}: {found}; check VISIONSERVE_WEIGHTS_DIR, which names the folder to "
            f"serve: {served} (`make weights` exports the bundled default model into weights/, not there)")


def read_checked_manifest(weights_dir: Path) -> Manifest:
    """The directory's manifest, or ModelLoadError saying what to serve instead (``no_export_message``)."""
    try:
        return read_manifest(weights_dir)
    except FileNotFoundError as exc:
        raise ModelLoadError(no_export_message(weights_dir)) from exc
    except (ValueError, pydantic.ValidationError) as exc:
        raise ModelLoadError(f"{weights_dir}/manifest.json is invalid: {exc}") from exc


def checked_path(path: Path, sha256: str, what: str, hint: str = "") -> Path:
    """``path``, present and with the manifest's ``sha256``; ``what`` names it in the error (``hint`` ends it)."""
    if not path.is_file():
        raise ModelLoadError(f"{what} {path} is missing")
    actual = sha256_of(path)
    if actual != sha256:
        raise ModelLoadError(f"{what} {path} has sha256 {actual}, the manifest says {sha256}{hint}")
    return path


def checked_file(weights_dir: Path, manifest: Manifest, fmt: WeightsFormat) -> Path:
    """The weights file of ``fmt``, present and with the manifest's sha256."""
    entry = manifest.files.get(fmt)
    if entry is None:
        raise ModelLoadError(f"the manifest in {weights_dir} lists no {fmt} file (has: {', '.join(manifest.files)})")
    return checked_path(weights_dir / entry.path, entry.sha256, "weights file",
                        ": the file is corrupt or belongs to another export")


def check_output_shape(model: nn.Module, manifest: Manifest, device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.float32) -> None:
    """Raise ModelLoadError unless the model gives one column per label, and its embedding when the manifest says
    it has one (and nothing else when not)."""
    with torch.inference_mode():
        out, embedding = split_outputs(model(torch.zeros(1, *manifest.preprocess.input_shape, device=device,
                                                         dtype=dtype)))
    if out.ndim != 2 or out.shape[1] != manifest.num_classes:
        raise ModelLoadError(f"model outputs shape {tuple(out.shape)} but the manifest has "
                             f"{manifest.num_classes} labels")
    wanted = None if manifest.embedding is None else (1, manifest.embedding.dim)
    found = None if embedding is None else tuple(embedding.shape)
    if found != wanted:
        raise ModelLoadError(f"model answers an embedding of shape {found} but the manifest says "
                             f"{wanted or 'it has none'}")
