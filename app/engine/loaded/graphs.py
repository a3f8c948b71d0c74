"""A forward pass replayed as one CUDA graph per batch size (Settings.cuda_graphs).

On a GPU the thread that runs a forward pass pays for every kernel it launches, and at the small batches a
one-image-per-request load makes those launches, not the GPU, bound the engine: EfficientNet-Lite0 in float32 cost
its thread ~2.2 ms of CPU per batch of 1-8 on an H200, and 7-9 us replayed from a graph, whose batch also finished
4x sooner (530 against 2,270 us at one image; bench/results/2026-11-28-gpu-drill-h200.md). A graph is captured per
batch size the batcher runs (the padded sizes of Predictor.batch_shapes) at warm-up, into one shared memory pool,
and replayed from fixed input and output tensors: a batch is copied into its size's input, the graph replayed, the
rows read back, under one lock, so no replay can overwrite what another is reading.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, NamedTuple

import torch

from models.data.jpeg import stream_drawn_once

Forward = Callable[[torch.Tensor], torch.Tensor]
# (forward, its fixed input, the shared memory pool) -> (replay, its fixed output)
Capture = Callable[[Forward, torch.Tensor, object], tuple[Callable[[], None], torch.Tensor]]


# PyTorch hands out a device's streams from a pool per priority, 32 in turn, so two draws of one priority can be one
# stream. Graphs are captured on a pool no other stream of the engine is drawn from, where the device has one: a
# serving version's batches run on -1 (version.py BATCH_STREAM_PRIORITY), JPEG decoding on 0 (ours,
# models/data/jpeg.py, and torchvision's nvJPEG). Work another thread queued on a capturing stream would be captured
# into the graph instead of run, or fail it.
CAPTURE_PRIORITY = -2
_capture_streams: dict[torch.device, torch.cuda.Stream] = {}
_capturing = threading.Lock()  # captures one at a time: a device's captures share its stream


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream graphs are captured on for ``device``, drawn once: from CAPTURE_PRIORITY's pool where PyTorch
    offers it on this device, else from the default one (a device of two priorities; drawn once, it is not the
    decoding's stream). Called under ``_capturing``."""
    if device in _capture_streams:
        return _capture_streams[device]
    _, highest = torch.cuda.Stream.priority_range()
    return stream_drawn_once(_capture_streams, device, CAPTURE_PRIORITY if highest <= CAPTURE_PRIORITY else 0)


def cuda_capture(forward: Forward, fixed_input: torch.Tensor, pool: object) -> tuple[Callable[[], None],
                                                                                      torch.Tensor]:
    """``forward`` on ``fixed_input`` captured as one CUDA graph in ``pool``, on the device's capture stream
    (``capture_stream``) after two runs there (lazy initialisation and cuDNN's choices happen outside the capture,
    as PyTorch's CUDA graph notes ask), one capture at a time.

    Not through ``torch.cuda.graph``: that synchronises the device and empties the caching allocator first, under
    the feet of the versions serving beside a version that loads, and captures in the global mode, in which any
    other thread's allocation during the capture fails (theirs) and invalidates it (this one's). Captured here in
    the thread-local mode, with the capture stream left whatever happens, so a capture that fails leaves the thread's
    eager forward passes on its own stream."""
    device = fixed_input.device
    with _capturing:
        side = capture_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):
                forward(fixed_input)
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                fixed_output = forward(fixed_input)
            except BaseException:
                with contextlib.suppress(Exception):  # ends the capture; the forward's error is the one to report
                    graph.capture_end()
                _stop_allocating_to(pool, device)
                raise
            graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(side)
    return graph.replay, fixed_output


def _stop_allocating_to(pool: object, device: torch.device) -> None:
    """After a capture that failed: the allocator told that it is over. Before 2.12, PyTorch skipped that when ending
    an invalidated capture raised (pytorch/pytorch#180395), and its allocator then refused every later
    ``empty_cache`` and never reclaimed a block freed on another stream; later versions did it already, and say so
    (suppressed)."""
    with contextlib.suppress(Exception):
        torch._C._cuda_endAllocateToPool(device.index, pool)


def release_cached_memory(wait: bool) -> bool:
    """``torch.cuda.empty_cache()``, which PyTorch refuses (an internal assert) while a capture is under way anywhere
    in the process: only between captures. ``wait``: for the capture under way to end; else none is waited for, and
    nothing is released while one runs. Whether it ran."""
    if not _capturing.acquire(blocking=wait):
        return False
    try:
        torch.cuda.empty_cache()
        return True
    finally:
        _capturing.release()


class _Captured(NamedTuple):
    fixed_input: torch.Tensor
    replay: Callable[[], None]
    fixed_output: torch.Tensor


class GraphedForward:
    """``forward`` (a batch on the device -> its output) captured once per batch size and replayed."""

    def __init__(self, forward: Forward, capture: Capture = cuda_capture) -> None:
        self._forward = forward
        self._capture = capture
        self._captured: dict[int, _Captured] = {}
        self._pool: object = None
        self._lock = threading.Lock()

    @property
    def batch_sizes(self) -> list[int]:
        """The batch sizes captured, smallest first."""
        return sorted(self._captured)

    def capture(self, example: torch.Tensor) -> None:
        """Capture ``forward`` at ``example``'s batch size (its shape, dtype and device). Capture the largest size
        first: the later ones then fit in the memory the first one's pool holds."""
        if self._pool is None and example.is_cuda:
            self._pool = torch.cuda.graph_pool_handle()
        fixed_input = torch.zeros_like(example)
        replay, fixed_output = self._capture(self._forward, fixed_input, self._pool)
        self._captured[example.shape[0]] = _Captured(fixed_input, replay, fixed_output)

    def run(self, batch: torch.Tensor, size: int) -> torch.Tensor | None:
        """``batch`` (at most ``size`` rows, on the CPU, pinned, or on the device) through the graph of ``size`` ->
        its rows of the output, copied to the CPU; None when no graph of that size was captured. Rows past the
        batch's are zeros, as an eager padded batch's are."""
        captured = self._captured.get(size)
        if captured is None:
            return None
        rows = batch.shape[0]
        if batch.device != captured.fixed_input.device:  # uploaded as it is: a cast to the compute dtype runs there
            batch = batch.to(captured.fixed_input.device, non_blocking=True)
        with self._lock:
            captured.fixed_input[:rows].copy_(batch)
            if rows < size:
                captured.fixed_input[rows:].zero_()
            captured.replay()
            return captured.fixed_output[:rows].to("cpu", copy=True)
