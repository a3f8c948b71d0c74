"""Predictor: a verified model placed on its device with its manifest's transforms; warms up and runs the forward
pass of a batch."""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from app.engine.batching.batcher import ItemsFailed
from app.engine.batching.tuning import run_spread
from app.engine.loaded.graphs import GraphedForward, release_cached_memory
from app.errors import InferenceFailed
from models.architectures import split_outputs
from models.export.checks import ModelLoadError
from models.export.load import load_model, module_bytes
from models.export.manifest import Manifest, too_few_labels
from models.presets import ImageTransform, TensorEvalTransform, eval_transform

log = logging.getLogger(__name__)

# What the batcher treats as "this batch is too big": split it and retry the halves.
OUT_OF_MEMORY_ERRORS: tuple[type[BaseException], ...] = (torch.cuda.OutOfMemoryError,)
WARMUP_PROGRESS_S = 10.0  # a warm-up running longer says how far it got this often (a slow model: minutes)
NON_FINITE_OUTPUT = "non_finite_output"  # the error code of an image whose row the model answered NaN or inf in


def non_finite_error(where: str) -> InferenceFailed:
    """One image's error when the model answered NaN or infinity for it: a 500 (the forward pass failed, as the
    OpenAPI document lists for every inference route), so it counts as the version's failure, with a code of its
    own (a code set on the instance crosses the engine's link as app/errors.py's classes do)."""
    error = InferenceFailed(f"{where} produced non-finite output (NaN or infinity) for this image: the model is at "
                            f"fault, not the image")
    error.code = NON_FINITE_OUTPUT
    return error


class NonFiniteOutput(ItemsFailed):
    """A batch whose rows are NaN or infinite for some images: each of those fails alone (``non_finite_error``),
    the others keep their rows (``outputs``, as ``predict_batch`` answers them, in numpy); ``finite`` says which rows
    are. Raised instead of returning, so the caller's steps after the forward pass (the drift monitor's rows) never
    see such a batch; the batcher answers the finite rows (app/engine/batching/batcher.py ItemsFailed)."""

    def __init__(self, rows: np.ndarray, where: str) -> None:
        finite = np.isfinite(rows).all(axis=1)
        bad = np.flatnonzero(~finite)
        super().__init__(f"{where}: the model's output is not finite (NaN or infinity) for {len(bad)} of the "
                         f"batch's {len(rows)} images", rows, {int(index): non_finite_error(where) for index in bad})
        self.finite = finite


def _to_channels_last(module: nn.Module, example: torch.Tensor) -> str | None:
    """``module``'s 4-D weights laid out channels_last (in place), tried on ``example`` (one image laid out so): None
    when it took them and answers, else why not, the module as it was (a frozen TorchScript module's weights are
    constants, an ONNX Runtime session's its own: neither has any; a module that views a feature map as flat, or
    holds weights of another rank, refuses the layout)."""
    weights = [weight for weight in module.parameters() if weight.dim() == 4]
    if not weights:
        return "its module holds no 4-D weights to lay out"
    try:
        module.to(memory_format=torch.channels_last)
        with torch.inference_mode():
            module(example.contiguous(memory_format=torch.channels_last))
    except Exception as exc:  # noqa: BLE001 - the version still serves, in the layout it was exported in
        module.to(memory_format=torch.contiguous_format)
        return f"its forward pass refused it: {type(exc).__name__}: {exc}"[:300]
    return None


