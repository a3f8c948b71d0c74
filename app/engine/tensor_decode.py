"""The tensor decode path: bytes -> uint8 (C, H, W) tensor with torchvision's decoders, then the eval transform
on tensors (models/presets.py ``TensorEvalTransform``), so the same code runs on the CPU and, batched, on a GPU.

The header is read and every limit checked by PIL first (app/engine/decode.py), before any pixel is decoded.
JPEGs go to libjpeg-turbo (``torchvision.io.decode_jpeg``, EXIF orientation applied); every other format, and any
JPEG it refuses, falls back to PIL's decoder for that image and joins the same tensor transform.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_jpeg

from app.engine.decode import _JPEG_FORMATS, DecodeLimits, _check_header, _open, decode_image
from app.errors import InvalidImage
from models.presets import TensorEvalTransform

log = logging.getLogger(__name__)


def _pil_tensor(data: bytes, limits: DecodeLimits) -> torch.Tensor:
    image = decode_image(data, DecodeLimits(limits.max_pixels, limits.max_aspect_ratio, 0))  # full size, as JPEGs
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)


def decode_tensor(data: bytes, limits: DecodeLimits) -> torch.Tensor:
    """An upright RGB uint8 (3, H, W) tensor; raises InvalidImage, ImageTooLarge or UnsupportedImageFormat."""
    image = _open(data)
    _check_header(image, limits)
    if image.format not in _JPEG_FORMATS:
        return _pil_tensor(data, limits)
    try:
        encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return decode_jpeg(encoded, mode=ImageReadMode.RGB, apply_exif_orientation=True)
    except RuntimeError as exc:  # a JPEG libjpeg-turbo refuses here (a broken one fails in PIL too, as 400)
        log.debug("decode_jpeg refused an image, PIL decodes it: %s", exc)
        try:
            return _pil_tensor(data, limits)
        except InvalidImage:
            raise
        except Exception as pil_exc:  # noqa: BLE001 - whichever codec error, the client sent a bad image
            raise InvalidImage(f"the image data is corrupt or truncated: {pil_exc}") from pil_exc


def image_to_tensor_path(data: bytes, transform: TensorEvalTransform, limits: DecodeLimits) -> torch.Tensor:
    """Decode ``data`` on the tensor path and apply the model's eval transform: one (C, H, W) float tensor."""
    return transform(decode_tensor(data, limits))
