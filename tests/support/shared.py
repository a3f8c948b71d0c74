"""Folders that cost seconds to minutes to build (an export, a photo set) built once per test run, also when
pytest-xdist runs the tests in several processes: the first process to ask builds the folder under the run's base
temp while it holds a file lock, and every other one waits on the lock and reuses it (the pattern pytest-xdist
documents for session fixtures). Whoever uses such a folder only reads it: a test that changes one copies it first."""
from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable

import pytest


def run_temp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's base temp: each xdist worker's own base temp lies in it (``.../pytest-N/popen-gw0``)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_folder(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """``run_temp/name``, filled by ``build(folder)`` (given an empty folder) the first time any process asks."""
    root = run_temp(tmp_path_factory)
    out, done = root / name, root / f"{name}.built"
    with (root / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # half a folder from a process that failed mid-way
            out.mkdir()
            build(out)
            done.touch()
    return out
