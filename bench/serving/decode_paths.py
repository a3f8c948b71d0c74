"""``python -m bench.serving.decode_paths``: the tensor decode path (torchvision decoders + tensor transform, the CPU
twin of
the GPU path of issue #18) against today's PIL path, on this machine's CPU, in one run.

Accuracy: EfficientNet-Lite0's answers for the same bytes through both paths, on scikit-image's photos in every
accepted format (JPEG, PNG, WebP, GIF, BMP), at native, ImageNet (500x375) and phone (4000x3000) sizes, and as
EXIF-rotated JPEGs: top-1 agreement and the largest probability difference. Speed: milliseconds per image for
decode + transform on one thread, median of 3 rounds, per group; then the server with each path (images/s and p50
at C=1 and C=16, the benchmark's photo mix). Writes
bench/results/<date>-decode-paths-cpu-<cores>cpu-vm.md and prints it.
"""
from __future__ import annotations

import datetime
import io
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from PIL import Image

from app.config import Settings
from app.engine.decoding.image import DecodeLimits, image_to_tensor
from app.engine.loaded.predictor import Predictor
from app.engine.decoding.tensor import image_to_tensor_path
from bench import paths
from bench.serving.load import measure
from bench.serving.report import save_result
from harness.photos import PHOTO_NAMES, photo, workload
from harness.servers import visionserve
from models.export.write import export_default
from models.presets import TensorEvalTransform, eval_transform

WORK = paths.WORK / "decode-paths"
SIZES = {"native": None, "ImageNet 500x375": (500, 375), "phone 4000x3000": (4000, 3000)}
FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")


def encoded(image: Image.Image, fmt: str, size: tuple[int, int] | None, orientation: int = 1) -> bytes:
    """``image`` resized to ``size`` and saved as ``fmt``; an EXIF orientation other than 1 stores it turned so the
    tag turns it back."""
    if size is not None:
        image = image.resize(size, Image.BICUBIC)
    save: dict[str, object] = {"quality": 90} if fmt in ("JPEG", "WEBP") else {}
    if orientation != 1:
        exif = Image.Exif()
        exif[0x0112] = orientation
        image = image.transpose({6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270,
                                 3: Image.Transpose.ROTATE_180}[orientation])
        save["exif"] = exif.tobytes()
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save)
    return buffer.getvalue()


def cases() -> dict[str, list[bytes]]:
    """Groups of bodies, by format and size, plus the EXIF-rotated JPEGs."""
    groups: dict[str, list[bytes]] = {}
    for fmt in FORMATS:
        for label, size in SIZES.items():
            if fmt in ("GIF", "BMP", "PNG") and label.startswith("phone"):
                continue  # 12 MP lossless files: no phone sends them, and they only slow the run
            groups[f"{fmt}, {label}"] = [encoded(photo(name), fmt, size) for name in PHOTO_NAMES]
    groups["JPEG EXIF-rotated (3, 6, 8), native"] = [encoded(photo(name), "JPEG", None, o)
                                                      for name in PHOTO_NAMES for o in (3, 6, 8)]
    return groups


def parity(predictor: Predictor, bodies: list[bytes], pil: Callable, tensor: Callable) -> tuple[int, float]:
    """How many of ``bodies`` get the same top-1 on both paths, and the largest probability difference."""
    a = predictor.probabilities(torch.stack([pil(b) for b in bodies]))
    b = predictor.probabilities(torch.stack([tensor(b) for b in bodies]))
    return int((a.argmax(1) == b.argmax(1)).sum()), float((a - b).abs().max())


def ms_per_image(path: Callable, bodies: list[bytes], rounds: int = 5) -> float:
    """Median over rounds of the mean decode + transform time per image."""
    per_round = []
    for _ in range(rounds):
        started = time.perf_counter()
        for body in bodies:
            path(body)
        per_round.append(1000 * (time.perf_counter() - started) / len(bodies))
    return statistics.median(per_round)


def served_table(weights: Path, rounds: int = 2, duration_s: float = 15.0) -> list[str]:
    """The server (gunicorn, 2 workers, the benchmark's photo mix) with each path, alternating rounds: medians."""
    points: dict[str, list[tuple[float, float, float, float]]] = {"pil": [], "tensor": []}
    for _ in range(rounds):
        for path in points:
            server = visionserve(weights, WORK, decode_path=path, workers="2").wait_ready()
            try:
                one, many = (measure(path, "lite0", server.url, "/predict", list(workload()), c, duration_s, 3.0)
                             for c in (1, 16))
                points[path].append((one.images_per_s, one.p50_ms, many.images_per_s, many.p50_ms))
            finally:
                server.stop()
    lines = [f"The server with each path (gunicorn, 2 workers, the benchmark's photo mix: 6 photos at native, "
             f"1920x1080 and 4000x3000; median of {rounds} rounds of {duration_s:g} s):", "",
             "| DECODE_PATH | C=1 images/s | C=1 p50 (ms) | C=16 images/s | C=16 p50 (ms) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    medians = {path: [statistics.median(p[i] for p in runs) for i in range(4)] for path, runs in points.items()}
    lines += [f"| {path} | {m[0]:.1f} | {m[1]:.1f} | {m[2]:.1f} | {m[3]:.1f} |" for path, m in medians.items()]
    lines += ["", f"tensor / pil images/s: C=1 {medians['tensor'][0] / medians['pil'][0]:.2f}x, "
              f"C=16 {medians['tensor'][2] / medians['pil'][2]:.2f}x"]
    return lines


def main() -> int:
    torch.set_num_threads(1)
    weights = WORK / "lite0"
    if not (weights / "manifest.json").is_file():
        export_default(weights, force=True)
    predictor = Predictor.load(weights, device="cpu", jit_optimize=True)
    limits = DecodeLimits.from_settings(Settings())
    pil_transform, tensor_transform = eval_transform(predictor.manifest.preprocess), TensorEvalTransform(
        predictor.manifest.preprocess)

    def pil(body: bytes) -> torch.Tensor:
        return image_to_tensor(body, pil_transform, limits)

    def tensor(body: bytes) -> torch.Tensor:
        return image_to_tensor_path(body, tensor_transform, limits)

    lines = [f"# Decode paths on the CPU ({os.cpu_count()} cores), {datetime.date.today()}", "",
             f"`python -m bench.serving.decode_paths`; torch {torch.__version__}; EfficientNet-Lite0; PIL path with "
             f"JPEG_DRAFT_MIN_SIDE={limits.jpeg_draft_min_side} (the default); one thread.", "",
             "| images | top-1 agreement | largest probability difference | PIL ms/image | tensor ms/image | "
             "tensor / PIL time |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    agree_all = total = 0
    for label, bodies in cases().items():
        agree, diff = parity(predictor, bodies, pil, tensor)
        agree_all, total = agree_all + agree, total + len(bodies)
        pil_ms, tensor_ms = ms_per_image(pil, bodies, 3), ms_per_image(tensor, bodies, 3)
        lines.append(f"| {label} | {agree}/{len(bodies)} | {diff:.4f} | {pil_ms:.1f} | {tensor_ms:.1f} | "
                     f"{tensor_ms / pil_ms:.2f} |")
    lines += ["", f"Top-1 agreement over all {total} images: {agree_all / total:.1%}.", ""]
    lines += served_table(weights)
    text = "\n".join(lines) + "\n"
    save_result("decode-paths", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
