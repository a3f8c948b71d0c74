"""Where the engine process's time goes under load (issue #50): ``engine_only``'s engine and client, with py-spy
sampling the engine meanwhile, twice: the thread holding the interpreter lock (``gil``: what bounds one engine,
whose Python runs under one lock), then every thread on a CPU (``cpu``: waits for a device that spin, and C++ that
runs without the lock, included, each as its Python caller's own time). Each is summarised by function: the share
of the samples in which it is on the stack (inclusive) and at the top (self). On a GPU host the engine is what
bounds process mode (the drill of 11-29: its time per image beyond the forward pass 4x its floor's there, 2x on a
CPU), and this is where the difference is. The engine lets a profiler beside it read it (``engine_only``'s
``allow_profilers``: Yama's ptrace_scope 1 allows only ancestors); where py-spy is refused all the same (a container
without CAP_SYS_PTRACE), the step fails saying py-spy's reason.

    .venv/bin/python -m bench.serving.engine_profile --forms "v2 x1"            # py-spy from requirements-dev.txt
    python3 -m bench.serving.engine_profile --device cuda --out FOLDER          # on a GPU host (the drill runs it)

py-spy reads the engine's memory from outside (ptrace), without stopping it (``--nonblocking``), at ``--rate``
samples a second. Writes ``engine-profile-<device>.md`` (the summaries) and each sampling's raw stacks
(``engine-profile-<device>-<form>-<kind>.txt``, py-spy's collapsed format) into ``--out``.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from bench.serving import engine_only
from bench.serving.forward_launch import WORK
from harness.servers import ROOT

# py-spy's flags for each sampling, neither stopping the engine. Not --native: py-spy reads native frames only with
# the thread stopped, and then counts threads waiting on a lock as running (measured: 42% of the samples); a C++
# call's time shows as its Python caller's own.
KINDS = {"gil": ("--gil", "--nonblocking"), "cpu": ("--nonblocking",)}
WARM_UP_S = 1.0  # of load before the first sampling


def py_spy() -> str:
    """py-spy's path: beside this interpreter (a virtual environment's bin/), else on PATH."""
    found = Path(sys.executable).with_name("py-spy")
    path = str(found) if found.exists() else shutil.which("py-spy")
    if path is None:
        raise SystemExit("py-spy not found: pip install -r requirements-dev.txt (on a lent GPU machine: the wheels, "
                         "bench/gpu_wheels.sh)")
    return path


def sample(form: str, concurrency: int, seconds: float, device: str, rate: int, raw_stem: Path,
           clients: str = "loop") -> dict:
    """The engine under ``form`` at ``concurrency`` (engine_only's ``clients``: its client loop, or "messages": several
    requests a message on two connections, as HTTP workers' loop links send them), sampled ``seconds`` for each kind;
    the raw stacks written beside ``raw_stem``. Returns the load point engine_only measured over the whole run."""
    from bench.serving.tiny_work import TINY_WEIGHTS, tiny_weights

    weights, spy = tiny_weights(TINY_WEIGHTS), py_spy()
    record_s = max(1, math.ceil(seconds))
    load_s = WARM_UP_S + len(KINDS) * (record_s + 1) + 1  # py-spy's own start in each, and a second to spare
    with engine_only._engine(ROOT, ["--serve", str(ROOT), str(weights)], device) as (engine, sock, env):
        client = subprocess.Popen([sys.executable, "-m", "bench.serving.engine_only", "--drive", str(ROOT), str(sock),
                                   form, str(concurrency), str(load_s), str(engine.pid), clients,
                                   str(engine_only.LINKS)],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        try:
            time.sleep(WARM_UP_S)
            for kind, flags in KINDS.items():
                spied = subprocess.run([spy, "record", "-d", str(record_s), "-r", str(rate), "-f", "raw", *flags,
                                        "-o", str(raw_file(raw_stem, kind)), "-p", str(engine.pid)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                if spied.returncode:  # say why (on a host whose ptrace rules refuse it: its permission error)
                    raise RuntimeError(f"py-spy could not sample the engine ({spied.returncode}): "
                                       f"{spied.stderr.strip()[-2000:]}")
            out, _ = client.communicate()
        finally:
            if client.poll() is None:
                client.kill()
                client.wait()
    if client.returncode:
        raise RuntimeError(f"the client of {form} ended with {client.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def raw_file(stem: Path, kind: str) -> Path:
    return stem.with_name(f"{stem.name}-{kind}.txt")


def summarise(raw: str, top: int) -> tuple[int, list[tuple[str, float]], list[tuple[str, float]]]:
    """py-spy's collapsed stacks (``frame;frame;... count``, outermost first) -> (samples, the ``top`` functions by
    inclusive share, by self share); a function is named with its file, not its line."""
    inclusive: collections.Counter[str] = collections.Counter()
    itself: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples = int(count)
        total += samples
        frames = [_function(frame) for frame in stack.split(";")]
        for name in set(frames):
            inclusive[name] += samples
        itself[frames[-1]] += samples
    if not total:
        return 0, [], []
    most = max(inclusive.values())
    entry = {name for name, n in inclusive.items() if n == most}  # the busiest thread's entry: on all of its stacks
    shown = [(name, n / total) for name, n in inclusive.most_common(top + len(entry)) if name not in entry]
    return total, shown[:top], [(name, n / total) for name, n in itself.most_common(top)]


def _function(frame: str) -> str:
    """``name (path/to/file.py:123)`` -> ``name (file.py)``: the file's name alone, without the line."""
    return re.sub(r" \((?:[^()]*/)?([^/():]+?)(?::\d+)?\)$", r" (\1)", frame)


