"""Per-worker resident memory and CPU for /metrics when several gunicorn workers share it.

prometheus-client's multiprocess mode drops its ``process_*`` collector (one process cannot speak for the others),
so with several workers there was no memory or CPU series at all. The worker answering the scrape reads its
siblings (the children of the gunicorn master, its parent) from /proc instead, labelled by worker pid. Linux only;
elsewhere it reports nothing.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def children(pid: int) -> list[int]:
    """``pid``'s live children, sorted: each of its threads' (a child is listed under the thread that started it);
    none when /proc does not say (the process is gone, or the kernel keeps no such list). A thread that ends while
    they are read (a server's thread per connection) takes only its own children's list with it."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").glob("*/children"))
    except OSError:  # it ended while its threads were listed (a drill step's process: the drill's run failed)
        return []
    found: list[int] = []
    for task in tasks:
        try:
            found += [int(child) for child in task.read_text().split()]
        except (OSError, ValueError):
            continue
    return sorted(found)


def worker_pids(parent: int | None = None) -> list[int]:
    """The parent's children (gunicorn's workers, and the engines, which a watcher thread of the master restarts),
    or just this process when /proc does not say."""
    return children(os.getppid() if parent is None else parent) or [os.getpid()]


def cpu_and_memory(pid: int) -> tuple[float, int] | None:
    """(CPU seconds, resident bytes) of ``pid``, or None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After the command name: state is field 3, utime 14, stime 15, rss 24 (man proc), so index - 3 here.
    return (int(fields[11]) + int(fields[12])) / _TICKS, int(fields[21]) * _PAGE


class WorkerCollector:
    """process_resident_memory_bytes and process_cpu_seconds_total, one series per live worker."""

    def collect(self) -> Iterator[Metric]:
        """Read every worker now."""
        memory = GaugeMetricFamily("process_resident_memory_bytes", "Resident memory of each gunicorn worker",
                                   labels=["worker"])
        cpu = CounterMetricFamily("process_cpu_seconds", "CPU seconds (user + system) of each gunicorn worker",
                                  labels=["worker"])
        for pid in worker_pids():
            stat = cpu_and_memory(pid)
            if stat is not None:
                cpu.add_metric([str(pid)], stat[0])
                memory.add_metric([str(pid)], stat[1])
        yield memory
        yield cpu
