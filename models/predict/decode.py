"""Reading one file as the server reads an upload, in a DataLoader worker; the batch on the model's device.

Three paths, as the server's ``DECODE_PATH`` (app/engine/decoding/decoders.py): ``pil`` decodes with PIL
(reduced-scale for large JPEGs) and runs ``eval_transform``; ``tensor`` (the server's default on the CPU) decodes
JPEGs with libjpeg-turbo and runs ``TensorEvalTransform``; ``device`` (its default on CUDA) sends the JPEG's bytes
and decodes the batch on the device (nvJPEG), preprocessing there. Every path first reads the header and checks the
server's limits, so a file the server would refuse is reported with the server's reason: the decode rules are the
server's own (models/image_decode.py, in the serving contract).
"""
from __future__ import annotations

import os
import stat
from typing import Any, Sequence

import torch
from torch.utils.data import Dataset

from models.data.jpeg import decode_jpegs
from models.image_decode import (
    DecodeLimits,
    ImageRefused,
    decode_image,
    decode_tensor,
    checked_header,
    load_upright,
)
from models.predict.inputs import Item
from models.presets import EvalPreset, TensorEvalTransform, eval_transform, pil_to_tensor

PATHS = ("pil", "tensor", "device")


class NotARegularFile(Exception):
    """An input that is no regular file: its record's reason."""


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def read_regular_file(file: str) -> bytes:
    """The bytes of ``file``; NotARegularFile when it is a pipe, device, socket or folder. Opened without blocking
    and checked on the open descriptor (fstat): a plain open of a named pipe waits for a writer, and a check before
    the open could be of another file than the one read."""
    descriptor = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(descriptor).st_mode
    except OSError:
        os.close(descriptor)
        raise
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        kind = next((name for test, name in _KINDS if test(mode)), "a special file")
        raise NotARegularFile(f"cannot read the file: it is {kind}, not a regular file")
    with os.fdopen(descriptor, "rb") as handle:
        return handle.read()


class ScoreSet(Dataset):
    """Items read by the DataLoader's workers: (position, payload or None, reason). The payload is the model's
    input (``pil``, ``tensor``), or for ``device`` a JPEG's bytes (1-D uint8) or another format's pixels (3-D)."""

    def __init__(self, items: Sequence[Item], preset: EvalPreset, path: str,
                 limits: DecodeLimits = DecodeLimits()) -> None:
        self.items, self.path, self.limits = list(items), path, limits
        self.pil = eval_transform(preset)
        self.tensor = TensorEvalTransform(preset)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor | None, str]:
        try:
            data = read_regular_file(self.items[index].file)
            return index, self._payload(data), ""
        except (ImageRefused, NotARegularFile) as exc:
            return index, None, str(exc)
        except OSError as exc:
            return index, None, f"cannot read the file: {exc.strerror or exc}{_relative_hint(self.items[index], exc)}"

    def _payload(self, data: bytes) -> torch.Tensor:
        if self.path == "pil":
            return self.pil(decode_image(data, self.limits))
        if self.path == "tensor":
            return self.tensor(decode_tensor(data, self.limits))
        header, image = checked_header(data, self.limits)
        if header is None:  # not a JPEG: decoded here by PIL, as the device decodes only JPEGs
            return pil_to_tensor(load_upright(image, self.limits))  # type: ignore[arg-type]
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _relative_hint(item: Item, exc: OSError) -> str:
    """For a list's line not found where the list's folder puts it but found from the current folder: so said."""
    if isinstance(exc, FileNotFoundError) and item.file != item.path and os.path.isfile(item.path):
        return (f" (a list's paths are relative to the list's folder: this one is read as {item.file}; {item.path} "
                "is found from the current folder)")
    return ""


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
                pixels = decode_tensor(payload.numpy().tobytes(), DecodeLimits())
            except ImageRefused as exc:
                batch["failed"].append((position, str(exc)))
                continue
        index.append(position)
        rows.append(transform(pixels.to(device, non_blocking=True)))
    return index, torch.stack(rows).to(dtype) if rows else None
