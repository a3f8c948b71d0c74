"""The benchmark's report from made-up figures: efficiency against the right limit, the CPU split, the files."""
from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

import pytest

from bench.serving import report
from bench.serving.limit import LimitResult
from bench.serving.load import LoadResult


def _results() -> dict[str, object]:
    limit = [LimitResult("in-process", 8, 100.0, 2.0),
             LimitResult("2 processes x 1 thread", 8, 120.0, None)]
    ceiling = LimitResult("CPU-time bound (2 cores, ...)", 8, 150.0, 1.5, decode_ms=11.0, forward_config="served")
    loads = [LoadResult("visionserve", "m", 16, 108.0, 130, 250, 300, 0, 200, 2.5, 1.9, 0.05, 17.6, 12.0, 3.0),
             LoadResult("naive-flask", "m", 16, 72.0, 200, 380, 450, 0, 150, None, 1.9, 0.03, 26.0),
             LoadResult("visionserve", "m", 1, 50.0, 17.0, 30, 35, 0, 100, 1.0, 1.0, 0.03, 20.0, 12.5, 5.5),
             LoadResult("visionserve (best: WORKERS=3)", "m", 16, 117.0, 120, 240, 280, 0, 210, 2.4, 1.95, 0.05)]
    return {"limit": [asdict(r) for r in limit], "ceiling": asdict(ceiling),
            "bound_at": {16: asdict(ceiling)}, "pipeline_at": {16: asdict(LimitResult("again", 8, 135.0, None))},
            "single_image_ms": 15.0, "forward_threads": 1, "loads": [asdict(r) for r in loads],
            "request_path": {"cpu_ms_per_image": 16.0, "decode_ms": 11.5, "forward_ms": 2.5, "images": 36,
                             "images_per_s": 125.0},
            "probes": [{"settings": {}, "images_per_s": 100.0, "p99_ms": 310.0},
                       {"settings": {"workers": "3"}, "images_per_s": 110.0, "p99_ms": 290.0}]}


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_points_are_compared_with_the_higher_limit_and_their_own_ceiling(tmp_path: Path) -> None:
    args = argparse.Namespace(seconds=8.0, warmup=2.0)
    machine = {"platform": "test", "cpus": 2, "torch": "x", "device": "cpu", "seconds": 1}
    markdown = report.write({"m": _results()}, machine, args, tmp_path)
    # C=16: the pipeline measured right before it (135) beats the start's best (120); its ceiling is 150.
    assert "- C=16: efficiency 0.80 of the limit, 0.72 of the ceiling; 1.50x naive-flask" in markdown
    # The request path in process: its split, and how close to the start's ceiling any server running it can get.
    assert ("16.0 ms CPU per image = decode 11.5 + forward 2.5 + the rest 2.0, so with every core busy about "
            "**125.0 img/s** at most, 0.83 of the ceiling measured with it.") in markdown
    assert "server CPU per image 17.6 ms = decode 12.0 + forward 3.0 + HTTP, Python and the rest 2.6" in markdown
    assert "(the bound counts decode 11.0 + forward 1.5 = 12.5)" in markdown
    assert "; p99 300 ms against 450 naive-flask" in markdown
    # The best settings found: their own lines against the same peers and ceiling, and the probes fastest first.
    best = markdown.split("visionserve (best: WORKERS=3):\n")[1]
    assert best.startswith("- C=16: efficiency 0.87 of the limit, 0.78 of the ceiling; 1.62x naive-flask; p99 280")
    assert "| WORKERS=3 | 110.0 | 290 |\n| defaults | 100.0 | 310 |" in markdown
    # C=1 has no re-measured limit or ceiling: the start's best pipeline only.
    assert "- C=1: efficiency 0.42 of the limit; server CPU per image 20.0 ms" in markdown
    assert "- C=1 p50 17.0 ms vs in-process single image 15.0 ms (1.13x)" in markdown
    assert "| naive-flask | 16 | 72.0 | 200 | 380 | 450 | 0 | - | 1.90 | 0.03 | 26.0 |" in markdown
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".md", ".png"]


@pytest.mark.slow
def test_the_process_pipeline_runs_one_process_per_worker_and_sums_them(small_weights: Path) -> None:
    from bench.serving.limit import SERVED, process_pipeline
    from tests.support.imaging import BLUE, RED, image_bytes

    photos = [image_bytes(RED, size=(160, 120)), image_bytes(BLUE, size=(90, 120))]
    result = process_pipeline(small_weights, photos, "torch.compile(freezing), channels_last", 2, 0.3, 2)
    assert result.images_per_s > 0 and result.batch_size == 2
    assert result.config == f"2 processes x (1 forward thread + 1 decode), {SERVED}"  # compile is not spawned


@pytest.mark.slow
def test_a_pipeline_process_that_dies_is_reported_at_once(small_weights: Path) -> None:
    from bench.serving.limit import process_pipeline
    from tests.support.imaging import RED, image_bytes

    with pytest.raises(RuntimeError, match="exited with code"):
        process_pipeline(small_weights, [image_bytes(RED)], "no such configuration", 1, 0.3, 1)


