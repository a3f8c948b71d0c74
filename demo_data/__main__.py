"""Real datasets from installed packages, written as train/val image folders (nothing is downloaded).

    python -m demo_data digits --out data/digits       # scikit-learn's 1797 handwritten digits, 10 classes
    python -m demo_data textures --out data/textures   # brick / grass / gravel photo patches (scikit-image)
    python -m demo_data photos --out data/photos       # ImageNet-like JPEGs: 100 classes, 12,000 images
    python -m demo_data samples --out .                # cat.jpg and cup.jpg, the photos the docs' commands send
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Callable, Sequence

from demo_data.small_sets import write_digits, write_textures

log = logging.getLogger("demo_data")


def _write_photos(out: Path, *, seed: int, args: argparse.Namespace) -> dict[str, int]:
    from demo_data.photos import write_photos

    return write_photos(out, classes=args.classes, train_per_class=args.train_per_class,
                        val_per_class=args.val_per_class, long_side=args.long_side, seed=seed)


WRITERS: dict[str, Callable[..., dict[str, int]]] = {
    "digits": lambda out, seed, args: write_digits(out, seed=seed),
    "textures": lambda out, seed, args: write_textures(out, seed=seed),
    "photos": _write_photos,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for ``python -m demo_data NAME --out DIR``."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(prog="python -m demo_data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=sorted([*WRITERS, "samples"]))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    photos = parser.add_argument_group("photos (ImageNet-like JPEGs, for python -m bench.training.train)")
    photos.add_argument("--classes", type=int, default=100, help="1 to 138")
    photos.add_argument("--train-per-class", type=int, default=100)
    photos.add_argument("--val-per-class", type=int, default=20)
    photos.add_argument("--long-side", type=int, default=500, help="pixels, +-10%% per image")
    args = parser.parse_args(argv)
    if args.name == "samples":  # two named files beside whatever the folder holds
        from demo_data.samples import write_samples

        for path in write_samples(args.out):
            log.info("wrote %s", path)
        return 0
    if args.out.exists() and any(args.out.iterdir()):
        log.error("error: %s is not empty; choose a new --out folder", args.out)
        return 2
    try:
        counts = WRITERS[args.name](args.out, seed=args.seed, args=args)
    except ValueError as exc:
        log.error("error: %s", exc)
        return 2
    except ModuleNotFoundError as exc:  # an environment without requirements.txt's scikit-learn or scikit-image
        log.error("error: %s needs %s: pip install -r requirements.txt", args.name, exc.name)
        return 2
    size = f", {counts['bytes'] / 2**20:.0f} MiB" if "bytes" in counts else ""
    log.info("wrote %s to %s: %d train, %d val images%s", args.name, args.out, counts["train"], counts["val"], size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
