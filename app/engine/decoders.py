"""A loaded version's decoder, chosen once when it starts (``DECODE_PATH``, app/engine/tuning.decode_path): what a
request thread does with an image's bytes (``prepare``) and how the batch worker turns the prepared images into
the model's input batch (``collate``).

- ``pil`` and ``tensor``: the request thread decodes and preprocesses (PIL, or libjpeg-turbo into a tensor and
  the transform on tensors), in parallel with the forward pass of the batch before; ``collate`` stacks the rows.
- ``device``: the request thread reads the header and checks every limit only (``Encoded``); ``collate`` decodes
  the whole batch on the model's device and preprocesses it there (app/engine/device_decode.py).

Preprocessed pixels a client sent (V2 FP32) skip ``prepare`` and join the same batches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch

from app.engine.decode import DecodeLimits, image_to_tensor
from app.engine.device_decode import Encoded, check_header, collate_on_device
from app.engine.predictor import Predictor
from app.engine.tensor_decode import image_to_tensor_path

Prepared = Union[torch.Tensor, Encoded]  # one image as it waits in the queue


@dataclass(frozen=True)
class Decoder:
    """One version's decode path: ``prepare`` in the request thread, ``collate`` in the batch worker."""

    path: str  # pil, tensor or device
    prepare: Callable[[bytes], Prepared]
    collate: Callable[[Sequence[Prepared]], torch.Tensor]


def decoder_for(path: str, predictor: Predictor, limits: DecodeLimits) -> Decoder:
    """The decoder of ``path`` for ``predictor``'s transform, device and dtype."""
    if path == "device":
        return Decoder(path, lambda data: check_header(data, limits),
                       lambda items: collate_on_device(items, predictor.device, predictor.tensor_transform,
                                                       predictor.dtype))
    if path == "tensor":
        return Decoder(path, lambda data: image_to_tensor_path(data, predictor.tensor_transform, limits), _stack)
    return Decoder(path, lambda data: image_to_tensor(data, predictor.transform, limits), _stack)


def _stack(rows: Sequence[Prepared]) -> torch.Tensor:
    return torch.stack(list(rows))  # type: ignore[arg-type]
