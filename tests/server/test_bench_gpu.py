"""The GPU drill (``python -m bench.drill``) end to end on the CPU: every step of the one call a lent GPU gets runs
here first (the served benchmark's decode paths x engines x images per request, the serving overhead beside the
bare Flask app, the ``-m gpu`` tests, the photo folder, ``models.predict``, the training feed), so device time is spent
on figures, not on fixing the script."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import drill
from bench.serving import device_collate
from harness import servers


def tar_text(out: Path, ending: str, outside: str | None = None, inside: str | None = None) -> str:
    """The text of the one file in the drill's figures whose name ends with ``ending`` (and is not in a folder named
    ``outside``, or is in one named ``inside``: a step's own, whatever the date its reports are named by; a drill
    across midnight names them by two)."""
    with tarfile.open(out / "figures.tar.gz") as tar:
        return tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith(ending)
                                    and not (outside and outside in m.name)
                                    and (inside is None or inside in m.name))).read().decode()


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
    by_size = tar_text(out, "-engine-only-cpu.md", inside="by-size/")
    assert "2 images in flight" in by_size and [
        re.match(r"^\| this \| (v2 x\d+) \| (\d+) \|.* \| 0 \|$", line).groups()
        for line in by_size.splitlines() if line.startswith("| this |")] == [("v2 x1", "2"), ("v2 x2", "1")], by_size
    # the smoke's one served variant (DECODE_PATH=tensor): its served points alone, every one answered
    table = tar_text(out, "-gpu-cpu.md", inside="served-tensor/")
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in table.splitlines()
            if line.startswith("| inline |")]
    assert "in-process pipeline" not in table and len(rows) == 1, table
    # engine, decode path, images per request, C, errors, efficiency (none without the in-process figures)
    assert [rows[0][i] for i in (0, 1, 2, 6, 10, 15)] == ["inline", "tensor", "1", "2", "0", "-"]
    assert float(rows[0][7]) > 0  # images/s
    launches = tar_text(out, "forward-launch-cpu.md")  # a forward per layout and batch size; no graph without CUDA
    rows = [line.split("|") for line in launches.splitlines() if line.startswith("| float32 |")]
    assert [row[1:5] + row[7:8] for row in rows] == [[" float32 ", " state_dict ", f" {layout} ", f" {size} ",
                                                      " no CUDA "] for layout in ("contiguous", "channels_last")
                                                     for size in (1, 2)]
    assert all(float(row[-2]) < 1e-4 for row in rows)  # the same pixels' logits in channels_last as contiguous
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
        ("process-2", "auto", per_request, "2") for per_request in ("1", "2")]  # inline: the served-tensor variant
    assert all(row.split("|")[11].strip() == "0" for row in served)  # no request failed
    log = (out / "drill.log").read_text()
    assert re.search(r"^The unit, one bare-Flask request, read before and after each server's points .*: C=1: \d+ us "
                     r"\(\d+-\d+, 2 readings\), C=4: ", log, re.M), log[-3000:]
    assert "engine per image beyond decode and forward, 1 per request" in log


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
    assert rows[2]["step"] == "late" and rows[2]["skipped"].endswith("needs 1000")
    assert tarfile.is_tarfile(tmp_path / "out" / "figures.tar.gz")


def gone(pid: int) -> bool:
    """Ended: no such process, or a zombie no one has reaped yet (an orphan's parent may be a container's init)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def wait_gone(pid: int) -> bool:
    """Whether ``pid`` ends within a minute (SIGKILL is delivered at once, the exit soon after; no timing asserted)."""
    for _ in range(600):
        if gone(pid):
            return True
        time.sleep(0.1)
    return False


def kill_if_left(*pids: int) -> None:
    for pid in pids:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)


# A step that starts a process in a session of its own, as visionserve's gunicorn and engines are started, writes
# both pids (the step's, then the server's) into the file named first and sleeps: it is only ever stopped.
LEAVES_A_SERVER = ("import os, subprocess, sys, time; server = subprocess.Popen(['sleep', '300'], "
                   "start_new_session=True); open(sys.argv[1], 'w').write(f'{os.getpid()} {server.pid}'); "
                   "time.sleep(300)")


