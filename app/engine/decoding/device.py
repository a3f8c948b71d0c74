"""The device decode path: the request thread checks the header and every limit (no pixel decoded) and queues
the encoded bytes; the batch worker decodes the whole batch on the model's device and preprocesses it there, in
the model's dtype, right before the forward pass.

On CUDA the batch's JPEGs go to nvJPEG in one batched ``decode_jpeg(list, device="cuda")`` call, then each is
turned by the EXIF orientation read with its header (nvJPEG ignores it; the same turn runs on the CPU, so CI tests
it); a JPEG nvJPEG refuses (and every PNG, WebP, GIF, BMP) is decoded on the CPU for that image alone, and its
pixels join the batch through pinned memory with a non-blocking copy. On the CPU the same code runs with
libjpeg-turbo, which is how CI tests it. The resize and crop are ``TensorEvalTransform``'s; the crops are stacked once
and scaled and normalised as one batch, mean and std resident on the device (on CUDA the images of one size are
resized together and the crops stay float32 and are rounded as one batch: ``TensorEvalTransform.batch``).
"""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from app.engine.decoding.image import DecodeLimits, service_errors
from app.engine.decoding.tensor import decode_tensor
from models.data.jpeg import LIBJPEG_MODES, decode_jpegs
from models.image_decode import checked_header
from models.presets import TensorEvalTransform


@dataclass(frozen=True)
class Encoded:
    """An image whose header passed every limit, waiting to be decoded in its batch."""

    data: bytes | bytearray | memoryview  # (as the engine read it: a view of a loop link's arena is not hashable)
    jpeg: bool  # one the device's JPEG decoder takes: not CMYK or YCCK, which PIL converts its own way
    limits: DecodeLimits
    orientation: int = 1  # EXIF, read with the header: the device decode turns the pixels by it


def check_header(data: bytes, limits: DecodeLimits) -> Encoded:
    """Read the header only and check every limit (InvalidImage, ImageTooLarge, UnsupportedImageFormat): a plain
    JPEG's without PIL (models/data/jpeg.py ``read_jpeg_header``), any other image's by PIL."""
    with service_errors():
        header, _ = checked_header(data, limits)
    jpeg = header is not None and header.mode in LIBJPEG_MODES
    return Encoded(data, jpeg, limits, header.orientation if header is not None else 1)


def _writable(data: bytes | bytearray | memoryview) -> bytearray | memoryview:
    """A JPEG's bytes as a buffer a tensor may wrap: the engine's own (its request's segment, read from the link, or
    its view of the link's arena) as it is, a copy of read-only bytes (torch warns of a tensor on memory it may not
    write)."""
    if isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly):
        return data
    return bytearray(data)


def _jpegs_on(device: torch.device, items: Sequence[Encoded]) -> dict[int, torch.Tensor]:
    """The batch's JPEGs decoded on ``device`` in one call, by position; those it refuses are left out."""
    positions = [i for i, item in enumerate(items) if item.jpeg]
    encoded = [torch.frombuffer(_writable(items[i].data), dtype=torch.uint8) for i in positions]
    turns = [items[i].orientation for i in positions]
    return {i: pixels for i, pixels in zip(positions, decode_jpegs(encoded, device, turns)) if pixels is not None}


def decode_batch(items: Sequence[Encoded], device: torch.device, transform: TensorEvalTransform,
                 dtype: torch.dtype) -> torch.Tensor:
    """The batch as the model's input, (N, C, H, W) on ``device`` in ``dtype``. An image no decoder can read
    raises InvalidImage (the batcher then runs each image alone, so only its request fails)."""
    on_device = _jpegs_on(device, items)
    decoded = []
    for i, item in enumerate(items):
        pixels = on_device.get(i)
        if pixels is None:  # other formats, and JPEGs the device decoder refused: the CPU path, then upload
            pixels = decode_tensor(item.data, item.limits)
            if device.type == "cuda":
                pixels = pixels.pin_memory().to(device, non_blocking=True)
        decoded.append(pixels)
    return transform.batch(decoded).to(dtype)  # resized by size, rounded and normalised as one batch


_DTYPE_OF = operator.attrgetter("dtype")  # (the checks of a batch's rows in C: no Python step a row)


def stack_pixels(items: Sequence[torch.Tensor | np.ndarray]) -> torch.Tensor:
    """Preprocessed rows as one (N, C, H, W) tensor where they are: a client's pixels (arrays) stacked by numpy,
    else every row made a tensor and stacked."""
    if all(map(isinstance, items, itertools.repeat(np.ndarray))):  # one shape (the model's input)
        dtype = items[0].dtype
        if len(set(map(_DTYPE_OF, items))) == 1:  # their bytes one after another: a third of np.array's time
            try:  # for small rows, which looks at each row's shape and type
                stacked = np.frombuffer(bytearray().join(items), dtype)  # type: ignore[arg-type]
                return torch.from_numpy(stacked.reshape(len(items), *items[0].shape))
            except (TypeError, BufferError):  # a row that is no C-contiguous buffer
                pass
        return torch.from_numpy(np.array(items))  # (rows of several types: of the one they all cast to)
    try:
        return torch.stack(items)  # type: ignore[arg-type]  # (decoded here: tensors, stacked as they are)
    except TypeError:  # arrays among them (a client's pixels beside photos decoded here)
        return torch.stack([torch.as_tensor(item) for item in items])


def collate_on_device(items: Sequence[Encoded | torch.Tensor | np.ndarray], device: torch.device,
                      transform: TensorEvalTransform, dtype: torch.dtype) -> torch.Tensor:
    """A batch of encoded images, possibly mixed with preprocessed pixels (V2 clients may send those), as the
    model's input on ``device``: the rows in their order."""
    encoded = [i for i, item in enumerate(items) if isinstance(item, Encoded)]
    if not encoded:  # a client's pixels only: one stack, one copy to the device
        return stack_pixels(items).to(device, dtype)  # type: ignore[arg-type]
    decoded = decode_batch([items[i] for i in encoded], device, transform, dtype)  # type: ignore[misc]
    if len(encoded) == len(items):
        return decoded
    rows = dict(zip(encoded, decoded))
    return torch.stack([rows[i] if i in rows else torch.as_tensor(items[i]).to(device, dtype)  # type: ignore[arg-type]
                        for i in range(len(items))])
