"""Real datasets from installed packages, written as train/val image folders (nothing is downloaded).

    python -m models.datasets digits --out data/digits       # scikit-learn's 1797 handwritten digits, 10 classes
    python -m models.datasets textures --out data/textures   # brick / grass / gravel photo patches (scikit-image)
    python -m models.datasets photos --out data/photos       # ImageNet-like JPEGs: 100 classes, 12,000 images
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from PIL import Image

log = logging.getLogger(__name__)


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


def _write_photos(out: Path, *, seed: int, args: argparse.Namespace) -> dict[str, int]:
    from models.photo_dataset import write_photos

    return write_photos(out, classes=args.classes, train_per_class=args.train_per_class,
                        val_per_class=args.val_per_class, long_side=args.long_side, seed=seed)


WRITERS: dict[str, Callable[..., dict[str, int]]] = {
    "digits": lambda out, seed, args: write_digits(out, seed=seed),
    "textures": lambda out, seed, args: write_textures(out, seed=seed),
    "photos": _write_photos,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for ``python -m models.datasets NAME --out DIR``."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=sorted(WRITERS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    photos = parser.add_argument_group("photos (ImageNet-like JPEGs, for python -m bench.train)")
    photos.add_argument("--classes", type=int, default=100, help="1 to 138")
    photos.add_argument("--train-per-class", type=int, default=100)
    photos.add_argument("--val-per-class", type=int, default=20)
    photos.add_argument("--long-side", type=int, default=500, help="pixels, +-10%% per image")
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        log.error("error: %s is not empty; choose a new --out folder", args.out)
        return 2
    try:
        counts = WRITERS[args.name](args.out, seed=args.seed, args=args)
    except ValueError as exc:
        log.error("error: %s", exc)
        return 2
    except ModuleNotFoundError as exc:  # scikit-image is a development requirement (kept out of the image)
        log.error("error: %s needs %s: pip install -r requirements-dev.txt", args.name, exc.name)
        return 2
    size = f", {counts['bytes'] / 2**20:.0f} MiB" if "bytes" in counts else ""
    log.info("wrote %s to %s: %d train, %d val images%s", args.name, args.out, counts["train"], counts["val"], size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
