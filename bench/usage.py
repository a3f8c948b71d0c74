"""What a measured run used, for the serving and the training benchmarks: CPU seconds of a process group or of a
server's process tree (from /proc), and GPU utilisation sampled by ``nvidia-smi`` every 200 ms (no NVML binding
needed; None where there is no NVIDIA driver, as on the CPU machines)."""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import threading
from pathlib import Path

from app.hosting.procstat import children, cpu_and_memory
from app.link.supervisor import ENGINE_MODULE


def process_group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of the live processes in process group ``pgid`` (a server and its workers)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[2]) == pgid:  # fields after "(comm)": state ppid pgrp ... utime(11) stime(12)
            total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def process_tree_cpu(root: int) -> dict[int, tuple[str, float]]:
    """``root`` and every live process below it: pid -> (command line, CPU seconds). A server's tree, not its process
    group: an engine process (ENGINE=process) runs in a session of its own, below the gunicorn master."""
    found, pending = {}, [root]
    while pending:
        pid = pending.pop()
        stat = cpu_and_memory(pid)
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended meanwhile
            continue
        pending += children(pid)
        if stat is not None:
            found[pid] = (command, stat[0])
    return found


def engine_pids(tree: dict[int, tuple[str, float]]) -> list[int]:
    """The engine processes of a server's tree (``process_tree_cpu``)."""
    return [pid for pid, (command, _) in tree.items() if ENGINE_MODULE in command]


def tree_cpu_spent(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
                   ) -> tuple[float, float | None]:
    """CPU seconds a server's tree spent between two ``process_tree_cpu`` readings (the processes in both), and of
    them its engine processes' (None: it has none, or one of them started in between: a restarted engine, whose
    CPU and its predecessor's are not in both readings, so its figure would read 0)."""
    spent = {pid: cpu - before[pid][1] for pid, (_, cpu) in after.items() if pid in before}
    engines = engine_pids(after)
    if not engines or any(pid not in before for pid in engines):
        return sum(spent.values()), None
    return sum(spent.values()), sum(spent[pid] for pid in engines)


class GpuUtilisation:
    """``with GpuUtilisation() as gpu: ...``, then ``gpu.mean`` (percent, or None without nvidia-smi)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._process: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> "GpuUtilisation":
        smi = shutil.which("nvidia-smi")
        if smi:
            self._process = subprocess.Popen([smi, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                              "-lms", "200"], stdout=subprocess.PIPE, text=True)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        return self

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            first = line.split(",")[0].strip()  # the first GPU: each worker's is in /v1/models
            if first.replace(".", "", 1).isdigit():
                self.samples.append(float(first))

    def __exit__(self, *exc: object) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(5)

    @property
    def mean(self) -> float | None:
        """The mean utilisation over the samples, in percent."""
        return statistics.fmean(self.samples) if self.samples else None
