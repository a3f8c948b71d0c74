"""Small image factories for tests."""
from __future__ import annotations

import io
from pathlib import Path

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


def write_image_folder(root: Path, *, train_per_class: int = 6, val_per_class: int = 3, seed: int = 0) -> Path:
    """A tiny train/val image folder: red, green and blue noisy pictures in mixed sizes and formats."""
    import numpy as np

    rng = np.random.default_rng(seed)
    formats = ("PNG", "JPEG", "WEBP", "BMP")
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for name, colour in (("red", RED), ("green", GREEN), ("blue", BLUE)):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for index in range(count):
                height, width = (int(v) for v in rng.integers(24, 72, size=2))
                noise = rng.normal(0, 40, size=(height, width, 3))
                pixels = (np.array(colour) + noise).clip(0, 255).astype("uint8")
                fmt = formats[index % len(formats)]
                (folder / f"{index}.{fmt.lower()}").write_bytes(encode(Image.fromarray(pixels), fmt))
    return root
