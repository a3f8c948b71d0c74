"""Real photos for benchmarks and tests: scikit-image's colour photos, re-encoded at several sizes."""
from __future__ import annotations

import base64
import io
import json
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


@lru_cache(maxsize=1)
def imagenet_workload() -> tuple[bytes, ...]:
    """Every photo as an ImageNet-size JPEG (500x375, about what ImageNet's validation images are)."""
    return tuple(jpeg(photo(name), (500, 375)) for name in PHOTO_NAMES)


MULTIPART_BOUNDARY = "visionservebench"


def multipart(images: tuple[bytes, ...] | list[bytes]) -> bytes:
    """One multipart/form-data body with every image as a field ``image`` (boundary MULTIPART_BOUNDARY)."""
    parts = [f'--{MULTIPART_BOUNDARY}\r\nContent-Disposition: form-data; name="image"; filename="{i}.jpg"\r\n'
             f"Content-Type: image/jpeg\r\n\r\n".encode() + data + b"\r\n" for i, data in enumerate(images)]
    return b"".join(parts) + f"--{MULTIPART_BOUNDARY}--\r\n".encode()


def json_bodies(photos: tuple[bytes, ...] | list[bytes]) -> list[bytes]:
    """One base64 JSON body per photo, as visionserve's /predict reads it: {"images": ["<base64>"]}."""
    return [json.dumps({"images": [base64.b64encode(data).decode()]}).encode() for data in photos]


def request_bodies(photos: tuple[bytes, ...], per_request: int) -> tuple[list[bytes], str]:
    """Request bodies of ``per_request`` photos each (a raw JPEG for one, multipart for more), and their type."""
    if per_request == 1:
        return list(photos), "image/jpeg"
    bodies = [multipart([photos[(start + i) % len(photos)] for i in range(per_request)])
              for start in range(len(photos))]
    return bodies, f"multipart/form-data; boundary={MULTIPART_BOUNDARY}"
