"""Mixed precision in one place: autocast for the forward pass, and the backward/step sequence.

The order matters and is easy to get wrong (torchvision's reference script once clipped scaled gradients):
scale -> backward -> unscale_ -> clip -> step -> update. GradScaler is only needed for fp16, whose narrow range
underflows small gradients; bf16 has fp32's range and needs no scaling.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager, Iterable, Literal

import torch

AmpDtype = Literal["bf16", "fp16"]
_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_amp(device: torch.device, amp_dtype: AmpDtype | None) -> None:
    """fp16 autocast is a CUDA feature here; on CPU we offer bf16, which CPUs run well and which needs no scaler."""
    if amp_dtype == "fp16" and device.type != "cuda":
        raise ValueError("--amp-dtype fp16 needs a CUDA device; use --amp-dtype bf16 on CPU")


def autocast(device: torch.device, amp_dtype: AmpDtype | None) -> ContextManager[object]:
    """The forward-pass context: autocast to ``amp_dtype``, or nothing when mixed precision is off."""
    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_DTYPES[amp_dtype])


def use_tf32(device: torch.device, enabled: bool) -> None:
    """TF32 tensor cores for the fp32 matmuls and convolutions on CUDA (Ampere and later). Both switches: cuDNN's
    is on by default, so turning only the matmul one off would leave the convolutions on TF32."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled


def make_scaler(device: torch.device, amp_dtype: AmpDtype | None) -> torch.amp.GradScaler | None:
    """A GradScaler for fp16 only."""
    return torch.amp.GradScaler(device.type) if amp_dtype == "fp16" else None


def backward_and_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, *,
                      scaler: torch.amp.GradScaler | None, parameters: Iterable[torch.nn.Parameter],
                      clip_grad_norm: float | None = None) -> None:
    """One optimisation step from a loss: scale -> backward -> unscale_ -> clip -> step -> update.

    Clipping must see true (unscaled) gradients, so ``unscale_`` comes first; ``scaler.step`` skips the step when
    the gradients overflowed, and ``update`` then lowers the scale.
    """
    optimizer.zero_grad(set_to_none=True)
    if scaler is None:
        loss.backward()
        if clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(list(parameters), clip_grad_norm)
        optimizer.step()
        return
    scaler.scale(loss).backward()
    if clip_grad_norm:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(list(parameters), clip_grad_norm)
    scaler.step(optimizer)
    scaler.update()
