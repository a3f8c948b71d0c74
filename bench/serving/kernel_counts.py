"""What a request costs the kernel (issue #50): system calls, page faults and context switches per request of the HTTP
workers and of the engine, counted by ``perf stat`` while the overhead benchmark's clients run.

    .venv/bin/python -m bench.serving.kernel_counts                       # bare, process; JPEG, V2 x1, multipart
    .venv/bin/python -m bench.serving.kernel_counts --servers process --checkout ../before   # A/B: another checkout
    .venv/bin/python -m bench.serving.kernel_counts --smoke               # half a second a point (the suite)

Needs ``perf`` (Debian: ``apt-get install linux-perf``) allowed to count another process's software events and
syscall tracepoints (root, or ``kernel.perf_event_paranoid`` <= 1 and tracefs readable).

The CPU time of a request moves by 10-20% from run to run on a VM, and ``--instructions`` (callgrind) counts only
what runs in user space. These counts are the kernel's side, and they hardly move: a page fault or a map and unmap
costs microseconds on a VM (a 100 KB map, touch and unmap about 110 us here), and each is counted. The servers, the
model, the bodies and the clients are the overhead benchmark's (``bench.serving.overhead``): C keep-alive clients
after a warm-up, the count over the measured window divided by the requests answered in it.
"""
from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from bench.serving import overhead
from bench.serving.engine_only import GPU_BATCH_CEILING
from bench.serving.load import closed_loop
from bench.serving.tiny_work import padded_jpeg, tiny_weights
from bench.usage import engine_pids, process_tree_cpu
from harness.servers import Running

# The system calls counted (each a tracepoint, where the kernel has it); the rest of a request's calls are rarer
SYSCALLS = ("recvfrom", "sendto", "recvmsg", "sendmsg", "read", "write", "writev", "epoll_wait", "epoll_pwait",
            "epoll_ctl", "poll", "ppoll", "select", "futex", "ioctl", "fcntl", "accept4", "close", "openat",
            "newfstatat", "statx", "getpid", "getppid", "getrandom", "utimensat", "clock_gettime", "mmap", "munmap",
            "mremap", "madvise", "brk")
SOFTWARE = ("page-faults", "context-switches")
TRACEFS = Path("/sys/kernel/tracing/events/syscalls")
SHOWN_FROM = 0.01  # counts per request below this are left out of the table


def events() -> list[str]:
    """The events this kernel can count: the software ones, and each syscall of SYSCALLS it has a tracepoint for."""
    found = [f"syscalls:sys_enter_{name}" for name in SYSCALLS if (TRACEFS / f"sys_enter_{name}").is_dir()]
    return [*SOFTWARE, *found]


def usable() -> str | None:
    """Why ``perf`` cannot count here (None: it can)."""
    if shutil.which("perf") is None:
        return "perf is not installed (Debian: apt-get install linux-perf)"
    if len(events()) == len(SOFTWARE):  # what this benchmark is for: a kernel without tracefs mounted has none
        return f"the kernel's syscall tracepoints are not readable at {TRACEFS} (is tracefs mounted there?)"
    probe = subprocess.run(["perf", "stat", "-x,", "-e", ",".join(events()), "true"], capture_output=True, text=True)
    if probe.returncode != 0 or "<not supported>" in probe.stderr or "not counted" in probe.stderr:
        return f"perf cannot count these events here: {probe.stderr.strip()[-300:]}"
    return None


