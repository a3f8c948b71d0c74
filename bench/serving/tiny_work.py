"""What the overhead benchmarks serve (``overhead``, ``engine_only``, ``http_side``): a one-layer model on 8x8 inputs
with an ImageNet model's 1,000 classes, exported the normal way, so a forward pass takes microseconds, and JPEG bodies
of a photo's size that decode in microseconds (an 8x8 photo padded with comment segments)."""
from __future__ import annotations

import io
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

MODEL = "tiny"
INPUT = (3, 8, 8)
BODY_BYTES = 100_000  # about an ImageNet photo's JPEG
CLASSES = 1000  # as an ImageNet model: its labels and its rows cross the link
TINY_WEIGHTS = Path(tempfile.gettempdir()) / "visionserve-engine-only-weights"  # the tiny model engine_only and
# http_side share (the overhead benchmark writes its own in each run's folder)


def tiny_weights(out: Path) -> Path:
    """A one-layer classifier on 8x8 inputs (CLASSES classes), exported the normal way. Written once, whole or not
    at all (two tools at once may both find it missing), and torch imported only to write it."""
    if not (out / "manifest.json").exists():
        import torch
        from torch import nn

        from models.export.write import export_model
        from models.presets import EvalPreset

        torch.manual_seed(0)
        out.parent.mkdir(parents=True, exist_ok=True)
        written = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        export_model(nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(INPUT)), CLASSES)), out_dir=written,
                     name=MODEL, version="1", arch="linear", labels=[f"n{i:08d} class {i}" for i in range(CLASSES)],
                     preset=EvalPreset(resize_size=8, crop_size=8))
        try:
            written.rename(out)
        except OSError:  # written meanwhile by another (ours is dropped), or a folder left without its manifest
            if not (out / "manifest.json").exists():
                shutil.rmtree(out)
                written.rename(out)
            shutil.rmtree(written, ignore_errors=True)
    return out


def padded_jpeg(seed: int, size: int = BODY_BYTES) -> bytes:
    """An 8x8 JPEG photo of ``size`` bytes: comment (COM) segments after its start marker carry the padding, which
    every decoder skips."""
    pixels = np.random.default_rng(seed).integers(0, 255, (8, 8, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    photo = buffer.getvalue()
    padding, left = [], size - len(photo)
    while left > 4:
        length = min(left - 2, 65_535)  # a segment's length counts its own two bytes, not the marker's
        padding.append(b"\xff\xfe" + length.to_bytes(2, "big") + b"\0" * (length - 2))
        left -= length + 2
    return photo[:2] + b"".join(padding) + photo[2:]
