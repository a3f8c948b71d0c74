"""What serving costs beyond decode and forward (issue #50): the product's own paths on a model and bodies that cost
next to nothing, so every figure is the serving path's own, in the budget's unit measured in the same run.

    .venv/bin/python -m bench.serving.overhead                     # inline, process, the unit and the peers
    .venv/bin/python -m bench.serving.overhead --smoke             # the same, tiny (the suite runs it)
    .venv/bin/python -m bench.serving.overhead --servers process --checkout ../before   # A/B: another checkout
    python3 -m bench.serving.overhead --device cuda --servers process inline bare       # on a GPU host (the drill)

What runs: a one-layer model on 8x8 inputs with 1,000 classes (an ImageNet model's answer and labels), exported with
``models.export`` (TorchScript, its default format), so a forward pass takes microseconds; ~100 KB JPEG bodies of
an 8x8 photo padded with comment segments, so the decode takes microseconds and the body's size is a real photo's;
and V2 binary tensors (FP32 pixels: no decode at all).
Each server (visionserve inline, visionserve with the engine process, the bare Flask app that is the unit, and the
peers: the naive Flask app and LitServe, on the same model and bodies) is started once a round (the unit's through
it); each point runs C keep-alive clients after a warm-up. CPU is read from /proc for every process of the server:
the engine's (process mode) apart from the rest (the HTTP workers and the master). visionserve batches as on a GPU
host, the host the budget is written for: MAX_BATCH_SIZE 32, its automatic value there (``--max-batch-size``; 0
leaves it to the device: 8 on a CPU, where a 16-image request is two forward passes, each with its own steps).

The unit, **one bare-Flask request**, is the bare app's CPU per request with the same one-image body and the same
client, at the same C, read just before each server starts and just after it stops (the bare app runs through the
round): each of a server's points is in the mean of the two readings at its C, each round's in its own, so a slow
spell of the machine weighs on a figure and its unit alike. The budget (issue #50): HTTP worker <= 1.5 units per
one-image request; engine <= 0.1 unit per image at one image per request, <= 0.04 at 16, for everything but decode
and the forward pass: the engine's figure in units is its CPU less its decoding's and its forward passes' (their CPU
as visionserve's /metrics counts it, read around each point; the table shows all three); the budget is checked at
each C measured. ``bare-wait`` is the same bare app sleeping before it answers: what the unit's request costs when
it waits, as every request in process mode waits for its engine; ``bare-gevent`` and ``bare-gevent-wait`` the same
two under gunicorn's gevent worker (gevent installed by hand): what the wait costs a worker class without a thread
hand-off (docs/performance.md).
``--floor`` adds, for the V2 forms, the engine process alone (``bench.serving.engine_only --clients messages``: the
requests on two connections, several a message, as two HTTP workers' loop links send them) and its floor (a loop
with the same wire, model and answers, nothing else), their CPU beyond the forward pass in the same run's unit (the
median of its readings: the floor runs after a round's unit is read): what the engine's budget leaves beyond the
least a Python engine on this wire spends. Each runs at the headline C, and again with as many clients as process
mode's mean batch there (the table's "mean batch": behind two HTTP workers on two cores the engine runs smaller
batches than its own clients give it, and a batch's steps are shared by fewer images): the floor at the batches the
served engine ran.
"""
from __future__ import annotations

import argparse
import base64
import collections
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from bench.serving import engine_only
from bench.serving.load import closed_loop, percentile, server_counters
from bench.serving.tiny_work import BODY_BYTES, CLASSES, INPUT, MODEL, padded_jpeg, tiny_weights
from bench.usage import process_tree_cpu, tree_cpu_spent
from harness.photos import multipart
from harness.servers import ROOT, Running, free_port, visionserve

