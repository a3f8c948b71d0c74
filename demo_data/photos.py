"""An ImageNet-like JPEG folder from the photos that scikit-image and scikit-learn ship, for measuring training
speed where decoding costs what it costs on ImageNet (``python -m bench.training.train``); nothing is downloaded.

Each class is one region of one photo (a 2 x 3 grid over 23 photos, taken round-robin so 100 classes span them
all); each image is a random crop around its region, resized to about 500 x 375 (landscape or, one in four,
portrait), with brightness, contrast and colour jitter and sensor-like noise, saved as a baseline JPEG at quality
94-96 with 4:2:0 chroma. That lands at 100-150 KB per image, as ImageNet's photos do. Grey photos are toned
with a colour per class; 2% of the images are single-channel JPEGs, as in ImageNet. The same seed writes the same
files.
"""
from __future__ import annotations

import io
import os
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance

_COLOUR = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry", "retina",
           "stereo_left", "stereo_right", "china", "flower", "colorwheel", "logo")
_GREY = ("camera", "brick", "grass", "gravel", "moon", "coins", "clock", "cell", "page", "text")
PHOTOS = _COLOUR + _GREY
GRID = (2, 3)  # rows x columns of regions per photo
GREY_FRACTION = 0.02  # single-channel JPEGs, about as many as ImageNet has


@lru_cache(maxsize=None)
def photo(name: str) -> np.ndarray:
    """A shipped photo as uint8 (H, W, 3) for colour or (H, W) for grey."""
    import skimage.data

    if name in ("china", "flower"):
        from sklearn.datasets import load_sample_image
        return load_sample_image(f"{name}.jpg")
    if name.startswith("stereo_"):
        left, right, _ = skimage.data.stereo_motorcycle()
        return left if name == "stereo_left" else right
    pixels = np.asarray(getattr(skimage.data, name)())
    return pixels[..., :3] if pixels.ndim == 3 else pixels


@dataclass(frozen=True)
class ClassRegion:
    """Where a class's images come from: a photo and a (row, column) cell of its grid."""

    name: str
    photo: str
    row: int
    column: int


def class_regions(count: int) -> list[ClassRegion]:
    """``count`` classes, round-robin over the photos so that even a few classes come from different photos."""
    cells = [(row, column) for row in range(GRID[0]) for column in range(GRID[1])]
    if not 0 < count <= len(PHOTOS) * len(cells):
        raise ValueError(f"classes must be between 1 and {len(PHOTOS) * len(cells)}, got {count}")
    regions = [ClassRegion(f"{name}_{row}{column}", name, row, column)
               for row, column in cells for name in PHOTOS]
    return regions[:count]


def _crop(pixels: np.ndarray, region: ClassRegion, rng: np.random.Generator) -> np.ndarray:
    """A random crop around the region's cell (which it may overlap by a quarter of a cell)."""
    height, width = pixels.shape[:2]
    cell_h, cell_w = height / GRID[0], width / GRID[1]
    top0, left0 = max(0.0, (region.row - 0.25) * cell_h), max(0.0, (region.column - 0.25) * cell_w)
    bottom0, right0 = min(height, (region.row + 1.25) * cell_h), min(width, (region.column + 1.25) * cell_w)
    side = rng.uniform(0.4, 0.8)
    crop_h, crop_w = max(8, int((bottom0 - top0) * side)), max(8, int((right0 - left0) * side))
    top = int(rng.uniform(top0, max(top0, bottom0 - crop_h)))
    left = int(rng.uniform(left0, max(left0, right0 - crop_w)))
    return pixels[top:top + crop_h, left:left + crop_w]


def render(region: ClassRegion, seed: int, long_side: int = 500) -> bytes:
    """One image of ``region`` as JPEG bytes, the same for the same seed."""
    rng = np.random.default_rng(seed)
    pixels = _crop(photo(region.photo), region, rng)
    if pixels.ndim == 2:  # a grey photo: toned with its class's colour, as old prints are
        tone = np.random.default_rng(zlib.crc32(region.name.encode())).uniform(0.75, 1.0, 3)
        pixels = (pixels[..., None] * tone).astype(np.uint8)
    image = Image.fromarray(pixels)
    long_side = int(long_side * rng.uniform(0.9, 1.1))
    size = (long_side, long_side * 3 // 4) if rng.random() < 0.75 else (long_side * 3 // 4, long_side)
    image = image.resize(size, Image.Resampling.BICUBIC)
    image = ImageEnhance.Brightness(image).enhance(rng.uniform(0.8, 1.2))
    image = ImageEnhance.Contrast(image).enhance(rng.uniform(0.8, 1.2))
    image = ImageEnhance.Color(image).enhance(rng.uniform(0.7, 1.3))
    noisy = np.asarray(image, dtype=np.float32) + rng.normal(0, rng.uniform(9, 13), np.asarray(image).shape)
    image = Image.fromarray(noisy.clip(0, 255).astype(np.uint8))
    if rng.random() < GREY_FRACTION:
        image = image.convert("L")
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=int(rng.integers(94, 97)))
    return buffer.getvalue()


def _write_one(job: tuple[ClassRegion, int, Path, int]) -> int:
    region, seed, path, long_side = job
    data = render(region, seed, long_side)
    path.write_bytes(data)
    return len(data)


def write_photos(out: Path, *, classes: int = 100, train_per_class: int = 100, val_per_class: int = 20,
                 long_side: int = 500, seed: int = 0, workers: int | None = None) -> dict[str, int]:
    """Write ``out/{train,val}/<class>/*.jpg``; returns the counts and the total bytes."""
    jobs = []
    for index, region in enumerate(class_regions(classes)):
        for split, count in (("train", train_per_class), ("val", val_per_class)):
            folder = out / split / region.name
            folder.mkdir(parents=True, exist_ok=True)
            for number in range(count):
                image_seed = (seed * 1_000 + index) * 100_000 + number * 2 + (split == "val")
                jobs.append((region, image_seed, folder / f"{region.name}_{number:05d}.jpg", long_side))
    with ProcessPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        total = sum(pool.map(_write_one, jobs, chunksize=32))
    return {"train": classes * train_per_class, "val": classes * val_per_class, "bytes": total}
