"""A process's descendants, to kill what a server or a benchmark step left behind: visionserve's servers and
engines run in sessions of their own, so a signal to the group of what started them misses them, and once their
parent ends they are re-parented, so they are collected while it runs, before anything is killed."""
from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from app.hosting.procstat import children


def descendants(pid: int, found: dict[int, str] | None = None) -> dict[int, str]:
    """``pid``'s descendants now, children's children included, added to ``found`` (a new dict when None), each with
    its start time, to tell it later from a process that got its pid again."""
    found = {} if found is None else found
    todo = children(pid)
    while todo:
        child = todo.pop()
        started = start_time(child)
        if started is not None and child not in found:
            found[child] = started
            todo += children(child)
    return found


def start_time(pid: int) -> str | None:
    """``pid``'s start time in clock ticks since boot (field 22 of /proc's stat), or None once it is gone."""
    try:  # 19 fields after the command name
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def kill_left(found: dict[int, str]) -> None:
    """SIGKILL each of ``found`` (``descendants``) that is still the process it was."""
    for pid, started in found.items():
        if start_time(pid) == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