class Predictor:
    """A model placed on its device with its manifest's transform; ``predict_batch`` returns probabilities (and,
    when the export has one, each image's embedding after them: one forward pass for both)."""

    def __init__(self, model: nn.Module, manifest: Manifest, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, weights_format: str = "eager",
                 pad_batches: bool | None = None, weights_bytes: int | None = None, cuda_graphs: bool = False,
                 memory_format: str = "contiguous") -> None:
        problem = too_few_labels(manifest.labels)  # a manifest made in code skips its validation (a given one)
        if problem:
            raise ModelLoadError(problem)
        self.manifest = manifest
        self.where = f"{manifest.name} version {manifest.version}"  # how its errors name it
        self.device = torch.device(device)
        self.dtype = dtype
        self.weights_format = weights_format
        self.weights_dir: Path | None = None  # where it was loaded from (its other formats: explanations' weights)
        self.transform: ImageTransform = eval_transform(manifest.preprocess)
        self.tensor_transform = TensorEvalTransform(manifest.preprocess)  # the same, on decoded tensors
        self.module = model.eval().to(device=self.device, dtype=dtype)
        # The layout its forward passes run in: channels_last only where the module's own weights took it and its
        # forward pass answers so (else it keeps its own, saying why), its batches then made so (``_laid_out``).
        self.memory_format = "contiguous"
        if memory_format == "channels_last":
            refused = _to_channels_last(self.module, torch.zeros(1, *manifest.preprocess.input_shape,
                                                                 device=self.device, dtype=dtype))
            if refused is None:
                self.memory_format = "channels_last"
            else:
                log.warning("%s keeps the contiguous layout, not %s (MEMORY_FORMAT): %s", self.where, memory_format,
                            refused)
        # What the weights take in memory; a frozen TorchScript module holds them as graph constants, so the caller
        # measures them before freezing.
        self.weights_bytes = module_bytes(self.module) if weights_bytes is None else weights_bytes
        self.warmed_batch_sizes: list[int] = []
        # warm-up's run-to-run spread: the median over batch sizes of (median timed run / fastest) - 1; 0 untimed
        self.warmup_noise = 0.0
        # On CUDA a batch is padded with zeros up to the next power of two (or the cap): every new input shape costs
        # cuDNN autotuning, which is slow (docs/performance.md: Figures behind the code's choices), and a few spare
        # rows cost the GPU almost nothing.
        # On the CPU every row costs its full share, so each size runs as it is.
        self.pad_batches = self.device.type == "cuda" if pad_batches is None else pad_batches
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick its fastest kernels
        # Each batch shape's forward pass replayed as one CUDA graph, captured at warm-up (graphs.py): modules only
        # (an AOTInductor package runs its own kernels; ONNX Runtime runs on the CPU).
        self.graphs = (GraphedForward(self._rows) if cuda_graphs and self.device.type == "cuda"
                       and weights_format in ("torchscript", "state_dict", "eager") else None)

    @classmethod
    def load(cls, weights_dir: Path, *, weights_format: str = "auto", device: str = "auto",
             dtype: str = "float32", jit_optimize: bool = False, max_batch_size: int = 1,
             threads: int = 1, cuda_graphs: bool = False, memory_format: str = "contiguous") -> "Predictor":
        """Load and verify (manifest, checksum, keys, output shape) or raise ModelLoadError. ``auto`` serves what
        was measured fastest on the device type (models/export/choose.py FASTEST_ON): the ONNX file under ONNX
        Runtime with ``threads`` intra-op threads, or a fitting AOTInductor package (float or int8); else the
        manifest's default format (models/export/load.py, shared with python -m models.predict). ``cuda_graphs``:
        on CUDA, replay each warmed batch shape's forward pass as a CUDA graph (graphs.py); ``memory_format``:
        ``channels_last`` lays out the module's weights and its batches so, where it holds its weights."""
        loaded = load_model(weights_dir, weights_format=weights_format, device=device, dtype=dtype,
                            jit_optimize=jit_optimize, max_batch_size=max_batch_size, threads=threads)
        predictor = cls(loaded.module, loaded.manifest, device=loaded.device, dtype=loaded.dtype,
                        weights_format=loaded.weights_format, weights_bytes=loaded.weights_bytes,
                        cuda_graphs=cuda_graphs, memory_format=memory_format)
        predictor.weights_dir = weights_dir
        return predictor

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

    def replays_batches_up_to(self, cap: int) -> bool:
        """Whether every batch of up to ``cap`` images runs its forward pass as a CUDA graph's replay: warm-up
        captured one for each batch shape a batch is padded to, the largest at least ``cap`` (a batch past every
        warmed shape would run eagerly)."""
        return (self.graphs is not None and bool(self.warmed_batch_sizes) and max(self.warmed_batch_sizes) >= cap
                and set(self.warmed_batch_sizes) <= set(self.graphs.batch_sizes))

    def _padded_size(self, rows: int) -> int:
        return next((size for size in self.warmed_batch_sizes if size >= rows), rows)

    def _rows(self, batch: torch.Tensor) -> torch.Tensor:
        """The forward pass of a batch on the device in the compute dtype -> float32 softmax probabilities there,
        followed by the embedding's columns when the model answers one, of unit length in float32 (one normalised
        in bfloat16 or float16 is off by up to about 1%: its dot products would be no cosine similarities)."""
        logits, embedding = split_outputs(self.module(batch))  # laid out by its caller (``_laid_out``)
        probabilities = logits.float().softmax(dim=1)
        if embedding is None:
            return probabilities
        return torch.cat([probabilities, F.normalize(embedding.float(), dim=1)], dim=1)

    def predict_batch(self, batch: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) on the CPU or the device -> (N, classes) float32 softmax probabilities on the CPU, each row
        followed by the image's embedding when the model has one ((N, classes + dim)). NonFiniteOutput when a row
        holds NaN or infinity: one vectorised check a batch, the rows looked at only then."""
        out = self._forward(batch)
        values = out.numpy()
        if not np.isfinite(values).all():
            failed = NonFiniteOutput(values, self.where)
            log.warning("%s", failed)
            raise failed
        return out

    def _forward(self, batch: torch.Tensor) -> torch.Tensor:
        """``predict_batch`` unchecked: the rows whatever their values (the warm-up's, which nobody reads)."""
        rows = batch.shape[0]
        size = self._padded_size(rows) if self.pad_batches else rows
        if self.device.type == "cuda" and batch.device.type == "cpu":
            batch = batch.pin_memory()
        if self.graphs is not None and (replayed := self.graphs.run(batch, size)) is not None:
            return replayed
        batch = batch.to(self.device, non_blocking=True)
        if size > rows:
            batch = torch.cat([batch, batch.new_zeros(size - rows, *batch.shape[1:])])  # on the device
        try:
            with torch.inference_mode():
                return self._rows(self._laid_out(batch, self.dtype))[:rows].cpu()
        except torch.cuda.OutOfMemoryError:
            if self.device.type == "cuda":
                release_cached_memory(wait=False)  # the smaller retry gets the cached blocks, unless a capture runs
            raise

    def probabilities(self, batch: torch.Tensor) -> torch.Tensor:
        """``predict_batch``'s probabilities alone: (N, classes) float32 on the CPU."""
        return self.predict_batch(batch)[:, :self.num_classes]

    def memory_stats(self) -> dict[str, int]:
        """CUDA memory allocated and reserved by this process on its device, or nothing on CPU."""
        return device_memory_stats(self.device)

    def warmup(self, max_batch_size: int, repeats: int = 5, timing_s: float = math.inf) -> dict[int, float]:
        """Run every batch shape the batcher's batches run with (``batch_shapes``: so no request pays for
        first-call setup) and time them.

        Returns images/s of the forward pass per batch size from the fastest of ``repeats`` timed runs after one
        untimed one (the fastest run is the one least disturbed by other work on the machine); the timed rounds
        after the first stop once the warm-up has run ``timing_s`` (WARMUP_TIMING_S: a model of seconds a forward
        pass took a quarter of an hour for its five rounds of sixteen sizes on the CPU), and a warm-up that runs
        long says how far it got every WARMUP_PROGRESS_S. The timed runs go
        round the sizes rather than size after size: a machine whose speed drifts during warm-up then slows every
        size alike, instead of making one size look best, as it did on a shared VM (docs/performance.md: Figures
        behind the code's choices). How much the runs of a size differ (``warmup_noise``) says how far the figures
        can be trusted: a worker warming up beside a busy one measures a curve no steadier than that.
        """
        started = said = time.perf_counter()
        # one batch of the largest shape, each smaller one a view of its first rows (before: a batch of each shape,
        # so the inputs alone took sizes squared: MAX_BATCH_SIZE=64 held 1.2 GB of zeros on the CPU; a trial)
        shapes = self.batch_shapes(max_batch_size)
        largest = torch.zeros(max(shapes), *self.manifest.preprocess.input_shape)
        batches = {size: largest[:size] for size in shapes}
        for size, batch in batches.items():
            self._forward(batch)
            self.warmed_batch_sizes.append(size)
            if time.perf_counter() - said > WARMUP_PROGRESS_S:
                said = time.perf_counter()
                log.info("warming up %s version %s: %d of %d batch shapes run in %.0fs", self.manifest.name,
                         self.manifest.version, len(self.warmed_batch_sizes), len(batches), said - started)
        if self.graphs is not None:
            self._capture_graphs(list(batches))
        runs: dict[int, list[float]] = {size: [] for size in batches}
        for round_ in range(repeats):
            if round_ and time.perf_counter() - started > timing_s:
                log.info("warming up %s version %s: timed %d round(s) of %d in %.0fs (WARMUP_TIMING_S)",
                         self.manifest.name, self.manifest.version, round_, repeats, time.perf_counter() - started)
                break
            for size, batch in batches.items():
                begun = time.perf_counter()
                self._forward(batch)  # returns on the CPU, so CUDA work is finished when it does
                runs[size].append(time.perf_counter() - begun)
        fastest = {size: max(min(times), 1e-9) for size, times in runs.items()}
        self.warmup_noise = run_spread(runs)
        log.info("warmed up batch sizes %s in %.2fs", self.warmed_batch_sizes, time.perf_counter() - started)
        return {size: size / seconds for size, seconds in fastest.items()}

    def _laid_out(self, batch: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``batch`` in ``dtype`` and, in channels_last, laid out so, in one copy (none when nothing changes); in the
        contiguous layout, the default, its strides as they come, as before MEMORY_FORMAT."""
        layout = torch.channels_last if self.memory_format == "channels_last" else torch.preserve_format
        return batch.to(dtype=dtype or batch.dtype, memory_format=layout)

    def _capture_graphs(self, sizes: list[int]) -> None:
        """Capture the forward pass of each of ``sizes`` as a graph, the largest first (they share its memory); if
        one cannot be captured the forward passes stay eager, and the log says why."""
        assert self.graphs is not None
        try:
            for size in sorted(sizes, reverse=True):
                self.graphs.capture(self._laid_out(torch.zeros(  # a replay's copy into it lays its batch out
                    size, *self.manifest.preprocess.input_shape, device=self.device, dtype=self.dtype)))
        except Exception as exc:  # noqa: BLE001 - a module capture refuses still serves, eagerly
            log.warning("%s %s: forward passes stay eager: CUDA graph capture failed: %s", self.manifest.name,
                        self.manifest.version, exc)
            self.graphs = None
            return
        log.info("%s %s: forward passes replay CUDA graphs for batch sizes %s", self.manifest.name,
                 self.manifest.version, self.graphs.batch_sizes)


def device_memory_stats(device: torch.device) -> dict[str, int]:
    """CUDA memory allocated and reserved by this process on ``device``, or nothing on CPU."""
    if device.type != "cuda":
        return {}
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device)}