def report(points: dict[str, dict], summaries: dict[tuple[str, str], tuple], device: str, seconds: float,
           concurrency: int, clients: str = "one client loop") -> str:
    """The load points and each sampling's summary as markdown."""
    lines = [f"# The engine's profile under load: {device}, C={concurrency} ({clients}), {seconds:g} s of "
             "samples each", "",
             "gil: the thread holding the interpreter lock; cpu: every thread on a CPU. Shares of the samples: "
             "inclusive (on the stack; the busiest thread's entry, the functions on as many stacks as the most, "
             "left out) and self (at the top).", ""]
    for form, point in points.items():
        lines += [f"## {form}: {point['requests_per_s']:.0f} req/s, mean batch {point['mean_batch']:.1f}, engine "
                  f"{point['engine_us_per_image']:.0f} us per image (forward {point['forward_us_per_image']:.0f}, "
                  f"beyond decode and forward {point['beyond_us_per_image']:.0f}), {point['errors']} errors", ""]
        for kind in KINDS:
            total, inclusive, itself = summaries[(form, kind)]
            lines += [f"### {kind}: {total} samples", "", "| inclusive | function | self | function |",
                      "| --- | --- | --- | --- |"]
            for index in range(max(len(inclusive), len(itself))):
                left = inclusive[index] if index < len(inclusive) else ("", 0.0)
                right = itself[index] if index < len(itself) else ("", 0.0)
                lines.append(f"| {left[1]:.1%} | {left[0]} | {right[1]:.1%} | {right[0]} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forms", nargs="+", default=["v2 x1", "jpeg"], choices=list(engine_only.FORMS))
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=3.0, help="of samples, for each kind (whole seconds)")
    parser.add_argument("--rate", type=int, default=500, help="py-spy's samples a second")
    parser.add_argument("--top", type=int, default=30, help="functions in each summary")
    parser.add_argument("--device", default="cpu", help="the engine's DEVICE")
    parser.add_argument("--clients", choices=["loop", "messages"], default="loop",
                        help="engine_only's clients: one loop, a request a message on a connection each; messages: "
                             "several a message on two connections, photos in shared memory, as served")
    parser.add_argument("--out", type=Path, default=WORK / "engine-profile")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    points: dict[str, dict] = {}
    summaries: dict[tuple[str, str], tuple] = {}
    for form in args.forms:
        stem = args.out / f"engine-profile-{args.device}-{form.replace(' ', '')}"
        points[form] = sample(form, args.concurrency, args.seconds, args.device, args.rate, stem, args.clients)
        for kind in KINDS:
            summaries[(form, kind)] = summarise(raw_file(stem, kind).read_text(), args.top)
        # after each form: a run stopped at its limit keeps the forms it finished
        text = report(points, summaries, args.device, max(1, math.ceil(args.seconds)), args.concurrency,
                      engine_only.CLIENTS[args.clients].format(links=engine_only.LINKS))
        (args.out / f"engine-profile-{args.device}.md").write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
