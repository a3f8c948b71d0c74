"""``python -m bench.serving.explain_faithfulness``: are the explanations faithful (the deletion test), and what does
one cost on the CPU?

The packaged EfficientNet-Lite0 (as the server explains it: its state dict, models/explain.py's Grad-CAM at the
layer it finds) over real photos: the 23 photos scikit-image and scikit-learn ship that demo_data's folder is cut
from (demo_data/photos.py), each whole
and as its four corner crops of 70% (115 images). For each image, the top class and its map; the map scaled up to
the input (bilinear) ranks the input's pixels; then the class's probability again with the top ``--share`` of the
pixels blanked (set to the normalisation's mean: 0 after normalising), against the same share blanked at random
(``--draws`` draws, averaged), both as single pixels and as whole cells of the map's grid (random pixels are
noise spread over the whole image; random cells have the map's own blocky shape). A faithful map finds pixels whose
loss lowers the class's probability more than random ones. Prints the mean probability drop both ways, on how many images the map's drop was the larger, and the
median milliseconds of one explanation (decode excluded: forward, backward, map) with torch on one thread and on
every core.

    .venv/bin/python -m bench.serving.explain_faithfulness
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from PIL import Image

from demo_data.photos import PHOTOS, photo
from models.architectures import split_outputs
from models.explain import feature_layer, grad_cam
from models.presets import eval_transform, lite0_preset
from models.pretrained import load_lite0_imagenet

CORNERS = ((0, 0), (1, 0), (0, 1), (1, 1))  # left/right, top/bottom of a corner crop
# Two ways to blank the same number of pixels, each both by the map and at random: single pixels (the map scaled up
# ranks them; random ones are scattered noise over the whole image) and whole cells of the map's grid (its most
# evidential cells against random cells: the same blocky shape both ways)
BLANKINGS = {"map, pixels": "the map's top {share} of pixels",
             "random pixels": "a random {share} of pixels (mean of {draws})",
             "map, cells": "the map's top cells, {share} of pixels",
             "random cells": "random cells, {share} of pixels (mean of {draws})"}


def views(share: float = 0.7) -> list[torch.Tensor]:
    """Each photo whole and as its four corner crops of ``share``, through Lite0's eval transform."""
    transform = eval_transform(lite0_preset())
    out = []
    for name in PHOTOS:
        image = Image.fromarray(photo(name)).convert("RGB")
        width, height = image.size
        w, h = int(width * share), int(height * share)
        out.append(transform(image))
        out += [transform(image.crop((x * (width - w), y * (height - h), x * (width - w) + w, y * (height - h) + h)))
                for x, y in CORNERS]
    return out


def probability(model: torch.nn.Module, pixels: torch.Tensor, index: int) -> float:
    with torch.inference_mode():
        return float(split_outputs(model(pixels.unsqueeze(0)))[0].softmax(dim=1)[0, index])


def blanked(pixels: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """``pixels`` with the positions ``chosen`` (flat indices of H x W) set to 0, the normalised mean."""
    out = pixels.clone().reshape(pixels.shape[0], -1)
    out[:, chosen] = 0
    return out.reshape(pixels.shape)


def cells(shape: tuple[int, int], grid: tuple[int, int], order: torch.Tensor, count: int) -> torch.Tensor:
    """Flat pixel indices (of an H x W input) of the grid cells in ``order`` (flat cell indices), the first
    ``count`` pixels: whole cells, the last one cut."""
    height, width = shape
    rows, columns = grid
    taken = []
    for cell in order.tolist():
        r, c = divmod(cell, columns)
        top, bottom = r * height // rows, (r + 1) * height // rows
        left, right = c * width // columns, (c + 1) * width // columns
        ys, xs = torch.meshgrid(torch.arange(top, bottom), torch.arange(left, right), indexing="ij")
        taken.append((ys * width + xs).flatten())
        if sum(len(t) for t in taken) >= count:
            break
    return torch.cat(taken)[:count]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--share", type=float, default=0.10, help="share of the pixels blanked (default 0.10)")
    parser.add_argument("--draws", type=int, default=5, help="random blankings per image (default 5)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = load_lite0_imagenet().eval()
    images = views()
    layer = feature_layer(model, tuple(images[0].shape))
    count = int(args.share * images[0].shape[1] * images[0].shape[2])
    drops: dict[str, list[float]] = {name: [] for name in BLANKINGS}
    wins = dict.fromkeys(("pixels", "cells"), 0)
    for pixels in images:
        found = grad_cam(model, layer, pixels)
        shape, grid_shape = tuple(pixels.shape[1:]), found.grid.shape
        grid = torch.from_numpy(found.grid)[None, None].float()
        heat = F.interpolate(grid, size=shape, mode="bilinear", align_corners=False).flatten()
        cell_order = torch.from_numpy(found.grid).flatten().argsort(descending=True)

        def drop(chosen: torch.Tensor) -> float:
            return found.score - probability(model, blanked(pixels, chosen), found.index)

        got = {"map, pixels": drop(heat.argsort(descending=True)[:count]),
               "random pixels": statistics.mean(drop(torch.randperm(heat.numel())[:count])
                                                for _ in range(args.draws)),
               "map, cells": drop(cells(shape, grid_shape, cell_order, count)),
               "random cells": statistics.mean(drop(cells(shape, grid_shape, torch.randperm(cell_order.numel()),
                                                          count)) for _ in range(args.draws))}
        for name, value in got.items():
            drops[name].append(value)
        wins["pixels"] += got["map, pixels"] > got["random pixels"]
        wins["cells"] += got["map, cells"] > got["random cells"]
    timings = {}
    for threads in (1, torch.get_num_threads()):
        torch.set_num_threads(threads)
        spent = []
        for pixels in images[:20]:
            started = time.perf_counter()
            grad_cam(model, layer, pixels)
            spent.append((time.perf_counter() - started) * 1000)
        timings[threads] = statistics.median(spent)
    print(f"EfficientNet-Lite0 (its state dict), Grad-CAM at {layer}, {len(images)} views of {len(PHOTOS)} photos; "
          f"{100 * args.share:g}% of the input's pixels blanked")
    print("| blanked | mean drop of the class's probability | median drop |")
    print("| --- | --- | --- |")
    for name, values in drops.items():
        print(f"| {BLANKINGS[name].format(share=f'{100 * args.share:g}%', draws=args.draws)} | {np.mean(values):.4f} "
              f"| {np.median(values):.4f} |")
    for unit in ("pixels", "cells"):
        ratio = np.mean(drops[f"map, {unit}"]) / max(np.mean(drops[f"random {unit}"]), 1e-9)
        print(f"By {unit}: the map's blanking lowered the class more than random on {wins[unit]} of {len(images)} "
              f"images; its mean drop is {ratio:.2f}x random's.")
    print("One explanation (forward + backward + map, decode excluded), median of 20: " +
          ", ".join(f"{ms:.0f} ms on {t} thread{'s' if t > 1 else ''}" for t, ms in timings.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
