"""What making a batch of decoded photos into the model's input costs the thread that does it (issue #50): the
device path's resize, centre crop and normalisation (``TensorEvalTransform.batch``, in the batch worker after the
batch's JPEGs are decoded on the device), image by image as before (each image through torchvision's resize, which on
CUDA converts it to float32, resizes, rounds and converts it back to uint8: five steps and torchvision's dispatch
each) against the crops kept float32 and rounded together (``rounded_crops``: the images of one size made float32
and resized as one batch, a few steps a size).

    python3 -m bench.serving.batch_preprocess --device cuda --out FOLDER      # on a GPU host (the drill runs it)
    .venv/bin/python -m bench.serving.batch_preprocess --device cpu           # the stand-in on a CPU host

On the CPU torchvision resizes uint8 natively and neither path runs, so there both are made to take the float round
trip they take on CUDA (torchvision's native kernels turned off for the run), on the photos shrunk to 64 pixels and a
48-pixel crop: the same steps, the compute small, so the CPU per image stands for what the dispatch costs. On CUDA:
the ImageNet-size photos and Lite0's preset. For each batch size: the operations torch runs per batch that compute
(views left out: on a GPU, each a kernel launch), the calling thread's CPU per image (``time.thread_time``: what
the interpreter lock is held for) and the wall time per image, waited for; the largest difference between the two
paths' batches (0: the same values). Writes ``batch-preprocess-<device>.json`` and ``.md`` into ``--out``.
"""
from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import models.presets
from app.engine.decoding.image import DecodeLimits
from app.engine.decoding.tensor import decode_tensor
from bench.serving.forward_launch import WORK, device_name, timed_call, write_report
from harness.photos import imagenet_workload
from models.presets import EvalPreset, TensorEvalTransform, lite0_preset

SMALL_SIDE = 64  # the CPU stand-in's photos: their short side, then SMALL_PRESET's resize and crop
SMALL_PRESET = EvalPreset(resize_size=56, crop_size=48, interpolation="bicubic", mean=lite0_preset().mean,
                          std=lite0_preset().std)


class _Counted(TorchDispatchMode):
    """Counts the operations torch runs inside it that compute (not views: on a GPU, each a kernel launch)."""

    def __init__(self) -> None:
        super().__init__()
        self.operations = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.operations += not func.is_view
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def through_float() -> Iterator[None]:
    """torchvision's and this project's native uint8 resizes turned off: the CPU resizes as CUDA does."""
    import torchvision.transforms.v2.functional._geometry as geometry

    saved = geometry._do_native_uint8_resize_on_cpu, models.presets._native_uint8_resize
    geometry._do_native_uint8_resize_on_cpu = lambda interpolation: False
    models.presets._native_uint8_resize = lambda device, interpolation: False
    try:
        yield
    finally:
        geometry._do_native_uint8_resize_on_cpu, models.presets._native_uint8_resize = saved


def photos(device: torch.device, small: bool) -> list[torch.Tensor]:
    """The benchmark's ImageNet-size photos decoded (uint8 (C, H, W)) on ``device``; ``small``: shrunk first."""
    decoded = [decode_tensor(data, DecodeLimits()) for data in imagenet_workload()]
    if small:
        decoded = [F.interpolate(image[None].float(), scale_factor=SMALL_SIDE / min(image.shape[-2:]),
                                 mode="bilinear", antialias=True)[0].round().to(torch.uint8) for image in decoded]
    return [image.to(device) for image in decoded]


def measure(device: torch.device, batch_sizes: Sequence[int], seconds: float) -> list[dict[str, object]]:
    """One row per batch size (see the module's docstring)."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    transform = TensorEvalTransform(lite0_preset() if cuda else SMALL_PRESET)
    decoded = photos(device, small=not cuda)
    rows: list[dict[str, object]] = []
    with (contextlib.nullcontext() if cuda else through_float()):
        for size in batch_sizes:
            images = [decoded[i % len(decoded)] for i in range(size)]

            def one_by_one() -> torch.Tensor:  # as the batch was made before
                return transform.normalize(torch.stack([transform.resize_crop(image) for image in images]))

            def together() -> torch.Tensor:
                return transform.batch(images)

            row: dict[str, object] = {"batch": size}
            for name, make in (("one_by_one", one_by_one), ("together", together)):
                make()  # once first: what the first call makes and keeps (the normalisation's constants) not counted
                with _Counted() as counted:
                    make()
                row[f"{name}_operations"] = counted.operations
                cpu_us, wall_us, _ = timed_call(make, sync, seconds)
                row[f"{name}_cpu_us_per_image"], row[f"{name}_wall_us_per_image"] = cpu_us / size, wall_us / size
            row["max_difference"] = float((one_by_one() - together()).abs().max())
            rows.append(row)
    return rows


def report(rows: Sequence[dict[str, Any]], machine: dict[str, object]) -> str:
    """The rows as a markdown table."""
    lines = [f"# Making a batch the model's input, the thread's cost: {machine['device_name']}, torch "
             f"{machine['torch']}, {machine['photos']}", "",
             "| batch | operations that compute, image by image | together | CPU us / image, image by image | "
             "together | wall us / image, image by image | together | largest difference |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['batch']} | {r['one_by_one_operations']} | {r['together_operations']} | "
              f"{r['one_by_one_cpu_us_per_image']:.0f} | {r['together_cpu_us_per_image']:.0f} | "
              f"{r['one_by_one_wall_us_per_image']:.0f} | {r['together_wall_us_per_image']:.0f} | "
              f"{r['max_difference']:.2g} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--seconds", type=float, default=1.0, help="per point and path")
    parser.add_argument("--out", type=Path, default=WORK / "batch-preprocess")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    machine = {"device_name": device_name(device), "torch": torch.__version__,
               "photos": ("ImageNet-size photos, Lite0's preset" if device.type == "cuda" else
                          f"the photos shrunk to {SMALL_SIDE} px, a {SMALL_PRESET.crop_size} px crop, the float "
                          "round trip CUDA takes")}
    rows = measure(device, args.batch_sizes, args.seconds)
    write_report(args.out / f"batch-preprocess-{device.type}", machine, rows, report(rows, machine))


if __name__ == "__main__":
    main()
