"""A smoke run of ``python -m bench.serving.gpu`` on the CPU: the GPU session's benchmark (decode paths x images per
request x C, the device path's in-process limit, GPU utilisation) runs end to end here first, so device time is spent on
figures, not on fixing the script."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench.serving import gpu


@pytest.mark.slow
def test_the_gpu_benchmark_runs_on_the_cpu(tmp_path: Path) -> None:
    gpu.main(["--device", "cpu", "--dtype", "float32", "--models", "mobilenet_v3_small", "--batch-sizes", "2",
              "--concurrency", "1", "--workers", "1", "--processes", "--seconds", "0.5", "--warmup", "0.2",
              "--limit-seconds", "0.3", "--images-per-request", "1", "2", "--decode-paths", "pil", "device",
              "--workload", "imagenet", "--engines", "process", "inline", "--out", str(tmp_path)])
    (report,) = tmp_path.glob("*-gpu-cpu.md")
    text = report.read_text()
    assert "device path + forward (float32), batch 2: the limit" in text
    rows = [line for line in text.splitlines() if line.startswith(("| process |", "| inline |"))]
    assert [tuple(cell.strip() for cell in row.split("|")[1:4]) for row in rows] == [
        (engine, path, per_request) for engine in ("process", "inline") for path in ("pil", "device")
        for per_request in ("1", "2")]
    assert all(row.split("|")[11].strip() == "0" for row in rows)  # no request failed on either path or engine
