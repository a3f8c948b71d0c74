"""Training augmentation in two halves: drawing a sample's random crop and flip, and applying them to pixels.

The draw needs only the image's size, so the GPU data path draws in the DataLoader worker from the JPEG header
(no pixels decoded there) and applies the same crop and flip on the GPU; the CPU path draws and applies in the
worker. Both draw exactly as torchvision's ``RandomResizedCrop`` then ``RandomHorizontalFlip`` do (same calls on
the same RNG, in the same order), so with the per-(seed, epoch, index) seed of ``FolderDataset`` a sample gets the
same crop and flip whichever path, worker or GPU trains on it (tests/training/test_gpu_data.py checks both).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from PIL import Image

from models.presets import EvalPreset, ImageTransform, Interpolation, interpolation_mode

RATIO = (3 / 4, 4 / 3)  # torchvision's default aspect-ratio range for RandomResizedCrop


@dataclass(frozen=True)
class CropFlip:
    """One sample's augmentation: the crop box in the upright image, and whether to mirror it."""

    top: int
    left: int
    height: int
    width: int
    flip: bool

    def as_tensor(self) -> torch.Tensor:
        """The five numbers as an int64 tensor (what DataLoader workers send)."""
        return torch.tensor([self.top, self.left, self.height, self.width, int(self.flip)], dtype=torch.int64)

    @staticmethod
    def from_tensor(row: torch.Tensor) -> "CropFlip":
        """The inverse of :meth:`as_tensor`."""
        top, left, height, width, flip = (int(v) for v in row.tolist())
        return CropFlip(top, left, height, width, bool(flip))


def _crop_box(height: int, width: int, scale: tuple[float, float]) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop box: ten tries at a random area and log-uniform aspect, else centred."""
    area = height * width
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).item())
        w, h = int(round(math.sqrt(target_area * aspect))), int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, size=(1,)).item())
            left = int(torch.randint(0, width - w + 1, size=(1,)).item())
            return top, left, h, w
    ratio = width / height
    if ratio < RATIO[0]:
        w, h = width, int(round(width / RATIO[0]))
    elif ratio > RATIO[1]:
        w, h = int(round(height * RATIO[1])), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def check_min_crop_scale(value: float) -> float:
    """The smallest crop's area fraction, refused outside (0, 1] when a data path is built."""
    if not 0 < value <= 1:
        raise ValueError(f"min_crop_scale must be in (0, 1], got {value}")
    return value


def draw(height: int, width: int, min_crop_scale: float, hflip_prob: float) -> CropFlip:
    """The random crop and flip of an upright ``height`` x ``width`` image, from torch's current RNG."""
    top, left, h, w = _crop_box(height, width, (min_crop_scale, 1.0))
    flip = bool(torch.rand(1) < hflip_prob)  # RandomHorizontalFlip flips unless rand >= p
    return CropFlip(top, left, h, w, flip)


def crop_pil(image: Image.Image, box: CropFlip, size: int, interpolation: Interpolation) -> Image.Image:
    """Apply ``box`` to an RGB PIL image: crop, resize to ``size`` (antialiased), mirror."""
    from torchvision.transforms import v2 as T  # where used: torchvision's import costs ~1.4 s (torch._dynamo)

    out = T.functional.resized_crop(image, box.top, box.left, box.height, box.width, [size, size],
                                    interpolation=interpolation_mode(interpolation), antialias=True)
    return out.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if box.flip else out


def crop_tensor(pixels: torch.Tensor, box: CropFlip, size: int, interpolation: Interpolation) -> torch.Tensor:
    """Apply ``box`` to a uint8 (C, H, W) tensor on any device; resizing the uint8 pixels, as PIL does."""
    from torchvision.transforms import v2 as T

    out = T.functional.resized_crop(pixels, box.top, box.left, box.height, box.width, [size, size],
                                    interpolation=interpolation_mode(interpolation), antialias=True)
    return out.flip(-1) if box.flip else out


class RandomCropFlip:
    """The CPU path's augmentation of a PIL image (used inside ``train_transform``)."""

    def __init__(self, preset: EvalPreset, hflip_prob: float, min_crop_scale: float) -> None:
        self.preset, self.hflip_prob, self.min_crop_scale = preset, hflip_prob, check_min_crop_scale(min_crop_scale)

    def __call__(self, image: Image.Image) -> Image.Image:
        box = draw(image.height, image.width, self.min_crop_scale, self.hflip_prob)
        return crop_pil(image, box, self.preset.crop_size, self.preset.interpolation)


def train_transform(preset: EvalPreset, hflip_prob: float = 0.5, min_crop_scale: float = 0.08) -> ImageTransform:
    """The CPU path's training transform: random resized crop and flip, then the eval scaling and normalisation.

    ``min_crop_scale`` is the smallest crop area as a fraction of the image (torchvision's default 0.08 suits
    photos; centred subjects such as digits want more, and no flip).
    """
    from torchvision.transforms import v2 as T

    return T.Compose([
        RandomCropFlip(preset, hflip_prob, min_crop_scale),
        T.PILToTensor(),
        T.ToDtype(torch.float32, scale=True),
        T.Normalize(mean=list(preset.mean), std=list(preset.std)),
    ])