RAMP_S = 0.5  # the measured call's clients run this long before its window
UNIT_REWARM_S = 0.5  # the warm-up of the unit's later readings: its server answered the first reading's already
BUDGET = {"http": 1.5, "engine_1": 0.1, "engine_16": 0.04}
DECODE, FORWARD = "stage_cpu_seconds_total:decode", "stage_cpu_seconds_total:forward"  # as /metrics counts them


@dataclass(frozen=True)
class Form:
    """A request form: its name, images per request, path, bodies and headers."""

    name: str
    images: int
    path: str
    bodies: tuple[bytes, ...]
    headers: tuple[tuple[str, str], ...]
    method: str = "POST"


def forms(photos: Sequence[bytes]) -> dict[str, Form]:
    """Every form the benchmark sends, by name: raw JPEG, multipart (1 and 16 images), V2 binary tensors (1 and
    16), the model listing (a GET), and the peers' tutorial JSON (``{"image": "<base64>"}``, what LitServe's app
    reads)."""
    boundary = "visionservebench"
    multipart_type = (("Content-Type", f"multipart/form-data; boundary={boundary}"),)

    def grouped(count: int) -> tuple[bytes, ...]:
        return tuple(multipart([photos[(start + i) % len(photos)] for i in range(count)])
                     for start in range(len(photos)))

    def v2(count: int) -> Form:
        bodies, header_sizes = [], set()
        for start in range(len(photos)):
            pixels = np.random.default_rng(start).standard_normal((count, *INPUT)).astype(np.float32).tobytes()
            header = json.dumps({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [count, *INPUT],
                                             "parameters": {"binary_data_size": len(pixels)}}],
                                 "outputs": [{"name": "probabilities", "parameters": {"classification": 1}}]}
                                ).encode()
            bodies.append(header + pixels)
            header_sizes.add(len(header))
        (header_size,) = header_sizes  # one header length for every body: the header says where the JSON ends
        return Form(f"v2 x{count}", count, f"/v2/models/{MODEL}/infer", tuple(bodies),
                    (("Content-Type", "application/octet-stream"),
                     ("Inference-Header-Content-Length", str(header_size))))

    every = [Form("jpeg", 1, "/predict", tuple(photos), (("Content-Type", "image/jpeg"),)),
             Form("multipart x1", 1, "/predict", grouped(1), multipart_type),
             Form("multipart x16", 16, "/predict", grouped(16), multipart_type),
             v2(1), v2(16), Form("/v1/models", 0, "/v1/models", (b"",), (), method="GET"),
             Form("json", 1, "/predict", tuple(json.dumps({"image": base64.b64encode(p).decode()}).encode()
                                               for p in photos), (("Content-Type", "application/json"),))]
    return {form.name: form for form in every}


GEVENT_WORKER = ("-k", "gevent", "--worker-connections", "1000")  # gunicorn's greenlet worker (gevent by hand)


def bare_app(log_dir: Path, workers: int, threads: int, cwd: Path = ROOT, wait_ms: float = 0.0,
             gevent: bool = False) -> Running:
    """The unit: bench/serving/bare_app.py under gunicorn with visionserve's worker class, workers and threads
    (``-c /dev/null``: not the project's gunicorn.conf.py, which would start an engine beside it); ``wait_ms``: its
    route sleeps that long before it answers (``bare-wait``); ``gevent``: gunicorn's gevent worker instead, a
    greenlet per connection (``bare-gevent``: what another worker class would cost; gevent must be installed)."""
    port = free_port()
    worker = (list(GEVENT_WORKER) if gevent else
              ["-k", "app.hosting.worker.BufferingWorker", "--threads", str(threads)])
    command = [sys.executable, "-m", "gunicorn", "-c", "/dev/null", *worker, "-w", str(workers),
               "-b", f"127.0.0.1:{port}", "--log-level", "warning", "bench.serving.bare_app:app"]
    # cwd before what PYTHONPATH already holds (on a lent GPU machine: the carried wheels, gunicorn among them)
    path = os.pathsep.join(filter(None, (str(cwd), os.environ.get("PYTHONPATH"))))
    # a name (its log's) of each kind's own: the unit's bare app runs beside the others (``_round``)
    name = "bare-flask" + ("-gevent" if gevent else "") + ("-wait" if wait_ms else "")
    return Running(name, command, {"PYTHONPATH": path, "BARE_WAIT_MS": str(wait_ms)}, port, "/readyz", log_dir)


