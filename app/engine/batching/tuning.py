"""How a version's batches are sized to the machine: forward threads, the batch cap, where short batches run.

``forward_threads`` is models/serving.py's rule, which models.predict follows too; the server is its default case:
each gunicorn worker's request threads decode beside its forward pass, which takes half of the worker's share of
the cores (Settings.torch_threads).
"""
from __future__ import annotations

import statistics

import torch

from models.serving import forward_threads

__all__ = ["cap_share", "choose_batch_cap", "forward_threads", "inline_batches", "loop_batches", "run_spread"]


def inline_batches(setting: bool, device: torch.device) -> bool:
    """Whether a lone request may run its batch on its own thread (Settings.inline_when_idle): on the CPU only.

    On CUDA every thread that runs a forward pass has its own cuDNN handles and tuned plans (see Batcher.start):
    each of gunicorn's request threads would pay for them on its first batch, where the batcher thread has had
    them from warm-up (docs/performance.md: Figures behind the code's choices).
    """
    return setting and device.type == "cpu"


def loop_batches(device: torch.device, replays_every_batch: bool) -> bool:
    """Whether an engine's event loop may run a version's short batches itself (Batcher.run_queued, as
    ENGINE_LOOP_BATCH_MS says) instead of waking the batcher's thread and being woken back: on the CPU; on CUDA when
    every batch's forward pass replays a CUDA graph (``Predictor.replays_batches_up_to`` the batch cap).

    A replay holds none of the per-thread cuDNN plans an eager pass would tune again on the loop's thread (seconds a
    shape, see ``inline_batches``), and its launch is one call; what else a batch runs on the device (the upload,
    the device path's decode and resize, the read-back) uses neither cuDNN nor cuBLAS. Batches expected to take
    longer stay on the batcher's thread. The hand-off to that thread and back costs the engine about 1.5x its CPU
    per image on the CPU (docs/performance.md).
    """
    return device.type == "cpu" or replays_every_batch


CAP_TOLERANCE = 0.95  # a batch size within this share of the best images/s is as fast (choose_batch_cap)


def run_spread(runs: dict[int, list[float]]) -> float:
    """How much timed runs of the same batch differ: the median over batch sizes of (their median run / their
    fastest) - 1; 0 with one run each (nothing to compare)."""
    spreads = [statistics.median(times) / max(min(times), 1e-9) - 1 for times in runs.values() if len(times) > 1]
    return statistics.median(spreads) if spreads else 0.0


def cap_share(noise: float, tolerance: float = CAP_TOLERANCE) -> float:
    """The share of the best images/s a batch size must reach to be as fast: ``tolerance``, less twice the
    measurement's run-to-run ``noise`` (Predictor.warmup_noise), so that only a slowdown larger than the noise caps
    the batches (a flat curve measured beside a busy worker capped one worker's batches at 1 until it restarted)."""
    return max(0.0, tolerance - 2 * noise)


def choose_batch_cap(profile: dict[int, float], tolerance: float = CAP_TOLERANCE, noise: float = 0.0) -> int:
    """The largest batch size whose images/s is within ``cap_share`` of the best: above it the forward pass slows.

    Up to that size a batch costs about the same per image measured alone, and in the server the larger ones save
    what the warm-up cannot see (the batch's hand-offs, the weights read again per pass while request threads
    decode), at no higher p99 (docs/performance.md: Figures behind the code's choices). A batch only forms from
    requests already waiting, so a lone request never waits for a larger cap. Where batches do slow (on a small
    CPU, once the activations leave the cache) the cap stops below them; a GPU's curve keeps rising to the
    configured maximum.
    """
    least = cap_share(noise, tolerance) * max(profile.values())
    return max(size for size, rate in profile.items() if rate >= least)
