"""A smoke run of ``python -m bench.training.train`` on the CPU: the training benchmark (synthetic limit, CPU and
GPU data paths, the step's choices, the checkpoint stall, DDP's scaling) runs end to end here, so GPU time goes to
figures."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.training import train as bench_train
from demo_data.photos import write_photos


@pytest.mark.slow  # two DDP processes and three small training runs: about 20 s
def test_the_training_benchmark_runs_on_the_cpu(tmp_path: Path) -> None:
    data = tmp_path / "photos"
    write_photos(data, classes=3, train_per_class=8, val_per_class=2, long_side=96, workers=1)
    report = bench_train.main(["--device", "cpu", "--archs", "mobilenet_v3_small", "--data", str(data),
                               "--batch-size", "4", "--crop-size", "64", "--steps", "2", "--warmup", "1",
                               "--workers", "1", "--amp", "none", "--ddp", "2", "--rounds", "1",
                               "--out", str(tmp_path / "out")])
    text = report.read_text()
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| mobilenet_v3_small |")]
    assert [row[2].strip() for row in rows[:3]] == ["synthetic (limit)", "JPEG folder, CPU path",
                                                   "JPEG folder, GPU path"]
    assert rows[0][4].strip() == "1.00" and all(float(row[3]) > 0 for row in rows)
    figures = json.loads(report.with_suffix(".json").read_text())
    assert [v["note"] for v in figures["variants"]] == ["as shipped", "a loss.item() per step", "optimiser fused"]
    assert figures["ddp"]["mobilenet_v3_small@2"]["images_per_s"] > 0
    assert figures["checkpoint"]["writer_s"] > 0 and figures["checkpoint"]["bytes"] > 1_000_000
    assert report.with_suffix(".png").stat().st_size > 10_000