@dataclass
class Point:
    """One server, one form, one concurrency."""

    server: str
    form: str
    images: int
    concurrency: int
    req_s: float
    img_s: float
    p50_ms: float
    p99_ms: float
    errors: int
    http_us: float  # CPU per request of the HTTP side (workers and master)
    engine_us: float | None  # CPU per image (per request for a listing) of the engine process(es); None without one
    decode_us: float | None = None  # of which its decoding (visionserve's /metrics; None where not told)
    forward_us: float | None = None  # of which its forward passes (the same)
    mean_batch: float | None = None  # images per forward pass (visionserve's /metrics)
    http_units: float | None = None
    engine_units: float | None = None  # the engine beyond its decoding and forward passes: what the budget counts
    unit_us: float | None = None  # the unit its figures are in: the bare app's readings around its server's points


def measure(server: str, running: Running, form: Form, concurrency: int, seconds: float, warmup: float) -> Point:
    """A warm-up, then the measured run with the server's CPU read before and after."""
    url, headers = running.url + form.path, dict(form.headers)
    # warm-up: enough clients that every worker has answered (a worker's first answer of a kind is slow)
    closed_loop(url, form.bodies, max(concurrency, 8), warmup, 0.0, headers=headers, method=form.method)
    counted = server_counters(running.url)  # visionserve's own: its decoding's and forward passes' CPU (outside
    # the CPU read)
    before = process_tree_cpu(running.process.pid)
    statuses: collections.Counter[int] = collections.Counter()
    # the clients ramp again inside the measured call (half a second: these requests take milliseconds), so its
    # window counts the steady state (load.closed_loop); the CPU read spans the whole call and all its answers
    latencies, errors, answered = closed_loop(url, form.bodies, concurrency, seconds, min(warmup, RAMP_S),
                                              headers=headers, method=form.method, statuses=statuses)
    after = process_tree_cpu(running.process.pid)
    now = server_counters(running.url)
    decode_s, forward_s = (now.get(key, 0.0) - counted.get(key, 0.0) for key in (DECODE, FORWARD))
    batches, batched = (now.get(key, 0.0) - counted.get(key, 0.0) for key in ("batch_size_count", "batch_size_sum"))
    if before.keys() != after.keys():  # a worker replaced or an engine restarted: its CPU is in neither reading
        raise RuntimeError(f"{server}, {form.name} at C={concurrency}: the server's processes changed during the "
                           f"measured run (ended {sorted(before.keys() - after.keys())}, started "
                           f"{sorted(after.keys() - before.keys())}): its CPU per request cannot be told; its log: "
                           f"{running.output()[-2000:]}")
    server_s, engine_s = tree_cpu_spent(before, after)
    http_s = server_s - (engine_s or 0.0)
    answered = max(answered, 1)
    per_image = 1e6 / (answered * max(form.images, 1))
    ms = sorted(x * 1000 for x in latencies)
    return Point(server, form.name, form.images, concurrency, len(latencies) / seconds,
                 len(latencies) * form.images / seconds, percentile(ms, 50), percentile(ms, 99), errors,
                 http_s / answered * 1e6, None if engine_s is None else engine_s * per_image,
                 decode_s * per_image if FORWARD in counted else None,
                 forward_s * per_image if FORWARD in counted else None, batched / batches if batches else None)


