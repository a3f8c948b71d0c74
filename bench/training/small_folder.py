"""``python -m bench.training.small_folder``: the training recipes a new user meets, on the folder a new user has.

Four classes of 30 training images each (patches of scikit-image's brick, grass, gravel and moon photos; 15 val
images per class from the other half of each photo), 5 epochs on the CPU. Prints each recipe's best and last
val top-1 and its largest val loss, so docs/training.md can say which recipes learn from so little.
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from models import train
from demo_data.small_sets import write_textures

RECIPES = {
    "pretrained fine-tune (head only)": ["--arch", "efficientnet_lite0", "--pretrained", "--freeze-backbone"],
    "resnet18 from scratch, defaults": ["--arch", "resnet18"],
    "resnet18 from scratch, old defaults (lr 0.05, no warm-up)": ["--arch", "resnet18", "--lr", "0.05",
                                                                  "--lr-warmup-epochs", "0"],
    "mobilenet_v3_small from scratch, defaults": ["--arch", "mobilenet_v3_small"],
}


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="small-folder-"))
    data = work / "data"
    write_textures(data, per_class=30, classes=("brick", "grass", "gravel", "moon"))
    print("| recipe | best val top-1 | last val top-1 | largest val loss | time |\n|---|---:|---:|---:|---:|")
    for name, options in RECIPES.items():
        out = work / name.split()[0]
        started = time.monotonic()
        code = train.main(["--data", str(data), "--epochs", "5", "--workers", "1", "--device", "cpu",
                           "--output-dir", str(out), *options])
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if code == 0 else []
        if not rows:
            print(f"| {name} | failed (exit {code}) | | | |")
            continue
        print(f"| {name} | {max(r['val_acc1'] for r in rows):.3f} | {rows[-1]['val_acc1']:.3f} | "
              f"{max(r['val_loss'] for r in rows):.3g} | {time.monotonic() - started:.0f} s |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
