"""The one-step resize + centre crop against torchvision's two steps it replaces."""
from __future__ import annotations

import pytest
import torch
from PIL import Image
from torchvision.transforms import InterpolationMode
from torchvision.transforms import v2 as T

from harness.photos import photo
from models.presets import ResizeCenterCrop

SIZES = [(4000, 3000), (1920, 1080), (1080, 1920), (451, 300), (640, 427), (257, 256), (1000, 1001), (700, 3),
         (3, 700), (225, 300), (224, 224), (100, 60), (1, 1)]


def _two_steps(image: Image.Image, resize: int, crop: int, interpolation: str) -> torch.Tensor:
    steps = T.Compose([T.Resize(resize, interpolation=InterpolationMode(interpolation), antialias=True),
                       T.CenterCrop(crop), T.PILToTensor()])
    return steps(image).int()


@pytest.mark.parametrize("interpolation", ["nearest", "bilinear", "bicubic", "lanczos"])
@pytest.mark.parametrize("resize,crop", [(256, 224), (224, 224), (200, 224), (32, 16)])
def test_same_pixels_as_resize_then_center_crop(interpolation: str, resize: int, crop: int) -> None:
    source = photo("chelsea")
    one_step = ResizeCenterCrop(resize, crop, interpolation)  # type: ignore[arg-type]
    for size in SIZES:
        image = source.resize(size, Image.BICUBIC)
        expected = _two_steps(image, resize, crop, interpolation)
        got = T.PILToTensor()(one_step(image)).int()
        assert got.shape == expected.shape == (3, crop, crop)
        difference = (got - expected).abs()
        # PIL rounds its intermediate (one pass) to 8 bits in both; where the filter overshoots near an edge
        # the rounding can land differently, but on average the two agree to a small fraction of a level.
        assert difference.float().mean() < 0.2, (size, interpolation)
        if size[0] >= size[1]:  # landscape: the crop is along the first pass, which rounds identically
            assert difference.max() <= 1, (size, interpolation)


def test_large_photos_take_the_one_step_path() -> None:
    image = photo("astronaut").resize((1920, 1080))
    calls = []
    one_step = ResizeCenterCrop(256, 224, "bicubic")
    one_step.two_steps = lambda img: calls.append(img)  # type: ignore[assignment,method-assign]
    assert one_step(image).size == (224, 224)
    assert not calls
    one_step(image.resize((200, 150)))  # smaller than the resize: enlarging goes through torchvision
    assert len(calls) == 1
