"""Train and eval transforms. The eval transform is the one the server runs and ``evaluate()`` runs.

The eval transforms are written on PIL and torch alone, as torchvision's Resize, CenterCrop, PILToTensor, ToDtype
and Normalize compute them (tests/unit/test_presets.py holds them to torchvision's, value for value): importing
torchvision imports ``torch._dynamo`` (about a second of every server worker's start), so the server imports it
only for what has no such path here (the device path's nvJPEG, a filter or crop the fast paths leave to it).
"""
from __future__ import annotations

import functools
import logging
import platform
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from models.export.manifest import EvalPreset, Interpolation  # the preset's definition: torch-free, with the manifest

if TYPE_CHECKING:
    from torchvision.transforms import InterpolationMode

ImageTransform = Callable[[Image.Image], torch.Tensor]

_ALPHA_BACKGROUND = (255, 255, 255)

# The image formats the server accepts and training reads. MPO is what many cameras write: a JPEG with extra
# frames. GIF and WebP may be animated: the first frame is used.
IMAGE_FORMATS = frozenset({"JPEG", "MPO", "PNG", "WEBP", "BMP", "GIF"})
JPEG_FORMATS = frozenset({"JPEG", "MPO"})  # what JPEG decoders (libjpeg-turbo, nvJPEG) take

log = logging.getLogger(__name__)


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
    """torchvision's enum for a preset's filter name: ``nearest`` is NEAREST_EXACT, PIL's nearest on tensors too
    (torchvision's NEAREST floors a pixel's source position, PIL's rounds it: up to a pixel apart, most of a photo
    off by a level or more); on a PIL image torchvision hands both to PIL's NEAREST, so the PIL paths are as before."""
    from torchvision.transforms import InterpolationMode

    return InterpolationMode.NEAREST_EXACT if name == "nearest" else InterpolationMode(name)


def _torchvision_v2() -> Any:
    from torchvision.transforms import v2

    return v2


def resized_size(width: int, height: int, resize_size: int) -> tuple[int, int]:
    """(width, height) after torchvision's ``Resize(resize_size)``: the short side becomes ``resize_size``, the long
    side is truncated, not rounded."""
    if width <= height:
        return resize_size, int(resize_size * height / width)
    return int(resize_size * width / height), resize_size


def crop_origin(width: int, height: int, crop_size: int) -> tuple[int, int]:
    """(left, top) of torchvision's ``CenterCrop(crop_size)`` in an image of ``width`` x ``height``."""
    return int(round((width - crop_size) / 2.0)), int(round((height - crop_size) / 2.0))


class ResizeCenterCrop:
    """torchvision's ``Resize(short side)`` then ``CenterCrop``, as one PIL resample of only the kept pixels.

    Same output size, sampling positions and filter as the two steps, so outputs differ only by PIL's 8-bit
    rounding between its two passes: within 1 level on landscape photos, a few levels at a few pixels of portrait
    ones (mean under 0.2 level). 2-4x faster on large photos because the border the crop throws away is never
    resampled. Only shrinking takes the one-step path: enlarging (cheap anyway) can differ by more where the filter
    overshoots, nearest picks the other pixel on ties, and a crop larger than the resized image pads.
    """

    def __init__(self, resize_size: int, crop_size: int, interpolation: Interpolation) -> None:
        self.resize_size, self.crop_size, self.interpolation = resize_size, crop_size, interpolation
        self.resample = Image.Resampling[interpolation.upper()]

    @functools.cached_property
    def two_steps(self) -> Callable[[Image.Image], Image.Image]:
        T = _torchvision_v2()
        return T.Compose([T.Resize(self.resize_size, interpolation=interpolation_mode(self.interpolation),
                                   antialias=True), T.CenterCrop(self.crop_size)])

    def __call__(self, image: Image.Image) -> Image.Image:
        width, height = image.size
        if (self.crop_size > self.resize_size or min(width, height) <= self.resize_size
                or self.resample == Image.Resampling.NEAREST):
            return self.two_steps(image)
        new_width, new_height = resized_size(width, height, self.resize_size)
        # CenterCrop's offsets in the resized image, mapped back to source coordinates for PIL's box.
        left, top = crop_origin(new_width, new_height, self.crop_size)
        scale_x, scale_y = width / new_width, height / new_height
        box = (left * scale_x, top * scale_y, (left + self.crop_size) * scale_x, (top + self.crop_size) * scale_y)
        return image.resize((self.crop_size, self.crop_size), self.resample, box=box)


