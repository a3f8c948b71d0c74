"""A storm of short deadlines: what a refusal costs the server against an answer (issue #50, item 3: "a refused
request costs a small fraction of an answered one's CPU").

    .venv/bin/python -m bench.serving.storm                                  # Lite0, process mode, memory on and off
    .venv/bin/python -m bench.serving.storm --engines process inline --rounds 2 --out bench/results/storm

Each server start (an engine layout and a ``REFUSAL_MEMORY_MS``, alternated ``--rounds`` times) is warmed, then
measured twice with hey (a Debian package), its CPU read from /proc for the HTTP workers and the engine apart:
- answered: ``--base-concurrency`` clients without a deadline (every answer a 200): the HTTP side's and the engine's
  CPU an answered request;
- the storm: ``--concurrency`` clients, each at most ``--qps`` requests a second (an offered load, not a closed
  loop: a client that retries at once takes the CPU the refusals free, on a host the server shares with it), each
  request with ``X-Request-Timeout: --deadline-ms``: answers by status, the photos answered a second, and the HTTP
  side's CPU a refusal (its CPU less the storm's 200s and 504s at the answered CPU, over the 429s).
A refusal is then said as a share of an answered request's CPU (its HTTP side and its engine). Writes
``storm.md`` and ``storm.json`` into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.serving.overload import weights_for
from bench.usage import engine_pids, process_tree_cpu
from harness.photos import imagenet_workload, request_bodies
from harness.servers import Running, visionserve

STATUS_LINE = re.compile(r"\[(\d{3})\]\s+(\d+) responses")


def hey_statuses(output: str) -> dict[int, int]:
    """hey's "Status code distribution" as status -> count."""
    return {int(status): int(count) for status, count in STATUS_LINE.findall(output)}


def cpu_split(before: dict, after: dict, master: int) -> tuple[float, float]:
    """CPU seconds between two ``process_tree_cpu`` readings: the HTTP workers' and the engines' (the master's
    left out: it serves no request)."""
    engines = set(engine_pids(after))
    spent = {pid: cpu - before[pid][1] for pid, (_, cpu) in after.items() if pid in before and pid != master}
    return (sum(v for pid, v in spent.items() if pid not in engines),
            sum(v for pid, v in spent.items() if pid in engines))


def refusal_share(answered: dict[str, float], storm: dict[str, float]) -> dict[str, float]:
    """The HTTP side's CPU a refusal of the storm (its CPU less its 200s and 504s at the answered CPU each, over its
    429s) and that as a share of an answered request's CPU (HTTP side and engine)."""
    http_each = answered["http_cpu_s"] / answered["requests"]
    whole_each = (answered["http_cpu_s"] + answered["engine_cpu_s"]) / answered["requests"]
    refusals = storm["refused"]
    others = storm["answered"] + storm["late"]
    per_refusal = max(0.0, storm["http_cpu_s"] - others * http_each) / refusals if refusals else float("nan")
    return {"http_us_answered": http_each * 1e6, "whole_us_answered": whole_each * 1e6,
            "http_us_refusal": per_refusal * 1e6, "refusal_of_answered": per_refusal / whole_each}


def _hey(url: str, body: Path, seconds: float, concurrency: int, qps: float = 0.0,
         deadline_ms: int | None = None) -> tuple[dict[int, int], float]:
    command = ["hey", "-z", f"{seconds}s", "-c", str(concurrency), "-m", "POST", "-T", "image/jpeg", "-D", str(body)]
    if qps:
        command += ["-q", f"{qps:g}"]
    if deadline_ms is not None:
        command += ["-H", f"X-Request-Timeout: {deadline_ms}"]
    started = time.monotonic()
    done = subprocess.run([*command, url + "/predict"], capture_output=True, text=True, check=True)
    return hey_statuses(done.stdout), time.monotonic() - started


