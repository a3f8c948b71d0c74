"""Real photos for benchmarks and tests: scikit-image's colour photos, re-encoded at several sizes."""
from __future__ import annotations

import io
from functools import lru_cache

import numpy as np
import skimage.data
from PIL import Image

PHOTO_NAMES = ("chelsea", "coffee", "astronaut", "rocket", "cat", "immunohistochemistry")
SIZES = {"native": None, "1920x1080": (1920, 1080), "4000x3000": (4000, 3000)}


def photo(name: str) -> Image.Image:
    """One scikit-image photo as an RGB PIL image."""
    return Image.fromarray(np.asarray(getattr(skimage.data, name)())).convert("RGB")


def jpeg(image: Image.Image, size: tuple[int, int] | None = None, quality: int = 90) -> bytes:
    """JPEG bytes of ``image``, resized (bicubic) to ``size`` first when given."""
    if size is not None:
        image = image.resize(size, Image.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


@lru_cache(maxsize=1)
def workload() -> tuple[bytes, ...]:
    """The benchmark's request bodies: every photo at its native size, 1920x1080 and 4000x3000, as JPEG."""
    return tuple(jpeg(photo(name), size) for name in PHOTO_NAMES for size in SIZES.values())
