"""Train and eval transforms. The eval transform is the one the server runs and ``evaluate()`` runs."""
from __future__ import annotations

import logging
from typing import Callable, Literal

import numpy as np
import torch
from PIL import Image, ImageOps
from pydantic import BaseModel, ConfigDict, Field
from torchvision.transforms import InterpolationMode
from torchvision.transforms import v2 as T

Interpolation = Literal["nearest", "bilinear", "bicubic", "lanczos"]
ImageTransform = Callable[[Image.Image], torch.Tensor]

_ALPHA_BACKGROUND = (255, 255, 255)

# The image formats the server accepts and training reads. MPO is what many cameras write: a JPEG with extra
# frames. GIF and WebP may be animated: the first frame is used.
IMAGE_FORMATS = frozenset({"JPEG", "MPO", "PNG", "WEBP", "BMP", "GIF"})
JPEG_FORMATS = frozenset({"JPEG", "MPO"})  # what JPEG decoders (libjpeg-turbo, nvJPEG) take

log = logging.getLogger(__name__)


class EvalPreset(BaseModel):
    """How a picture becomes the model's input: resize the short side, centre-crop, scale, normalise."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    resize_size: int = Field(gt=0)
    crop_size: int = Field(gt=0)
    interpolation: Interpolation = "bilinear"
    # On 0..1 pixels, as torchvision's Normalize expects.
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """The (C, H, W) shape of one preprocessed image."""
        return (3, self.crop_size, self.crop_size)


def to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL mode -> 8-bit RGB: alpha composited on white, 16-bit and float greys rescaled, CMYK converted."""
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        # PIL's own convert clips 16-bit values at 255, which turns most 16-bit photos white.
        wide = np.asarray(image, dtype=np.uint32)
        scale = 257 if image.mode.startswith("I;16") or wide.max(initial=0) > 255 else 1
        image = Image.fromarray((wide // scale).clip(0, 255).astype(np.uint8), mode="L")
    elif image.mode == "F":
        image = Image.fromarray(np.asarray(image).clip(0, 255).astype(np.uint8), mode="L")
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, _ALPHA_BACKGROUND + (255,))
        image = Image.alpha_composite(background, rgba)
    return image.convert("RGB")


def pil_to_tensor(image: Image.Image) -> torch.Tensor:
    """An RGB PIL image as a uint8 (3, H, W) tensor: one copy, writable."""
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)


def upright_rgb(image: Image.Image) -> Image.Image:
    """A loaded image, turned upright by its EXIF orientation, as RGB: what both the server and training see.

    The image is the caller's own fresh decode and is turned in place: without ``in_place`` Pillow returns a copy of
    every image, even one with no orientation to fix.
    """
    try:
        ImageOps.exif_transpose(image, in_place=True)
    except Exception:  # noqa: BLE001 - a broken EXIF block should not lose an otherwise good photo
        log.debug("ignoring unreadable EXIF orientation", exc_info=True)
    return to_rgb(image)


def interpolation_mode(name: Interpolation) -> InterpolationMode:
    """torchvision's enum for a preset's filter name."""
    return InterpolationMode(name)


class ResizeCenterCrop:
    """torchvision's ``Resize(short side)`` then ``CenterCrop``, as one PIL resample of only the kept pixels.

    Same output size, sampling positions and filter as the two steps, so outputs differ only by PIL's 8-bit
    rounding between its two passes: within 1 level on landscape photos, a few levels at a few pixels of portrait
    ones (mean under 0.2 level). 2-4x faster on large photos because the border the crop throws away is never
    resampled. Only shrinking takes the one-step path: enlarging (cheap anyway) can differ by more where the filter
    overshoots, nearest picks the other pixel on ties, and a crop larger than the resized image pads.
    """

    def __init__(self, resize_size: int, crop_size: int, interpolation: Interpolation) -> None:
        self.resize_size, self.crop_size = resize_size, crop_size
        self.resample = Image.Resampling[interpolation.upper()]
        self.two_steps = T.Compose([
            T.Resize(resize_size, interpolation=interpolation_mode(interpolation), antialias=True),
            T.CenterCrop(crop_size)])

    def _resized_size(self, width: int, height: int) -> tuple[int, int]:
        # torchvision's rule: the short side becomes resize_size, the long side is truncated, not rounded.
        if width <= height:
            return self.resize_size, int(self.resize_size * height / width)
        return int(self.resize_size * width / height), self.resize_size

    def __call__(self, image: Image.Image) -> Image.Image:
        width, height = image.size
        if (self.crop_size > self.resize_size or min(width, height) <= self.resize_size
                or self.resample == Image.Resampling.NEAREST):
            return self.two_steps(image)
        new_width, new_height = self._resized_size(width, height)
        # CenterCrop's offsets in the resized image, mapped back to source coordinates for PIL's box.
        left, top = int(round((new_width - self.crop_size) / 2.0)), int(round((new_height - self.crop_size) / 2.0))
        scale_x, scale_y = width / new_width, height / new_height
        box = (left * scale_x, top * scale_y, (left + self.crop_size) * scale_x, (top + self.crop_size) * scale_y)
        return image.resize((self.crop_size, self.crop_size), self.resample, box=box)


def eval_transform(preset: EvalPreset) -> ImageTransform:
    """RGB PIL image -> normalised float tensor (C, H, W). Resize and crop run in PIL's C code, then one copy."""
    return T.Compose([
        ResizeCenterCrop(preset.resize_size, preset.crop_size, preset.interpolation),
        T.PILToTensor(),
        T.ToDtype(torch.float32, scale=True),
        T.Normalize(mean=list(preset.mean), std=list(preset.std)),
    ])


class TensorEvalTransform:
    """The eval transform on a decoded uint8 (C, H, W) tensor, on whichever device it lives: resize the short side
    (antialiased, the preset's filter), centre-crop, scale to 0..1, normalise.

    The resize runs on the uint8 pixels, as PIL's does: torchvision's uint8 kernel then gives PIL's pixels (within
    1 level at a few pixels, measured on the benchmark's photos), where resizing in float gave up to 5 levels and
    flipped the top-1 of 3 of 90 photos (bench/serving/decode_paths.py).
    """

    def __init__(self, preset: EvalPreset) -> None:
        self.preset = preset
        self.interpolation = interpolation_mode(preset.interpolation)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        p = self.preset
        pixels = T.functional.resize(image, [p.resize_size], interpolation=self.interpolation, antialias=True)
        pixels = T.functional.center_crop(pixels, [p.crop_size]).float().div_(255)
        return T.functional.normalize(pixels, list(p.mean), list(p.std), inplace=True)


def lite0_preset() -> EvalPreset:
    """The released Lite0 weights expect (x - 127) / 128 on 0..255 pixels, bicubic, 224 crop of a 256 resize."""
    return EvalPreset(resize_size=256, crop_size=224, interpolation="bicubic",
                      mean=(127 / 255,) * 3, std=(128 / 255,) * 3)