def count(pids: Sequence[int], out: Path) -> subprocess.Popen[bytes]:
    """``perf stat`` counting every event of ``events()`` in ``pids`` (their threads included) until interrupted."""
    return subprocess.Popen(["perf", "stat", "-x,", "-e", ",".join(events()), "-p", ",".join(map(str, pids)),
                             "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def counted(out: Path) -> dict[str, int]:
    """The counts ``perf stat -x,`` wrote, by event (the syscalls by their name alone)."""
    found = {}
    for line in out.read_text().splitlines():
        fields = line.split(",")
        if len(fields) > 2 and fields[0].strip().isdigit():
            found[fields[2].replace("syscalls:sys_enter_", "")] = int(fields[0])
    return found


def measure(running: Running, form: overhead.Form, concurrency: int, seconds: float,
            folder: Path) -> dict[str, object]:
    """One point: the clients warm the server up, then run ``seconds`` while perf counts its HTTP workers (every
    process but the master and the engines) and its engines apart; counts per answered request."""
    url, headers = running.url + form.path, dict(form.headers)
    closed_loop(url, form.bodies, max(concurrency, 8), 1.0, 0.0, headers=headers, method=form.method)
    tree = process_tree_cpu(running.process.pid)
    engines = engine_pids(tree)
    groups = {"http": [pid for pid in tree if pid not in engines and pid != running.process.pid], "engine": engines}
    counters = {name: count(pids, folder / f"{name}.txt") for name, pids in groups.items() if pids}
    time.sleep(0.3)  # perf attached
    _, errors, answered = closed_loop(url, form.bodies, concurrency, seconds, 0.0, headers=headers,
                                      method=form.method)
    for counter in counters.values():
        counter.send_signal(signal.SIGINT)
        counter.wait(10)
    answered = max(answered, 1)
    per_request = {name: {event: n / answered for event, n in counted(folder / f"{name}.txt").items()}
                   for name in counters}
    return {"form": form.name, "concurrency": concurrency, "answered": answered, "errors": errors, **per_request}


def table(points: list[dict[str, object]]) -> str:
    """Each server's points as rows: its processes' counts per request, largest first."""
    lines = ["| server | form | processes | per request (counts at least 0.01) |", "| --- | --- | --- | --- |"]
    for point in points:
        for group in ("http", "engine"):
            found = point.get(group)
            if not isinstance(found, dict):
                continue
            shown = sorted(((n, event) for event, n in found.items() if n >= SHOWN_FROM), reverse=True)
            lines.append(f"| {point['server']} | {point['form']} | {group} | "
                         + ", ".join(f"{event} {n:.2f}" for n, event in shown) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", nargs="+", default=["bare", "process"], choices=("bare", "process", "inline"))
    parser.add_argument("--checkout", type=Path, action="append", default=[],
                        help="another checkout whose process mode runs beside (repeatable)")
    parser.add_argument("--forms", nargs="+", default=["jpeg", "v2 x1", "multipart x1"])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=2, help="HTTP workers of every server")
    parser.add_argument("--out", type=Path, help="also write the report (Markdown) and the points (JSON) here")
    parser.add_argument("--smoke", action="store_true", help="half a second a point, C=4")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seconds, args.concurrency = 0.5, 4
    why_not = usable()
    if why_not is not None:
        print(why_not, file=sys.stderr)
        return 2
    every = overhead.forms([padded_jpeg(seed) for seed in range(8)])
    started = argparse.Namespace(device="cpu", workers=args.workers, max_batch_size=GPU_BATCH_CEILING,
                                 checkout=args.checkout, bare_wait_ms=0.0, servers=args.servers)
    points: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as folder:
        weights = tiny_weights(Path(folder) / "weights")
        for server, start in overhead.starters(started, weights, Path(folder)).items():
            running = start().wait_ready()
            try:
                for form in overhead.forms_for(server, every, args.forms):
                    point = {"server": server, **measure(running, form, args.concurrency, args.seconds, Path(folder))}
                    points.append(point)
                    print(json.dumps(point), flush=True)
            finally:
                running.stop()
    report = "\n".join([f"# What a request costs the kernel, {time.strftime('%Y-%m-%d %H:%M')}", "",
                        f"C={args.concurrency}, {args.seconds:g} s a point, {args.workers} HTTP workers; counted by "
                        "perf stat in each server's HTTP workers and engines apart, per answered request.", "",
                        table(points)])
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"{time.strftime('%Y-%m-%d')}-kernel-counts"
        stem.with_suffix(".md").write_text(report)
        stem.with_suffix(".json").write_text(json.dumps(points, indent=1))
    return 0 if all(point["errors"] == 0 for point in points) else 1


if __name__ == "__main__":
    raise SystemExit(main())