def in_unit(point: Point, unit_us: float) -> None:
    """``point``'s CPU in bare-Flask requests of ``unit_us`` each: its HTTP side's, and its engine's beyond decode and
    forward (unknown, None, where the forward pass is not counted: another checkout's engine; not its whole CPU)."""
    point.unit_us = unit_us
    point.http_units = point.http_us / unit_us
    point.engine_units = (None if point.engine_us is None or point.forward_us is None
                          else (point.engine_us - (point.decode_us or 0.0) - point.forward_us) / unit_us)


def bracket(block: list[Point], before: dict[int, Point], after: dict[int, Point]) -> None:
    """A server's points of one round in the unit read just before its server started and just after it stopped,
    at the same C (the mean of the two readings): a slow spell of the machine then weighs on a figure and its unit
    alike, as it did not with one reading of the unit a round (2026-12-04: the bare app's request 651 us at C=64 at
    a run's start, 872 us at its third round's). A point with no reading at its C on either side has no units."""
    for point in block:
        readings = [found[point.concurrency].http_us for found in (before, after) if point.concurrency in found]
        if len(readings) == 2:
            in_unit(point, statistics.mean(readings))


def unit_by_c(points: list[Point]) -> dict[int, list[float]]:
    """Every reading of the unit (the bare app's HTTP CPU per one-image JPEG request) by C, in the order taken."""
    unit: dict[int, list[float]] = collections.defaultdict(list)
    for p in points:
        if p.server == "bare" and p.form == "jpeg":
            unit[p.concurrency].append(p.http_us)
    return dict(unit)


def table(points: list[Point]) -> str:
    lines = ["| server | form | C | req/s | img/s | mean batch | p50 ms | p99 ms | errors | HTTP us / request | "
             "engine us / image | of which decode | of which forward | HTTP in units | engine beyond decode and "
             "forward, in units |", "|" + " --- |" * 15]
    for p in points:
        lines.append(f"| {p.server} | {p.form} | {p.concurrency} | {p.req_s:.0f} | {p.img_s:.0f} | "
                     f"{'-' if p.mean_batch is None else f'{p.mean_batch:.1f}'} | {p.p50_ms:.1f} | "
                     f"{p.p99_ms:.1f} | {p.errors} | {p.http_us:.0f} | "
                     f"{'-' if p.engine_us is None else f'{p.engine_us:.0f}'} | "
                     f"{'-' if p.decode_us is None or p.engine_us is None else f'{p.decode_us:.0f}'} | "
                     f"{'-' if p.forward_us is None or p.engine_us is None else f'{p.forward_us:.0f}'} | "
                     f"{'-' if p.http_units is None else f'{p.http_units:.2f}'} | "
                     f"{'-' if p.engine_units is None else f'{p.engine_units:.3f}'} |")
    return "\n".join(lines)


def verdict(points: list[Point], headline_c: int) -> list[str]:
    """The budget's checks at ``headline_c``, and what the figures imply for a host (docs/performance.md)."""
    lines = []
    at = {(p.server, p.form): p for p in points if p.concurrency == headline_c}
    for server in ("process", "inline"):
        for form, budget_key, what in (("jpeg", "http", "HTTP side per one-image request (raw)"),
                                       ("multipart x1", "http", "HTTP side per one-image request (multipart)"),
                                       ("jpeg", "engine_1", "engine per image beyond decode and forward, 1 per "
                                        "request"),
                                       ("multipart x16", "engine_16", "engine per image beyond decode and forward, "
                                        "16 per request"),
                                       ("v2 x1", "engine_1", "engine per image beyond forward, V2 tensors, 1 per "
                                        "request"),
                                       ("v2 x16", "engine_16", "engine per image beyond forward, V2 tensors, 16 per "
                                        "request")):
            p = at.get((server, form))
            figure = None if p is None else (p.http_units if budget_key == "http" else p.engine_units)
            if figure is None:
                continue
            held = "within" if figure <= BUDGET[budget_key] else "OVER"
            lines.append(f"{server}: {what}: {figure:.3f} units, budget {BUDGET[budget_key]} ({held})")
    listing = {server: at.get((server, "/v1/models")) for server in ("process", "inline")}
    if all(listing.values()):
        lines.append(f"/v1/models: process {listing['process'].req_s:.0f} req/s, inline {listing['inline'].req_s:.0f} "
                     f"req/s: inline / process = {listing['inline'].req_s / listing['process'].req_s:.2f} (bar <= 1.5)")
    for server in ("process", "inline"):
        p = at.get((server, "jpeg"))
        if p is not None and p.http_units is not None:
            engine = (f"; one engine: {1e6 / p.engine_us:.0f} img/s on this host"
                      if p.engine_us else "")
            lines.append(f"{server}, one image per request: one core of HTTP workers carries "
                         f"{1e6 / p.http_us:.0f} req/s on this host{engine}")
    return lines


