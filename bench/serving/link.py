"""What the engine link costs: ENGINE=process on a small model with small JPEGs, so the figures are the serving path's
own (HTTP worker and engine CPU per request, read from /proc), not the decode's or the model's.

    .venv/bin/python -m bench.serving.link                        # this checkout
    .venv/bin/python -m bench.serving.link --checkout OTHER_DIR   # and another one (a worktree of an older
                                                                  # commit), alternating in the same run

Each round starts the server (2 HTTP workers, one engine), warms it up, then runs C client threads for a few
seconds posting one raw JPEG per request; it prints req/s, p50 and the CPU per request of the HTTP workers and of
the engine. Medians over the rounds; with two checkouts, their ratio.
"""
from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
from PIL import Image

from bench.serving.load import server_counters
from harness.faults import small_weights
from harness.servers import ROOT, free_port

_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _children(pid: int) -> dict[int, str]:
    pids = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return {p: Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode() for p in pids}


def _jpeg() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buffer, "JPEG")
    return buffer.getvalue()


def _start(checkout: Path, weights: Path | None, log: Path, device: str, workers: int
           ) -> tuple[subprocess.Popen[bytes], str]:
    """visionserve in process mode on ``weights``, or with no weights the bare Flask app (the budget's unit) under
    gunicorn with the same worker class and count."""
    port = free_port()
    env = {**os.environ, "VISIONSERVE_BIND": f"127.0.0.1:{port}",
           "VISIONSERVE_DEVICE": device, "VISIONSERVE_ENGINE": "process", "VISIONSERVE_WORKERS": str(workers),
           "VISIONSERVE_LOG_LEVEL": "warning", "VISIONSERVE_AUTO_BATCH_SIZE": "false",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    command = ["bin/serve"]
    if weights is None:
        # -c /dev/null: not the project's gunicorn.conf.py, which would start an engine beside the bare app
        command = [sys.executable, "-m", "gunicorn", "-c", "/dev/null", "-k", "app.hosting.worker.BufferingWorker",
                   "--threads", "16", "-w", str(workers), "-b", f"127.0.0.1:{port}", "--log-level", "warning",
                   "bench.serving.bare_app:app"]
    else:
        env["VISIONSERVE_WEIGHTS_DIR"] = str(weights)
    process = subprocess.Popen(command, cwd=checkout, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                               start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/readyz", timeout=2).status_code == 200:
                return process, url
        except requests.ConnectionError:
            pass
        assert process.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    raise RuntimeError("not ready: " + log.read_text()[-3000:])


def _load(url: str, body: bytes, clients: int, seconds: float) -> tuple[int, list[float], int]:
    latencies: list[float] = []
    errors = [0]
    stop = time.monotonic() + seconds

    def client() -> None:
        session = requests.Session()
        while time.monotonic() < stop:
            started = time.perf_counter()
            answer = session.post(f"{url}/predict", data=body, headers={"Content-Type": "image/jpeg"}, timeout=30)
            if answer.status_code == 200:
                latencies.append(time.perf_counter() - started)
            else:
                errors[0] += 1

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(latencies), latencies, errors[0]


def one_round(checkout: Path, weights: Path | None, args: argparse.Namespace) -> dict[str, float]:
    """One server start: req/s, p50 ms, HTTP worker and engine CPU microseconds per request."""
    clients, seconds = args.clients, args.seconds
    with tempfile.TemporaryDirectory() as logs:
        process, url = _start(checkout, weights, Path(logs) / "server.log", args.device, args.workers)
        try:
            body = _jpeg()
            _load(url, body, clients, 1.0)  # warm-up: every worker thread's connection to the engine
            children = _children(process.pid)
            engines = [p for p, command in children.items()
                       if weights and (".link.server" in command or ".engine.process" in command)]
            workers = [p for p in children if p not in engines]
            before = {p: _cpu_s(p) for p in children}
            stages_before = server_counters(url) if weights else {}
            started = time.perf_counter()
            count, latencies, errors = _load(url, body, clients, seconds)
            elapsed = time.perf_counter() - started
            stages = {k: v - stages_before.get(k, 0.0) for k, v in server_counters(url).items()} if weights else {}
            gone = [p for p in children if not Path(f"/proc/{p}/stat").exists()]
            if gone:  # a worker or engine that exited under load: said, with the server's log, not counted
                print(f"exited during the round: {[children[p] for p in gone]}\n"
                      f"{(Path(logs) / 'server.log').read_text()[-4000:]}", flush=True)
            spent = {p: _cpu_s(p) - before[p] for p in children if p not in gone}
        finally:
            process.terminate()
            process.wait(30)
    return {"req_s": count / elapsed, "p50_ms": statistics.median(latencies) * 1000, "errors": errors,
            "worker_us": sum(spent.get(p, 0.0) for p in workers) / count * 1e6,
            "engine_us": sum(spent.get(p, 0.0) for p in engines) / count * 1e6,
            # the engine's CPU less its decode and forward threads' (the stage counters): the serving overhead
            "engine_other_us": (sum(spent.get(p, 0.0) for p in engines)
                                - stages.get("stage_cpu_seconds_total:decode", 0.0)
                                - stages.get("stage_cpu_seconds_total:inference", 0.0)) / count * 1e6}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", type=Path, action="append", default=[],
                        help="another checkout to measure beside this one (repeatable)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="the engine's device (DEVICE): cpu, cuda")
    parser.add_argument("--workers", type=int, default=2, help="HTTP workers (WORKERS)")
    parser.add_argument("--bare", action="store_true",
                        help="also measure the bare Flask app (bench/serving/bare_app.py) each round: the budget's "
                        "unit")
    args = parser.parse_args(argv)
    checkouts = [ROOT, *args.checkout]
    runs: list[tuple[str, Path, bool]] = [(str(c), c, True) for c in checkouts]
    if args.bare:
        runs.append(("bare Flask app (the unit)", ROOT, False))
    with tempfile.TemporaryDirectory() as folder:
        weights = small_weights(Path(folder) / "weights")
        figures: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in runs}
        for _ in range(args.rounds):
            for label, checkout, served in runs:  # alternating: the machine's drift falls on all alike
                figures[label].append(one_round(checkout, weights if served else None, args))
    print(f"ENGINE=process on {args.device}, {args.workers} HTTP workers, {args.clients} clients, "
          f"{args.seconds:g} s x {args.rounds} rounds (medians); CPU per request from /proc")
    print(f"{'server':<40} {'req/s':>8} {'p50 ms':>8} {'worker us':>10} {'engine us':>10} {'other us':>9} "
          f"{'errors':>7}")
    medians = {}
    for label, rounds in figures.items():
        medians[label] = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        m = medians[label]
        print(f"{label[-40:]:<40} {m['req_s']:>8.1f} {m['p50_ms']:>8.1f} {m['worker_us']:>10.0f} "
              f"{m['engine_us']:>10.0f} {m['engine_other_us']:>9.0f} {m['errors']:>7.0f}")
    this = medians[str(ROOT)]
    for checkout in checkouts[1:]:
        ratio = {k: this[k] / medians[str(checkout)][k] for k in ("req_s", "worker_us", "engine_us")}
        print(f"this / {checkout.name}: req/s x{ratio['req_s']:.2f}, worker CPU x{ratio['worker_us']:.2f}, "
              f"engine CPU x{ratio['engine_us']:.2f}")
    if args.bare:
        unit = medians["bare Flask app (the unit)"]["worker_us"]
        print(f"in bare-Flask requests ({unit:.0f} us of worker CPU each): HTTP worker "
              f"{this['worker_us'] / unit:.2f} per request (budget 1.5), engine {this['engine_us'] / unit:.3f} per "
              f"image, of which not decode or forward {this['engine_other_us'] / unit:.3f} (budget 0.1)")


if __name__ == "__main__":
    main()
