"""The tensor decode path: bytes -> uint8 (C, H, W) tensor, then the eval transform on tensors (models/presets.py
``TensorEvalTransform``), so the same code runs on the CPU and, batched, on a GPU.

The decode is models/image_decode.py's ``decode_tensor`` (models.predict's too): the header read and every limit
checked first, before any pixel is decoded (a plain JPEG's without PIL, models/data/jpeg.py ``read_jpeg_header``);
JPEGs to libjpeg-turbo (models/data/jpeg.py ``decode_jpeg_cpu``: PIL's pixels, reduced-scale decoding by
``JPEG_DRAFT_MIN_SIDE`` and the EXIF orientation included, without PIL's copies); every other format, CMYK and YCCK
JPEGs (PIL converts them its own way), and any JPEG libjpeg-turbo refuses (truncated data: PIL then says why not) to
PIL's decoder, joining the same tensor transform.
"""
from __future__ import annotations

import torch

from app.engine.decoding.image import DecodeLimits, service_errors
import models.image_decode as image_decode
from models.presets import TensorEvalTransform


def decode_tensor(data: bytes, limits: DecodeLimits) -> torch.Tensor:
    """An upright RGB uint8 (3, H, W) tensor; raises InvalidImage, ImageTooLarge or UnsupportedImageFormat."""
    with service_errors():
        return image_decode.decode_tensor(data, limits)


def image_to_tensor_path(data: bytes, transform: TensorEvalTransform, limits: DecodeLimits) -> torch.Tensor:
    """Decode ``data`` on the tensor path and apply the model's eval transform: one (C, H, W) float tensor."""
    return transform(decode_tensor(data, limits))
