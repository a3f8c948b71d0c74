"""What a run reads from the device without stalling it: a scalar copied behind the queued work, peak memory."""
from __future__ import annotations

import torch


class AsyncScalar:
    """A device scalar shown without stalling the GPU: copied to pinned host memory behind the queued work, read
    once that copy has landed (a ``.item()`` would wait for every queued kernel). On the CPU it is read at once."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host = torch.zeros((), dtype=torch.float32, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None
        self.pending, self.value = False, float("nan")

    def push(self, value: torch.Tensor) -> None:
        """Start copying ``value``; while the previous copy is still in flight, skip this one."""
        if self.event is None:
            self.value = float(value)
            return
        if not self._landed():
            return
        self.host.copy_(value.detach(), non_blocking=True)
        self.event.record()
        self.pending = True

    def _landed(self) -> bool:
        """Take the value of a copy that has landed; whether no copy is in flight."""
        if self.pending and self.event is not None and self.event.query():
            self.value, self.pending = float(self.host), False
        return not self.pending

    def text(self) -> str:
        """The newest landed value, for a progress bar (a copy that landed since the last push counts)."""
        self._landed()
        return f"{self.value:.4f}"


def reset_peak_memory(device: torch.device) -> None:
    """Start measuring the peak GPU memory anew (each epoch)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, float]:
    """``{"peak_gpu_memory_mb": ...}`` since the last reset on CUDA; nothing on the CPU."""
    if device.type != "cuda":
        return {}
    return {"peak_gpu_memory_mb": torch.cuda.max_memory_allocated(device) / 2**20}
