"""The checks every served artefact passes, and the error that says why one cannot serve: the manifest, a file's
sha256, the output shape; the device and dtype asked for.

Shared by the format choice (choose.py) and the load (load.py), so the server and ``python -m models.predict``
refuse the same exports with the same messages.
"""
from __future__ import annotations

import re
import zipfile
from pathlib import Path
from typing import Mapping, Sequence

import pydantic
import torch
import torch.nn as nn

from models.architectures import split_outputs
from models.export.compile import DTYPES
from models.export.manifest import MANIFEST_NAME, Manifest, WeightsFormat, read_manifest, sha256_of, too_few_labels


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
            raise ModelLoadError(f"device {name!r} was asked for (VISIONSERVE_DEVICE, or a command's --device) but "
                                 "CUDA is not available on this machine: set it to auto (a GPU when there is one) or "
                                 "cpu")
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
    within = sorted(child for child in weights_dir.glob(f"*/{MANIFEST_NAME}")) if weights_dir.is_dir() else []
    if weights_dir.is_file():  # a run's checkpoint or an export's model file, for the folder that holds the export
        found = "it is a file, not a folder"
        within = [folder / MANIFEST_NAME for folder in (weights_dir.parent, weights_dir.parent / "export")
                  if (folder / MANIFEST_NAME).is_file()]
    if within:  # a run's folder named for its export's (runs/mine for runs/mine/export)
        found += f", but {within[0].parent} does: set VISIONSERVE_WEIGHTS_DIR={within[0].parent}"
    elif not weights_dir.exists() and (trimmed := Path(str(weights_dir).strip())) != weights_dir and trimmed.is_dir():
        found += (f" ({str(weights_dir)!r}, the setting's spaces around it kept), but {trimmed} does: drop the "
                  f"spaces")  # before: "weights " was said as if the folder were missing (a trial)
    if weights_dir.resolve() == DEFAULT_WEIGHTS_DIR:
        return (f"no manifest.json in {weights_dir}: {found}; run `make weights` to export the bundled default model "
                f"into it, or set VISIONSERVE_WEIGHTS_DIR to {served}")
    if weights_dir.is_dir() and not any(weights_dir.iterdir()):  # a new volume meant for a repository, say
        return (f"no manifest.json in {weights_dir}: the folder is empty; write a model into it before the server "
                f"starts (python -m models.export --repository {weights_dir}, from a pod or host that mounts it "
                f"read-write: docs/models.md), or set VISIONSERVE_WEIGHTS_DIR to {served}")
    return (f"no manifest.json in {weights_dir}: {found}; check VISIONSERVE_WEIGHTS_DIR, which names the folder to "
            f"serve: {served} (`make weights` exports the bundled default model into weights/, not there)")


def read_checked_manifest(weights_dir: Path) -> Manifest:
    """The directory's manifest, or ModelLoadError saying what to serve instead (``no_export_message``)."""
    try:
        return read_manifest(weights_dir)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise ModelLoadError(no_export_message(weights_dir)) from exc
    except (ValueError, pydantic.ValidationError) as exc:
        raise ModelLoadError(f"{weights_dir}/manifest.json is invalid: {invalid_because(exc)}") from exc


def invalid_because(exc: ValueError) -> str:
    """Why a manifest is refused, in one line: pydantic's first errors as ``field: message`` (its own text runs to
    a line an error and a link each), or the error's first line."""
    if isinstance(exc, pydantic.ValidationError):
        errors = exc.errors()
        said = [f"{'.'.join(map(str, e['loc'])) or 'the manifest'}: {e['msg'].removeprefix('Value error, ')}"
                for e in errors[:3]]
        return "; ".join(said) + (f" (and {len(errors) - 3} more)" if len(errors) > 3 else "")
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


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


