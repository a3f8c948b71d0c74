"""Predictor: loads the model named by a weights manifest, places it, warms it up, and runs batches."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pydantic
import torch
import torch.nn as nn
from PIL import Image

from models.export import quiet_jit
from models.manifest import Manifest, WeightsFormat, read_manifest, sha256_of
from models.presets import ImageTransform, eval_transform
from models.registry import build_model

log = logging.getLogger(__name__)

# What the batcher treats as "this batch is too big": split it and retry the halves.
OUT_OF_MEMORY_ERRORS: tuple[type[BaseException], ...] = (torch.cuda.OutOfMemoryError,)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
    """The compute dtype; float16 only on CUDA, where CPU kernels for it are slow or missing."""
    dtype = _DTYPES[name]
    if dtype is torch.float16 and device.type != "cuda":
        raise ModelLoadError("dtype float16 needs a CUDA device; use bfloat16 or float32 on cpu")
    return dtype


def _read_manifest(weights_dir: Path) -> Manifest:
    try:
        return read_manifest(weights_dir)
    except FileNotFoundError as exc:
        raise ModelLoadError(f"no manifest.json in {weights_dir}: run `make weights` "
                             f"(python -m models.export --default --out {weights_dir})") from exc
    except (ValueError, pydantic.ValidationError) as exc:
        raise ModelLoadError(f"{weights_dir}/manifest.json is invalid: {exc}") from exc


def _checked_file(weights_dir: Path, manifest: Manifest, fmt: WeightsFormat) -> Path:
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


def _load_module(path: Path, manifest: Manifest, fmt: WeightsFormat) -> nn.Module:
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


def optimize_for_cpu(model: nn.Module, manifest: Manifest) -> nn.Module:
    """Freeze a TorchScript module and apply optimize_for_inference; eager modules are returned unchanged."""
    if not isinstance(model, torch.jit.ScriptModule):
        return model
    with quiet_jit(), torch.inference_mode():
        optimized = torch.jit.optimize_for_inference(torch.jit.freeze(model.eval()))
        optimized(torch.zeros(1, *manifest.preprocess.input_shape))  # the first call runs the graph passes
    return optimized


def choose_batch_cap(profile: dict[int, float], tolerance: float = 0.95) -> int:
    """The smallest batch size whose images/s is within ``tolerance`` of the best: larger batches only add latency.

    On a small CPU throughput often peaks at 4 or fewer images; on a GPU it keeps rising to the configured cap.
    """
    best = max(profile.values())
    return min(size for size, rate in profile.items() if rate >= tolerance * best)


def _check_output_shape(model: nn.Module, manifest: Manifest) -> None:
    with torch.inference_mode():
        out = model(torch.zeros(1, *manifest.preprocess.input_shape))
    if out.ndim != 2 or out.shape[1] != manifest.num_classes:
        raise ModelLoadError(f"model outputs shape {tuple(out.shape)} but the manifest has "
                             f"{manifest.num_classes} labels")


def canary_image(size: int = 320) -> Image.Image:
    """A deterministic synthetic photo-like image (colour gradients) for the readiness canary."""
    ramp = np.linspace(0, 255, size, dtype=np.float32)
    red, green = np.meshgrid(ramp, ramp[::-1])
    blue = np.full_like(red, 96.0)
    return Image.fromarray(np.stack([red, green, blue], axis=-1).astype(np.uint8), mode="RGB")


class Predictor:
    """A model placed on its device with its manifest's transform; ``predict_batch`` returns probabilities."""

    def __init__(self, model: nn.Module, manifest: Manifest, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, weights_format: str = "eager",
                 pad_batches: bool | None = None) -> None:
        self.manifest = manifest
        self.device = torch.device(device)
        self.dtype = dtype
        self.weights_format = weights_format
        self.transform: ImageTransform = eval_transform(manifest.preprocess)
        self.model = model.eval().to(device=self.device, dtype=dtype)
        self.warmed_batch_sizes: list[int] = []
        # On CUDA a batch is padded with zeros up to the next power of two (or the cap): every new input shape costs
        # cuDNN autotuning (seconds per shape for these models), and a few spare rows cost the GPU almost nothing.
        # On the CPU every row costs its full share, so each size runs as it is.
        self.pad_batches = self.device.type == "cuda" if pad_batches is None else pad_batches
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick its fastest kernels

    @classmethod
    def load(cls, weights_dir: Path, *, weights_format: str = "auto", device: str = "auto",
             dtype: str = "float32", jit_optimize: bool = False) -> "Predictor":
        """Load and verify (manifest, checksum, keys, output shape) or raise ModelLoadError."""
        manifest = _read_manifest(weights_dir)
        fmt: WeightsFormat = manifest.default_format if weights_format == "auto" else weights_format  # type: ignore[assignment]
        path = _checked_file(weights_dir, manifest, fmt)
        model = _load_module(path, manifest, fmt)
        _check_output_shape(model, manifest)
        target = resolve_device(device)
        if jit_optimize and target.type == "cpu" and dtype == "float32":
            model = optimize_for_cpu(model, manifest)
        log.info("loaded %s %s (%s) from %s onto %s", manifest.name, manifest.version, fmt, path, target)
        return cls(model, manifest, device=target, dtype=resolve_dtype(dtype, target), weights_format=fmt)

    @property
    def dtype_name(self) -> str:
        """The compute dtype as the settings spell it (float32, float16, bfloat16)."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def labels(self) -> list[str]:
        """Class names in output order."""
        return self.manifest.labels

    @property
    def num_classes(self) -> int:
        """Number of output classes."""
        return self.manifest.num_classes

    def batch_shapes(self, max_batch_size: int) -> list[int]:
        """The batch sizes the forward pass runs with for batches of up to ``max_batch_size`` images."""
        if not self.pad_batches:
            return list(range(1, max_batch_size + 1))
        return sorted({min(2 ** i, max_batch_size) for i in range(max_batch_size.bit_length() + 1)})

    def _padded_size(self, rows: int) -> int:
        return next((size for size in self.warmed_batch_sizes if size >= rows), rows)

    def predict_batch(self, batch: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) float32 on CPU -> (N, classes) float32 softmax probabilities on CPU."""
        rows = batch.shape[0]
        if self.device.type == "cuda":
            batch = batch.pin_memory().to(self.device, non_blocking=True)
        if self.pad_batches and (padded := self._padded_size(rows)) > rows:
            batch = torch.cat([batch, batch.new_zeros(padded - rows, *batch.shape[1:])])  # on the device
        try:
            with torch.inference_mode():
                logits = self.model(batch.to(dtype=self.dtype))[:rows]
                return logits.float().softmax(dim=1).cpu()
        except torch.cuda.OutOfMemoryError:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # give the smaller retry the cached blocks back
            raise

    def memory_stats(self) -> dict[str, int]:
        """CUDA memory allocated and reserved by this process, or nothing on CPU."""
        if self.device.type != "cuda":
            return {}
        return {"allocated": torch.cuda.memory_allocated(self.device),
                "reserved": torch.cuda.memory_reserved(self.device)}

    def predict_list(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        """Stack preprocessed images and predict them as one batch (the batcher's predict function)."""
        return self.predict_batch(torch.stack(list(images)))

    def warmup(self, max_batch_size: int, repeats: int = 5) -> dict[int, float]:
        """Run every batch shape the batcher's batches run with (``batch_shapes``: so no request pays for
        first-call setup) and time them.

        Returns images/s of the forward pass per batch size from the fastest of ``repeats`` timed runs after one
        untimed one (the fastest run is the one least disturbed by other work on the machine). The timed runs go
        round the sizes rather than size after size: a machine whose speed drifts during warm-up then slows every
        size alike, instead of making one size look best (seen on a shared VM: a batch cap of 4 for a model whose
        images/s fall by a third above 2).
        """
        started = time.perf_counter()
        batches = {size: torch.zeros(size, *self.manifest.preprocess.input_shape)
                   for size in self.batch_shapes(max_batch_size)}
        for size, batch in batches.items():
            self.predict_batch(batch)
            self.warmed_batch_sizes.append(size)
        fastest = dict.fromkeys(batches, float("inf"))
        for _ in range(repeats):
            for size, batch in batches.items():
                begun = time.perf_counter()
                self.predict_batch(batch)  # returns on the CPU, so CUDA work is finished when it does
                fastest[size] = min(fastest[size], time.perf_counter() - begun)
        log.info("warmed up batch sizes %s in %.2fs", self.warmed_batch_sizes, time.perf_counter() - started)
        return {size: size / max(seconds, 1e-9) for size, seconds in fastest.items()}

    def canary(self) -> None:
        """Run a synthetic image through the whole transform and model; raise if the answer is not sane."""
        probs = self.predict_batch(self.transform(canary_image()).unsqueeze(0))
        total = float(probs.sum())
        if probs.shape != (1, self.num_classes) or not torch.isfinite(probs).all() or abs(total - 1.0) > 1e-3:
            raise ModelLoadError(f"canary inference failed: shape {tuple(probs.shape)}, sum {total}")

    def info(self) -> dict[str, Any]:
        """Model metadata for /v1/models."""
        m = self.manifest
        return {"name": m.name, "version": m.version, "arch": m.arch, "num_classes": m.num_classes,
                "input_shape": list(m.preprocess.input_shape), "preprocess": m.preprocess.model_dump(),
                "format": self.weights_format, "device": str(self.device), "dtype": self.dtype_name,
                "files": {fmt: entry.sha256 for fmt, entry in m.files.items()}, "metrics": m.metrics,
                "source": m.source, "warmed_batch_sizes": self.warmed_batch_sizes}
