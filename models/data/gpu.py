"""The GPU data path (``--data-backend gpu``): DataLoader workers read each JPEG's bytes and header only; the
batch is decoded on the GPU (batched nvJPEG), cropped, flipped and normalised there.

A worker reads the file, takes the upright size from the header (EXIF orientation), and draws the sample's crop
and flip with the same seed and the same calls as the CPU path (``models.data.augment``), so a sample's augmentation
does not depend on the path, the number of workers or of GPUs. Non-JPEG files (PNG, WebP, GIF, BMP) are decoded
in the worker as the CPU path does and travel as pixels; a JPEG the device decoder refuses is decoded on the host
in the training process (rare; PIL is the last resort, and it read every file when the folder was scanned).
On a CPU device the same code runs with libjpeg-turbo, which is how the tests check it.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from models.data.augment import CropFlip, check_min_crop_scale, crop_tensor, draw
from models.data.folder import Sample, SampleKey, sample_seed, unreadable
from models.data.jpeg import decode_jpegs, stream_drawn_once
from models.presets import JPEG_FORMATS, EvalPreset, pil_to_tensor, upright_rgb

_SWAPS_SIDES = (5, 6, 7, 8)  # EXIF orientations that turn the image by 90 degrees

Batch = tuple[torch.Tensor, torch.Tensor]  # images, targets
Prepare = Callable[[Any], Batch]  # a loader's batch -> a batch on the device


def _pixels(image: Image.Image) -> torch.Tensor:
    """A PIL image as an upright RGB uint8 (C, H, W) tensor, the CPU path's decode."""
    image.load()
    return pil_to_tensor(upright_rgb(image))


def _upright_size(image: Image.Image) -> tuple[int, int]:
    """(height, width) after EXIF orientation, from the header alone."""
    width, height = image.size
    try:
        turned = image.getexif().get(0x0112) in _SWAPS_SIDES
    except Exception:  # noqa: BLE001 - a broken EXIF block is ignored by every decoder, so here too
        turned = False
    return (width, height) if turned else (height, width)


class EncodedFolder(Dataset):
    """The train split for the GPU path: (JPEG bytes or decoded pixels, crop-and-flip row, target) per sample."""

    def __init__(self, samples: Sequence[Sample], *, min_crop_scale: float, hflip_prob: float, seed: int) -> None:
        self.samples = list(samples)
        self.min_crop_scale, self.hflip_prob, self.seed = check_min_crop_scale(min_crop_scale), hflip_prob, seed

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: SampleKey) -> tuple[torch.Tensor, torch.Tensor, int]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        path, target = self.samples[index]
        try:
            payload, (height, width) = _payload(Path(path))
        except Exception as exc:  # noqa: BLE001 - PIL raises many types on broken files; OSError on a missing one
            raise unreadable(Path(path), exc) from None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed(self.seed, epoch, index))
            box = draw(height, width, self.min_crop_scale, self.hflip_prob)
        return payload, box.as_tensor(), target


def _payload(path: Path) -> tuple[torch.Tensor, tuple[int, int]]:
    """A JPEG's bytes (decoded on the device) or another image's pixels, and its upright height and width."""
    data = path.read_bytes()
    with Image.open(io.BytesIO(data)) as image:
        if image.format in JPEG_FORMATS:
            return torch.frombuffer(bytearray(data), dtype=torch.uint8), _upright_size(image)
        pixels = _pixels(image)
        return pixels, (pixels.shape[1], pixels.shape[2])


@dataclass
class EncodedBatch:
    """A batch as the workers send it: payloads (1-D encoded JPEG, or 3-D pixels), boxes (N, 5), targets (N,)."""

    payloads: list[torch.Tensor]
    boxes: torch.Tensor
    targets: torch.Tensor

    def pin_memory(self) -> "EncodedBatch":
        """Called by the DataLoader's pinning thread: the small tensors and the decoded pixels go pinned."""
        payloads = [p if p.ndim == 1 else p.pin_memory() for p in self.payloads]
        return EncodedBatch(payloads, self.boxes.pin_memory(), self.targets.pin_memory())

    def __len__(self) -> int:
        return len(self.payloads)


def collate(rows: list[tuple[torch.Tensor, torch.Tensor, int]]) -> EncodedBatch:
    """The DataLoader's collate_fn for :class:`EncodedFolder`: payloads stay a list (their sizes differ)."""
    return EncodedBatch([row[0] for row in rows], torch.stack([row[1] for row in rows]),
                        torch.tensor([row[2] for row in rows], dtype=torch.int64))


