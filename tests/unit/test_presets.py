"""The one-step resize + centre crop against torchvision's two steps it replaces, and the eval transforms written
without torchvision against torchvision's own."""
from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from harness.photos import photo
from harness.servers import ROOT
from models.presets import (
    EvalPreset,
    ResizeCenterCrop,
    TensorEvalTransform,
    eval_transform,
    lite0_preset,
    pil_to_tensor,
)

# 70x3 and 3x70: a strip enlarged (its short side to 256: 5,973 x 256; 700x3 made 59,733 x 256, 1.6 s of the fast
# subset's CPU for each, to test the same enlarging path)
SIZES = [(4000, 3000), (1920, 1080), (1080, 1920), (451, 300), (640, 427), (257, 256), (1000, 1001), (70, 3),
         (3, 70), (225, 300), (224, 224), (100, 60), (1, 1)]


def _two_steps(image: Image.Image, resize: int, crop: int, interpolation: str) -> torch.Tensor:
    from torchvision.transforms import InterpolationMode, v2 as T  # here, not at collection: ~1.4 s a process

    steps = T.Compose([T.Resize(resize, interpolation=InterpolationMode(interpolation), antialias=True),
                       T.CenterCrop(crop), T.PILToTensor()])
    return steps(image).int()


@functools.lru_cache(maxsize=None)
def _chelsea_at(size: tuple[int, int]) -> Image.Image:
    """The photo at ``size``, made once for every case (the 4000x3000 one alone takes a tenth of a second)."""
    return photo("chelsea").resize(size, Image.BICUBIC)


@pytest.mark.parametrize("interpolation", ["nearest", "bilinear", "bicubic", "lanczos"])
@pytest.mark.parametrize("resize,crop", [(256, 224), (224, 224), (200, 224), (32, 16)])
def test_same_pixels_as_resize_then_center_crop(interpolation: str, resize: int, crop: int) -> None:
    from torchvision.transforms import v2 as T

    one_step = ResizeCenterCrop(resize, crop, interpolation)  # type: ignore[arg-type]
    for size in SIZES:
        image = _chelsea_at(size)
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


# -- the eval transforms without torchvision, against torchvision's own -------------------------------------------

def _torchvision_pil_eval(preset: EvalPreset):  # noqa: ANN202
    from torchvision.transforms import v2 as T

    return T.Compose([ResizeCenterCrop(preset.resize_size, preset.crop_size, preset.interpolation), T.PILToTensor(),
                      T.ToDtype(torch.float32, scale=True), T.Normalize(mean=list(preset.mean), std=list(preset.std))])


def _torchvision_tensor_eval(preset: EvalPreset, image: torch.Tensor) -> torch.Tensor:
    from torchvision.transforms import InterpolationMode, v2 as T

    # nearest as PIL's: NEAREST_EXACT on tensors (test_nearest_is_pil_s_nearest_on_tensors too)
    mode = InterpolationMode.NEAREST_EXACT if preset.interpolation == "nearest" else InterpolationMode(
        preset.interpolation)
    pixels = T.functional.resize(image, [preset.resize_size], interpolation=mode, antialias=True)
    pixels = T.functional.center_crop(pixels, [preset.crop_size]).float().div_(255)
    return T.functional.normalize(pixels, list(preset.mean), list(preset.std), inplace=True)


PRESETS = [lite0_preset(), EvalPreset(resize_size=232, crop_size=224, interpolation="bilinear"),
           EvalPreset(resize_size=64, crop_size=56, interpolation="nearest"),
           EvalPreset(resize_size=200, crop_size=224, interpolation="bicubic")]  # a crop larger than the resize


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: f"{p.interpolation}-{p.resize_size}-{p.crop_size}")
def test_the_eval_transforms_give_torchvisions_values(preset: EvalPreset) -> None:
    source = photo("chelsea")
    pil_eval, tensor_eval = eval_transform(preset), TensorEvalTransform(preset)
    for size in [(1920, 1080), (1080, 1920), (451, 300), (256, 300), (232, 232), (120, 90)]:
        image = source.resize(size, Image.BICUBIC)
        assert torch.equal(pil_eval(image), _torchvision_pil_eval(preset)(image)), size
        hwc = torch.from_numpy(np.array(image))
        # as libjpeg-turbo's pixels arrive (a channels-last view) and as a contiguous copy
        for pixels in (hwc.permute(2, 0, 1), hwc.permute(2, 0, 1).contiguous()):
            expected = _torchvision_tensor_eval(preset, pixels.clone())
            got = tensor_eval(pixels.clone())
            assert got.shape == expected.shape == preset.input_shape and torch.equal(got, expected), size


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: f"{p.interpolation}-{p.resize_size}-{p.crop_size}")
def test_a_batch_resized_through_float_gives_torchvision_s_float_round_trip_image_by_image(
        preset: EvalPreset, monkeypatch: pytest.MonkeyPatch) -> None:
    # Where torchvision resizes uint8 through float32 and back (on CUDA; here with its native uint8 kernels turned
    # off, so it runs that path on the CPU), a batch keeps the crops float32 and rounds them together: the same
    # values, image by image, for every size, layout and filter; a filter or crop it cannot take goes image by image.
    import torchvision.transforms.v2.functional._geometry as geometry

    import models.presets

    monkeypatch.setattr(geometry, "_do_native_uint8_resize_on_cpu", lambda interpolation: False)
    monkeypatch.setattr(models.presets, "_native_uint8_resize", lambda device, interpolation: False)
    source, tensor_eval = photo("chelsea"), TensorEvalTransform(preset)
    images = []
    for size in [(1920, 1080), (1080, 1920), (451, 300), (256, 300), (232, 232), (120, 90)]:
        hwc = torch.from_numpy(np.array(source.resize(size, Image.BICUBIC)))
        images += [hwc.permute(2, 0, 1), hwc.permute(2, 0, 1).contiguous()]  # as decoded, and a contiguous copy
    if preset.interpolation == "bicubic":  # a bicubic resize overshoots on a hard edge, clamped as torchvision does
        images.append(torch.tensor([0, 255] * 150, dtype=torch.uint8).reshape(1, 1, 300).expand(3, 300, 300))
    crops: list[torch.Tensor] = []  # what rounded_crops gave, before batch normalises it in place

    def rounded_crops(batch: list[torch.Tensor]) -> torch.Tensor:
        crops.append(TensorEvalTransform.rounded_crops(tensor_eval, batch))
        return crops[-1].clone()

    monkeypatch.setattr(tensor_eval, "rounded_crops", rounded_crops)
    got = tensor_eval.batch(images)
    expected = torch.stack([_torchvision_tensor_eval(preset, image.clone()) for image in images])
    assert got.shape == expected.shape == (len(images), *preset.input_shape) and torch.equal(got, expected)
    in_float = preset.interpolation in ("bilinear", "bicubic") and preset.crop_size <= preset.resize_size
    assert len(crops) == in_float  # nearest, and a crop larger than the resize: image by image, as before
    if in_float:
        assert crops[0].dtype == torch.float32 and torch.equal(crops[0], crops[0].round().clamp(0, 255))