def verdicts(points: list[Point], concurrencies: Sequence[int]) -> list[str]:
    """``verdict`` at each concurrency measured, lowest first: the budget holds or not at each (a GPU host at its
    rate has many requests in flight: docs/performance.md)."""
    lines = []
    for concurrency in sorted(set(concurrencies)):
        found = verdict(points, concurrency)
        if found:
            lines += [f"At C={concurrency}:", *(f"- {line}" for line in found), ""]
    return lines


ENGINE_ALONE = ("engine alone", "floor")  # --floor's engines: this one without HTTP, and the floor
AT_HEADLINE, AT_SERVED = "at the headline C", "at the served batches"  # --floor's client counts


def alone_clients(served: Point | None, headline: int) -> dict[str, int]:
    """``--floor``'s requests in flight for a V2 form: the headline C, and as many as process mode's mean batch at that C
    in the served run (``served``) holds requests, rounded, when that differs: the engine alone and its floor then run
    about the batches the engine ran behind HTTP workers, where the headline's clients give them larger ones."""
    clients = {AT_HEADLINE: headline}
    if served is not None and served.mean_batch is not None:
        at_served = max(1, round(served.mean_batch / max(served.images, 1)))
        if at_served != headline:
            clients[AT_SERVED] = at_served
    return clients


def at_batch(run: Callable[[int], dict], clients: int, batch: float | None, most: int) -> dict:
    """``run`` with ``clients`` requests in flight; with a ``batch`` to reach, again with twice as many (``most`` at
    most) while its mean batch stays below nine tenths of it: an engine that does not wait for more requests (the
    floor) runs smaller batches than its clients, and is set beside the served engine at the batches that engine ran,
    not at fewer."""
    found = run(clients)
    while batch is not None and clients < most and (found["mean_batch"] or 0.0) < 0.9 * batch:
        clients = min(most, 2 * clients)
        found = run(clients)
    return found


def alone_table(alone: dict[tuple[str, str, str], list[dict]], unit_us: float | None, concurrency: int) -> list[str]:
    """``--floor``'s section: the engine alone and its floor per V2 form and client count (medians over the rounds,
    with the batches they ran), their CPU beyond the forward pass in this run's unit, against the engine's budget."""
    lines = [f"## The engine alone and its floor (no HTTP, sent as two loop links send: C={concurrency}, and as "
             "many as visionserve's mean batch in the served run)", "",
             "| engine | form | clients | mean batch | req/s | engine us / image | of which forward | beyond forward, "
             "us / image | beyond forward, in units | budget | errors |", "|" + " --- |" * 11]
    for (kind, form_name, _), found in alone.items():
        figures = [engine_only.median_of(found, "concurrency"), engine_only.median_of(found, "mean_batch", 1),
                   *(engine_only.median_of(found, key) for key in ("requests_per_s", "engine_us_per_image",
                                                                   "forward_us_per_image", "beyond_us_per_image"))]
        budget = BUDGET["engine_16" if form_name.endswith("x16") else "engine_1"]
        beyond = [p["beyond_us_per_image"] for p in found]
        units = (f"{statistics.median(beyond) / unit_us:.3f}" if unit_us and None not in beyond else "-")
        lines.append(f"| {kind} | {form_name} | " + " | ".join(figures) +
                     f" | {units} | {budget} | {sum(p['errors'] for p in found)} |")
    return [*lines, ""]


