"""The tensor decode path: bytes -> uint8 (C, H, W) tensor, then the eval transform on tensors (models/presets.py
``TensorEvalTransform``), so the same code runs on the CPU and, batched, on a GPU.

The header is read and every limit checked by PIL first (app/engine/decoding/image.py), before any pixel is decoded.
JPEGs go to libjpeg-turbo (models/data/jpeg.py ``decode_jpeg_cpu``: PIL's pixels, reduced-scale decoding by
``JPEG_DRAFT_MIN_SIDE`` and the EXIF orientation included, without PIL's copies); every other format, CMYK and
YCCK JPEGs (PIL converts them its own way), and any JPEG libjpeg-turbo refuses (truncated data: PIL then says why
not) go to PIL's decoder and join the same tensor transform.
"""
from __future__ import annotations

import logging

import torch

from app.engine.decoding.image import DecodeLimits, is_jpeg, load_upright, open_checked
from models.data.jpeg import decode_jpeg_cpu
from models.presets import TensorEvalTransform, pil_to_tensor

log = logging.getLogger(__name__)


def decode_tensor(data: bytes, limits: DecodeLimits) -> torch.Tensor:
    """An upright RGB uint8 (3, H, W) tensor; raises InvalidImage, ImageTooLarge or UnsupportedImageFormat."""
    image = open_checked(data, limits)
    if is_jpeg(image):
        try:
            return decode_jpeg_cpu(data, image, limits.jpeg_draft_min_side)
        except ValueError as exc:
            log.debug("PIL decodes this JPEG: %s", exc)
    return pil_to_tensor(load_upright(image, limits))  # the header read above, its pixels not yet touched


def image_to_tensor_path(data: bytes, transform: TensorEvalTransform, limits: DecodeLimits) -> torch.Tensor:
    """Decode ``data`` on the tensor path and apply the model's eval transform: one (C, H, W) float tensor."""
    return transform(decode_tensor(data, limits))
