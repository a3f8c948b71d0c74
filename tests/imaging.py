"""Small image factories for tests."""
from __future__ import annotations

import io

from PIL import Image

RED, GREEN, BLUE = (230, 20, 20), (20, 230, 20), (20, 20, 230)


def image_bytes(color: tuple[int, ...] = RED, fmt: str = "JPEG", size: tuple[int, int] = (32, 24),
                mode: str = "RGB", **save: object) -> bytes:
    """Encode a flat-colour image; ``color`` is given in ``mode``'s channels."""
    buffer = io.BytesIO()
    Image.new(mode, size, color).save(buffer, format=fmt, **save)
    return buffer.getvalue()


def encode(image: Image.Image, fmt: str = "JPEG", **save: object) -> bytes:
    """Encode a PIL image."""
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save)
    return buffer.getvalue()