@pytest.mark.slow
def test_the_request_path_is_the_apps_cpu_per_image_split_by_its_stage_counters(small_weights: Path) -> None:
    import base64
    import json

    from bench.serving.request_path import request_path
    from harness.photos import json_bodies
    from tests.support.imaging import BLUE, RED, image_bytes

    bodies = json_bodies([image_bytes(c, size=(160, 120)) for c in (RED, BLUE)])
    assert json.loads(bodies[1]) == {"images": [base64.b64encode(image_bytes(BLUE, size=(160, 120))).decode()]}
    result = request_path(small_weights, 2, bodies, rounds=2)
    assert result.images == 4
    assert result.decode_ms > 0 and result.forward_ms > 0 and result.rest_ms > 0
    assert result.images_per_s(2) == pytest.approx(2000 / result.cpu_ms_per_image)
    # A request the app refuses is no measurement: the parent says why instead of timing errors.
    with pytest.raises(RuntimeError, match="400 BAD REQUEST"):
        request_path(small_weights, 2, [b'{"images": ["not base64!"]}'], rounds=1)
    # A model that cannot load is said as such, without waiting out the timeout.
    with pytest.raises(RuntimeError, match="ModelLoadError"):
        request_path(small_weights.parent / "no-such-weights", 2, bodies, rounds=1, timeout_s=60)


MACHINE = {"gpu": "H100", "cpus": 16, "torch": "x", "dtype": "float16", "photos": "6 photos at 500x375"}


def test_gpu_report_compares_each_point_with_the_best_pipeline_of_its_run() -> None:
    from bench.serving.gpu import report as gpu_report

    load = {"workers": 4, "torch_threads": 0, "ready_s": 36.4, "concurrency": 64, "images_per_s": 330.0,
            "p50_ms": 180.0, "p99_ms": 360.0, "errors": 0, "mean_batch": 4.3, "server_cores": 11.9}
    results = {"m": {"limit_by_batch": {"32": [250.0, "1 intra-op, 16 decode threads"],
                                        "16 x 4 processes": [300.0, "4 processes x ..."]},
                     "decode": {"CPU": 290.0, "GPU": 1150.0}, "single_ms": 30.0, "loads": [load]}}
    markdown = gpu_report(results, MACHINE)
    # A row from before the decode paths (the committed H100 runs) reads as the PIL path, one image per request.
    assert "| pil | 1 | 4 | default | 36 | 64 | 330.0 | 180.0 | 360.0 | 0 | 4.30 | 11.90 | - | - | 1.10 | 6.00 |" in (
        markdown)
    device = {**load, "decode_path": "device", "per_request": 16, "client_cores": 0.8, "gpu_util": 71.4}
    results["m"]["loads"] = [device]
    assert "| device | 16 | 4 | default | 36 | 64 | 330.0 | 180.0 | 360.0 | 0 | 4.30 | 11.90 | 0.80 | 71 | 1.10 |" in (
        gpu_report(results, MACHINE))
    assert "| 16 x 4 processes | 300.0 | 4 processes x ... |" in markdown
    assert "median: 30.0 ms" in markdown and "| GPU | 1150.0 |" in markdown and "6 photos at 500x375, closed" in markdown
    # --loads-only: the served points alone, nothing to compare them with
    loads_only = gpu_report({"m": {"loads": [device]}}, MACHINE)
    assert "in-process pipeline" not in loads_only
    assert "| device | 16 | 4 | default | 36 | 64 | 330.0 | 180.0 | 360.0 | 0 | 4.30 | 11.90 | 0.80 | 71 | - | - |" in (
        loads_only)
    # a point measured before the engine's share and the batch's figures were: each of them "-"
    assert "| 71 | - | - | - | - | - | - | - | - |" in loads_only
    # process mode: the engine's cores, the server's CPU per image (every process), a batch's wall time and CPU, each
    # with its forward pass's
    engine = {**device, "engine": "process", "engine_cores": 1.234, "cpu_ms_per_image": 2.5, "batch_wall_ms": 29.04,
              "forward_wall_ms": 22.96, "batch_cpu_ms": 0.4567, "forward_cpu_ms": 0.3682}
    row = ("| process | device | 16 | 4 | default | 36 | 64 | 330.0 | 180.0 | 360.0 | 0 | 4.30 | 11.90 | 0.80 | 71 | "
           "- | - | 1.23 | 2.50 | 29.0 | 23.0 | 0.457 | 0.368 |")
    assert row in gpu_report({"m": {"loads": [engine]}}, MACHINE)


def test_the_batch_inference_report_gives_each_round_and_the_median_ratio() -> None:
    from bench.training.predict import report as predict_report

    args = argparse.Namespace(weights=Path("w"), device="cpu", dtype="float32", images=10, rounds=3, predict_args="")
    rounds = [(90.0, 5.0, 6.0, 100.0, "a"), (60.0, 5.0, 7.0, 100.0, "b"), (99.0, 5.0, 6.0, 90.0, "c")]
    text = predict_report(args, rounds)
    assert "| 2 | 100.0 | b | 60.0 | 5.0, 7.0 | 0.60 |" in text
    assert "**0.90** (target 0.9)" in text  # the median of 0.90, 0.60 and 1.10, not a ratio of medians
    assert "--rounds 3" in text and "--predict-args" not in text
