"""Bytes -> RGB image -> model input tensor, with every limit checked before the pixels are decoded."""
from __future__ import annotations

import io
import logging
import warnings
from dataclasses import dataclass

import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from app.errors import ImageTooLarge, InvalidImage, UnsupportedImageFormat
from models.presets import ImageTransform, to_rgb

log = logging.getLogger(__name__)

# MPO is what many cameras write: a JPEG with extra frames. GIF and WebP may be animated: we use the first frame.
ACCEPTED_FORMATS = frozenset({"JPEG", "MPO", "PNG", "WEBP", "BMP", "GIF"})
_JPEG_FORMATS = frozenset({"JPEG", "MPO"})

# Our own max_pixels check runs first; PIL's bomb guard stays as a second line for absurd headers.
Image.MAX_IMAGE_PIXELS = 200_000_000


@dataclass(frozen=True)
class DecodeLimits:
    """Per-image limits the decoder enforces."""

    max_pixels: int
    max_aspect_ratio: float
    jpeg_draft_min_side: int  # 0 disables reduced-scale JPEG decoding


def _open(data: bytes) -> Image.Image:
    if not data:
        raise InvalidImage("the image is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageTooLarge(f"image dimensions are too large: {exc}") from exc
    except UnidentifiedImageError as exc:
        raise InvalidImage("the data is not an image in a format we can read") from exc
    except Exception as exc:  # noqa: BLE001 - PIL's header parsers raise many types on garbage
        raise InvalidImage(f"the image header is broken: {exc}") from exc


def _check_header(image: Image.Image, limits: DecodeLimits) -> None:
    if image.format not in ACCEPTED_FORMATS:
        raise UnsupportedImageFormat(
            f"image format {image.format} is not supported; send one of {', '.join(sorted(ACCEPTED_FORMATS))}")
    width, height = image.size
    if width <= 0 or height <= 0:
        raise InvalidImage(f"the image has no pixels ({width}x{height})")
    if width * height > limits.max_pixels:
        raise ImageTooLarge(f"the image is {width}x{height} = {width * height} pixels; "
                            f"the limit is {limits.max_pixels}")
    if max(width, height) / min(width, height) > limits.max_aspect_ratio:
        raise InvalidImage(f"the image is {width}x{height}; its aspect ratio is over {limits.max_aspect_ratio:g}")


def _apply_exif_orientation(image: Image.Image) -> Image.Image:
    try:
        return ImageOps.exif_transpose(image)
    except Exception:  # noqa: BLE001 - a broken EXIF block should not lose an otherwise good photo
        log.debug("ignoring unreadable EXIF orientation", exc_info=True)
        return image


def decode_image(data: bytes, limits: DecodeLimits) -> Image.Image:
    """Decode bytes to an upright RGB image; raises InvalidImage, ImageTooLarge or UnsupportedImageFormat."""
    image = _open(data)
    _check_header(image, limits)
    try:
        if image.format in _JPEG_FORMATS and limits.jpeg_draft_min_side:
            # libjpeg scales by 1/2, 1/4 or 1/8 during the DCT: much faster, and the later resize shrinks further.
            side = limits.jpeg_draft_min_side
            image.draft(image.mode, (side, side))
        image.load()
        image = _apply_exif_orientation(image)
        return to_rgb(image)
    except Exception as exc:  # noqa: BLE001 - truncated or corrupt pixel data, in whichever codec
        raise InvalidImage(f"the image data is corrupt or truncated: {exc}") from exc


def image_to_tensor(data: bytes, transform: ImageTransform, limits: DecodeLimits) -> torch.Tensor:
    """Decode ``data`` and apply the model's eval transform: one (C, H, W) float tensor."""
    return transform(decode_image(data, limits))
