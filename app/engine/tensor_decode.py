"""The tensor decode path: bytes -> uint8 (C, H, W) tensor with torchvision's decoders, then the eval transform
on tensors (models/presets.py ``TensorEvalTransform``), so the same code runs on the CPU and, batched, on a GPU.

The header is read and every limit checked by PIL first (app/engine/decode.py), before any pixel is decoded.
JPEGs go to libjpeg-turbo (``torchvision.io.decode_jpeg``, EXIF orientation applied); every other format, any JPEG
it refuses, and JPEGs large enough for reduced-scale decoding (``JPEG_DRAFT_MIN_SIDE``) go to PIL's decoder for
that image and join the same tensor transform.
"""
from __future__ import annotations

import logging

import torch
from torchvision.io import ImageReadMode, decode_jpeg

from app.engine.decode import DecodeLimits, is_jpeg, load_upright, open_checked
from models.presets import TensorEvalTransform, pil_to_tensor

log = logging.getLogger(__name__)


def decode_tensor(data: bytes, limits: DecodeLimits) -> torch.Tensor:
    """An upright RGB uint8 (3, H, W) tensor; raises InvalidImage, ImageTooLarge or UnsupportedImageFormat."""
    image = open_checked(data, limits)
    draft = limits.jpeg_draft_min_side
    if not is_jpeg(image) or (draft and min(image.size) >= 2 * draft):
        # Other formats; and JPEGs large enough for PIL's reduced-scale decoding (1/2 to 1/8 in the DCT), which
        # libjpeg-turbo's full decode cannot match on the CPU (a 12 MP photo: 51 against 30 ms, measured).
        return pil_to_tensor(load_upright(image, limits))
    try:
        encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return decode_jpeg(encoded, mode=ImageReadMode.RGB, apply_exif_orientation=True)
    except RuntimeError as exc:  # a JPEG libjpeg-turbo refuses here (a broken one fails in PIL too, as 400)
        log.debug("decode_jpeg refused an image, PIL decodes it: %s", exc)
        return pil_to_tensor(load_upright(image, limits))  # the header read above, its pixels not yet touched


def image_to_tensor_path(data: bytes, transform: TensorEvalTransform, limits: DecodeLimits) -> torch.Tensor:
    """Decode ``data`` on the tensor path and apply the model's eval transform: one (C, H, W) float tensor."""
    return transform(decode_tensor(data, limits))
