"""Reading one file as the server reads an upload, in a DataLoader worker; the batch on the model's device.

Three paths, as the server's ``DECODE_PATH`` (app/engine/decoding/image.py, tensor_decode.py, device_decode.py):
``pil`` decodes with PIL (reduced-scale for large JPEGs) and runs ``eval_transform``; ``tensor`` (the server's
default on the CPU) decodes JPEGs with libjpeg-turbo and runs ``TensorEvalTransform``; ``device`` (its default on
CUDA) sends the JPEG's bytes and decodes the batch on the device (nvJPEG), preprocessing there. Every path first
reads the header and checks the server's limits, so a file the server would refuse is reported with its reason.
The rules are the server's, restated here because models/ may not import app/; ``tests/training/test_predict.py``
checks that the answers equal the server's for the same files.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from PIL import Image
from torch.utils.data import Dataset

from models.data.jpeg import decode_jpeg_cpu, decode_jpegs
from models.predict.inputs import Item
from models.presets import (
    IMAGE_FORMATS,
    JPEG_FORMATS,
    EvalPreset,
    TensorEvalTransform,
    eval_transform,
    pil_to_tensor,
    upright_rgb,
)

PATHS = ("pil", "tensor", "device")
# The limits below refuse a too-large image from its header; PIL's own bomb guard is left to them, as on the server.
Image.MAX_IMAGE_PIXELS = None


@dataclass(frozen=True)
class Limits:
    """The server's per-image limits (app/config.py's defaults: MAX_PIXELS, MAX_ASPECT_RATIO, JPEG_DRAFT_MIN_SIDE)."""

    max_pixels: int = 40_000_000
    max_aspect_ratio: float = 20.0
    jpeg_draft_min_side: int = 1024


class Unreadable(Exception):
    """A file that cannot be scored; the message is the reason written on its output line."""


def open_checked(data: bytes, limits: Limits) -> Image.Image:
    """The header read and every limit checked, no pixel decoded (the server's ``open_checked``)."""
    if not data:
        raise Unreadable("the image is empty (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data))
    except Exception as exc:  # noqa: BLE001 - PIL's header parsers raise many types on garbage
        raise Unreadable(f"not an image in a format we can read ({type(exc).__name__})") from None
    width, height = image.size
    if image.format not in IMAGE_FORMATS:
        raise Unreadable(f"image format {image.format} is not supported")
    if width <= 0 or height <= 0 or width * height > limits.max_pixels:
        raise Unreadable(f"the image is {width}x{height} pixels; the limit is {limits.max_pixels}")
    if max(width, height) / min(width, height) > limits.max_aspect_ratio:
        raise Unreadable(f"the image is {width}x{height}; its aspect ratio is over {limits.max_aspect_ratio:g}")
    return image


def load_upright(image: Image.Image, limits: Limits) -> Image.Image:
    """An ``open_checked`` image's pixels, upright RGB; large JPEGs decoded at reduced scale (the server's rule)."""
    try:
        if image.format in JPEG_FORMATS and limits.jpeg_draft_min_side:
            image.draft(image.mode, (limits.jpeg_draft_min_side,) * 2)
        image.load()
        return upright_rgb(image)
    except Exception as exc:  # noqa: BLE001 - truncated or corrupt pixel data, in whichever codec
        raise Unreadable(f"the image data is corrupt or truncated: {exc}") from None


def decode_pixels(data: bytes, limits: Limits) -> torch.Tensor:
    """The tensor path's decode: uint8 (3, H, W), libjpeg-turbo for JPEGs (PIL's pixels), else PIL."""
    image = open_checked(data, limits)
    if image.format in JPEG_FORMATS:
        try:
            return decode_jpeg_cpu(data, image, limits.jpeg_draft_min_side)
        except ValueError:  # libjpeg-turbo refused it: PIL decides, as on the server
            pass
    return pil_to_tensor(load_upright(image, limits))


class ScoreSet(Dataset):
    """Items read by the DataLoader's workers: (position, payload or None, reason). The payload is the model's
    input (``pil``, ``tensor``), or for ``device`` a JPEG's bytes (1-D uint8) or another format's pixels (3-D)."""

    def __init__(self, items: Sequence[Item], preset: EvalPreset, path: str, limits: Limits = Limits()) -> None:
        self.items, self.path, self.limits = list(items), path, limits
        self.pil = eval_transform(preset)
        self.tensor = TensorEvalTransform(preset)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor | None, str]:
        try:
            with open(self.items[index].file, "rb") as handle:
                data = handle.read()
            return index, self._payload(data), ""
        except Unreadable as exc:
            return index, None, str(exc)
        except OSError as exc:
            return index, None, f"cannot read the file: {exc.strerror or exc}"

    def _payload(self, data: bytes) -> torch.Tensor:
        if self.path == "pil":
            return self.pil(load_upright(open_checked(data, self.limits), self.limits))
        if self.path == "tensor":
            return self.tensor(decode_pixels(data, self.limits))
        image = open_checked(data, self.limits)
        if image.format in JPEG_FORMATS:
            return torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return pil_to_tensor(load_upright(image, self.limits))


def collate(rows: list[tuple[int, torch.Tensor | None, str]]) -> dict[str, Any]:
    """A batch: the positions and payloads that were read (stacked when preprocessed), and (position, reason) for
    those that were not."""
    good = [(index, payload) for index, payload, _ in rows if payload is not None]
    payloads = [payload for _, payload in good]
    stackable = bool(payloads) and all(p.dtype.is_floating_point for p in payloads)
    return {"index": [index for index, _ in good],
            "images": torch.stack(payloads) if stackable else payloads,
            "failed": [(index, reason) for index, payload, reason in rows if payload is None]}


def on_device(batch: dict[str, Any], device: torch.device, dtype: torch.dtype,
              transform: TensorEvalTransform) -> tuple[list[int], torch.Tensor | None]:
    """The batch's model input on ``device`` in ``dtype`` and the positions it holds. On the device path the JPEGs
    are decoded there in one call and preprocessed there; one the device decoder refuses is decoded on the host,
    and one nothing can read is added to ``batch["failed"]``."""
    images = batch["images"]
    if isinstance(images, torch.Tensor):
        return batch["index"], images.to(device, dtype, non_blocking=True)
    jpegs = [i for i, payload in enumerate(images) if payload.dim() == 1]
    decoded = dict(zip(jpegs, decode_jpegs([images[i] for i in jpegs], device)))
    index, rows = [], []
    for slot, (position, payload) in enumerate(zip(batch["index"], images)):
        pixels = decoded.get(slot) if payload.dim() == 1 else payload
        if pixels is None:  # a JPEG the device decoder refused: the host's decoders decide
            try:
                pixels = decode_pixels(payload.numpy().tobytes(), Limits())
            except Unreadable as exc:
                batch["failed"].append((position, str(exc)))
                continue
        index.append(position)
        rows.append(transform(pixels.to(device, non_blocking=True)))
    return index, torch.stack(rows).to(dtype) if rows else None
