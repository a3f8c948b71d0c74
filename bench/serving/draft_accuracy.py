"""Does reduced-scale JPEG decoding (PIL draft) change predictions, and how much time does it save?

    .venv/bin/python -m bench.serving.draft_accuracy [--weights weights] [--min-side 512]

Prints, per photo and size: decode+preprocess milliseconds with and without draft (median of 5), whether top-1
agrees, top-5 overlap, and the largest difference of any class probability.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from app.engine.decoding.image import DecodeLimits, image_to_tensor
from app.engine.loaded.predictor import Predictor
from harness.photos import PHOTO_NAMES, SIZES, jpeg, photo


def _median_ms(fn, repeats: int = 5) -> float:  # noqa: ANN001
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main() -> None:
    """Print the comparison table."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--weights", type=Path, default=Path("weights"))
    parser.add_argument("--min-side", type=int, default=1024)
    args = parser.parse_args()
    predictor = Predictor.load(args.weights, device="cpu")
    full = DecodeLimits(max_pixels=100_000_000, max_aspect_ratio=20, jpeg_draft_min_side=0)
    draft = DecodeLimits(max_pixels=100_000_000, max_aspect_ratio=20, jpeg_draft_min_side=args.min_side)
    print(f"{'photo':22} {'size':10} {'full ms':>8} {'draft ms':>8} {'top1':>5} {'top5':>5} {'max|dp|':>8}")
    worst = 0.0
    for name in PHOTO_NAMES:
        for size_name, size in SIZES.items():
            data = jpeg(photo(name), size)
            tensors = [image_to_tensor(data, predictor.transform, limits) for limits in (full, draft)]
            p_full, p_draft = predictor.probabilities(torch.stack(tensors))
            t_full = _median_ms(lambda: image_to_tensor(data, predictor.transform, full))
            t_draft = _median_ms(lambda: image_to_tensor(data, predictor.transform, draft))
            same_top1 = int(p_full.argmax()) == int(p_draft.argmax())
            overlap = len(set(p_full.topk(5).indices.tolist()) & set(p_draft.topk(5).indices.tolist()))
            diff = float((p_full - p_draft).abs().max())
            worst = max(worst, diff)
            print(f"{name:22} {size_name:10} {t_full:8.1f} {t_draft:8.1f} {str(same_top1):>5} {overlap:>5} {diff:8.4f}")
    print(f"largest probability difference: {worst:.4f}")


if __name__ == "__main__":
    main()
