"""A loaded version's decoder, chosen once when it starts (``DECODE_PATH``: ``decoder_for``): what a request thread
does with an image's bytes (``prepare``) and how the batch worker turns the prepared images into the model's input
batch (``collate``).

- ``PilDecoder`` and ``TensorDecoder``: the request thread decodes and preprocesses (PIL, or libjpeg-turbo into a
  tensor and the transform on tensors), in parallel with the forward pass of the batch before; ``collate`` stacks
  the rows.
- ``DeviceDecoder``: the request thread reads the header and checks every limit only (``Encoded``); ``collate``
  decodes the whole batch on the model's device and preprocesses it there (app/engine/decoding/device.py).

Preprocessed pixels a client sent (V2 FP32) skip ``prepare`` and join the same batches.
"""
from __future__ import annotations

from typing import Sequence, Union

import numpy as np
import torch
from PIL import Image

from app.engine.decoding.device import Encoded, check_header, collate_on_device, stack_pixels
from app.engine.decoding.image import DecodeLimits, image_to_tensor
from app.engine.decoding.tensor import image_to_tensor_path
from models.presets import ImageTransform, TensorEvalTransform, pil_to_tensor

Prepared = Union[torch.Tensor, np.ndarray, Encoded]  # one image as it waits in the queue (an array: V2 pixels)


class Decoder:
    """One version's decode path: ``prepare`` in the request thread, ``collate`` in the batch worker."""

    path = ""  # pil, tensor or device

    def __init__(self, limits: DecodeLimits) -> None:
        self.limits = limits

    def prepare(self, data: bytes) -> Prepared:
        """One image's bytes as it waits in the queue; raises InvalidImage, ImageTooLarge, UnsupportedImageFormat."""
        raise NotImplementedError

    def collate(self, items: Sequence[Prepared]) -> torch.Tensor:
        """The prepared images of one batch as the model's (N, C, H, W) input."""
        return stack_pixels(items)  # type: ignore[arg-type]

    def prepare_decoded(self, photo: Image.Image) -> Prepared | None:
        """What ``prepare`` makes of an image whose upright RGB decode by PIL (``load_upright``: its reduced scale
        and EXIF turn) is ``photo``, without decoding it again (an explanation needs the photo too); None where
        the pixels are not made from PIL's (the device path's decode)."""
        return None

    def decodes_on_host_in_batch(self, item: Prepared) -> bool:
        """Whether ``collate`` decodes ``item`` on the CPU (the others came decoded, or the device decodes them)."""
        return False

    def decodes_in_batch(self, items: Sequence[Prepared]) -> bool:
        """Whether ``collate`` decodes any of ``items`` (then making their batch is their decode stage's work)."""
        return False

    def in_float32(self) -> "Decoder":
        """This decoder, its batches made in float32 where it makes them in the model's dtype (an explanation's
        gradients take them before that rounding, which the serving forward pass does itself)."""
        return self


class PilDecoder(Decoder):
    """PIL decodes and the manifest's PIL eval transform preprocesses, in the request thread."""

    path = "pil"

    def __init__(self, limits: DecodeLimits, transform: ImageTransform) -> None:
        super().__init__(limits)
        self.transform = transform

    def prepare(self, data: bytes) -> Prepared:
        """Decoded and preprocessed: a (C, H, W) float tensor."""
        return image_to_tensor(data, self.transform, self.limits)

    def prepare_decoded(self, photo: Image.Image) -> Prepared:
        return self.transform(photo)


class TensorDecoder(Decoder):
    """libjpeg-turbo (PIL for other formats) into a tensor, then the eval transform on tensors, in the request
    thread."""

    path = "tensor"

    def __init__(self, limits: DecodeLimits, transform: TensorEvalTransform) -> None:
        super().__init__(limits)
        self.transform = transform

    def prepare(self, data: bytes) -> Prepared:
        """Decoded and preprocessed: a (C, H, W) float tensor."""
        return image_to_tensor_path(data, self.transform, self.limits)

    def prepare_decoded(self, photo: Image.Image) -> Prepared:
        return self.transform(pil_to_tensor(photo))  # (its decode gives PIL's pixels, bit for bit)


class DeviceDecoder(Decoder):
    """The header only in the request thread; the whole batch decoded and preprocessed on the model's device."""

    path = "device"

    def __init__(self, limits: DecodeLimits, transform: TensorEvalTransform, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__(limits)
        self.transform, self.device, self.dtype = transform, device, dtype

    def prepare(self, data: bytes) -> Prepared:
        """The header checked against every limit; the bytes kept for the batch (``Encoded``)."""
        return check_header(data, self.limits)

    def collate(self, items: Sequence[Prepared]) -> torch.Tensor:
        """The batch decoded on the device, in the model's dtype (preprocessed pixels join in their place)."""
        return collate_on_device(items, self.device, self.transform, self.dtype)

    def decodes_on_host_in_batch(self, item: Prepared) -> bool:
        """An image that is not a JPEG: the batch decodes it on the CPU, then uploads it."""
        return isinstance(item, Encoded) and not item.jpeg

    def decodes_in_batch(self, items: Sequence[Prepared]) -> bool:
        """Encoded images among them (a client's pixels alone are stacked and copied, no decode)."""
        return any(isinstance(item, Encoded) for item in items)

    def in_float32(self) -> Decoder:
        if self.dtype == torch.float32:
            return self
        return DeviceDecoder(self.limits, self.transform, self.device, torch.float32)


def decode_path(setting: str, device: torch.device) -> str:
    """Where a model's images are decoded (Settings.decode_path): ``auto`` is the device path on CUDA and the tensor
    path on the CPU, faster than PIL there with the same answers (docs/performance.md: Figures behind the code's
    choices)."""
    if setting != "auto":
        return setting
    return "device" if device.type == "cuda" else "tensor"


def decoder_for(setting: str, limits: DecodeLimits, *, device: torch.device, dtype: torch.dtype,
                transform: ImageTransform, tensor_transform: TensorEvalTransform) -> Decoder:
    """The decoder ``setting`` (auto, pil, tensor or device) picks for a model on ``device`` in ``dtype`` with these
    eval transforms."""
    path = decode_path(setting, device)
    if path == "device":
        return DeviceDecoder(limits, tensor_transform, device, dtype)
    if path == "tensor":
        return TensorDecoder(limits, tensor_transform)
    return PilDecoder(limits, transform)
