"""Batched JPEG decoding on a device (nvJPEG on CUDA, libjpeg-turbo on the CPU), shared by the server's device
decode path and training's GPU data path."""
from __future__ import annotations

import contextlib
import logging
from typing import Sequence

import torch
from torchvision.io import ImageReadMode, decode_jpeg

log = logging.getLogger(__name__)

_DECODE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _decode(encoded: torch.Tensor | list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``decode_jpeg`` on ``device``; on CUDA ordered safely against the caller's stream.

    torchvision allocates nvJPEG's outputs on the caller's current stream but decodes on a private stream that does
    not wait for it (pytorch/vision#9606), so a block just freed on the caller's stream, still read by its queued
    kernels, could be overwritten. Decoding under a stream of our own, whose freed blocks only ever held decoder
    output that the caller's stream is recorded on, keeps the allocator from handing out such a block; the caller's
    stream then waits for the decode. No host synchronisation.
    """
    cuda = device.type == "cuda"
    caller = torch.cuda.current_stream(device) if cuda else None
    stream = _DECODE_STREAMS.setdefault(device, torch.cuda.Stream(device)) if cuda else None
    with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
        out = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device, apply_exif_orientation=True)
    images = out if isinstance(out, list) else [out]
    if caller is not None and stream is not None:
        caller.wait_stream(stream)
        for image in images:
            image.record_stream(caller)
    return images


def decode_jpegs(encoded: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """Each encoded JPEG (a 1-D uint8 CPU tensor) as upright RGB uint8 (C, H, W) on ``device``, in one batched call;
    None for those the decoder refuses (the caller decodes them on the CPU and says why if it cannot either)."""
    if not encoded:
        return []
    try:
        return list(_decode(list(encoded), device))
    except RuntimeError as exc:  # one bad image fails the batched call: decode them one by one instead
        log.debug("batched JPEG decoding failed, decoding one at a time: %s", exc)
    out: list[torch.Tensor | None] = []
    for data in encoded:
        try:
            out.append(_decode(data, device)[0])
        except RuntimeError:
            out.append(None)
    return out
