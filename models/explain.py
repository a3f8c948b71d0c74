"""Why a model chose a class: Grad-CAM on its last convolutional feature map, and the map drawn over the photo.

Grad-CAM (Selvaraju et al., 2017): one forward pass keeps the last feature map A (C x h x w: 7 x 7 for a 224-pixel
input to EfficientNet-Lite0 or a ResNet) and one backward pass gives the gradient of the chosen class's logit with
respect to it; each channel is weighed by its gradient's mean over the map, and the weighted sum over channels,
negative parts cut to 0, is the map: where the evidence for that class lies. It needs a module with gradients (an
eager model: the export's state dict), not a compiled or exported graph.

``feature_layer`` finds the layer generically, as the last module whose output is a feature map (4 dimensions, more
than one cell) in the order a forward pass finishes them: ``bn2`` of timm's EfficientNet (after ``conv_head`` and
its activation), ``layer4`` of a ResNet, ``features`` of a MobileNetV3. ``grad_cam`` runs it; ``overlay`` draws a map
over the region of the photo the model saw (the eval transform's resize and centre crop, ``crop_box``).
"""
from __future__ import annotations

import io
import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from PIL import Image

from models.architectures import split_outputs
from models.export.manifest import EvalPreset

METHOD = "grad-cam"
OVERLAY_OPACITY = 0.5  # the heat map's weight over the photo in the overlay
# A dark-to-bright map (black, purple, red, orange, pale yellow: the "inferno" look), sampled from 0 to 1
_COLOURS = np.array([[0, 0, 4], [87, 16, 110], [188, 55, 84], [249, 142, 9], [252, 255, 164]], dtype=np.float32)


class NoFeatureMap(ValueError):
    """The model has no convolutional feature map to explain with."""


@dataclass(frozen=True)
class ClassMap:
    """A Grad-CAM map: ``grid`` (h x w, 0..1, the largest cell 1 unless the class has no positive evidence, then all
    0) for class ``index``, whose probability is ``score``, from the feature map of ``layer``."""

    grid: np.ndarray
    index: int
    score: float
    layer: str


def feature_layer(model: nn.Module, input_shape: tuple[int, ...]) -> str:
    """The name of the last module whose output is a feature map (N, C, h, w with h * w > 1) when ``model`` runs on
    an input of ``input_shape`` (C, H, W); NoFeatureMap when none is."""
    finished: list[str] = []
    names = {module: name for name, module in model.named_modules()}

    def seen(module: nn.Module, _: object, output: object) -> None:
        if isinstance(output, torch.Tensor) and output.ndim == 4 and output.shape[2] * output.shape[3] > 1:
            finished.append(names[module])

    handles = [module.register_forward_hook(seen) for module in names if module is not model]
    try:
        with torch.inference_mode():
            model(torch.zeros(1, *input_shape, device=_device_of(model)))
    finally:
        for handle in handles:
            handle.remove()
    if not finished:
        raise NoFeatureMap(f"{type(model).__name__} has no convolutional feature map (no layer answers N x C x h x w)")
    return finished[-1]


def grad_cam(model: nn.Module, layer: str, pixels: torch.Tensor, index: int | None = None) -> ClassMap:
    """Grad-CAM of ``pixels`` (C, H, W, preprocessed) for class ``index`` (None: the top one) at ``layer`` of
    ``model`` (in eval mode; it answers logits, or logits and an embedding): one forward and one backward pass."""
    kept: list[torch.Tensor] = []
    caller = threading.get_ident()  # threads explaining at once share the module: each keeps its own feature map

    def keep(_: nn.Module, __: object, output: torch.Tensor) -> None:
        if threading.get_ident() == caller:
            kept.append(output)

    handle = model.get_submodule(layer).register_forward_hook(keep)
    try:
        with torch.enable_grad():
            logits, _ = split_outputs(model(pixels.unsqueeze(0).to(_device_of(model), torch.float32)))
            chosen = int(logits[0].argmax()) if index is None else index
            (gradient,) = torch.autograd.grad(logits[0, chosen], kept[0])
    finally:
        handle.remove()
    with torch.no_grad():
        weights = gradient.mean(dim=(2, 3), keepdim=True)
        cam = torch.relu((weights * kept[0]).sum(dim=1))[0].float()
        peak = float(cam.max())
        grid = (cam / peak if peak > 0 else cam).cpu().numpy()
        score = float(logits.detach().float().softmax(dim=1)[0, chosen])
    return ClassMap(grid, chosen, score, layer)


def crop_box(width: int, height: int, preset: EvalPreset) -> tuple[int, int, int, int]:
    """The region (left, top, right, bottom) of a ``width`` x ``height`` photo the model sees through ``preset``:
    the short side resized to ``resize_size``, then the centre ``crop_size`` square."""
    scale = min(width, height) / preset.resize_size
    side = min(preset.crop_size * scale, width, height)
    left, top, square = round((width - side) / 2), round((height - side) / 2), round(side)
    return left, top, left + square, top + square


def heat_colours(grid: np.ndarray) -> np.ndarray:
    """``grid`` (values 0..1) as RGB (h x w x 3, uint8) on the map's colour scale."""
    positions = np.clip(grid, 0, 1) * (len(_COLOURS) - 1)
    low = np.floor(positions).astype(int).clip(0, len(_COLOURS) - 2)
    share = (positions - low)[..., None]
    return ((1 - share) * _COLOURS[low] + share * _COLOURS[low + 1]).round().astype(np.uint8)


def overlay(photo: Image.Image, grid: np.ndarray, preset: EvalPreset) -> bytes:
    """A PNG of the region of ``photo`` the model saw, with ``grid`` drawn over it (smoothly scaled up)."""
    box = crop_box(photo.width, photo.height, preset)
    seen = photo.convert("RGB").crop(box)
    heat = Image.fromarray(heat_colours(grid)).resize(seen.size, Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    Image.blend(seen, heat, OVERLAY_OPACITY).save(buffer, format="PNG")
    return buffer.getvalue()


def _device_of(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))
