"""The temporary directories a gunicorn master makes for its processes (the metrics' multiprocess files, CONTROL_DIR)
and who may remove them.

A master removes the ones it made when it exits; one killed outright (SIGKILL, the OOM killer) cannot, and a
container restarted in its pod keeps the pod's /tmp (an emptyDir, often of memory: deploy/k8s's, 256 MiB) with
every such directory in it. So each directory holds a lock file its master holds a shared lock on for its whole
life (the workers it forks share it; an engine, a fresh interpreter, does not need to), and a master starting
removes every directory of these names whose lock no process holds: its master and workers are gone. A directory
without the lock file (made by an older version, or by hand) is never removed. The lock file appears already
locked (made under another name, locked, then renamed), so a starting master never takes a directory being made
for a stale one. A master started by gunicorn's USR2 upgrade takes a shared lock on the directories it inherits:
the old master, exiting, leaves them to it.

Standard library only: gunicorn.conf.py, in the master, uses it.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

PREFIXES = ("visionserve-metrics-", "visionserve-control-")
HELD_WHILE_IN_USE = ".master.lock"  # the lock file in each directory (a dot: no glob of the metrics' *.db sees it)
_HELD: dict[str, int] = {}  # each directory this master holds: its lock file's descriptor (kept open till exit)


def make(prefix: str) -> str:
    """A new directory in the temporary folder, held by this process until it exits and removed then."""
    path = tempfile.mkdtemp(prefix=prefix)
    fd, name = tempfile.mkstemp(prefix=".making-", dir=path)
    fcntl.flock(fd, fcntl.LOCK_SH)
    os.rename(name, os.path.join(path, HELD_WHILE_IN_USE))
    _HELD[path] = fd
    return path


def hold(path: str) -> None:
    """Hold a directory another master made (USR2's new master inherits its old one's), so that it is this one's to
    remove at exit and no starting master takes it for stale. One without the lock file is left as it is."""
    if path in _HELD:
        return
    try:
        fd = os.open(os.path.join(path, HELD_WHILE_IN_USE), os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:  # a starting master is removing it: its makers are gone
        os.close(fd)
        return
    _HELD[path] = fd


def remove_held(master: int) -> None:
    """The directories this master holds, removed in the process of pid ``master`` only: registered to run at its
    exit however it exits (a refusal at start, a halt, gunicorn's own ``sys.exit`` when it cannot listen, before
    any hook), where the workers it forks run the same exit functions. One another process holds too (USR2's new
    master) is that one's now, and left."""
    if os.getpid() != master:
        return
    for path, fd in list(_HELD.items()):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass
        else:
            shutil.rmtree(path, ignore_errors=True)
        os.close(fd)
        del _HELD[path]


def remove_stale(folder: str | None = None) -> list[str]:
    """Directories of these names in ``folder`` (the temporary folder) whose lock no process holds, removed: what
    masters killed outright left. Returns their paths."""
    removed = []
    for entry in Path(folder or tempfile.gettempdir()).iterdir():
        if not entry.name.startswith(PREFIXES) or str(entry) in _HELD:
            continue
        try:
            fd = os.open(entry / HELD_WHILE_IN_USE, os.O_RDONLY)
        except OSError:  # not one of ours (no lock file), or not ours to read
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its master, or one of its workers, lives
            os.close(fd)
            continue
        try:
            shutil.rmtree(entry, ignore_errors=True)
        finally:
            os.close(fd)
        removed.append(str(entry))
    return removed
