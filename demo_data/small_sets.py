"""The two small sets, as train/val image folders: scikit-learn's handwritten digits and patches of scikit-image's
texture photos."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image


def _save(image: Image.Image, out: Path, split: str, label: str, index: int) -> None:
    folder = out / split / label
    folder.mkdir(parents=True, exist_ok=True)
    image.save(folder / f"{label}_{index:05d}.png")


def write_digits(out: Path, *, size: int = 32, val_fraction: float = 0.2, seed: int = 0) -> dict[str, int]:
    """scikit-learn's 8x8 digit scans (0-16 ink levels), scaled to ``size`` pixels, split per class at random."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    counts = {"train": 0, "val": 0}
    for label in range(10):
        indices = rng.permutation(np.flatnonzero(digits.target == label))
        n_val = round(len(indices) * val_fraction)
        for rank, index in enumerate(indices):
            # Ink is dark on paper in real scans: invert, so the images look like what users would send.
            pixels = (255 - digits.images[index] * (255 / 16)).clip(0, 255).astype(np.uint8)
            image = Image.fromarray(pixels, mode="L").resize((size, size), Image.Resampling.BICUBIC)
            split = "val" if rank < n_val else "train"
            _save(image, out, split, str(label), int(index))
            counts[split] += 1
    return counts


_TEXTURES = ("brick", "grass", "gravel")


def write_textures(out: Path, *, per_class: int = 60, seed: int = 0,
                   classes: Sequence[str] = _TEXTURES) -> dict[str, int]:
    """Random patches of scikit-image's brick, grass and gravel photos (or other ``skimage.data`` photos named in
    ``classes``); train from the top half, val from the bottom half, so no val pixel was ever seen in training."""
    import skimage.data

    rng = np.random.default_rng(seed)
    counts = {"train": 0, "val": 0}
    for label in classes:
        photo = np.asarray(getattr(skimage.data, label)())
        half = photo.shape[0] // 2
        for split, rows in (("train", photo[:half]), ("val", photo[half:])):
            for index in range(per_class if split == "train" else per_class // 2):
                side = int(rng.integers(96, min(rows.shape[0], rows.shape[1]) + 1))
                top = int(rng.integers(0, rows.shape[0] - side + 1))
                left = int(rng.integers(0, rows.shape[1] - side + 1))
                patch = Image.fromarray(rows[top:top + side, left:left + side]).convert("RGB")
                _save(patch, out, split, label, index)
                counts[split] += 1
    return counts