def _host_decode(encoded: torch.Tensor) -> torch.Tensor:
    """A JPEG the device refused, decoded on the host: libjpeg-turbo, else PIL (CMYK and other rare kinds)."""
    from torchvision.io import ImageReadMode, decode_jpeg  # where used, as models/data/jpeg.py's device path

    try:
        return decode_jpeg(encoded, mode=ImageReadMode.RGB, apply_exif_orientation=True)
    except RuntimeError:
        with Image.open(io.BytesIO(encoded.numpy().tobytes())) as image:
            return _pixels(image)


class DeviceAugment:
    """An :class:`EncodedBatch` -> (normalised float images (N, C, S, S), targets) on ``device``."""

    def __init__(self, preset: EvalPreset, device: torch.device, memory_format: torch.memory_format) -> None:
        self.preset, self.device, self.memory_format = preset, device, memory_format
        # (x / 255 - mean) / std as one subtract and one divide on 0..255 values.
        self.mean = torch.tensor(preset.mean, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(preset.std, device=device).view(1, 3, 1, 1) * 255

    def _decoded(self, payloads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        jpegs = [i for i, payload in enumerate(payloads) if payload.ndim == 1]
        on_device = dict(zip(jpegs, decode_jpegs([payloads[i] for i in jpegs], self.device)))
        out = []
        for i, payload in enumerate(payloads):
            pixels = on_device.get(i)
            if pixels is None:
                host = payload if payload.ndim == 3 else _host_decode(payload)
                pixels = host.to(self.device, non_blocking=True)
            out.append(pixels)
        return out

    def __call__(self, batch: EncodedBatch) -> Batch:
        size, interpolation = self.preset.crop_size, self.preset.interpolation
        crops = [crop_tensor(pixels, CropFlip.from_tensor(row), size, interpolation)
                 for pixels, row in zip(self._decoded(batch.payloads), batch.boxes)]
        images = torch.stack(crops).float().sub_(self.mean).div_(self.std)
        return (images.contiguous(memory_format=self.memory_format),
                batch.targets.to(self.device, non_blocking=True))


class ToDevice:
    """The CPU path's batch preparation: the worker's float batch copied to ``device`` (pinned, non-blocking)."""

    def __init__(self, device: torch.device, memory_format: torch.memory_format) -> None:
        self.device, self.memory_format = device, memory_format

    def __call__(self, batch: Batch) -> Batch:
        images, targets = batch
        return (images.to(self.device, non_blocking=True, memory_format=self.memory_format),
                targets.to(self.device, non_blocking=True))


# The side stream batches are prepared on, drawn once per device from the high-priority pool. PyTorch hands a pool's
# 32 streams out in turn: one drawn from the default pool every epoch would in time be the JPEG decoding's own
# (models/data/jpeg.py ``decode_stream``), which then no longer orders nvJPEG's output against its caller.
PREFETCH_PRIORITY = -1
_prefetch_streams: dict[torch.device, torch.cuda.Stream] = {}


def prefetch_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream ``DevicePrefetcher`` prepares ``device``'s batches on."""
    return stream_drawn_once(_prefetch_streams, device, PREFETCH_PRIORITY)


class DevicePrefetcher:
    """Iterates a loader's batches prepared on the device; on CUDA the next batch is prepared on a side stream
    while the current step runs (its decode and crops overlap the forward and backward pass)."""

    def __init__(self, loader: DataLoader, prepare: Prepare, device: torch.device) -> None:
        self.loader, self.prepare, self.device = loader, prepare, device

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Batch]:
        if self.device.type != "cuda":
            return (self.prepare(batch) for batch in self.loader)
        return self._overlapped()

    def _overlapped(self) -> Iterator[Batch]:
        stream, batches = prefetch_stream(self.device), iter(self.loader)
        main = torch.cuda.current_stream(self.device)
        stream.wait_stream(main)  # what the main stream queued first (the augment's constants) before any batch

        def ahead() -> Batch | None:
            batch = next(batches, None)
            if batch is None:
                return None
            with torch.cuda.stream(stream):
                return self.prepare(batch)

        ready = ahead()
        while ready is not None:
            main.wait_stream(stream)
            for tensor in ready:  # made on the side stream, used on the main one: keep the allocator honest
                tensor.record_stream(main)
            current, ready = ready, ahead()
            yield current
