"""The photos the docs' commands send (``curl -F image=@cat.jpg ...``): a cat and a cup of coffee from
scikit-image's bundled photos, written as the JPEGs the docs' sample answers came from."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from PIL import Image

SAMPLES = {"cat.jpg": "chelsea", "cup.jpg": "coffee"}  # file -> skimage.data's photo
QUALITY = 90

log = logging.getLogger("demo_data")


def write_samples(out: Path) -> list[Path]:
    """Each of ``SAMPLES`` written into ``out`` (made if missing), a file already there kept as it is; the files
    written."""
    import skimage.data

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, photo in SAMPLES.items():
        path = out / name
        if path.exists():
            log.info("kept %s (already there)", path)
            continue
        Image.fromarray(np.asarray(getattr(skimage.data, photo)())).convert("RGB").save(path, "JPEG",
                                                                                        quality=QUALITY)
        written.append(path)
    return written
