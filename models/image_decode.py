"""An image's bytes to upright RGB pixels under the serving limits: the decode rules the server
(app/engine/decoding/) and ``python -m models.predict`` both follow, stated once.

Every limit is checked from the header before any pixel is decoded (``open_checked``; a plain JPEG's header is read
without PIL on the tensor and device paths, ``checked_header``); then PIL decodes the pixels
(reduced-scale for large JPEGs) and turns them upright by their EXIF orientation (``load_upright``), or on the
tensor path libjpeg-turbo decodes a JPEG to the same pixels (``decode_tensor``). A refused image raises an
``ImageRefused`` whose message says why: the server raises its HTTP error of that kind with the same message
(app/engine/decoding/image.py), models.predict writes the message on the file's line.
"""
from __future__ import annotations

import io
import logging
import warnings
from dataclasses import dataclass
from typing import Protocol

import torch
from PIL import Image, UnidentifiedImageError

from models.data.jpeg import JpegHeader, decode_jpeg_cpu, read_jpeg_header
from models.presets import IMAGE_FORMATS, JPEG_FORMATS, pil_to_tensor, upright_rgb

log = logging.getLogger(__name__)

# The max_pixels check reads the size from the header and refuses before any pixel is decoded, so PIL's own bomb
# guard (a warning, then an error at a fixed size) is left to it. Filters are set once at import because
# warnings.catch_warnings is not thread-safe and the server's requests decode in parallel threads.
Image.MAX_IMAGE_PIXELS = None
warnings.filterwarnings("ignore", message="(Corrupt|Possibly corrupt) EXIF", category=UserWarning)


class ImageRefused(Exception):
    """An image the serving rules refuse; the message says why, for whoever sent it."""


class BrokenImage(ImageRefused):
    """Empty, not an image, a broken header, no pixels, too long and thin, or corrupt pixel data (the server's
    400 invalid_image)."""


class TooManyPixels(ImageRefused):
    """More pixels than ``max_pixels``, read from the header (the server's 413 image_too_large)."""


class FormatNotServed(ImageRefused):
    """An image in a format outside IMAGE_FORMATS (the server's 415 unsupported_image_format)."""


class LimitSettings(Protocol):
    """What holds the limits by name (the server's Settings)."""

    @property
    def max_pixels(self) -> int: ...

    @property
    def max_aspect_ratio(self) -> float: ...

    @property
    def jpeg_draft_min_side(self) -> int: ...

    @property
    def max_jpeg_scans(self) -> int: ...


@dataclass(frozen=True)
class DecodeLimits:
    """Per-image limits the decoder enforces; the defaults are the server's (app/config.py, held equal by
    tests/training/test_predict.py)."""

    max_pixels: int = 40_000_000
    max_aspect_ratio: float = 20.0
    jpeg_draft_min_side: int = 1024  # 0 disables reduced-scale JPEG decoding
    max_jpeg_scans: int = 64  # a progressive JPEG's scans, each a decode of the whole image again (0: no limit)

    @classmethod
    def from_settings(cls, settings: LimitSettings) -> "DecodeLimits":
        """The limits a service with ``settings`` enforces."""
        return cls(max_pixels=settings.max_pixels, max_aspect_ratio=settings.max_aspect_ratio,
                   jpeg_draft_min_side=settings.jpeg_draft_min_side, max_jpeg_scans=settings.max_jpeg_scans)


SERVED_NAMES = "JPEG, PNG, WebP, BMP, GIF"  # IMAGE_FORMATS as a sender names them (MPO: a camera's JPEG)
# Formats people send that PIL does not read, told by how they begin: refused as not served (415), not as broken
ISO_BRANDS = {b"heic": "HEIC", b"heix": "HEIC", b"hevc": "HEIC", b"hevx": "HEIC", b"heim": "HEIC", b"heis": "HEIC",
              b"mif1": "HEIF", b"msf1": "HEIF", b"avif": "AVIF", b"avis": "AVIF"}  # an ISO media file's ftyp brand
JPEG_XL_SIGNATURES = (b"\xff\x0a", b"\x00\x00\x00\x0cJXL \r\n\x87\n")


def unserved_format(data: bytes | memoryview) -> str | None:
    """The name of an image format outside IMAGE_FORMATS that ``data`` begins as (an iPhone's HEIC, AVIF, JPEG XL,
    SVG, PDF), or None."""
    head = bytes(data[:1024])
    if head[4:8] == b"ftyp":
        return ISO_BRANDS.get(head[8:12])
    if head.startswith(JPEG_XL_SIGNATURES):
        return "JPEG XL"
    if head.startswith(b"%PDF-"):
        return "PDF"
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if text.startswith(b"<") and b"<svg" in text.lower():
        return "SVG"
    return None


def _open(data: bytes) -> Image.Image:
    if not data:
        raise BrokenImage("the image is empty (0 bytes)")
    try:
        return Image.open(io.BytesIO(data))
    except UnidentifiedImageError as exc:
        name = unserved_format(data)
        if name is not None:
            raise FormatNotServed(f"image format {name} is not supported; send one of {SERVED_NAMES}") from exc
        raise BrokenImage("the data is not an image in a format we can read") from exc
    except Exception as exc:  # noqa: BLE001 - PIL's header parsers raise many types on garbage
        raise BrokenImage(f"the image header is broken: {exc}") from exc


