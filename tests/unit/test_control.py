"""CONTROL_DIR's files (app/hosting/control.py): which pids name a live worker, and what a kept directory loses at
the next start."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import threading
from pathlib import Path
from typing import Iterator

import pytest

from app.engine.versions.desired import SharedDesiredState
from app.hosting import control


@pytest.fixture
def thread_id() -> Iterator[int]:
    """The id of a live thread of this process (not a process's own pid)."""
    started, stop = threading.Event(), threading.Event()
    ids: list[int] = []

    def run() -> None:
        ids.append(threading.get_native_id())
        started.set()
        stop.wait(30)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(10)
    yield ids[0]
    stop.set()
    thread.join(10)


@pytest.fixture
def squatter() -> Iterator[subprocess.Popen[bytes]]:
    """A live process started after the report it is given: a dead worker's pid taken by another process."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def test_a_thread_s_id_is_no_live_process(thread_id: int) -> None:
    # Before: os.kill(tid, 0) succeeds for a thread, so a stale report or mark naming one counted as a live worker.
    assert thread_id != os.getpid()
    assert control.process_alive(os.getpid()) and not control.process_alive(thread_id)
    assert not control.process_alive(0) and not control.process_alive(-1)  # a group, or every process: no worker


def test_a_live_process_counts_only_as_the_one_that_started_when_it_says(squatter: subprocess.Popen[bytes]) -> None:
    started = control.start_time(squatter.pid)
    assert started is not None and started >= control.start_time(os.getpid())  # type: ignore[operator]
    assert control.process_alive(squatter.pid) and control.process_alive(squatter.pid, started)
    assert not control.process_alive(squatter.pid, started - 1)  # an earlier process that had its pid


def test_a_report_counts_while_its_own_process_lives_not_a_thread_or_a_later_process_with_its_pid(
        tmp_path: Path, thread_id: int, squatter: subprocess.Popen[bytes]) -> None:
    # Before: a kept CONTROL_DIR's report whose pid was now a thread, or another process, listed a phantom worker
    # in /v1/models and every load or unload call waited for it until REPOSITORY_SYNC_TIMEOUT_S (504).
    serving = {"m": {"versions": ["1"], "default": "1"}}
    here = SharedDesiredState(tmp_path)
    here.report(1, serving, {}, "cpu")
    SharedDesiredState(tmp_path, pid=thread_id).report(1, serving, {}, "cpu")
    SharedDesiredState(tmp_path, pid=squatter.pid).report(1, serving, {}, "cpu")
    reused = control.report(tmp_path, squatter.pid)  # written by a process that had this pid before the squatter
    reused.write_text(json.dumps(json.loads(reused.read_text()) | {"started": control.start_time(os.getpid())}))
    assert [report["pid"] for report in here.workers()] == [os.getpid()]
    assert here.wait_applied(2, 0)[1] == [os.getpid()]  # only this worker is behind a newer generation


def test_a_kept_control_dir_loses_the_reports_an_earlier_server_left_at_the_next_start(tmp_path: Path) -> None:
    # Before: the ready marks went and the reports stayed (worker-<pid>.json): one naming a live process of the new
    # server counted as a worker of it.
    left = [control.report(tmp_path, os.getpid()), control.ready_mark(tmp_path, os.getpid()),
            control.leaving_mark(tmp_path, os.getpid())]
    kept = [tmp_path / control.DESIRED, tmp_path / control.LOCK]
    for path in left + kept:
        path.touch()
    control.clear_stale(tmp_path)
    assert [path.exists() for path in left + kept] == [False, False, False, True, True]


def test_a_worker_still_loading_leaves_new_connections_to_one_that_drains_and_still_answers(
        squatter: subprocess.Popen[bytes], tmp_path: Path) -> None:
    # Before: a HUP's old worker, draining, had no mark, so the new one, still loading, took the new connections to
    # answer them 503 while the old one could have served them (every 503 of a one-worker reload).
    loading, old, new = os.getpid(), os.getppid(), squatter.pid
    control.leaving_mark(tmp_path, old).touch()
    assert not control.takes_connections(tmp_path, loading)  # left to the leaving one
    assert control.takes_connections(tmp_path, old)  # which takes them, none serving
    control.ready_mark(tmp_path, new).touch()  # a new worker serves: the leaving one leaves them to it
    assert not control.takes_connections(tmp_path, old) and control.takes_connections(tmp_path, new)
    control.ready_mark(tmp_path, new).unlink()
    control.leaving_mark(tmp_path, old).unlink()  # its drain stopped answering: every worker takes them (503s)
    assert control.takes_connections(tmp_path, loading) and control.takes_connections(tmp_path, old)
    control.leaving_mark(tmp_path, 2 ** 22 + 7).touch()  # a leaving mark of no live process does not count
    assert control.takes_connections(tmp_path, loading)


def test_usr2_s_two_masters_leave_new_connections_to_each_other_s_workers_that_serve(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: USR2's new master made directories of its own, so its workers saw no worker serving and took new
    # connections while their engines loaded, to answer them 503 (an ops trial: 194 of 4,965 over 40 s), where the
    # old master's workers served on; and the old master's workers, stopped once the new ones served, took new
    # connections after their drain's answering window to answer them 503 (a review).
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    monkeypatch.setenv(control.PREDECESSOR_VARIABLE, str(old))  # the new master's environment (pre_exec)
    (old / control.SUCCESSOR).write_text(str(new))  # what the new master writes at its start
    loading, serving = os.getpid(), os.getppid()  # a new worker still loading; the old master's worker
    control.ready_mark(old, serving).touch()
    assert control.masters_beside(new) == [old] and control.masters_beside(old) == [new]
    assert not control.takes_connections(new, loading)  # left to the old master's serving worker
    assert control.takes_connections(new, loading, beside=[])  # (with none beside: none serves, it takes them)
    control.ready_mark(old, serving).unlink()
    control.leaving_mark(old, serving).touch()  # the old master stopped first: its drain still answers
    assert not control.takes_connections(new, loading) and control.takes_connections(old, serving)
    control.leaving_mark(old, serving).unlink()  # its drain's answering window over, the new worker not serving yet
    assert control.takes_connections(new, loading) and control.takes_connections(old, serving)  # 503 from each
    control.ready_mark(new, loading).touch()  # the new worker serves: the old one leaves them to it
    assert control.takes_connections(new, loading) and not control.takes_connections(old, serving)
    control.ready_mark(new, loading).unlink()
    old_marks = [old / control.SUCCESSOR]
    control.clear_stale(old)  # a kept directory's next start forgets the successor of an earlier run
    assert not any(path.exists() for path in old_marks)
    new.rmdir()
    old.rmdir()  # the masters gone with their directories: none beside
    assert control.masters_beside(new) == [] and control.takes_connections(new, loading)


def _gunicorn_config(monkeypatch: pytest.MonkeyPatch, control_dir: Path) -> dict:
    """gunicorn.conf.py run in this process, CONTROL_DIR set before it runs and what it set in the environment
    undone. Set after, the monkeypatch's undo put the config's own directory back into this process's environment,
    and the later tests in it shared that CONTROL_DIR (a server they started, and every Service built, read another
    test's desired state)."""
    import runpy

    monkeypatch.setenv("VISIONSERVE_CONTROL_DIR", str(control_dir))
    before = dict(os.environ)
    try:
        return runpy.run_path("gunicorn.conf.py")
    finally:
        os.environ.clear()
        os.environ.update(before)


def test_usr2_s_new_master_is_told_where_the_old_master_s_workers_say_they_serve(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    config = _gunicorn_config(monkeypatch, tmp_path)
    given = {"PATH": "/usr/bin"}  # the environment gunicorn hands the new master (gunicorn's cfg.env_orig)
    config["pre_exec"](SimpleNamespace(cfg=SimpleNamespace(env_orig=given),
                                       START_CTX={"args": [sys.executable], "cwd": str(tmp_path), 0: sys.executable}))
    assert given == {"PATH": "/usr/bin", control.PREDECESSOR_VARIABLE: str(tmp_path)}
    # and the new master, at its start, writes its own CONTROL_DIR into the old master's
    mine = tmp_path / "new"
    mine.mkdir()
    monkeypatch.setenv(control.PREDECESSOR_VARIABLE, str(tmp_path))
    monkeypatch.setenv("VISIONSERVE_CONTROL_DIR", str(mine))
    config["_tell_predecessor"](SimpleNamespace(log=logging.getLogger("test")))
    assert (tmp_path / control.SUCCESSOR).read_text() == str(mine)


def test_usr2_s_new_master_is_handed_the_metrics_directory_its_master_made_and_not_one_ops_set(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: it was given none and made its own, so the counters a scrape read went back and forth between the two
    # masters' totals while both served (rate() read resets). app/hosting/owned_dirs.py's tests follow the directory
    # through both masters' exits.
    import fcntl
    import tempfile
    from types import SimpleNamespace

    from app.hosting import owned_dirs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(owned_dirs, "_HELD", {})
    config = _gunicorn_config(monkeypatch, tmp_path)
    made = owned_dirs.make(owned_dirs.METRICS_PREFIX)

    def usr2(metrics_dir: str) -> dict:
        given = {"PATH": "/usr/bin", "PROMETHEUS_MULTIPROC_DIR": metrics_dir}  # (gunicorn's env_orig names the
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", metrics_dir)  # master's own after a HUP, ops' always)
        config["pre_exec"](SimpleNamespace(cfg=SimpleNamespace(env_orig=given), START_CTX={
            "args": [sys.executable], "cwd": str(tmp_path), 0: sys.executable}))
        return given

    given = usr2(made)
    fd, _, path = given.pop(owned_dirs.HANDED_OVER).partition(":")
    assert path == made and given == {"PATH": "/usr/bin", "PROMETHEUS_MULTIPROC_DIR": made,
                                      control.PREDECESSOR_VARIABLE: str(tmp_path)}
    assert os.get_inheritable(int(fd))  # kept across gunicorn's exec: the new master's lock on it
    with open(Path(made) / owned_dirs.HELD_WHILE_IN_USE) as lock, pytest.raises(BlockingIOError):
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(int(fd))
    ops = tmp_path / "ops-metrics"  # one ops set: given as it was started with, handed over to no one
    ops.mkdir()
    assert usr2(str(ops)) == {"PATH": "/usr/bin", "PROMETHEUS_MULTIPROC_DIR": str(ops),
                              control.PREDECESSOR_VARIABLE: str(tmp_path)}
    owned_dirs.remove_held(os.getpid())


def test_usr2_s_new_master_in_a_control_dir_of_its_own_serves_the_desired_state_of_the_master_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: it started from the repository's policies afresh (a new temporary CONTROL_DIR), so a version rolled
    # back from served again and a model a call unloaded came back (an upgrade trial)
    import tempfile
    from types import SimpleNamespace

    from app.hosting import owned_dirs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(owned_dirs, "_HELD", {})
    old, mine = tmp_path / "old", Path(owned_dirs.make(owned_dirs.CONTROL_PREFIX))
    old.mkdir()
    SharedDesiredState(old).write({"cats": {"versions": ["1", "2"], "default": "1", "rolled_back": ["2"]},
                                   "dogs": {"versions": [], "default": None}})
    carried = [control.batch_cap(old, "cats/1/cpu"), control.monitor_reference(old, "cats/1")]
    for path in carried:
        path.write_text("{}")
    stale = [control.ready_mark(old, 4242), control.report(old, 4242), old / control.SUCCESSOR]
    for path in stale:
        path.write_text("{}")
    config = _gunicorn_config(monkeypatch, mine)
    monkeypatch.setenv("VISIONSERVE_CONTROL_DIR", str(mine))
    monkeypatch.setenv(control.PREDECESSOR_VARIABLE, str(old))
    said: list[str] = []
    server = SimpleNamespace(log=SimpleNamespace(info=lambda message, *args: said.append(message % args)))
    config["_carry_over_from_predecessor"](server)
    assert (mine / control.DESIRED).read_bytes() == (old / control.DESIRED).read_bytes()
    assert sorted(path.name for path in mine.iterdir() if not path.name.startswith(".")) == sorted(
        [control.DESIRED, *(path.name for path in carried)])  # not the old workers' marks and reports
    assert len(said) == 1 and "cats versions 1, 2, default 1, 2 rolled back; dogs unloaded by a call" in said[0]
    # a master given its predecessor's kept CONTROL_DIR, or one of its own it kept, takes nothing
    (mine / control.DESIRED).unlink()
    monkeypatch.setattr(owned_dirs, "_HELD", {})
    config["_carry_over_from_predecessor"](server)
    assert not (mine / control.DESIRED).exists() and len(said) == 1


def test_usr2_s_new_master_runs_on_the_environment_of_the_release_now_in_its_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: gunicorn executes the old master's interpreter again, so a release swapped in with a .venv of its own
    # ran on the old release's packages (an upgrade trial). Checked by hand too: after a USR2 the new master's command
    # line is <working directory>/.venv/bin/python .venv/bin/gunicorn ..., and it serves.
    from types import SimpleNamespace

    config = _gunicorn_config(monkeypatch, tmp_path)
    release = tmp_path / "release"
    (release / ".venv" / "bin").mkdir(parents=True)

    def usr2(args: list[str]) -> dict:
        server = SimpleNamespace(cfg=SimpleNamespace(env_orig={}), START_CTX={
            "args": ["/old/.venv/bin/python", *args], "cwd": str(release), 0: "/old/.venv/bin/python"})
        config["pre_exec"](server)
        return server.START_CTX

    bin_serve = [".venv/bin/gunicorn", "-c", "gunicorn.conf.py", "app.wsgi:app"]
    assert usr2(bin_serve)[0] == "/old/.venv/bin/python"  # the release has no .venv: the master's own (a container)
    (release / ".venv" / "bin" / "python").touch()
    started = usr2(bin_serve)
    assert started[0] == started["args"][0] == str(release / ".venv" / "bin" / "python")
    assert started["args"][1:] == bin_serve
    # a master started otherwise (another interpreter's gunicorn, python -m gunicorn) is executed as it was
    assert usr2(["/usr/bin/gunicorn", "-c", "gunicorn.conf.py", "app.wsgi:app"])[0] == "/old/.venv/bin/python"


def test_a_worker_killed_during_its_drain_leaves_no_leaving_mark(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    config = _gunicorn_config(monkeypatch, tmp_path)
    marks = [control.ready_mark(tmp_path, 4242), control.leaving_mark(tmp_path, 4242)]
    for mark in marks:
        mark.touch()
    config["child_exit"](SimpleNamespace(log=SimpleNamespace(warning=print)), SimpleNamespace(pid=4242))
    assert not any(mark.exists() for mark in marks)


def test_a_master_folds_an_ended_worker_s_metrics_with_what_it_imported_at_its_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the master imported app.hosting.metrics_files as a worker ended. An operator's hot rollback (the old
    # release's code swapped in where the master had read its own, then USR2, then TERM to this master) had that
    # import find the old release, without the module: an ImportError out of child_exit ended the master's stop with
    # a traceback, the worker's report left in CONTROL_DIR and its counts never folded.
    from types import SimpleNamespace

    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    import app.hosting

    metrics, control_dir = tmp_path / "metrics", tmp_path / "control"
    metrics.mkdir()
    control_dir.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(metrics))
    config = _gunicorn_config(monkeypatch, control_dir)
    counter = MmapedDict(str(metrics / "counter_4242.db"))
    counter.write_value(mmap_key("served", "served_total", [], [], "served"), 3.0, 0.0)
    counter.close()
    control.report(control_dir, 4242).write_text("{}")
    # the release now where this master's code was read has no such module
    monkeypatch.delattr(app.hosting, "metrics_files", raising=False)
    monkeypatch.setitem(sys.modules, "app.hosting.metrics_files", None)
    config["child_exit"](SimpleNamespace(log=SimpleNamespace(warning=print)), SimpleNamespace(pid=4242))
    assert sorted(path.name for path in metrics.glob("*.db")) == ["counter_ended.db"]
    assert not control.report(control_dir, 4242).exists()


def _with_a_control_socket(calls: list[str], said: list[str], **attributes: object) -> object:
    """A stand-in arbiter whose control socket's stops and starts land in ``calls`` and log lines in ``said``."""
    from types import SimpleNamespace

    return SimpleNamespace(**attributes, _stop_control_server=lambda: calls.append("stop"),
                           _start_control_server=lambda: calls.append("start"),
                           log=SimpleNamespace(info=lambda message, *args: said.append(message % args)))


def test_a_usr2_master_in_its_predecessor_s_control_dir_listens_again_once_promoted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: an operator's kept CONTROL_DIR, USR2, then TERM to the old master: the old master's stop removed
    # gunicorn.ctl, where the new master's control socket listened (gunicorn removes its path, whoever listens
    # there), and `gunicornc -s CONTROL_DIR/gunicorn.ctl` found nothing until the next start (an upgrade trial).
    from types import SimpleNamespace

    config = _gunicorn_config(monkeypatch, tmp_path)
    said: list[str] = []
    calls: list[str] = []

    def promoted() -> None:  # gunicorn's: the old master gone, this one's master_pid 0
        server.master_pid = 0

    server = _with_a_control_socket(calls, said, master_pid=4242, maybe_promote_master=promoted)
    config["_listen_again_once_promoted"](server)
    server.maybe_promote_master()
    assert calls == ["stop", "start"] and str(tmp_path / "gunicorn.ctl") in said[0]
    server.maybe_promote_master()  # every turn of the master's loop: once only
    assert calls == ["stop", "start"]
    # its socket's path still there (the predecessor in a CONTROL_DIR of its own): nothing to do
    (tmp_path / "gunicorn.ctl").touch()
    server.master_pid = 4242
    config["_listen_again_once_promoted"](server)
    server.maybe_promote_master()
    assert calls == ["stop", "start"]
    # a master no USR2 started is never promoted: its loop's step left as gunicorn's
    first = SimpleNamespace(master_pid=0, maybe_promote_master=promoted)
    config["_listen_again_once_promoted"](first)
    assert first.maybe_promote_master is promoted


def test_a_master_whose_usr2_successor_stopped_listens_again_at_its_control_socket(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: a rollback on a kept CONTROL_DIR (USR2, then TERM to the new master): the new master's stop removed
    # gunicorn.ctl, where the kept old master's control socket listened, and gunicornc reached no master until the
    # old one's next HUP (an upgrade trial).
    config = _gunicorn_config(monkeypatch, tmp_path)
    said: list[str] = []
    calls: list[str] = []
    ended: list[int] = []

    def reaped() -> None:  # gunicorn's: an ended USR2 child's pid taken off reexec_pid
        if ended:
            server.reexec_pid = 0

    server = _with_a_control_socket(calls, said, reexec_pid=0, reap_workers=reaped)
    config["_listen_again_after_a_rollback"](server)
    server.reap_workers()  # a worker's end, no USR2 child: nothing
    server.reexec_pid = 4343
    server.reap_workers()  # the USR2 child still runs
    assert calls == []
    ended.append(4343)
    server.reap_workers()
    assert calls == ["stop", "start"] and str(tmp_path / "gunicorn.ctl") in said[0]
    server.reap_workers()  # once only
    assert calls == ["stop", "start"]
    # the new master in a CONTROL_DIR of its own left this one's socket where it was: nothing to do
    (tmp_path / "gunicorn.ctl").touch()
    server.reexec_pid = 4444
    server.reap_workers()
    assert calls == ["stop", "start"]


def test_a_master_started_on_a_kept_control_dir_says_the_desired_state_its_workers_serve(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the start said only the versions each model served; that a promotion's default and a call's unload
    # were an earlier run's, kept in CONTROL_DIR, and served instead of the repository's policies, was said nowhere
    # (an upgrade trial).
    from types import SimpleNamespace

    config = _gunicorn_config(monkeypatch, tmp_path)
    said: list[str] = []
    server = SimpleNamespace(log=SimpleNamespace(info=lambda message, *args: said.append(message % args)))
    config["_say_kept_desired_state"](server)
    assert said == []  # a directory of its own: nothing kept
    SharedDesiredState(tmp_path).write({
        "lite0": {"versions": ["1", "2"], "default": "2", "held": True, "previous_default": "1",
                  "rolled_back": ["3"], "rollout": {"candidate": None, "canary_percent": 20.0}},
        "mobile": {"versions": ["4", "5"], "default": "4", "rollout": {"candidate": "5", "canary_percent": 10.0}},
        "other": {"versions": [], "default": None}})
    monkeypatch.setenv("VISIONSERVE_CONTROL_DIR", str(tmp_path))
    config["_say_kept_desired_state"](server)
    assert len(said) == 1
    assert ("(generation 1: lite0 versions 1, 2, default 2 (a call's: held), 3 rolled back; mobile versions 4, 5, "
            "default 4, candidate 5; other unloaded by a call)") in said[0]
    assert f"remove {tmp_path / control.DESIRED} to start from the repository's policies" in said[0]
    # a file edited by hand, or of a release that wrote it otherwise: said as unreadable, never the start's end
    (tmp_path / control.DESIRED).write_text(json.dumps({"generation": 3, "models": {
        "lite0": "2", "mobile": {"versions": "4"}, "tiny": {"default": "1"}, "odd": {"versions": [1], "rollout": 5}}}))
    config["_say_kept_desired_state"](server)
    assert ("(generation 3: lite0 unreadable; mobile unreadable; odd versions 1, default None; tiny unreadable)"
            in said[1])


def test_a_dead_worker_s_files_the_master_cannot_remove_are_logged_not_raised(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the unlink's EROFS (CONTROL_DIR turned read-only) was raised in gunicorn's main loop from child_exit:
    # the master exited 1 at the first worker's death, every other worker with it.
    import errno
    from types import SimpleNamespace

    config = _gunicorn_config(monkeypatch, tmp_path)
    control.ready_mark(tmp_path, 4242).touch()

    def read_only(self: Path, missing_ok: bool = False) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "unlink", read_only)
    warnings: list[str] = []
    server = SimpleNamespace(log=SimpleNamespace(warning=lambda message, *args: warnings.append(message % args)))
    config["child_exit"](server, SimpleNamespace(pid=4242))
    assert len(warnings) == 1 and "worker 4242" in warnings[0] and os.strerror(errno.EROFS) in warnings[0]


def test_a_change_of_the_worker_count_by_ttin_or_ttou_is_refused_and_said(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    # Before: TTOU left one worker fewer than VISIONSERVE_WORKERS, whose marks readiness counts: /readyz answered
    # 503 for good while every check in its body was true (an orchestrator took the healthy server out).
    from types import SimpleNamespace

    monkeypatch.setenv("VISIONSERVE_WORKERS", "2")
    config = _gunicorn_config(monkeypatch, tmp_path)
    errors: list[str] = []
    server = SimpleNamespace(_num_workers=2, log=SimpleNamespace(error=lambda message, *args: errors.append(
        message % args)))
    config["nworkers_changed"](server, 2, None)  # gunicorn's own setting at start
    server._num_workers = 1  # TTOU: gunicorn's property sets the count, then calls the hook
    config["nworkers_changed"](server, 1, 2)
    assert server._num_workers == 2 and len(errors) == 1 and "VISIONSERVE_WORKERS=2" in errors[0]


def test_ttou_at_one_worker_is_refused_and_said_as_at_any_count(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    # Before: gunicorn's handle_ttou returns at one worker without a word and without the hook: TTIN logged its
    # refusal, TTOU nothing (an operator's trial)
    from types import SimpleNamespace

    monkeypatch.setenv("VISIONSERVE_WORKERS", "1")
    config = _gunicorn_config(monkeypatch, tmp_path)
    errors: list[str] = []
    gunicorns: list[str] = []
    server = SimpleNamespace(num_workers=1, _num_workers=1, handle_ttou=lambda: gunicorns.append("ttou"),
                             log=SimpleNamespace(error=lambda message, *args: errors.append(message % args)))
    config["_refuse_ttou_at_one_worker"](server)
    server.handle_ttou()
    assert server._num_workers == 1 and not gunicorns
    assert len(errors) == 1 and "change of the worker count to 0 (TTIN, TTOU) is refused" in errors[0]
    server.num_workers = 2  # more than one: gunicorn's own (which calls the hook)
    server.handle_ttou()
    assert gunicorns == ["ttou"]


def test_a_worker_takes_new_connections_when_control_dir_cannot_be_looked_into(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A look at the ready mark that fails otherwise than "not there" (EACCES) raises from Path.exists; the worker's
    # accept asks this at each new connection, and a raise there would end the worker with its connections.
    control.ready_mark(tmp_path, os.getppid()).touch()  # another live worker serves
    assert not control.takes_connections(tmp_path, os.getpid())

    def refused(self: Path, *args: object, **kwargs: object) -> object:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "stat", refused)
    assert control.takes_connections(tmp_path, os.getpid())


def test_a_boot_failure_is_said_by_its_own_master_once(tmp_path: Path) -> None:
    # Before: one boot.failed for every master: a USR2 master's failed start (or one left in a kept directory) was
    # said as "did not start" by the old master when it stopped normally later, and kept the first reason ever written
    control.tell_boot_failure(tmp_path, 100, "cannot serve the model: no manifest.json")
    control.tell_boot_failure(tmp_path, 100, "a second worker's reason")  # the first worker's is kept
    assert control.boot_failure(tmp_path, 200) is None  # another master's start failed, not this one's
    assert control.boot_failure(tmp_path, 100) == "cannot serve the model: no manifest.json"
    assert control.boot_failure(tmp_path, 100) is None and not list(tmp_path.iterdir())  # said once, then gone
    control.tell_boot_failure(tmp_path, 300, "left behind")
    control.clear_stale(tmp_path)
    assert not list(tmp_path.iterdir())


def test_a_drain_that_begins_while_the_ready_mark_is_written_still_leaves_its_leaving_mark(tmp_path: Path) -> None:
    # Before: begin_drain looked for the ready mark before _serving_now wrote it, so it wrote no leaving mark, and
    # _serving_now only took its ready mark away again: a HUP's new worker, still loading, then took the new
    # connections (503 until it served) while this one still answered.
    from app.engine.lifecycle import Lifecycle

    lifecycle = Lifecycle()

    class DrainBeginsMeanwhile(type(tmp_path)):  # a SIGTERM between _serving_now's look and its write
        def touch(self, *args: object, **kwargs: object) -> None:
            if self.name.endswith(".ready"):  # (its parent, and the leaving mark beside it, are of this class too)
                lifecycle.begin_drain()
            super().touch(*args, **kwargs)

    lifecycle.ready_mark = DrainBeginsMeanwhile(control.ready_mark(tmp_path, os.getpid()))
    lifecycle._serving_now()
    assert not lifecycle.ready_mark.exists() and control.leaving_mark(tmp_path, os.getpid()).exists()
    lifecycle.stop_serving()
    assert not control.leaving_mark(tmp_path, os.getpid()).exists()


def test_a_draining_worker_answers_on_while_its_replacement_loads_and_none_serves(
        squatter: subprocess.Popen[bytes], tmp_path: Path) -> None:
    # A HUP's old worker (this process) and its new one (the squatter), still loading: the old one answers on.
    old, new = os.getpid(), squatter.pid
    assert not control.replacement_loading(tmp_path, old)  # nothing loading: a whole server's stop
    control.loading_mark(tmp_path, old).touch()
    assert not control.replacement_loading(tmp_path, old)  # its own mark is no replacement
    control.loading_mark(tmp_path, new).touch()
    assert control.replacement_loading(tmp_path, old)
    control.ready_mark(tmp_path, new).touch()  # the new one serves: the old one's drain goes on to its end
    assert not control.replacement_loading(tmp_path, old)
    control.ready_mark(tmp_path, new).unlink()
    control.loading_mark(tmp_path, 2 ** 22 + 7).touch()  # a loading mark of no live process does not count
    control.loading_mark(tmp_path, new).unlink()
    assert not control.replacement_loading(tmp_path, old)


@pytest.mark.slow  # a drain's seconds, waited out
def test_a_drain_answers_on_while_told_and_leaves_its_last_requests_their_time(tmp_path: Path) -> None:
    from app.engine.lifecycle import ANSWER_ON_POLL_S, ANSWER_ON_SETTLE_S, Lifecycle

    lifecycle = Lifecycle()
    lifecycle.ready_mark = control.ready_mark(tmp_path, os.getpid())
    control.loading_mark(tmp_path, os.getpid()).touch()  # written at its fork (gunicorn.conf.py's post_fork)
    lifecycle._serving_now()
    assert not control.loading_mark(tmp_path, os.getpid()).exists()  # it serves: loading no more
    lifecycle.begin_drain()
    asked: list[bool] = []

    def answer_on() -> bool:
        assert not lifecycle.refusing  # still answering while it is asked
        asked.append(True)
        return len(asked) < 3

    started = time.monotonic()
    assert lifecycle.wait_drained(0.01, 8.0, answer_on) and len(asked) >= 3 and lifecycle.refusing
    # once the new worker serves, it answers ANSWER_ON_SETTLE_S more: the connections it took before (it takes none
    # after) answered, not 503 (before: it stopped at once; 3 of 2,021 requests of a HUP under a loaded suite)
    assert time.monotonic() - started >= 2 * ANSWER_ON_POLL_S + ANSWER_ON_SETTLE_S
    bounded = Lifecycle()
    bounded.begin_drain()  # told to answer on for good: it stops with ANSWER_ON_LEAVES_S (5 s) of max_s left
    started = time.monotonic()
    assert bounded.wait_drained(0.05, 5.5, lambda: True) and bounded.refusing
    assert 0.45 <= time.monotonic() - started < 5
    late = Lifecycle()  # no window (SHUTDOWN_DRAIN_S 0), and the new worker's mark comes just after the SIGTERM
    late.begin_drain()
    started = time.monotonic()
    assert late.wait_drained(0.0, 7.0, lambda: 0.3 < time.monotonic() - started < 0.6) and late.refusing
    assert time.monotonic() - started >= 0.6  # (before: it looked once, at once, and stopped answering)
