"""The temporary directories a master makes (app/hosting/owned_dirs.py): removed at its exit, and by a later master
once whoever made them is gone without removing them; never while a process of theirs lives, never one not made so."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from app.hosting import owned_dirs

ROOT = Path(__file__).resolve().parents[2]
# A master in a process of its own: makes its directories, says where, then ends as the line on its stdin says:
# "kill" (SIGKILL: no exit function runs, as under the OOM killer), "exit" (its exit functions run), or, holding a
# directory it is given, "hold PATH" first.
MASTER = """
import atexit, os, signal, sys
from app.hosting import owned_dirs
atexit.register(owned_dirs.remove_held, os.getpid())
print(owned_dirs.make("visionserve-metrics-"), owned_dirs.make("visionserve-control-"), flush=True)
for line in sys.stdin:
    word, _, path = line.strip().partition(" ")
    if word == "hold":
        owned_dirs.hold(path)
        print("held", flush=True)
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
        if line.startswith("hold"):
            assert self.process.stdout.readline().strip() == "held"
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


def test_a_master_holding_inherited_directories_keeps_them_when_the_old_one_exits(folder: Path) -> None:
    # gunicorn's USR2: the new master inherits the directories through the environment; the old one, exiting after
    old = Master(folder)
    for path in old.dirs:
        owned_dirs.hold(path)
    old.say("exit")
    assert all(Path(path).is_dir() for path in old.dirs)
    assert owned_dirs.remove_stale() == []  # held: not stale
    owned_dirs.hold(str(folder / "visionserve-control-missing"))  # nothing there: nothing held
    owned_dirs.remove_held(os.getpid())
    assert list(folder.iterdir()) == []


def test_a_live_master_s_directory_is_held_by_whoever_holds_it_not_by_its_maker_alone(folder: Path) -> None:
    # the other way round: this master made them, another took them over (hold) and outlives it
    mine = owned_dirs.make("visionserve-control-")
    successor = Master(folder)
    successor.say(f"hold {mine}")
    owned_dirs.remove_held(os.getpid())
    assert Path(mine).is_dir()  # left to the successor
    successor.say("kill")
    assert sorted(owned_dirs.remove_stale()) == sorted([mine, *successor.dirs])
    assert list(folder.iterdir()) == []