def measure(server: Running, body: Path, args: argparse.Namespace) -> dict[str, object]:
    master = server.process.pid
    _hey(server.url, body, args.warmup, args.base_concurrency)
    before = process_tree_cpu(master)
    statuses, _ = _hey(server.url, body, args.seconds, args.base_concurrency)
    http, engine = cpu_split(before, process_tree_cpu(master), master)
    answered = {"requests": sum(statuses.values()), "http_cpu_s": http, "engine_cpu_s": engine}
    before = process_tree_cpu(master)
    statuses, wall = _hey(server.url, body, args.seconds, args.concurrency, args.qps, args.deadline_ms)
    http, engine = cpu_split(before, process_tree_cpu(master), master)
    storm = {"answered": statuses.get(200, 0), "refused": statuses.get(429, 0), "late": statuses.get(504, 0),
             "other": sum(n for s, n in statuses.items() if s not in (200, 429, 504)),
             "http_cpu_s": http, "engine_cpu_s": engine, "wall_s": wall}
    return {"answered": answered, "storm": storm, "photos_s": storm["answered"] / wall,
            **refusal_share(answered, storm)}


def _table(rows: list[dict[str, object]]) -> str:
    lines = ["| engine | REFUSAL_MEMORY_MS | round | 200 | 429 | 504 | photos/s answered | HTTP cores | engine cores "
             "| HTTP us an answer | HTTP us a refusal | a refusal, of an answer's CPU |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        storm = row["storm"]
        lines.append(f"| {row['engine']} | {row['memory_ms']} | {row['round']} | {storm['answered']} | "
                     f"{storm['refused']} | {storm['late']} | {row['photos_s']:.1f} | "
                     f"{storm['http_cpu_s'] / storm['wall_s']:.2f} | {storm['engine_cpu_s'] / storm['wall_s']:.2f} | "
                     f"{row['http_us_answered']:.0f} | {row['http_us_refusal']:.0f} | "
                     f"{row['refusal_of_answered']:.3f} |")
    return "\n".join(lines)


def _medians(rows: list[dict[str, object]]) -> str:
    said = []
    for engine in dict.fromkeys(row["engine"] for row in rows):
        for memory in dict.fromkeys(row["memory_ms"] for row in rows):
            taken = [row for row in rows if row["engine"] == engine and row["memory_ms"] == memory]
            said.append(f"- {engine}, REFUSAL_MEMORY_MS={memory}: medians of {len(taken)} round(s): "
                        f"{statistics.median(r['photos_s'] for r in taken):.1f} photos/s answered, "
                        f"{statistics.median(r['storm']['refused'] for r in taken):.0f} refusals, "
                        f"{statistics.median(r['http_us_refusal'] for r in taken):.0f} us of HTTP CPU a refusal "
                        f"({statistics.median(r['refusal_of_answered'] for r in taken):.3f} of an answered request's)")
    return "\n".join(said)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="efficientnet_lite0", choices=("efficientnet_lite0", "small"))
    parser.add_argument("--engines", nargs="+", default=["process"], choices=("inline", "process"))
    parser.add_argument("--memory-ms", nargs="+", default=["100", "0"], help="REFUSAL_MEMORY_MS, a start each")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--qps", type=float, default=10.0, help="each storm client's most requests a second")
    parser.add_argument("--deadline-ms", type=int, default=500)
    parser.add_argument("--base-concurrency", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("bench/results/storm"))
    args = parser.parse_args(argv)
    if shutil.which("hey") is None:
        raise SystemExit("hey is missing: apt-get install -y hey")
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as folder:
        weights = weights_for(args.model, Path(folder))
        body = Path(folder) / "photo.jpg"
        body.write_bytes(request_bodies(imagenet_workload(), 1)[0][0])
        for round_ in range(1, args.rounds + 1):
            for engine in args.engines:
                for memory in args.memory_ms:
                    server = visionserve(weights, Path(folder), engine=engine, refusal_memory_ms=memory).wait_ready()
                    try:
                        row = {"engine": engine, "memory_ms": memory, "round": round_, **measure(server, body, args)}
                    finally:
                        server.stop()
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    (args.out / "storm.json").write_text(json.dumps(rows, indent=1))
    text = (f"# A storm of {args.deadline_ms} ms deadlines: {args.concurrency} clients at most {args.qps:g} requests "
            f"a second each, {args.seconds:g} s; answered: {args.base_concurrency} clients without a deadline\n\n"
            f"{_table(rows)}\n\n{_medians(rows)}\n")
    (args.out / "storm.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