# The load check's batch: two different images, so a model whose row count ignores its batch's (traced or exported
# for batches of 1) is refused here, not found out by every batch of two or more, each then run again image by image.
CHECK_BATCH_SIZE = 2
# How far from 1 a row may sum and still read as probabilities: float32's rounding over 1000 classes is about 1e-6,
# bfloat16's and float16's about 1e-2 (a logits row non-negative and that close to 1 on every image is no chance).
PROBABILITY_SUM_TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def is_torchscript(path: Path) -> bool:
    """Whether ``path`` is a TorchScript archive (torch.jit.save's: a zip holding its code's constants.pkl)."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.endswith("/constants.pkl") or name == "constants.pkl" for name in archive.namelist())


def fit_weights(model: nn.Module, weights: object, refusal: str) -> None:
    """``weights`` loaded into ``model`` strictly; ValueError in one line when they are not its weights, ``refusal``
    followed by how (torch's own error lists every key: thousands of characters)."""
    try:
        model.load_state_dict(weights, strict=True)  # type: ignore[arg-type]
    except (RuntimeError, TypeError, AttributeError):
        raise ValueError(weights_mismatch(model.state_dict(), weights if isinstance(weights, dict) else {},
                                          refusal)) from None


def weights_mismatch(expected: Mapping[str, torch.Tensor], given: Mapping[str, object], refusal: str) -> str:
    """``refusal`` and, in one line, how ``given`` differs from the weights ``expected`` (names missing, names it
    has none of, tensors of another shape); also when it does not differ (a load that failed otherwise)."""
    missing = [key for key in expected if key not in given]
    unexpected = [key for key in given if key not in expected]
    reshaped = [key for key, value in expected.items()
                if key in given and getattr(given[key], "shape", None) != value.shape]
    if reshaped and not missing and not unexpected and len(reshaped) <= 2:
        hint = (f" (the head {reshaped[-1]}: {tuple(given[reshaped[-1]].shape)} against "  # type: ignore[attr-defined]
                f"{tuple(expected[reshaped[-1]].shape)}, another class count)")
    elif unexpected and not missing and not reshaped:  # an EMA's or an auxiliary head's keys beside its own
        hint = f" (keys it has none of: {', '.join(unexpected[:3])}{', ...' if len(unexpected) > 3 else ''})"
    elif missing and not unexpected and not reshaped:
        hint = f" (keys not given: {', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
    else:
        hint = " (weights of another architecture or class count)"
    return (f"{refusal}: {len(missing)} of its {len(expected)} keys missing, {len(unexpected)} unexpected, "
            f"{len(reshaped)} of another shape{hint}")


def check_output_shape(model: nn.Module, manifest: Manifest, device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.float32, batch_size: int = CHECK_BATCH_SIZE) -> None:
    """Raise ModelLoadError unless the model, on a batch of ``batch_size`` different images, answers one row per
    image of one column per label, logits (``check_outputs``), and its embedding when the manifest says it has one
    (and nothing else when not)."""
    check_outputs(model, manifest.labels, manifest.preprocess.input_shape,
                  None if manifest.embedding is None else manifest.embedding.dim, device, dtype, batch_size)


def check_outputs(model: nn.Module, labels: Sequence[str], input_shape: tuple[int, int, int], embedding_dim: int | None,
                  device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                  batch_size: int = CHECK_BATCH_SIZE) -> None:
    """What the load and the export refuse a model for, each a ModelLoadError of one line: fewer than 2 labels; an
    error on a batch of ``batch_size`` different images; rows that are not one per image of a column per label;
    an embedding of other than ``embedding_dim`` values (None: none at all); rows that are already probabilities on
    every image of two batches (the server's softmax would be a second one)."""
    problem = too_few_labels(list(labels))
    if problem:
        raise ModelLoadError(problem)
    logits, embedding = _answers(model, _check_images(batch_size, input_shape, 0, device, dtype))
    if logits.ndim != 2 or logits.shape[1] != len(labels):
        raise ModelLoadError(f"model outputs shape {tuple(logits.shape)} but the manifest has {len(labels)} labels")
    if logits.shape[0] != batch_size:
        raise ModelLoadError(f"model answers {logits.shape[0]} rows for a batch of {batch_size} images: it must "
                             f"answer one row per image, whatever the batch size (export it with a dynamic batch "
                             f"dimension, not one fixed when it was traced)")
    if batch_size > 1:
        _check_alone(model, input_shape, len(labels), batch_size, device, dtype)
    wanted = None if embedding_dim is None else (batch_size, embedding_dim)
    found = None if embedding is None else tuple(embedding.shape)
    if found != wanted and wanted is None:  # a model brought as TorchScript that answers (logits, features)
        raise ModelLoadError(f"model answers a second output of shape {found} beside its logits: it must answer its "
                             "logits alone (to serve embeddings, export its state dict with --arch; else script a "
                             "wrapper answering the logits)")
    if found != wanted:
        raise ModelLoadError(f"model answers an embedding of shape {found} for {batch_size} images but the manifest "
                             f"says {wanted}")
    if _probabilities(logits) and _probabilities(
            _answers(model, _check_images(batch_size, input_shape, 1, device, dtype))[0]):
        raise ModelLoadError(f"the model's output rows are already probabilities (each non-negative and summing to 1 "
                             f"on {2 * batch_size} different images): the server applies softmax to them, which "
                             f"would be a second one; export the model without its final softmax (its logits)")


def check_finite_outputs(model: nn.Module, input_shape: tuple[int, int, int],
                         batch_size: int = CHECK_BATCH_SIZE) -> None:
    """ModelLoadError when ``model`` (float32, on the CPU, as an export runs it) answers NaN or infinity for the
    check images: weights a diverged training run left, which no format check would name (before: an export said
    "exported without an embedding: ... not the last step" and "TorchScript output differs from eager by nan")."""
    images = _check_images(batch_size, input_shape, 0, "cpu", torch.float32)
    logits, _ = _answers(model, images)
    rows = logits.reshape(logits.shape[0], -1) if logits.ndim else logits.reshape(1, 1)  # (a shape check_outputs
    broken = int((~torch.isfinite(rows)).any(dim=1).sum())  # refuses later, with its own words)
    if broken:
        raise ModelLoadError(f"the model's output is not finite (NaN or infinity) for {broken} of {len(rows)} check "
                             "images: its weights are broken (a training run that diverged, or a state dict whose "
                             "values overflow); export weights that answer numbers")


def _check_images(count: int, input_shape: tuple[int, int, int], seed: int, device: torch.device | str,
                  dtype: torch.dtype) -> torch.Tensor:
    """``count`` different preprocessed images, the same on every load: normalised pixels are about standard normal
    (the first of seed 0 all zeros: a flat grey photo, what the warm-up runs)."""
    images = torch.randn(count, *input_shape, generator=torch.Generator().manual_seed(seed))
    if seed == 0:
        images[0] = 0
    return images.to(device=device, dtype=dtype)


_CHANNELS_EXPECTED = re.compile(r"to have (\d+) channels")  # torch's convolution's words for input of other channels


def _answers(model: nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``model``'s (logits, embedding or None) for ``images``; ModelLoadError of one line when it raises or answers
    no tensor."""
    try:
        with torch.inference_mode():
            logits, embedding = split_outputs(model(images))
    except Exception as exc:  # noqa: BLE001 - whatever a model raises on a batch means "cannot serve this"
        if images.shape[0] > 1 and _runs_alone(model, images[:1]):  # (ONNX Runtime's or a traced reshape's words)
            raise ModelLoadError(f"the model runs on one image but fails on a batch of {images.shape[0]}: its batch "
                                 f"dimension is fixed at 1; export it with a dynamic one (torch.onnx.export's "
                                 f"dynamic_axes or dynamic_shapes; torch.jit.script rather than a trace of one "
                                 f"image) ({one_line(exc, 200)})") from exc
        channels = _CHANNELS_EXPECTED.search(str(exc))
        hint = (f" (it takes {channels[1]} channels; the server sends RGB, 3: wrap it to take them, e.g. averaging "
                "them to grey, docs/models.md)" if channels and channels[1] != "3" else "")
        raise ModelLoadError(f"the model fails on a batch of {images.shape[0]} images of shape "
                             f"{tuple(images.shape[1:])} ({images.dtype}): {one_line(exc)}{hint}") from exc
    for answer in (logits, embedding):
        if answer is not None and not isinstance(answer, torch.Tensor):
            raise ModelLoadError(f"the model answers a {type(answer).__name__} where a tensor of logits (or logits and "
                                 f"an embedding) was expected")
    return logits, embedding


def _check_alone(model: nn.Module, input_shape: tuple[int, int, int], classes: int, batch_size: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
    """ModelLoadError unless ``model``, which answered a batch of ``batch_size``, answers one image with one row of
    ``classes`` (a batch dimension fixed at ``batch_size``, ``reshape(2, -1)``, passed the export and failed the
    server's warm-up with a traceback; a new user's trial)."""
    try:
        lone, _ = _answers(model, _check_images(1, input_shape, 2, device, dtype))
    except ModelLoadError as exc:
        raise ModelLoadError(f"the model answers a batch of {batch_size} images but fails on one: its batch "
                             f"dimension is fixed; export it with a dynamic one (torch.jit.script rather than a "
                             f"trace, no reshape to a fixed batch) ({exc})") from None
    if tuple(lone.shape) != (1, classes):
        raise ModelLoadError(f"model answers shape {tuple(lone.shape)} for one image, where a batch of {batch_size} "
                             f"had one row each: it must answer one row per image, whatever the batch size")


def _runs_alone(model: nn.Module, image: torch.Tensor) -> bool:
    try:
        with torch.inference_mode():
            model(image)
    except Exception:  # noqa: BLE001 - fails alone too: the batch was not the trouble
        return False
    return True


def squashed_outputs(model: nn.Module, input_shape: tuple[int, int, int], batch_size: int = CHECK_BATCH_SIZE
                     ) -> bool:
    """Whether every output of ``model`` lies strictly between 0 and 1 on two batches of check images, its rows not
    summing to 1: a final sigmoid (a multi-label head), whose outputs the server's softmax turns into near-equal
    scores (the top class kept); logits are of both signs."""
    for seed in (0, 1):
        rows = _answers(model, _check_images(batch_size, input_shape, seed, "cpu", torch.float32))[0]
        if not bool(((rows > 0) & (rows < 1)).all()) or _probabilities(rows):
            return False
    return True


def _probabilities(rows: torch.Tensor) -> bool:
    """Whether every row is non-negative and sums to 1 (within the dtype's rounding)."""
    tolerance = PROBABILITY_SUM_TOLERANCE.get(rows.dtype, PROBABILITY_SUM_TOLERANCE[torch.float32])
    values = rows.detach().to("cpu", torch.float64)
    return bool((values >= 0).all()) and bool(((values.sum(dim=1) - 1).abs() <= tolerance).all())


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``exc`` as one line of at most ``limit`` characters: a TorchScript interpreter's error by its last line (the
    error itself, after the scripted traceback), any other's lines joined, without terminal colour codes (torch's
    weights-only refusal has them)."""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines() if line.strip()]
    if lines and "TorchScript interpreter" in lines[0]:
        text = lines[-1]
    else:
        text = f"{type(exc).__name__}: {' '.join(lines)}" if lines else type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."
