"""The temporary directories a master makes (app/hosting/owned_dirs.py): removed at its exit, and by a later master
once whoever made them is gone without removing them; never while a process of theirs lives, never one not made so."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from app.hosting import owned_dirs

ROOT = Path(__file__).resolve().parents[2]
# A master in a process of its own: makes its directories, says where, then ends as the line on its stdin says:
# "kill" (SIGKILL: no exit function runs, as under the OOM killer) or "exit" (its exit functions run); "fork" first:
# a worker of it, forked, holds them too while it lives (its pid said).
MASTER = """
import os, signal, sys, time
from app.hosting import owned_dirs
print(owned_dirs.make("visionserve-metrics-"), owned_dirs.make("visionserve-control-"), flush=True)
worker = None
for line in sys.stdin:
    word = line.strip()
    if word == "fork":
        worker = os.fork()
        if worker == 0:
            time.sleep(60)
            os._exit(0)
        print(worker, flush=True)
    elif word == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        sys.exit(0)
"""


class Master:
    def __init__(self, folder: Path) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", MASTER], cwd=ROOT, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(folder)})
        assert self.process.stdout is not None
        self.dirs = self.process.stdout.readline().split()

    def say(self, line: str) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        if line == "fork":
            self.worker = int(self.process.stdout.readline())
        else:
            self.process.wait(30)


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(owned_dirs, "_HELD", {})
    return tmp_path


def test_a_killed_master_s_directories_go_at_the_next_start_and_no_others(folder: Path) -> None:
    killed, alive = Master(folder), Master(folder)
    killed.say("kill")
    assert all(Path(path).is_dir() for path in killed.dirs)  # nothing ran at its end
    by_hand = folder / "visionserve-control-mine"  # no lock file: set aside by ops, or an older version's
    by_hand.mkdir()
    other = folder / "someone-else"
    other.mkdir()
    (other / owned_dirs.HELD_WHILE_IN_USE).touch()
    mine = owned_dirs.make("visionserve-metrics-")  # this master's own, being held

    assert sorted(owned_dirs.remove_stale()) == sorted(killed.dirs)
    assert sorted(path.name for path in folder.iterdir()) == sorted(
        [Path(path).name for path in alive.dirs] + [by_hand.name, other.name, Path(mine).name])
    alive.say("exit")  # a master that exits removes its own
    assert not any(Path(path).exists() for path in alive.dirs)
    owned_dirs.remove_held(os.getpid() + 1)  # in a worker it forked: nothing
    assert Path(mine).is_dir()
    owned_dirs.remove_held(os.getpid())
    assert sorted(path.name for path in folder.iterdir()) == sorted([by_hand.name, other.name])


def test_a_killed_master_s_live_worker_keeps_its_directories_until_it_ends(folder: Path) -> None:
    master = Master(folder)
    master.say("fork")
    master.say("kill")  # the worker, forked with the master's lock, outlives it a while
    try:
        assert owned_dirs.remove_stale() == [] and all(Path(path).is_dir() for path in master.dirs)
    finally:
        os.kill(master.worker, signal.SIGKILL)
    removed: list[str] = []
    deadline = time.monotonic() + 10
    while len(removed) < 2 and time.monotonic() < deadline:  # its lock goes as it dies (a zombie holds none)
        removed += owned_dirs.remove_stale()
        time.sleep(0.05)
    assert sorted(removed) == sorted(master.dirs)


def test_what_is_not_a_directory_of_ours_with_a_plain_lock_file_is_left_alone(folder: Path) -> None:
    fifo = folder / "visionserve-metrics-fifo"  # before: opening its lock file, a FIFO, hung every master's start
    fifo.mkdir()
    os.mkfifo(fifo / owned_dirs.HELD_WHILE_IN_USE)
    stale = folder / "visionserve-control-stale"
    stale.mkdir()
    (stale / owned_dirs.HELD_WHILE_IN_USE).touch()
    linked = folder / "visionserve-control-linked"  # a link to a stale one: neither followed nor counted
    linked.symlink_to(stale)
    lock_link = folder / "visionserve-metrics-locklink"
    lock_link.mkdir()
    (lock_link / owned_dirs.HELD_WHILE_IN_USE).symlink_to(stale / owned_dirs.HELD_WHILE_IN_USE)
    assert owned_dirs.remove_stale() == [str(stale)]
    assert sorted(path.name for path in folder.iterdir()) == sorted([fifo.name, linked.name, lock_link.name])


def test_usr2_s_new_master_is_given_none_of_the_old_master_s_directories(folder: Path) -> None:
    # gunicorn passes USR2's new master the environment it started with, which names them after a HUP: the new
    # master cleared the old one's live marks and engine sockets in them as stale (pre_exec leaves them out)
    mine = owned_dirs.make("visionserve-control-")
    environ = {"VISIONSERVE_CONTROL_DIR": mine, "PROMETHEUS_MULTIPROC_DIR": "/srv/metrics", "PATH": "/usr/bin"}
    owned_dirs.leave_out_of(environ)
    assert environ == {"PROMETHEUS_MULTIPROC_DIR": "/srv/metrics", "PATH": "/usr/bin"}  # one ops set is theirs
    owned_dirs.remove_held(os.getpid())
    assert list(folder.iterdir()) == []


# USR2's new master, executed with what the old one handed over: adopts it, says what it adopted, then exits as the
# line on its stdin says (its exit functions run).
ADOPTER = """
import os, sys
from app.hosting import owned_dirs
print(owned_dirs.adopt(os.environ), owned_dirs.HANDED_OVER in os.environ, flush=True)
sys.stdin.readline()
sys.exit(0)
"""


class Adopter:
    """USR2's new master: executed (here started) with the descriptor ``hand_over`` opened, which the old master
    (this process, before gunicorn's exec: its fork) then no longer has."""

    def __init__(self, environ: dict[str, str]) -> None:
        fd = int(environ[owned_dirs.HANDED_OVER].partition(":")[0])
        self.process = subprocess.Popen([sys.executable, "-c", ADOPTER], cwd=ROOT, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, pass_fds=(fd,),
                                        env={**os.environ, **environ})
        os.close(fd)
        assert self.process.stdout is not None
        adopted, still_named = self.process.stdout.readline().split()
        self.adopted, self.still_named = adopted, still_named == "True"

    def exit(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("exit\n")
        self.process.stdin.flush()
        self.process.wait(30)


def test_usr2_s_new_master_is_handed_the_metrics_directory_and_the_last_master_to_exit_removes_it(
        folder: Path) -> None:
    # Before: the new master made a metrics directory of its own, so while both masters served a scrape read either
    # master's totals: the counters went back and forth, and rate() read each fall as a reset.
    metrics, control_dir = owned_dirs.make("visionserve-metrics-"), owned_dirs.make("visionserve-control-")
    environ = {"PROMETHEUS_MULTIPROC_DIR": metrics, "VISIONSERVE_CONTROL_DIR": control_dir}
    owned_dirs.leave_out_of(environ)
    environ["PROMETHEUS_MULTIPROC_DIR"] = metrics
    owned_dirs.hand_over(metrics, environ)
    new = Adopter(environ)
    assert new.adopted == metrics and not new.still_named  # (its workers, and a HUP's reload, adopt nothing again)
    owned_dirs.remove_held(os.getpid())  # the old master exits: the metrics directory is the new master's now
    assert Path(metrics).is_dir() and not Path(control_dir).exists()
    assert owned_dirs.remove_stale() == []  # and no master starting meanwhile takes it for a dead one's
    new.exit()
    assert list(folder.iterdir()) == []


def test_a_rolled_back_usr2_master_leaves_the_metrics_directory_to_the_old_master(folder: Path) -> None:
    metrics = owned_dirs.make("visionserve-metrics-")
    environ = {"PROMETHEUS_MULTIPROC_DIR": metrics}
    owned_dirs.hand_over(metrics, environ)
    new = Adopter(environ)
    new.exit()  # the operator stops the new master and keeps the old one
    assert Path(metrics).is_dir()
    owned_dirs.remove_held(os.getpid())
    assert list(folder.iterdir()) == []


def test_a_handed_over_variable_naming_no_such_lock_is_not_adopted(folder: Path) -> None:
    metrics = owned_dirs.make("visionserve-metrics-")
    with open(os.devnull) as elsewhere:  # a descriptor that is open, but not the directory's lock file
        for value in (f"{elsewhere.fileno()}:{metrics}", f"999999:{metrics}", f"x:{metrics}", ""):
            environ = {owned_dirs.HANDED_OVER: value}
            assert owned_dirs.adopt(environ) is None and environ == {}
        os.fstat(elsewhere.fileno())  # left open
    assert not owned_dirs.made_here("/elsewhere") and owned_dirs.made_here(metrics)
