"""Decoding: formats, modes, orientation and limits, before any server is involved. The rules are
models/image_decode.py's (models.predict follows them too); the server raises its errors for their refusals."""
from __future__ import annotations

import io
import re

import numpy as np
import pytest
from PIL import Image

from app.engine.decoding.image import DecodeLimits, decode_image
from app.engine.decoding.tensor import decode_tensor
from app.errors import ImageTooLarge, InvalidImage, UnsupportedImageFormat
from models import image_decode
from tests.support.imaging import BLUE, RED, encode, image_bytes

LIMITS = DecodeLimits(max_pixels=1_000_000, max_aspect_ratio=20, jpeg_draft_min_side=0)


def _mean_rgb(image: Image.Image) -> tuple[float, ...]:
    return tuple(np.asarray(image, dtype=np.float32).mean(axis=(0, 1)).round())


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "BMP", "GIF"])
def test_each_supported_format_decodes_to_rgb(fmt: str) -> None:
    image = decode_image(image_bytes(RED, fmt=fmt, size=(40, 30)), LIMITS)
    assert image.mode == "RGB" and image.size == (40, 30)
    red, green, blue = _mean_rgb(image)
    assert red > 200 and green < 60 and blue < 60


@pytest.mark.parametrize("mode, color", [("L", 128), ("P", 3), ("CMYK", (0, 255, 255, 0)), ("LA", (128, 255))])
def test_other_modes_become_rgb(mode: str, color: object) -> None:
    fmt = "JPEG" if mode in ("L", "CMYK") else "PNG"
    image = decode_image(image_bytes(color, fmt=fmt, mode=mode), LIMITS)  # type: ignore[arg-type]
    assert image.mode == "RGB"


def test_cmyk_red_stays_red() -> None:
    red, green, blue = _mean_rgb(decode_image(image_bytes((0, 255, 255, 0), mode="CMYK"), LIMITS))
    assert red > 200 and green < 60 and blue < 60


def test_transparent_pixels_become_white() -> None:
    assert _mean_rgb(decode_image(image_bytes((10, 10, 10, 0), fmt="PNG", mode="RGBA"), LIMITS)) == (255,) * 3


def test_sixteen_bit_png_is_rescaled_not_clipped() -> None:
    grey16 = Image.new("I;16", (10, 10), 32768)  # mid grey in 16 bits
    image = decode_image(encode(grey16, "PNG"), LIMITS)
    assert 120 <= _mean_rgb(image)[0] <= 135


def test_animated_gif_uses_its_first_frame() -> None:
    frames = [Image.new("RGB", (20, 20), c) for c in (RED, BLUE)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    red, _, blue = _mean_rgb(decode_image(buffer.getvalue(), LIMITS))
    assert red > 200 and blue < 60


def test_exif_orientation_is_applied() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = encode(Image.new("RGB", (40, 20), RED), "JPEG", exif=exif.tobytes())
    assert decode_image(data, LIMITS).size == (20, 40)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_orientation_matches_pillows_own_transpose(orientation: int) -> None:
    from PIL import ImageOps

    pixels = np.arange(40 * 20 * 3, dtype=np.uint32).reshape(20, 40, 3) % 251
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(Image.fromarray(pixels.astype(np.uint8)), "PNG", exif=exif.tobytes())
    expected = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))  # Pillow's copying version
    got = decode_image(data, LIMITS)
    assert got.size == expected.size and np.array_equal(np.asarray(got), np.asarray(expected.convert("RGB")))


def test_broken_exif_block_does_not_lose_the_photo() -> None:
    data = encode(Image.new("RGB", (40, 20), RED), "JPEG", exif=b"Exif\x00\x00MM\x00*\x00\x00\x00\x08\xff\xff")
    assert decode_image(data, LIMITS).size == (40, 20)


@pytest.mark.parametrize("data", [b"", b"hello, I am a text file", image_bytes(fmt="JPEG", size=(64, 64))[:200]])
def test_undecodable_bytes_are_invalid_image(data: bytes) -> None:
    with pytest.raises(InvalidImage):
        decode_image(data, LIMITS)


def test_unsupported_format_is_415() -> None:
    with pytest.raises(UnsupportedImageFormat) as excinfo:
        decode_image(image_bytes(fmt="TIFF"), LIMITS)
    assert excinfo.value.status == 415


