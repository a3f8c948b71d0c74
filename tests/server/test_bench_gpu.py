"""The GPU drill (``python -m bench.drill``) end to end on the CPU: every step of the one call a lent GPU gets runs
here first (the served benchmark's decode paths x engines x images per request, the serving overhead beside the
bare Flask app, the ``-m gpu`` tests, the photo folder, ``models.predict``, the training feed), so device time is spent
on figures, not on fixing the script."""
from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path

import pytest

from bench import drill
from bench.serving import device_collate


def tar_text(out: Path, ending: str, outside: str | None = None) -> str:
    """The text of the one file in the drill's figures whose name ends with ``ending`` (and is not in a folder named
    ``outside``)."""
    with tarfile.open(out / "figures.tar.gz") as tar:
        return tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith(ending)
                                    and not (outside and outside in m.name))).read().decode()


@pytest.mark.slow
def test_the_gpu_drill_runs_every_step_on_the_cpu_and_returns_what_it_wrote(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert drill.main(["--smoke", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "drill.jsonl").read_text().splitlines()]
    assert [(row["step"], row["rc"], row["stopped"]) for row in rows] == [
        (step.name, 0, False) for step in drill.steps(tmp_path, tmp_path, smoke=True)]
    with tarfile.open(out / "figures.tar.gz") as tar:
        names = {Path(name).name for name in tar.getnames()}
        report = tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith("-gpu-cpu.md"))).read().decode()
    assert "predict.jsonl" in names and any(name.endswith("-train-cpu.md") for name in names)
    engine = tar_text(out, "-engine-only-cpu.md", outside="by-size/")
    # the engine alone, one tensor per request: its CPU, no decode, its forward passes' and what is beyond them,
    # every request answered (C, req/s, its mean batch, CPU per request and per image, decode, forward, beyond, errors)
    assert "The engine without HTTP on cpu" in engine and re.search(
        r"^\| this \| v2 x1 \| 2 \| \d+ \| \d+\.\d \| \d+ \| \d+ \| 0 \| \d+ \| -?\d+ \| 0 \|$", engine, re.M)
    # then by images per request, as many images in flight: one tensor on two connections, two on one
    by_size = tar_text(out, "by-size/" + next(Path(n).name for n in names if n.endswith("-engine-only-cpu.md")))
    assert "2 images in flight" in by_size and [
        re.match(r"^\| this \| (v2 x\d+) \| (\d+) \|.* \| 0 \|$", line).groups()
        for line in by_size.splitlines() if line.startswith("| this |")] == [("v2 x1", "2"), ("v2 x2", "1")], by_size
    # the smoke's one served variant (DECODE_PATH=tensor): its served points alone, every one answered
    table = tar_text(out, "served-tensor/" + next(Path(n).name for n in names if n.endswith("-gpu-cpu.md")))
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in table.splitlines()
            if line.startswith("| inline |")]
    assert "in-process pipeline" not in table and len(rows) == 1, table
    # engine, decode path, images per request, C, errors, efficiency (none without the in-process figures)
    assert [rows[0][i] for i in (0, 1, 2, 6, 10, 15)] == ["inline", "tensor", "1", "2", "0", "-"]
    assert float(rows[0][7]) > 0  # images/s
    launches = tar_text(out, "forward-launch-cpu.md")  # one forward per batch size; no graph without CUDA
    assert [line.split("|")[1:4] + line.split("|")[6:7] for line in launches.splitlines()
            if line.startswith("| float32 |")] == [[" float32 ", " onnx ", f" {size} ", " no CUDA "] for size in (1, 2)]
    preprocess = tar_text(out, "batch-preprocess-cpu.md")  # the batch made in float as on CUDA: the same values
    assert [line.split("|")[1].strip() + line.split("|")[8] for line in preprocess.splitlines()
            if re.match(r"^\| \d+ \|", line)] == ["1 0 ", "2 0 "]
    collate = tar_text(out, "device-collate-cpu.md")  # the device path's batch step by step, in both workloads
    assert [line.split("|")[2].strip() for line in collate.splitlines()
            if re.match(r"^\| 2 \| \w+ \| \d+ \| \d+ \| \d+ \|$", line)] == [*device_collate.STEPS] * 2, collate
    profile = tar_text(out, "engine-profile-cpu.md")  # py-spy on the engine under load: both samplings summarised
    assert re.search(r"^## v2 x1: \d+ req/s, .* 0 errors$", profile, re.M), profile
    assert [int(n) > 0 for n in re.findall(r"^### (?:gil|cpu): (\d+) samples$", profile, re.M)] == [True, True]
    assert "Batcher._run_batch (batcher.py)" in profile  # the engine's own functions, named by file
    served = [line for line in report.splitlines() if line.startswith(("| process-2 |", "| inline |"))]
    assert [tuple(cell.strip() for cell in row.split("|")[1:4]) + (row.split("|")[7].strip(),) for row in served] == [
        (engine, "auto", per_request, "2") for engine in ("process-2", "inline") for per_request in ("1", "2")]
    assert all(row.split("|")[11].strip() == "0" for row in served)  # no request failed in either engine
    log = (out / "drill.log").read_text()
    assert "The unit, one bare-Flask request: C=1:" in log and "engine per image beyond decode and forward, 1 per request" in log


def test_a_step_past_its_limit_is_stopped_and_the_drill_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    slow = drill.Step("sleeps", 1.0, ("sleep", "30"), least_s=0)
    quick = drill.Step("answers", 5.0, ("true",), least_s=0)
    late = drill.Step("late", 5.0, ("true",), least_s=1_000)
    monkeypatch.setattr(drill, "steps", lambda figures, work, smoke: [slow, quick, late])
    assert drill.main(["--out", str(tmp_path / "out"), "--deadline-s", "60"]) == 1
    rows = [json.loads(line) for line in (tmp_path / "out" / "drill.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("rc"), r.get("stopped")) for r in rows[:2]] == [("sleeps", None, True),
                                                                              ("answers", 0, False)]
    assert rows[0]["seconds"] < 25  # stopped at its limit, not waited for
    assert rows[2]["step"] == "late" and rows[2]["skipped"].endswith("needs 1000")
    assert tarfile.is_tarfile(tmp_path / "out" / "figures.tar.gz")