def _check_header(image: Image.Image, limits: DecodeLimits) -> None:
    if image.format not in IMAGE_FORMATS:
        raise FormatNotServed(
            f"image format {image.format} is not supported; send one of {SERVED_NAMES}")
    check_size(*image.size, limits)


def check_size(width: int, height: int, limits: DecodeLimits) -> None:
    """An image of ``width`` x ``height`` as the server's limits judge it (BrokenImage, TooManyPixels)."""
    if width <= 0 or height <= 0:
        raise BrokenImage(f"the image has no pixels ({width}x{height})")
    if width * height > limits.max_pixels:
        raise TooManyPixels(f"the image is {width}x{height} = {width * height} pixels; "
                            f"the limit is {limits.max_pixels}")
    if max(width, height) / min(width, height) > limits.max_aspect_ratio:
        raise BrokenImage(f"the image is {width}x{height}; its aspect ratio is over {limits.max_aspect_ratio:g}")


def _check_scans(data: bytes, limits: DecodeLimits) -> None:
    """A progressive JPEG's scans, counted by their markers (a thumbnail's in its EXIF count too): each decodes the
    whole image again, so a file of a few hundred KB with thousands of them held a decoding thread for minutes."""
    scans = (data if isinstance(data, (bytes, bytearray)) else bytes(data)).count(b"\xff\xda")  # (the link's views
    # of its arena have no count: a progressive JPEG's copy costs far less than its decode)
    if limits.max_jpeg_scans and scans > limits.max_jpeg_scans:
        raise BrokenImage(f"the progressive JPEG has {scans} scans; the limit is {limits.max_jpeg_scans} (each "
                          "decodes the whole image again; encoders write about 10)")


def open_checked(data: bytes, limits: DecodeLimits) -> Image.Image:
    """The image's header read and every limit checked; no pixel decoded yet (``load_upright`` does that)."""
    image = _open(data)
    _check_header(image, limits)
    if is_jpeg(image) and image.info.get("progressive"):
        _check_scans(data, limits)
    return image


def checked_header(data: bytes, limits: DecodeLimits) -> tuple[JpegHeader | None, Image.Image | None]:
    """An image's header read and every limit checked, no pixel decoded: a plain JPEG's without PIL
    (``read_jpeg_header``; no PIL image then), any other image's by PIL (``open_checked``: its image, and its
    JpegHeader when it is a JPEG)."""
    header = read_jpeg_header(data)
    if header is not None:
        check_size(header.width, header.height, limits)
        if header.progressive:
            _check_scans(data, limits)
        return header, None
    image = open_checked(data, limits)
    return (JpegHeader.of(image) if is_jpeg(image) else None), image


def is_jpeg(image: Image.Image) -> bool:
    """A JPEG (or a camera's MPO, a JPEG with extra frames)."""
    return image.format in JPEG_FORMATS


def load_upright(image: Image.Image, limits: DecodeLimits) -> Image.Image:
    """Decode an ``open_checked`` image's pixels to an upright RGB image; corrupt data is BrokenImage."""
    try:
        if is_jpeg(image) and limits.jpeg_draft_min_side:
            # libjpeg scales by 1/2, 1/4 or 1/8 during the DCT: much faster, and the later resize shrinks further.
            side = limits.jpeg_draft_min_side
            image.draft(image.mode, (side, side))
        image.load()
        return upright_rgb(image)
    except Exception as exc:  # noqa: BLE001 - truncated or corrupt pixel data, in whichever codec
        raise BrokenImage(f"the image data is corrupt or truncated: {exc}") from exc


def decode_image(data: bytes, limits: DecodeLimits) -> Image.Image:
    """Decode bytes to an upright RGB image (the pil path); raises an ImageRefused."""
    return load_upright(open_checked(data, limits), limits)


def decode_tensor(data: bytes, limits: DecodeLimits) -> torch.Tensor:
    """The tensor path's decode: an upright RGB uint8 (3, H, W) tensor, PIL's pixels; raises an ImageRefused.

    JPEGs go to libjpeg-turbo (models/data/jpeg.py ``decode_jpeg_cpu``: reduced-scale decoding and the EXIF turn
    included, without PIL's copies); every other format, CMYK and YCCK JPEGs, and any JPEG libjpeg-turbo refuses
    (truncated data: PIL then says why) go to PIL's decoder.
    """
    header, image = checked_header(data, limits)
    if header is not None:
        try:
            return decode_jpeg_cpu(data, header, limits.jpeg_draft_min_side)
        except ValueError as exc:
            log.debug("PIL decodes this JPEG: %s", exc)
    if image is None:  # libjpeg-turbo refused what its header read took: PIL decodes it, or says why not
        image = open_checked(data, limits)
    return pil_to_tensor(load_upright(image, limits))  # the header read above, its pixels not yet touched
