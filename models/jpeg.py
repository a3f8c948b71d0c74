"""Batched JPEG decoding on a device (nvJPEG on CUDA, libjpeg-turbo on the CPU), shared by the server's device
decode path and training's GPU data path."""
from __future__ import annotations

import logging
from typing import Sequence

import torch
from torchvision.io import ImageReadMode, decode_jpeg

log = logging.getLogger(__name__)


def decode_jpegs(encoded: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """Each encoded JPEG (a 1-D uint8 CPU tensor) as upright RGB uint8 (C, H, W) on ``device``, in one batched call;
    None for those the decoder refuses (the caller decodes them on the CPU and says why if it cannot either)."""
    if not encoded:
        return []
    try:
        return list(decode_jpeg(list(encoded), mode=ImageReadMode.RGB, device=device, apply_exif_orientation=True))
    except RuntimeError as exc:  # one bad image fails the batched call: decode them one by one instead
        log.debug("batched JPEG decoding failed, decoding one at a time: %s", exc)
    out: list[torch.Tensor | None] = []
    for data in encoded:
        try:
            out.append(decode_jpeg(data, mode=ImageReadMode.RGB, device=device, apply_exif_orientation=True))
        except RuntimeError:
            out.append(None)
    return out
