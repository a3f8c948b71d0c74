"""The multiprocess metrics' files once their process has ended (PROMETHEUS_MULTIPROC_DIR, prometheus-client's
multiprocess mode): a process's counters, histograms and summaries are files of their own (``counter_<pid>.db``,
...), which must outlive it, or its counts would leave the totals and a rate over them read as a reset. Kept as
they are, every HTTP worker a HUP replaces and every engine restart left its files behind, and every /metrics
scrape read them all: the folder and the scrape grew with the restarts for the server's whole life (a soak:
4 files of 64 KiB each HUP of two workers). So the master folds an ended process's files into one of each kind
(``counter_ended.db``, ...: added value by value, as a scrape sums them) and removes them (``fold_ended``), under an
exclusive lock that each scrape takes shared (``reading``): a scrape reads the counts before the fold or after it,
never twice or none. Its live gauges' files go as before (``mark_process_dead``)."""
from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator

from prometheus_client.mmap_dict import MmapedDict

FOLDED_KINDS = ("counter", "histogram", "summary")  # what a process's files hold that sums over processes
ENDED = "ended"  # the folded files' name in place of a pid: counter_ended.db
LOCK_NAME = ".fold.lock"  # (not a .db: prometheus-client reads only those)


@contextlib.contextmanager
def _locked(directory: Path, how: int) -> Iterator[None]:
    """``directory``'s fold lock held ``how`` (fcntl.LOCK_SH or LOCK_EX) meanwhile; where it cannot be opened (a
    read-only folder without one yet), nothing is held: no fold can happen there either."""
    try:
        fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)  # (the lock goes with it)


def reading(directory: Path) -> contextlib.AbstractContextManager[None]:
    """A scrape's read of the folder's files: no fold meanwhile."""
    return _locked(directory, fcntl.LOCK_SH)


def fold_ended(directory: Path, pid: int) -> int:
    """Process ``pid`` (ended) has its counters, histograms and summaries added into the folder's ``*_ended.db``
    and its own files removed; how many were folded. OSError where the folder cannot be written, what
    prometheus-client raises for a file that does not read (the master says so: ``_forget``)."""
    folded = 0
    with _locked(directory, fcntl.LOCK_EX):
        for kind in FOLDED_KINDS:
            own = directory / f"{kind}_{pid}.db"
            if not own.exists():
                continue
            values = list(MmapedDict.read_all_values_from_file(str(own)))  # all read before any is added: a file
            # that does not read (RuntimeError, struct.error) is left whole, none of it folded
            ended = MmapedDict(str(directory / f"{kind}_{ENDED}.db"))
            try:
                for key, value, timestamp, _ in values:
                    before, _ = ended.read_value(key)
                    ended.write_value(key, before + value, timestamp)
            finally:
                ended.close()
            own.unlink()
            folded += 1
    return folded
