"""Bytes -> RGB image -> model input tensor, with every limit checked before the pixels are decoded."""
from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from app.config import Settings
from app.errors import ImageTooLarge, InvalidImage, UnsupportedImageFormat
from models.presets import IMAGE_FORMATS, JPEG_FORMATS, ImageTransform, upright_rgb

# Our max_pixels check reads the size from the header and refuses before any pixel is decoded, so PIL's own
# bomb guard (a warning, then an error at a fixed size) is left to it. Filters are set once at import because
# warnings.catch_warnings is not thread-safe and requests decode in parallel threads.
Image.MAX_IMAGE_PIXELS = None
warnings.filterwarnings("ignore", message="(Corrupt|Possibly corrupt) EXIF", category=UserWarning)


@dataclass(frozen=True)
class DecodeLimits:
    """Per-image limits the decoder enforces."""

    max_pixels: int
    max_aspect_ratio: float
    jpeg_draft_min_side: int  # 0 disables reduced-scale JPEG decoding

    @classmethod
    def from_settings(cls, settings: Settings) -> "DecodeLimits":
        """The limits a service with ``settings`` enforces."""
        return cls(max_pixels=settings.max_pixels, max_aspect_ratio=settings.max_aspect_ratio,
                   jpeg_draft_min_side=settings.jpeg_draft_min_side)


def canary_jpeg(size: int = 320) -> bytes:
    """A deterministic synthetic photo-like image (colour gradients) as a JPEG, for the readiness canary."""
    ramp = np.linspace(0, 255, size, dtype=np.float32)
    red, green = np.meshgrid(ramp, ramp[::-1])
    blue = np.full_like(red, 96.0)
    buffer = io.BytesIO()
    Image.fromarray(np.stack([red, green, blue], axis=-1).astype(np.uint8), mode="RGB").save(
        buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def _open(data: bytes) -> Image.Image:
    if not data:
        raise InvalidImage("the image is empty (0 bytes)")
    try:
        return Image.open(io.BytesIO(data))
    except UnidentifiedImageError as exc:
        raise InvalidImage("the data is not an image in a format we can read") from exc
    except Exception as exc:  # noqa: BLE001 - PIL's header parsers raise many types on garbage
        raise InvalidImage(f"the image header is broken: {exc}") from exc


def _check_header(image: Image.Image, limits: DecodeLimits) -> None:
    if image.format not in IMAGE_FORMATS:
        raise UnsupportedImageFormat(
            f"image format {image.format} is not supported; send one of {', '.join(sorted(IMAGE_FORMATS))}")
    width, height = image.size
    if width <= 0 or height <= 0:
        raise InvalidImage(f"the image has no pixels ({width}x{height})")
    if width * height > limits.max_pixels:
        raise ImageTooLarge(f"the image is {width}x{height} = {width * height} pixels; "
                            f"the limit is {limits.max_pixels}")
    if max(width, height) / min(width, height) > limits.max_aspect_ratio:
        raise InvalidImage(f"the image is {width}x{height}; its aspect ratio is over {limits.max_aspect_ratio:g}")


def open_checked(data: bytes, limits: DecodeLimits) -> Image.Image:
    """The image's header read and every limit checked; no pixel decoded yet (``load_upright`` does that)."""
    image = _open(data)
    _check_header(image, limits)
    return image


def is_jpeg(image: Image.Image) -> bool:
    """A JPEG (or a camera's MPO, a JPEG with extra frames)."""
    return image.format in JPEG_FORMATS


def load_upright(image: Image.Image, limits: DecodeLimits) -> Image.Image:
    """Decode an ``open_checked`` image's pixels to an upright RGB image; corrupt data is InvalidImage."""
    try:
        if is_jpeg(image) and limits.jpeg_draft_min_side:
            # libjpeg scales by 1/2, 1/4 or 1/8 during the DCT: much faster, and the later resize shrinks further.
            side = limits.jpeg_draft_min_side
            image.draft(image.mode, (side, side))
        image.load()
        return upright_rgb(image)
    except Exception as exc:  # noqa: BLE001 - truncated or corrupt pixel data, in whichever codec
        raise InvalidImage(f"the image data is corrupt or truncated: {exc}") from exc


def decode_image(data: bytes, limits: DecodeLimits) -> Image.Image:
    """Decode bytes to an upright RGB image; raises InvalidImage, ImageTooLarge or UnsupportedImageFormat."""
    return load_upright(open_checked(data, limits), limits)


def image_to_tensor(data: bytes, transform: ImageTransform, limits: DecodeLimits) -> torch.Tensor:
    """Decode ``data`` and apply the model's eval transform: one (C, H, W) float tensor."""
    return transform(decode_image(data, limits))