def test_nearest_is_pil_s_nearest_on_tensors() -> None:
    from torchvision.transforms import v2 as T

    # Before: a preset's nearest was torchvision's NEAREST on tensors, which floors a pixel's source position where
    # PIL rounds it: the tensor and device paths (and the GPU training augment) took the neighbouring pixel, on a
    # 2:1 shrink every one of them.
    preset = EvalPreset(resize_size=256, crop_size=224, interpolation="nearest")
    for size in [(512, 512), (500, 375), (451, 300), (300, 451)]:
        image = photo("astronaut").resize(size, Image.BICUBIC)
        on_tensor = TensorEvalTransform(preset).resize_crop(pil_to_tensor(image))
        assert torch.equal(on_tensor, T.PILToTensor()(ResizeCenterCrop(256, 224, "nearest")(image))), size


def test_a_batch_resizes_the_images_of_one_size_together_and_keeps_their_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A batch of a camera's frames is a few steps, not two an image (on CUDA each a launch): one resize per size,
    # in whatever order the sizes come, each image's values as torchvision's float round trip gives them alone.
    import torchvision.transforms.v2.functional._geometry as geometry

    import models.presets

    monkeypatch.setattr(geometry, "_do_native_uint8_resize_on_cpu", lambda interpolation: False)
    monkeypatch.setattr(models.presets, "_native_uint8_resize", lambda device, interpolation: False)
    preset, source = lite0_preset(), photo("chelsea")
    sizes = [(500, 375), (375, 500), (500, 375), (320, 320), (375, 500), (500, 375)]  # interleaved
    images = [torch.from_numpy(np.array(source.resize(size, Image.BICUBIC).rotate(17 * i)))
              .permute(2, 0, 1).contiguous() for i, size in enumerate(sizes)]  # each image its own pixels
    expected = torch.stack([_torchvision_tensor_eval(preset, image.clone()) for image in images])
    resized: list[int] = []  # the images each resize call took
    interpolate = models.presets.F.interpolate
    monkeypatch.setattr(models.presets.F, "interpolate",
                        lambda pixels, **kw: resized.append(pixels.shape[0]) or interpolate(pixels, **kw))
    got = TensorEvalTransform(preset).batch(images)
    assert sorted(resized) == [1, 2, 3]  # 500x375 three times, 375x500 twice, 320x320 once
    assert torch.equal(got, expected)
    # a size's images are resized at most RESIZED_TOGETHER_PIXELS at once: their float32 copy stays bounded
    resized.clear()
    monkeypatch.setattr(models.presets, "RESIZED_TOGETHER_PIXELS", 2 * 500 * 375)
    assert torch.equal(TensorEvalTransform(preset).batch(images), expected)
    assert sorted(resized) == [1, 1, 2, 2]  # 500x375: two, then one


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_serving_a_model_on_the_tensor_path_imports_no_torchvision(tmp_path: Path) -> None:
    # torchvision imports torch._dynamo: about a second of every worker's start, for nothing the CPU path uses.
    script = """
import sys, numpy as np, torch
from PIL import Image
import app.engine.service, app.v1, app.v2
from models.export.load import load_module
from models.presets import TensorEvalTransform, eval_transform, lite0_preset, EvalPreset
for preset in (lite0_preset(), EvalPreset(resize_size=232, crop_size=224, interpolation="bilinear")):
    image = Image.fromarray(np.full((300, 451, 3), 120, np.uint8))
    eval_transform(preset)(image)
    TensorEvalTransform(preset)(torch.from_numpy(np.array(image)).permute(2, 0, 1))
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torchvision", "timm") or m == "torch._dynamo"))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", result.stdout