Start = Callable[[], Running]


def starters(args: argparse.Namespace, weights: Path, logs: Path) -> dict[str, Start]:
    """How each server named in ``--servers`` (and each ``--checkout``'s process mode) starts."""
    # warmed up on CUDA only, as served there: the warm-up captures the forward passes as CUDA graphs
    ours = {"device": args.device, "workers": str(args.workers), "auto_batch_size": "false",
            "max_images": "16", "log_level": "warning", "warmup": str(args.device.startswith("cuda")).lower(),
            **({"max_batch_size": str(args.max_batch_size)} if args.max_batch_size else {})}
    from app.config import Settings
    from bench.serving import peers

    threads = Settings.model_fields["threads"].default
    every: dict[str, Start] = {
        "inline": lambda: visionserve(weights, logs, engine="inline", **ours),
        "process": lambda: visionserve(weights, logs, engine="process", **ours),
        "process-2": lambda: visionserve(weights, logs, engine="process", engines_per_device="2", **ours),
        "process-threads": lambda: visionserve(weights, logs, engine="process", loop_requests="false", **ours),
        "process-gevent": lambda: visionserve(weights, logs, engine="process", gunicorn_args=GEVENT_WORKER, **ours),
        "bare": lambda: bare_app(logs, args.workers, threads),
        "bare-wait": lambda: bare_app(logs, args.workers, threads, wait_ms=args.bare_wait_ms),
        "bare-gevent": lambda: bare_app(logs, args.workers, threads, gevent=True),
        "bare-gevent-wait": lambda: bare_app(logs, args.workers, threads, wait_ms=args.bare_wait_ms, gevent=True),
        "naive": lambda: peers.naive(weights, logs, workers=args.workers),
        "litserve": lambda: peers.litserve(weights, logs, workers=args.workers),
    }
    chosen = {name: every[name] for name in args.servers}
    for checkout in args.checkout:
        chosen[f"process@{checkout.name}"] = functools.partial(visionserve, weights, logs, checkout.resolve(),
                                                               engine="process", **ours)
    return chosen


