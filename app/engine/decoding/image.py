"""Bytes -> RGB image -> model input tensor, with every limit checked before the pixels are decoded.

The decode rules (limits, header checks, the upright decode) are models/image_decode.py's, which models.predict
follows too; here their refusals become the service's errors, with the same message (``service_errors``).
"""
from __future__ import annotations

import io
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch
from PIL import Image

from app.errors import ImageTooLarge, InvalidImage, ServiceError, UnsupportedImageFormat
import models.image_decode as image_decode
from models.image_decode import BrokenImage, DecodeLimits, FormatNotServed, ImageRefused, TooManyPixels
from models.presets import ImageTransform

__all__ = ["DecodeLimits", "canary_jpeg", "decode_image", "image_to_tensor", "load_upright", "open_checked",
           "service_errors"]

_SERVICE_ERRORS: dict[type[ImageRefused], type[ServiceError]] = {
    BrokenImage: InvalidImage,  # 400 invalid_image
    TooManyPixels: ImageTooLarge,  # 413 image_too_large
    FormatNotServed: UnsupportedImageFormat,  # 415 unsupported_image_format
}


@contextmanager
def service_errors() -> Iterator[None]:
    """An image the decode rules refuse raised as the service's error of that kind (InvalidImage, ImageTooLarge,
    UnsupportedImageFormat), with the same message."""
    try:
        yield
    except ImageRefused as exc:
        raise _SERVICE_ERRORS[type(exc)](str(exc)) from exc


def canary_jpeg(size: int = 320) -> bytes:
    """A deterministic synthetic photo-like image (colour gradients) as a JPEG, for the readiness canary."""
    ramp = np.linspace(0, 255, size, dtype=np.float32)
    red, green = np.meshgrid(ramp, ramp[::-1])
    blue = np.full_like(red, 96.0)
    buffer = io.BytesIO()
    Image.fromarray(np.stack([red, green, blue], axis=-1).astype(np.uint8), mode="RGB").save(
        buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def open_checked(data: bytes, limits: DecodeLimits) -> Image.Image:
    """The image's header read and every limit checked; no pixel decoded yet (``load_upright`` does that)."""
    with service_errors():
        return image_decode.open_checked(data, limits)


def load_upright(image: Image.Image, limits: DecodeLimits) -> Image.Image:
    """Decode an ``open_checked`` image's pixels to an upright RGB image; corrupt data is InvalidImage."""
    with service_errors():
        return image_decode.load_upright(image, limits)


def decode_image(data: bytes, limits: DecodeLimits) -> Image.Image:
    """Decode bytes to an upright RGB image; raises InvalidImage, ImageTooLarge or UnsupportedImageFormat."""
    with service_errors():
        return image_decode.decode_image(data, limits)


def image_to_tensor(data: bytes, transform: ImageTransform, limits: DecodeLimits) -> torch.Tensor:
    """Decode ``data`` and apply the model's eval transform: one (C, H, W) float tensor."""
    return transform(decode_image(data, limits))
