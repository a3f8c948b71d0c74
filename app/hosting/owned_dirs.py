"""The temporary directories a gunicorn master makes for its processes (the metrics' multiprocess files, CONTROL_DIR)
and who may remove them.

A master removes the ones it made when it exits; one killed outright (SIGKILL, the OOM killer) cannot, and a
container restarted in its pod keeps the pod's /tmp (an emptyDir, often of memory: deploy/k8s's, 256 MiB) with
every such directory in it. So each directory holds a lock file its master holds a shared lock on for its whole
life (the workers it forks share it; an engine, a fresh interpreter, does not need to), and a master starting
removes every directory of these names, of its own user, whose lock no process holds: its master and workers are
gone. A directory without the lock file (made by an older version, or by hand) is never removed, nor one that is a
link, nor one whose lock file is not a plain file. The lock file appears already locked (made under another name,
locked, then renamed), so a starting master never takes a directory being made for a stale one.

A master started by gunicorn's USR2 upgrade makes a CONTROL_DIR of its own: the old one's is left out of the
environment it is given (``leave_out_of``; gunicorn passes the environment it started with, which holds it only
after a HUP), as its engines' sockets and its marks in it are the old master's, and the old one removes it. The
metrics directory is handed over instead (``hand_over``, ``adopt``): both masters' processes count in it while both
serve, so a scrape reaching either master's workers reads the same totals (with one each, the counters went back
and forth, and ``rate()`` read each fall as a reset), and whichever master exits last removes it: one exiting while
another holds its lock leaves it (``remove_held``).

Standard library only: gunicorn.conf.py, in the master, uses it.
"""
from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import MutableMapping

METRICS_PREFIX, CONTROL_PREFIX = "visionserve-metrics-", "visionserve-control-"  # the two a master makes
PREFIXES = (METRICS_PREFIX, CONTROL_PREFIX)
HELD_WHILE_IN_USE = ".master.lock"  # the lock file in each directory (a dot: no glob of the metrics' *.db sees it)
HANDED_OVER = "_VISIONSERVE_HANDED_OVER_DIR"  # "<descriptor>:<path>": a directory USR2's new master is handed
_HELD: dict[str, int] = {}  # each directory this master made: its lock file's descriptor (kept open till exit)
_REGISTERED: set[int] = set()  # the processes ``remove_held`` runs at the exit of


def make(prefix: str) -> str:
    """A new directory in the temporary folder, held by this process until it exits and removed then (also where
    gunicorn only reads its configuration: ``--check-config``)."""
    path = tempfile.mkdtemp(prefix=prefix)
    fd, name = tempfile.mkstemp(prefix=".making-", dir=path)
    fcntl.flock(fd, fcntl.LOCK_SH)
    os.rename(name, os.path.join(path, HELD_WHILE_IN_USE))
    _HELD[path] = fd
    remove_at_exit()
    return path


def remove_at_exit() -> None:
    """``remove_held`` registered to run at this process's exit (once a process: after a ``--daemon`` fork, again
    in the daemon, whose pid it is then)."""
    if os.getpid() not in _REGISTERED:
        _REGISTERED.add(os.getpid())
        atexit.register(remove_held, os.getpid())


def leave_out_of(environ: MutableMapping[str, str]) -> None:
    """The variables naming a directory this master made, taken out of ``environ`` (what USR2's new master is given:
    gunicorn's ``pre_exec``), so that it makes its own."""
    for key, value in list(environ.items()):
        if value in _HELD:
            del environ[key]


def made_here(path: str) -> bool:
    """Whether ``path`` is a directory this master made (or adopted), which it removes at its exit."""
    return path in _HELD


def hand_over(path: str, environ: MutableMapping[str, str]) -> bool:
    """USR2's new master, forked and about to be executed (gunicorn's ``pre_exec``), given ``path``, a directory this
    master made, in ``environ`` (what it is executed with) and a lock of its own on it (a descriptor it keeps across
    the exec, named in ``HANDED_OVER``): from then on this master's exit leaves the directory to it, and a master
    starting meanwhile sees it held. Whether it was: where the lock cannot be taken (the directory gone), nothing
    is."""
    environ.pop(HANDED_OVER, None)  # (what this master was handed itself, in the environment it started with)
    try:
        fd = os.open(os.path.join(path, HELD_WHILE_IN_USE), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    fcntl.flock(fd, fcntl.LOCK_SH)
    os.set_inheritable(fd, True)
    environ[HANDED_OVER] = f"{fd}:{path}"
    return True


def adopt(environ: MutableMapping[str, str]) -> str | None:
    """In USR2's new master, at its start: the directory its predecessor handed over (``hand_over``), now this
    master's own, removed at its exit unless a later master holds it then; its path, or None when none was handed
    over (``HANDED_OVER`` taken out of ``environ`` either way: its workers and a HUP's reload do not adopt it again).
    A descriptor that is not that directory's lock file (the variable set by hand, or inherited by another program)
    is left alone."""
    handed = environ.pop(HANDED_OVER, None)
    if not handed:
        return None
    number, _, path = handed.partition(":")
    try:
        fd = int(number)
        held, lock = os.fstat(fd), os.stat(os.path.join(path, HELD_WHILE_IN_USE), follow_symlinks=False)
    except (ValueError, OSError):
        return None
    if (held.st_dev, held.st_ino) != (lock.st_dev, lock.st_ino) or not _ours(lock, stat.S_ISREG):
        return None
    os.set_inheritable(fd, False)
    _HELD.setdefault(path, fd)
    remove_at_exit()
    return path


def remove_held(master: int) -> None:
    """The directories this master made or adopted, removed in the process of pid ``master`` only: registered to run
    at its exit however it exits (a refusal at start, a halt, gunicorn's own ``sys.exit`` when it cannot listen,
    before any hook), where the workers it forks run the same exit functions. One another master holds too (handed
    over to USR2's new master, or adopted from the master a rollback kept) is left to it."""
    if os.getpid() != master:
        return
    for path, fd in list(_HELD.items()):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (this master's workers share its lock: theirs is its)
        except OSError:  # another master holds it
            pass
        else:
            shutil.rmtree(path, ignore_errors=True)
        os.close(fd)
        del _HELD[path]


def remove_stale(folder: str | None = None) -> list[str]:
    """Directories of these names in ``folder`` (the temporary folder), this user's, whose lock no process holds,
    removed: what masters killed outright left. Returns their paths."""
    removed = []
    for entry in Path(folder or tempfile.gettempdir()).iterdir():
        if entry.name.startswith(PREFIXES) and str(entry) not in _HELD and _remove_if_stale(entry):
            removed.append(str(entry))
    return removed


def _remove_if_stale(entry: Path) -> bool:
    try:
        if not _ours(entry.lstat(), stat.S_ISDIR):  # a link, or another user's
            return False
        # not blocking on a FIFO put there, not following a link
        fd = os.open(entry / HELD_WHILE_IN_USE, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:  # not one of ours (no lock file), or not ours to read
        return False
    try:
        if not _ours(os.fstat(fd), stat.S_ISREG):
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # its master, or one of its workers, lives
        return False
    else:
        shutil.rmtree(entry, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def _ours(status: os.stat_result, kind: object) -> bool:
    return kind(status.st_mode) and status.st_uid == os.getuid()  # type: ignore[operator]