def test_pixel_limit_is_checked_from_the_header() -> None:
    # 2000x2000 is 4 Mpx against a 1 Mpx limit: refused without decoding its pixels.
    data = image_bytes(fmt="PNG", size=(2000, 2000), mode="L", color=0)
    with pytest.raises(ImageTooLarge) as excinfo:
        decode_image(data, LIMITS)
    assert excinfo.value.status == 413


def test_extreme_aspect_ratio_is_refused() -> None:
    with pytest.raises(InvalidImage, match="aspect ratio"):
        decode_image(image_bytes(fmt="PNG", size=(1, 500)), LIMITS)


def test_one_pixel_image_decodes() -> None:
    assert decode_image(image_bytes(fmt="PNG", size=(1, 1)), LIMITS).size == (1, 1)


def test_jpeg_draft_keeps_at_least_the_asked_short_side() -> None:
    data = image_bytes(RED, fmt="JPEG", size=(2400, 1600))
    limits = DecodeLimits(max_pixels=10_000_000, max_aspect_ratio=20, jpeg_draft_min_side=300)
    image = decode_image(data, limits)
    assert image.size == (600, 400)  # 1/4 scale: the smallest DCT scale that keeps both sides >= 300
    no_draft = DecodeLimits(max_pixels=10_000_000, max_aspect_ratio=20, jpeg_draft_min_side=0)
    assert decode_image(data, no_draft).size == (2400, 1600)


@pytest.mark.parametrize("data, refusal, error", [
    (b"", image_decode.BrokenImage, InvalidImage),
    (b"hello, I am a text file", image_decode.BrokenImage, InvalidImage),
    (image_bytes(fmt="JPEG", size=(64, 64))[:200], image_decode.BrokenImage, InvalidImage),
    (image_bytes(fmt="PNG", size=(1, 500)), image_decode.BrokenImage, InvalidImage),
    (image_bytes(fmt="PNG", size=(2000, 2000), mode="L", color=0), image_decode.TooManyPixels, ImageTooLarge),
    (image_bytes(fmt="TIFF"), image_decode.FormatNotServed, UnsupportedImageFormat),
])
def test_the_servers_error_is_the_rules_refusal_with_its_message(data: bytes, refusal: type, error: type) -> None:
    # One rule, two callers: models.predict writes the refusal's message, the server answers it under its code.
    with pytest.raises(refusal) as refused:
        image_decode.decode_image(data, LIMITS)
    for decode in (decode_image, decode_tensor):
        with pytest.raises(error) as served:
            decode(data, LIMITS)
        assert served.value.message == str(refused.value) and isinstance(served.value.__cause__, refusal)


def test_the_refusals_messages_are_the_servers() -> None:
    # What clients read (and tests/app assert): the wording stays as the server has always said it.
    refusals = {
        b"": "the image is empty (0 bytes)",
        b"hello, I am a text file": "the data is not an image in a format we can read",
        image_bytes(fmt="PNG", size=(1, 500)): "the image is 1x500; its aspect ratio is over 20",
        image_bytes(fmt="PNG", size=(2000, 2000), mode="L", color=0):
            "the image is 2000x2000 = 4000000 pixels; the limit is 1000000",
        image_bytes(fmt="TIFF"): "image format TIFF is not supported; send one of JPEG, PNG, WebP, BMP, GIF",
        # formats PIL does not read, named by how they begin (Before: "not an image in a format we can read", 400)
        b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic": "image format HEIC is not supported; send one of "
                                                                 "JPEG, PNG, WebP, BMP, GIF",
        b"\xff\x0a\xfa\x7f": "image format JPEG XL is not supported; send one of JPEG, PNG, WebP, BMP, GIF",
        b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n": "image format PDF is not supported; send one of JPEG, PNG, WebP, BMP, GIF",
        b'\xef\xbb\xbf<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg"/>':
            "image format SVG is not supported; send one of JPEG, PNG, WebP, BMP, GIF",
        b"<html><body>not a picture</body></html>": "the data is not an image in a format we can read",
    }
    for data, message in refusals.items():
        with pytest.raises(image_decode.ImageRefused, match="^" + re.escape(message) + "$"):
            image_decode.open_checked(data, LIMITS)
        with pytest.raises(image_decode.ImageRefused, match="^" + re.escape(message) + "$"):
            image_decode.open_checked(memoryview(data), LIMITS)  # as a photo placed in shared memory comes