def forms_for(server: str, every: dict[str, Form], chosen: Sequence[str]) -> list[Form]:
    """visionserve gets every chosen form; the bare app and the naive app the one-image JPEG, LitServe the same
    image in its JSON (what each serves)."""
    if server in ("inline", "process", "process-2", "process-threads", "process-gevent") or \
            server.startswith("process@"):
        return [every[name] for name in chosen]
    return [every["json" if server == "litserve" else "jpeg"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", nargs="+", default=["bare", "process", "inline", "naive", "litserve"],
                        choices=("bare", "bare-wait", "bare-gevent", "bare-gevent-wait", "process", "process-2",
                                 "process-threads", "process-gevent", "inline", "naive", "litserve"),
                        help="process-2: the engine process mode with two engines (ENGINES_PER_DEVICE=2); "
                        "process-threads: process mode with a request thread per request (LOOP_REQUESTS=false); "
                        "bare-wait: the bare app sleeping --bare-wait-ms before it answers; bare-gevent(-wait): the "
                        "same under gunicorn's gevent worker (pip install gevent), not a unit: another worker class; "
                        "process-gevent: process mode's HTTP workers under it, the app as it is (no slow-client 408s)")
    parser.add_argument("--bare-wait-ms", type=float, default=20.0,
                        help="bare-wait's sleep: about what a request in process mode waits for its engine at C=16")
    parser.add_argument("--checkout", type=Path, action="append", default=[],
                        help="another checkout whose process mode runs beside (repeatable)")
    parser.add_argument("--forms", nargs="+", default=["jpeg", "multipart x1", "multipart x16", "v2 x1", "v2 x16",
                                                       "/v1/models"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="server starts per server (medians over them; every other round starts them, and measures "
                        "each one's forms, in reverse order; the unit's bare app runs through each round)")
    parser.add_argument("--workers", type=int, default=2, help="HTTP workers of every server")
    parser.add_argument("--device", default="cpu", help="visionserve's DEVICE (the engine's, in process mode)")
    parser.add_argument("--max-batch-size", type=int, default=engine_only.GPU_BATCH_CEILING,
                        help="visionserve's MAX_BATCH_SIZE (and the engine alone's and the floor's): by default what "
                        "a GPU host gets, the host the budget is for; 0: the device's own automatic value (8 on a CPU)")
    parser.add_argument("--out", type=Path, help="also write the report (Markdown) and the points (JSON) here")
    parser.add_argument("--floor", action="store_true",
                        help="also the engine alone and its floor (V2 forms: at the headline C, and with as many "
                        "clients as process mode's mean batch there) in this run's unit")
    parser.add_argument("--smoke", action="store_true", help="half a second per point, C=1 and 4, one start each")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seconds, args.warmup, args.concurrency, args.rounds = 0.5, 1.0, [1, 4], 1
    if "bare" not in args.servers:
        args.servers = ["bare", *args.servers]  # the unit is measured in every run
    args.concurrency = list(dict.fromkeys(args.concurrency))  # each C once: a unit's reading a C (_unit_readings)
    every = forms([padded_jpeg(seed) for seed in range(8)])
    rounds: dict[tuple[str, str, int], list[Point]] = collections.defaultdict(list)
    alone: dict[tuple[str, str, str], list[dict]] = collections.defaultdict(list)  # --floor: (engine, form, at)
    headline = 16 if 16 in args.concurrency else max(args.concurrency)
    with tempfile.TemporaryDirectory() as folder:
        weights = tiny_weights(Path(folder) / "weights")
        for round_index in range(args.rounds):
            for point in _round(args, starters(args, weights, Path(folder)), every, round_index):
                rounds[(point.server, point.form, point.concurrency)].append(point)
            if args.floor:
                for form_name in (name for name in args.forms if name.startswith("v2")):
                    served = rounds.get(("process", form_name, headline), [])
                    clients = alone_clients(served[-1] if served else None, headline)  # this round's
                    for at, concurrency in clients.items():
                        batch = served[-1].mean_batch if at == AT_SERVED and served else None
                        for kind in ENGINE_ALONE:
                            run = functools.partial(_alone, kind, weights, form_name, args)
                            alone[(kind, form_name, at)].append(at_batch(run, concurrency, batch, headline))
    readings = unit_by_c([point for found in rounds.values() for point in found])
    points = [_median(found) for found in rounds.values()]
    unit = {c: statistics.median(found) for c, found in readings.items()}
    report = "\n".join([
        f"# Serving overhead, {time.strftime('%Y-%m-%d %H:%M')}", "",
        f"{os.cpu_count()} cores, device {args.device}, {args.workers} HTTP workers per server, {args.seconds:g} s per "
        f"point after {args.warmup:g} s of warm-up, median of {args.rounds} server start(s), MAX_BATCH_SIZE "
        f"{args.max_batch_size or 'auto'}. Model: one linear layer "
        f"on {'x'.join(map(str, INPUT))} inputs, {CLASSES} classes; JPEG bodies of {BODY_BYTES // 1000} KB (8x8 "
        "photos, padded).", "",
        "The unit, one bare-Flask request, read before and after each server's points (each point in the mean of its "
        "two readings at its C; the median and range of this run's readings): " + ", ".join(
            f"C={c}: {unit[c]:.0f} us ({min(found):.0f}-{max(found):.0f}, {len(found)} readings)"
            for c, found in sorted(readings.items())),
        "", table(points), "", *verdicts(points, args.concurrency),
        *(alone_table(alone, unit.get(headline), headline) if alone else [])])
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"{time.strftime('%Y-%m-%d')}-overhead-{args.device}"
        stem.with_suffix(".md").write_text(report)
        stem.with_suffix(".json").write_text(json.dumps(
            [asdict(p) for p in points] + [{"engine": kind, **found} for (kind, _, _), every in alone.items()
                                           for found in every], indent=1))
    answered_all = all(p.errors == 0 for p in points) and all(
        found["errors"] == 0 for every in alone.values() for found in every)
    return 0 if answered_all else 1


def _round(args: argparse.Namespace, chosen: dict[str, Start], every: dict[str, Form], round_index: int
           ) -> list[Point]:
    """One round: the bare app started first and kept running, its unit read at each C before the first server and
    after each one stops (``bracket``); the servers one after another, every other round in reverse order, each
    one's forms every other round in reverse too (a server's second form ran up to 10% dearer than the same work
    first, its decoding and forward passes alike, 2026-12-03)."""
    order = [(name, start) for name, start in chosen.items() if name != "bare"]
    if round_index % 2:
        order.reverse()
    unit_server = chosen["bare"]().wait_ready()
    try:
        before = _unit_readings(unit_server, every, args, args.warmup)
        found = list(before.values())
        for server, start in order:
            running = start().wait_ready()
            block: list[Point] = []
            try:
                for form in forms_for(server, every, args.forms)[::-1 if round_index % 2 else 1]:
                    for concurrency in args.concurrency:
                        block.append(measure(server, running, form, concurrency, args.seconds, args.warmup))
                        print(json.dumps(asdict(block[-1])), flush=True)  # as it comes (a drill's step may be
                        # stopped), its units once the unit is read again
            finally:
                running.stop()
            after = _unit_readings(unit_server, every, args, min(args.warmup, UNIT_REWARM_S))
            bracket(block, before, after)
            found += block + list(after.values())
            before = after
    finally:
        unit_server.stop()
    return found


def _unit_readings(unit_server: Running, every: dict[str, Form], args: argparse.Namespace, warmup: float
                   ) -> dict[int, Point]:
    """The unit at each C: the bare app's one-image JPEG requests (each reading 1.0 unit: its own)."""
    readings = {}
    for concurrency in args.concurrency:
        reading = measure("bare", unit_server, every["jpeg"], concurrency, args.seconds, warmup)
        in_unit(reading, reading.http_us)
        print(json.dumps(asdict(reading)), flush=True)
        readings[concurrency] = reading
    return readings


def _alone(kind: str, weights: Path, form_name: str, args: argparse.Namespace, clients: int) -> dict:
    """One ``--floor`` point: the engine alone or its floor (``kind``) with ``clients`` requests in flight, sent as
    the HTTP workers' loop links send them (``engine_only --clients messages``: two connections, several requests a
    message), as the served engine beside it was."""
    found = engine_only.measure(ROOT, weights, form_name, clients, args.seconds, floor=kind == "floor",
                                device=args.device, clients="messages", max_batch_size=args.max_batch_size)
    print(json.dumps({"engine": kind, **found}), flush=True)
    return found


def _median(found: list[Point]) -> Point:
    """A point's medians over the rounds; its figures in units each round's in that round's own unit."""
    first = found[0]
    numbers = {key: statistics.median(getattr(p, key) for p in found)
               for key in ("req_s", "img_s", "p50_ms", "p99_ms", "http_us")}
    engine = [p.engine_us for p in found if p.engine_us is not None]
    told = {key: [getattr(p, key) for p in found if getattr(p, key) is not None]
            for key in ("decode_us", "forward_us", "mean_batch", "http_units", "engine_units", "unit_us")}
    return Point(first.server, first.form, first.images, first.concurrency, errors=sum(p.errors for p in found),
                 engine_us=statistics.median(engine) if engine else None,
                 **{key: statistics.median(values) if values else None for key, values in told.items()}, **numbers)


if __name__ == "__main__":
    sys.exit(main())