@pytest.mark.slow  # a drill step run to its limit (5 s)
def test_a_step_stopped_at_its_limit_leaves_no_process_it_started(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    pids = tmp_path / "pids"
    step = drill.Step("leaves", 5.0, (sys.executable, "-c", LEAVES_A_SERVER, str(pids)), least_s=0)
    monkeypatch.setattr(drill, "steps", lambda figures, work, smoke: [step])
    monkeypatch.setattr(drill, "GRACE_S", 1.0)
    assert drill.main(["--out", str(tmp_path / "out"), "--deadline-s", "60"]) == 1
    step_pid, server_pid = (int(pid) for pid in pids.read_text().split())
    try:
        assert wait_gone(step_pid) and wait_gone(server_pid)  # the server, in its own session, too
    finally:
        kill_if_left(server_pid)


@pytest.mark.slow
def test_the_drill_on_sigterm_stops_its_step_packs_what_was_done_and_skips_the_rest(tmp_path: Path) -> None:
    pids, out = tmp_path / "pids", tmp_path / "out"
    code = ("import sys; from bench import drill; drill.GRACE_S = 1.0; drill.steps = lambda *args: ["
            f"drill.Step('leaves', 300.0, (sys.executable, '-c', {LEAVES_A_SERVER!r}, {str(pids)!r}), least_s=0), "
            "drill.Step('after', 5.0, ('true',), least_s=0)]; "
            f"sys.exit(drill.main(['--out', {str(out)!r}, '--deadline-s', '400']))")
    running = subprocess.Popen([sys.executable, "-c", code], cwd=drill.ROOT, stdout=subprocess.PIPE, text=True)
    try:
        while not pids.exists() or len(pids.read_text().split()) < 2:  # the step has started its server
            assert running.poll() is None, running.communicate()
            time.sleep(0.1)
        step_pid, server_pid = (int(pid) for pid in pids.read_text().split())
        # the step in the drill's session: what the call ends when it returns ends it (the server, in a session of
        # its own, is the drill's to stop)
        assert os.getsid(step_pid) == os.getsid(running.pid) and os.getpgid(step_pid) == step_pid
        running.send_signal(signal.SIGTERM)  # to the drill alone, as a call's timeout sends it
        assert running.wait(120) == 1
        assert wait_gone(step_pid) and wait_gone(server_pid)
    finally:
        if running.poll() is None:
            running.kill()
        if pids.exists():
            kill_if_left(*(int(pid) for pid in pids.read_text().split()))
    rows = [json.loads(line) for line in (out / "drill.jsonl").read_text().splitlines()]
    assert [(row["step"], row.get("stopped"), row.get("stopped_by"), row.get("skipped")) for row in rows] == [
        ("leaves", True, "the drill's SIGTERM", None), ("after", None, None, "the drill was stopped (SIGTERM)")]
    assert tarfile.is_tarfile(out / "figures.tar.gz")


def test_a_second_call_with_the_same_out_starts_clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # as `photos` does: it refuses a scratch folder that is not empty; and a report of its own each call
    code = ("import pathlib, sys, uuid; work, figures = map(pathlib.Path, sys.argv[1:]); "
            "sys.exit('not empty') if work.exists() else work.mkdir(parents=True); "
            "(figures / f'{uuid.uuid4().hex}.md').write_text('a call')")

    def steps(figures: Path, work: Path, smoke: bool) -> list[drill.Step]:
        return [drill.Step("writes", 30.0, (sys.executable, "-c", code, str(work), str(figures)), least_s=0)]

    monkeypatch.setattr(drill, "steps", steps)
    out = tmp_path / "out"
    for _ in range(2):  # the second call on one machine: OUT emptied between, what is beside it kept
        assert drill.main(["--out", str(out), "--deadline-s", "60"]) == 0
        with tarfile.open(out / "figures.tar.gz") as tar:
            assert [Path(name).suffix for name in tar.getnames() if not tar.getmember(name).isdir()] == [".md"]
        assert [json.loads(line)["rc"] for line in (out / "drill.jsonl").read_text().splitlines()] == [0]
        for path in list(out.iterdir()):  # the tool empties OUT between two calls
            shutil.rmtree(path) if path.is_dir() else path.unlink()


@pytest.mark.parametrize("only", [["--only", "nosuch"], ["--only", "facts", "predcit"], ["--only"]])
def test_only_refuses_an_unknown_step_or_none(tmp_path: Path, only: list[str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        drill.main(["--smoke", "--out", str(tmp_path / "out"), *only])
    assert stopped.value.code == 2 and not (tmp_path / "out").exists()
    assert only[-1] == "--only" or f"no step named {only[-1]}" in capsys.readouterr().err


def test_only_runs_the_steps_a_step_needs_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def step(name: str, *needs: str) -> drill.Step:
        return drill.Step(name, 10.0, ("true",), least_s=0, needs=needs)

    monkeypatch.setattr(drill, "steps", lambda figures, work, smoke: [
        step("a"), step("b", "a"), step("c"), step("d", "b"), step("e", "a")])
    assert drill.main(["--out", str(tmp_path / "out"), "--only", "d"]) == 0
    assert [json.loads(line)["step"] for line in (tmp_path / "out" / "drill.jsonl").read_text().splitlines()] == [
        "a", "b", "d"]


@pytest.mark.slow
def test_predict_runs_alone_making_its_photo_folder_and_its_export(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert drill.main(["--smoke", "--out", str(out), "--only", "predict"]) == 0
    assert [json.loads(line)["step"] for line in (out / "drill.jsonl").read_text().splitlines()] == [
        "photos", "weights", "predict"]
    assert tar_text(out, "predict.jsonl")


def test_the_smoke_collects_every_gpu_test_file_the_real_run_passes() -> None:
    def gpu_tests(smoke: bool) -> tuple[str, ...]:
        step = next(step for step in drill.steps(Path("figures"), Path("work"), smoke) if step.name == "gpu-tests")
        return tuple(arg for arg in step.command if arg.startswith("tests/"))

    assert gpu_tests(smoke=True) == gpu_tests(smoke=False) and len(gpu_tests(smoke=False)) > 1
    assert all((drill.ROOT / path).is_file() for path in gpu_tests(smoke=False))


@pytest.mark.slow
def test_a_server_that_never_gets_ready_fails_by_the_steps_deadline_with_its_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servers, "exit_on_sigterm_in_benchmarks", lambda: None)  # (this test process's SIGTERM)
    monkeypatch.setenv(servers.DEADLINE, str(time.time() + servers.READY_MARGIN_S + 1))
    server = servers.Running("never", ["sh", "-c", "echo booting; exec sleep 300"], {}, servers.free_port(), "/",
                             tmp_path)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)never not ready after \d+s \(the step deadline\):.*booting"):
            server.wait_ready(60)  # less than the step's deadline: that, not 60 s
        assert server.process.poll() is not None  # stopped, not left to the step's end
    finally:
        server.stop()


# A server that stops on SIGTERM no sooner than SIGKILL (a drain that does not end), having started an engine in a
# session of its own; it prints the engine's pid.
STUBBORN_SERVER = ("import signal, subprocess, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "engine = subprocess.Popen(['sleep', '300'], start_new_session=True); "
                   "print(engine.pid, flush=True); time.sleep(300)")
# A benchmark's process: it starts that server, says the pids, and stops the server in its finally block.
BENCHMARK = ("import sys, time; from pathlib import Path; from harness.servers import Running, free_port; "
             f"server = Running('stubborn', [sys.executable, '-c', {STUBBORN_SERVER!r}], {{}}, free_port(), '/', "
             "Path(sys.argv[1]))\n"
             "try:\n    while not server.output().strip(): time.sleep(0.05)\n"
             "    print(server.process.pid, server.output().strip(), flush=True)\n    time.sleep(300)\n"
             "finally:\n    server.stop()")


@pytest.mark.slow
def test_a_benchmark_on_sigterm_stops_its_servers_and_what_they_started(tmp_path: Path) -> None:
    env = {**os.environ, servers.DEADLINE: str(time.time() + 600)}  # as a drill's step
    bench = subprocess.Popen([sys.executable, "-c", BENCHMARK, str(tmp_path)], cwd=drill.ROOT, env=env,
                             stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = [int(pid) for pid in bench.stdout.readline().split()]
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(120) == 128 + signal.SIGTERM  # SystemExit: its finally stopped the server
        assert len(pids) == 2 and all(wait_gone(pid) for pid in pids)  # the engine too, in its own session
    finally:
        if bench.poll() is None:
            bench.kill()
        kill_if_left(*pids)


def test_the_served_benchmark_writes_each_point_as_it_is_measured(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.serving import gpu
    from bench.serving.load import LoadResult

    class Server:
        url, process = "http://127.0.0.1:9", SimpleNamespace(pid=os.getpid())
        stopped = False

        def wait_ready(self) -> "Server":
            return self

        def stop(self) -> None:
            Server.stopped = True

    measured: list[int] = []

    def measure(*args: object, **kwargs: object) -> LoadResult:
        if measured:  # the step's limit, in the second point
            raise SystemExit(143)
        measured.append(1)
        return LoadResult("visionserve", "tiny", 2, 100.0, 10.0, 12.0, 15.0, 0, 50, 1.5, 0.9, 0.1)

    monkeypatch.setattr(gpu, "export_models", lambda out, models: {model: tmp_path / model for model in models})
    monkeypatch.setattr(gpu, "visionserve", lambda *args, **kwargs: Server())
    monkeypatch.setattr(gpu, "served_photos", lambda name: (b"photo",))
    monkeypatch.setattr(gpu, "request_bodies", lambda photos, per_request: ([b"body"], "image/jpeg"))
    monkeypatch.setattr(gpu, "GpuUtilisation", lambda: contextlib.nullcontext(SimpleNamespace(mean=None)))
    monkeypatch.setattr(gpu, "measure", measure)
    with pytest.raises(SystemExit):
        gpu.main(["--device", "cpu", "--models", "tiny", "--engines", "inline", "--decode-paths", "tensor",
                  "--workers", "1", "--concurrency", "2", "4", "--images-per-request", "1", "--loads-only",
                  "--out", str(tmp_path / "figures")])
    assert Server.stopped
    (points,), (report,) = (tmp_path / "figures").glob("*.jsonl"), (tmp_path / "figures").glob("*.md")
    assert [json.loads(line)["concurrency"] for line in points.read_text().splitlines()] == [2]
    assert [line.split("|")[7].strip() for line in report.read_text().splitlines()
            if line.startswith("| inline |")] == ["2"]


# pip as the wheel script calls it: each NAME==VERSION becomes an empty wheel in the -d folder, the call is recorded
FAKE_PIP = """import pathlib, sys
args = sys.argv[1:]
folder = pathlib.Path(args[args.index("-d") + 1])
for pin in (arg for arg in args if "==" in arg):
    name, version = pin.split("==")
    (folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_text("")
pathlib.Path(sys.argv[0]).with_name("pins").write_text("\\n".join(arg for arg in args if "==" in arg))
"""


def test_the_wheel_script_empties_whl_and_takes_requirements_pins(tmp_path: Path) -> None:
    checkout, bin_dir = tmp_path / "checkout", tmp_path / "bin"
    (checkout / "bench").mkdir(parents=True)
    bin_dir.mkdir()
    shutil.copy(drill.ROOT / "bench" / "gpu_wheels.sh", checkout / "bench")
    requirements = {name: (drill.ROOT / name).read_text() for name in ("requirements.txt", "requirements-dev.txt")}
    bumped = requirements["requirements.txt"].replace("\nflask==", "\nflask==9.9.9  # bumped\n# was: flask==")
    requirements["requirements.txt"] = bumped
    for name, text in requirements.items():
        (checkout / name).write_text(text)
    (checkout / ".whl").mkdir()
    (checkout / ".whl" / "flask-3.1.3-py3-none-any.whl").write_text("")  # the last version's wheel
    (bin_dir / "python3").write_text(f"#!{sys.executable}\n{FAKE_PIP}")
    (bin_dir / "python3").chmod(0o755)
    done = subprocess.run(["bash", str(checkout / "bench" / "gpu_wheels.sh")], capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr
    wheels = sorted(path.name for path in (checkout / ".whl").iterdir())
    assert [name for name in wheels if name.startswith("flask-")] == ["flask-9.9.9-py3-none-any.whl"], wheels
    pins = dict(pin.split("==") for pin in (bin_dir / "pins").read_text().split())
    pinned = dict(line.split("#")[0].strip().lower().split("==") for text in requirements.values()
                  for line in text.splitlines() if "==" in line.split("#")[0])
    assert pins["flask"] == "9.9.9" and "py-spy" in pins  # (py-spy: requirements-dev.txt's)
    assert {name: pins[name] for name in pins if name in pinned} == {name: pinned[name] for name in pins
                                                                     if name in pinned}