def _as_float(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 pixels as a float32 copy laid out (C, H, W) in memory, whatever the pixels' strides: a decoded image is
    (H, W, C) in memory, and the in-place steps after this broadcast per channel, which runs several times faster
    along rows than across 3-value pixels (the batch is then stacked and handed to the model in this layout too)."""
    return pixels.to(torch.float32, memory_format=torch.contiguous_format)


def _normalized(pixels: torch.Tensor, preset: EvalPreset) -> torch.Tensor:
    """Float 0..1 pixels (C, H, W) normalised in place, as torchvision's ``Normalize`` computes it."""
    mean = torch.as_tensor(preset.mean, dtype=pixels.dtype, device=pixels.device).view(-1, 1, 1)
    std = torch.as_tensor(preset.std, dtype=pixels.dtype, device=pixels.device).view(-1, 1, 1)
    return pixels.sub_(mean).div_(std)


class PilEvalTransform:
    """RGB PIL image -> normalised float tensor (C, H, W): resize and crop in PIL's C code (``ResizeCenterCrop``),
    one copy, then torchvision's ``ToDtype(float32, scale=True)`` and ``Normalize``."""

    def __init__(self, preset: EvalPreset) -> None:
        self.preset = preset
        self.resize_crop = ResizeCenterCrop(preset.resize_size, preset.crop_size, preset.interpolation)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        pixels = pil_to_tensor(self.resize_crop(image))
        return _normalized(_as_float(pixels).mul_(1.0 / 255), self.preset)


def eval_transform(preset: EvalPreset) -> ImageTransform:
    """RGB PIL image -> normalised float tensor (C, H, W). Resize and crop run in PIL's C code, then one copy."""
    return PilEvalTransform(preset)


class ServedEvalTransform:
    """RGB PIL image -> normalised float tensor (C, H, W) as the server preprocesses it on the CPU by default
    (DECODE_PATH tensor, models.predict's default too): its pixels as a uint8 tensor, then ``TensorEvalTransform``.
    Training validates with it, so a run's val top-1 is what that server answers on the same files: PIL's resize
    (``eval_transform``) differs from it by a level at some pixels, which flipped 1 of 73 answers of an unsure
    model of upscaled digits (its run reported 0.6438, the server and the evaluation it printed 0.6575)."""

    def __init__(self, preset: EvalPreset) -> None:
        self.tensor = TensorEvalTransform(preset)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return self.tensor(pil_to_tensor(image))


class TensorEvalTransform:
    """The eval transform on a decoded uint8 (C, H, W) tensor, on whichever device it lives: resize the short side
    (antialiased, the preset's filter), centre-crop, scale to 0..1, normalise.

    The resize runs on the uint8 pixels, as PIL's does: torchvision's uint8 kernel then gives PIL's pixels (within
    1 level at a few pixels, measured on the benchmark's photos), where resizing in float gave up to 5 levels and
    flipped the top-1 of 3 of 90 photos (bench/serving/decode_paths.py). Where torchvision itself resizes uint8
    natively (bicubic on the CPU; bilinear on AVX2, AVX-512 or ARM CPUs) the same ``interpolate`` call runs here;
    elsewhere (CUDA's float round trip, other filters, a crop larger than the resized image, a batch)
    torchvision's does, but for a batch that torchvision would resize through float32 and back (``batch``).
    """

    def __init__(self, preset: EvalPreset) -> None:
        self.preset = preset
        # mean and std per (device, dtype), made once: building them per image on a GPU is a host-to-device copy
        # (and a wait for the stream) per image
        self._constants: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        """One decoded image as the model's (C, H, W) float input."""
        return self.normalize(self.resize_crop(image))

    def batch(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        """Decoded images of any sizes as one (N, C, H, W) float batch: each resized and cropped, then scaled and
        normalised together (one step for the batch, the constants resident on its device). Where torchvision would
        resize each image through float32 and back to uint8 (on CUDA; on a CPU without its native uint8 kernel for
        the filter), the crops stay float32 and are rounded together (``rounded_crops``, which resizes the images of
        one size together): the same values in a few steps a size, not five an image and torchvision's dispatch."""
        if images and all(self._through_float(image) for image in images):
            return self.normalize(self.rounded_crops(images))
        return self.normalize(torch.stack([self.resize_crop(image) for image in images]))

    def _through_float(self, image: torch.Tensor) -> bool:
        """Whether ``resize_crop`` hands ``image`` to torchvision, which resizes it in float32 and rounds it back:
        uint8 (C, H, W) pixels where no native uint8 resize runs, a filter ``interpolate`` has, a crop within."""
        p = self.preset
        if (image.ndim != 3 or image.dtype != torch.uint8 or p.interpolation not in INTERPOLATED
                or _native_uint8_resize(image.device, p.interpolation)):
            return False
        return p.crop_size <= min(resized_size(image.shape[-1], image.shape[-2], p.resize_size))

    def rounded_crops(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        """uint8 (C, H, W) images as one (N, C, crop, crop) float32 stack of the values torchvision's resize and
        centre crop give each (its float32 resize, clamped to 0..255 after a bicubic one, rounded), in their order.
        Images of one size are resized together, as one (n, C, H, W) batch made float32 (the filter runs on each
        image alone, so the values are the same), up to ``RESIZED_TOGETHER_PIXELS`` a batch: a batch of a camera's
        frames or of one client's photos is a few steps, not two per image (on CUDA, each a kernel launch and
        torch's dispatch); each crop a view; the clamp and the rounding once for the stack."""
        p = self.preset
        by_size: dict[tuple[int, int], list[int]] = {}
        for index, image in enumerate(images):
            by_size.setdefault((image.shape[-2], image.shape[-1]), []).append(index)
        groups: list[tuple[tuple[int, int], list[int]]] = []
        for (height, width), indices in by_size.items():
            per_batch = max(1, RESIZED_TOGETHER_PIXELS // (height * width))
            groups += [((height, width), indices[start:start + per_batch])
                       for start in range(0, len(indices), per_batch)]
        crops: list[torch.Tensor | None] = [None] * len(images)  # each filled below, by its size's group
        for (height, width), indices in groups:
            same = images[indices[0]][None] if len(indices) == 1 else torch.stack([images[i] for i in indices])
            pixels = same.to(torch.float32)
            new_width, new_height = resized_size(width, height, p.resize_size)
            if (new_height, new_width) != (height, width):  # torchvision leaves an image of that size as it is
                pixels = F.interpolate(pixels, size=[new_height, new_width], mode=p.interpolation,
                                       align_corners=False, antialias=True)
            left, top = crop_origin(new_width, new_height, p.crop_size)
            cropped = pixels[:, :, top:top + p.crop_size, left:left + p.crop_size]
            for position, index in enumerate(indices):
                crops[index] = cropped[position]
        stacked = torch.stack(crops)  # type: ignore[arg-type]
        if p.interpolation == "bicubic":  # its filter overshoots; bilinear's stays within the pixels' range
            stacked.clamp_(0, 255)
        return stacked.round_()

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """Resized and cropped pixels ((C, H, W) or (N, C, H, W), uint8 or float 0..255) scaled to 0..1 and
        normalised, as torchvision's ``ToDtype(scale=True)`` and ``Normalize`` compute it."""
        pixels = _as_float(pixels).div_(255)
        key = (pixels.device, pixels.dtype)
        if key not in self._constants:
            mean = torch.as_tensor(self.preset.mean, dtype=pixels.dtype, device=pixels.device).view(-1, 1, 1)
            std = torch.as_tensor(self.preset.std, dtype=pixels.dtype, device=pixels.device).view(-1, 1, 1)
            self._constants[key] = (mean, std)
        mean, std = self._constants[key]
        return pixels.sub_(mean).div_(std)

    def resize_crop(self, image: torch.Tensor) -> torch.Tensor:
        """Resize the short side (antialiased) and centre-crop; the pixels keep their dtype."""
        p = self.preset
        height, width = image.shape[-2:]
        new_width, new_height = resized_size(width, height, p.resize_size)
        if (image.ndim != 3 or image.dtype != torch.uint8 or not _native_uint8_resize(image.device, p.interpolation)
                or p.crop_size > min(new_width, new_height)):
            T = _torchvision_v2()
            pixels = T.functional.resize(image, [p.resize_size], interpolation=interpolation_mode(p.interpolation),
                                         antialias=True)
            pixels = T.functional.center_crop(pixels, [p.crop_size])
        else:
            pixels = _resize_uint8(image, new_height, new_width, p.interpolation)
            left, top = crop_origin(new_width, new_height, p.crop_size)
            pixels = pixels[:, top:top + p.crop_size, left:left + p.crop_size]
        return pixels


# The most source pixels resized together (``rounded_crops``): a group of one size is split into batches of at most
# this many, so its float32 copy stays about 200 MB (ImageNet-size photos: 85 a batch; 12-megapixel ones: one).
RESIZED_TOGETHER_PIXELS = 16_000_000
INTERPOLATED = ("bilinear", "bicubic")  # the filters torch's interpolate runs antialiased (not lanczos, not nearest)


def _native_uint8_resize(device: torch.device, interpolation: Interpolation) -> bool:
    """Whether torchvision resizes uint8 pixels without a float round trip (its ``_do_native_uint8_resize_on_cpu``)."""
    if device.type != "cpu":
        return False
    if interpolation == "bilinear":
        return _native_bilinear_cpu()
    return interpolation == "bicubic"


@functools.cache
def _native_bilinear_cpu() -> bool:
    """Whether this CPU gets torchvision's native uint8 bilinear resize (the host's, fixed: asked once)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in ("aarch64", "arm64")


def _resize_uint8(image: torch.Tensor, height: int, width: int, interpolation: Interpolation) -> torch.Tensor:
    """torchvision's antialiased uint8 resize of one (C, H, W) image on the CPU, step for step."""
    channels, old_height, old_width = image.shape
    if (height, width) == (old_height, old_width):
        return image
    batch = image.reshape(1, channels, old_height, old_width)
    strides = list(batch.stride())
    if batch.is_contiguous(memory_format=torch.channels_last) and batch.numel() != strides[0]:
        # As torchvision does (pytorch#68430): restride so interpolate keeps the input's channels_last layout.
        strides[0] = batch.numel()
        batch = batch.as_strided(batch.shape, strides)
    resized = F.interpolate(batch, size=[height, width], mode=interpolation, align_corners=False, antialias=True)
    return resized.reshape(channels, height, width)


def lite0_preset() -> EvalPreset:
    """The released Lite0 weights expect (x - 127) / 128 on 0..255 pixels, bicubic, 224 crop of a 256 resize."""
    return EvalPreset(resize_size=256, crop_size=224, interpolation="bicubic",
                      mean=(127 / 255,) * 3, std=(128 / 255,) * 3)
