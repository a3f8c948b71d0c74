"""The engine process's own cost without HTTP (issue #50): one engine (``EngineServer`` and ``Service`` on the tiny
model of ``bench.serving.overhead``) in a process of its own, and a one-thread client in another that keeps C
requests in flight on C connections, as C HTTP worker threads would, and reads the engine's CPU from /proc
(``--clients threads``: C client threads, each waiting for its answer before it sends again, as an HTTP worker's
request threads do: an engine with slack, whose turns carry the few requests that came meanwhile, the load HTTP
workers give it when they are the bound; ``--clients messages``: the C requests on two connections (``--links``:
as many as you say), as two HTTP workers' loops share theirs (app/link/loop_link.py), each connection's answered
requests sent again together as one message; a checkout that predates those messages is sent its requests as
``loop`` sends them).

    .venv/bin/python -m bench.serving.engine_only                                # JPEG, V2 x1, V2 x16 at C=16
    .venv/bin/python -m bench.serving.engine_only --checkout ../before --rounds 3   # A/B: another checkout beside
    .venv/bin/python -m bench.serving.engine_only --floor --forms "v2 x1" "v2 x16"   # beside the floor
    .venv/bin/python -m bench.serving.engine_only --clients threads --concurrency 4 --forms "v2 x1"  # with slack
    python3 -m bench.serving.engine_only --device cuda --floor --out FOLDER        # on a GPU host (the drill)
    .venv/bin/python -m bench.serving.engine_only --instructions --checkout ../before --forms "v2 x1" "v2 x16"
    .venv/bin/python -m bench.serving.engine_only --instructions --forms "v2 x1" --burst 16 --requests 192  # by 16
    .venv/bin/python -m bench.serving.engine_only --instructions --forms "v2 x1" --burst 16 --clients messages  # served
    .venv/bin/python -m bench.serving.engine_only --instructions --floor --forms "v2 x1" --burst 16  # the floor's too
    .venv/bin/python -m bench.serving.engine_only --forms "v2 x1" "v2 x4" "v2 x16" --images-in-flight 16  # by size
    .venv/bin/python -m bench.serving.engine_only --clients messages --floor --forms "v2 x1"  # as loop links send
    .venv/bin/python -m bench.serving.engine_only --clients messages --links 8 --forms "v2 x1"  # eight HTTP workers
    .venv/bin/python -m bench.serving.engine_only --with-settings VISIONSERVE_ENGINE_LOOP_BATCH_MS=0  # a setting's A/B

The engine batches as it does on a GPU host, the host the budget is written for (``--max-batch-size``: by default
MAX_BATCH_SIZE's automatic value there, 32, where a CPU's is 8: a 16-image request is one forward pass, not two).
With no HTTP worker beside it on the CPU, the engine is the bound and runs the batches it would run saturated: the
figures are its cost per request and per image at that load, with nothing of the HTTP side in them (the overhead
benchmark measures both together, at the batch sizes two HTTP workers feed it). Each checkout's engine and client
run that checkout's code (the wire differs between versions); rounds alternate the checkouts.

``--floor`` measures beside it the least a Python engine on this wire costs on this host: one loop, the same frames,
model, forward threads, batch cap and answers, nothing else (no admission, routing, deadlines, futures, batcher
thread, monitor, metrics but its forward passes' CPU); and again with the requests several to a message on two
connections (``Infers`` and ``Answers``, as two HTTP workers' loop links send them).

``--instructions`` (valgrind installed: ``apt-get install valgrind``) runs each checkout's engine under callgrind and
sends it requests one at a time (``--burst K``: K at a time, each on a connection of its own, so a turn of the
engine's loop holds K): its instructions per request, the same from run to run within a fraction of a percent, where
its CPU time moves 10-20% between runs on a VM. A change to the engine's steps shows there in one run;
what it does to the wake-ups and the caches of a loaded engine (not counted) the CPU runs still tell. With
``--floor``, the floor's engine is counted beside (V2 forms).

Each engine's decode and forward CPU is read as its metrics count it (the thread that runs each, ``time.thread_time``:
intra-op threads of a forward pass on more than one CPU thread land beyond it), and what is beyond both is told
apart; "-" for an engine that does not count its forward passes (an older checkout's).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import inspect
import itertools
import json
import os
import selectors
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

ROOT = Path(__file__).resolve().parents[2]
FORMS = {"jpeg": ("jpeg", 1), "jpeg x16": ("jpeg", 16), "v2 x1": ("v2", 1), "v2 x2": ("v2", 2), "v2 x4": ("v2", 4),
         "v2 x8": ("v2", 8), "v2 x16": ("v2", 16),
         **{f"photo {size}{repeat}": (f"photo {size}", count) for size in ("160x120", "320x240", "500x375")
            for repeat, count in (("", 1), (" x16", 16))}}  # real photos (harness/photos.py), not the padded 8x8
FLOOR = Path("/floor")  # the floor's key among the checkouts measured
FLOOR_MESSAGES = Path("/floor-messages")  # the floor, its requests several to a message
FLOOR_SETTINGS = {"VISIONSERVE_LINK_ARENA_MB": "0"}  # timed or counted: its client offers it no arena (the floor
# reads no offer; its forms' tensors are never placed)
WITH_SETTINGS = Path("/with-settings")  # this checkout's engine with --with-settings
LINKS = 2  # --clients messages: connections, as the HTTP workers of the overhead benchmark's servers
CLIENTS = {"loop": "one client loop", "threads": "a client thread each",
           "messages": "one client loop, on {links} connections several requests a message"}
STAGE_CPU_METRIC = "visionserve_stage_cpu_seconds"  # app/metrics.py's STAGE_CPU_SECONDS, which the floor writes too
BATCH_SIZE_METRIC = "visionserve_batch_size"  # app/metrics.py's BATCH_SIZE, the floor's too
BATCHES, BATCHED_IMAGES = "batches", "batched images"  # engine_counts' keys beside the stages'
WARM_UP_REQUESTS = 50  # before an instruction count: every step of the request path run (and translated) once
GPU_BATCH_CEILING = 32  # app/config.py AUTO_MAX_BATCH_SIZE["cuda"]: the engine batches as on the GPU host #50 is for


def _import_from(checkout: Path) -> None:
    """This process imports ``app`` from ``checkout`` (its wire and engine), ``bench`` from this one."""
    sys.path.insert(0, str(checkout))
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))


PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, (1 << 64) - 1  # linux/prctl.h (Yama): (unsigned long) -1

def serve(checkout: Path, weights: Path, sock: Path, device: str = "cpu") -> None:
    """The engine process: the tiny model's Service served on ``sock`` until killed (``sock``.ready once bound)."""
    _import_from(checkout)
    from app.config import Settings
    from app.engine.service import Service
    from app.engine.versions.sources import DirectorySource
    from app.link.loop import EngineServer

    assert Path(sys.modules["app"].__file__).is_relative_to(checkout), "the engine runs another checkout's code"

    settings = engine_settings(Settings, weights, device)
    allow_profilers()
    gc.freeze()  # what start-up imported, before the models load: as the engine process does (app/link/server.py)
    server = EngineServer(Service.build(settings, DirectorySource(settings)), sock)
    server.bind()
    Path(f"{sock}.ready").touch()
    server.listen()


def engine_settings(settings_class: Any, weights: Path, device: str) -> Any:
    """The engine's settings (of ``settings_class``: the served checkout's ``Settings``): warmed up on CUDA only,
    where the warm-up captures each batch shape's forward pass as a CUDA graph and pads batches to those shapes, and
    lets the engine's loop run short batches, as a served engine does (its default); on the CPU it changes nothing
    but the start."""
    return settings_class(weights_dir=weights, device=device, auto_batch_size=False, max_images=16,
                          log_level="warning", warmup=device.startswith("cuda"))


def allow_profilers() -> None:
    """Let any process of this user read this one (a profiler started beside it, not above it: engine_profile's
    py-spy), where Yama's ptrace_scope 1 allows only a process's ancestors (prctl PR_SET_PTRACER_ANY; nothing where
    Yama is absent, as on this project's CI machines)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, ctypes.c_ulong(PR_SET_PTRACER_ANY), ctypes.c_ulong(0),
                                                ctypes.c_ulong(0), ctypes.c_ulong(0))


def serve_floor(weights: Path, sock: Path, device: str = "cpu") -> None:
    """The floor: the same wire, model and answers with nothing else (no admission, routing, deadlines, futures,
    batcher thread, decode, monitor, metrics but its forward passes' CPU and its batch sizes): one loop reads a
    turn's requests, runs their tensors in batches of the engine's cap and answers each. What a Python engine on this
    wire cannot do with less, on this host; its forward passes' CPU and its batches counted as the engine counts its
    own (one write each a turn), so what the floor spends beyond them stands beside the engine's, at the batches it
    ran."""
    import itertools
    import socket

    import numpy as np
    import torch

    from app.config import Settings
    from app.engine.contract import BatchRun, Served
    from app.link import wire
    from app.metrics import BATCH_SIZE, STAGE_CPU_SECONDS, observe_many, series
    from bench.serving.tiny_work import MODEL

    from models.architectures import split_outputs
    from models.export.checks import device_type
    from models.export.torchscript import quiet_jit
    from models.serving import forward_threads

    torch.set_num_threads(forward_threads(0, device) or torch.get_num_threads())  # the engine's rule for its forward
    batch_cap = Settings(device=device).batch_ceiling(device_type(device))  # the engine's (auto_batch_size off)
    with quiet_jit():  # as the engine loads it (models/export/load.py): no deprecation notice in every log
        module = torch.jit.load(str(weights / "model.torchscript.pt"), map_location=device).eval()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock))
    listener.listen(64)
    listener.setblocking(False)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    batch_ids = itertools.count()
    forward_cpu = series(STAGE_CPU_SECONDS, MODEL, "1", "forward")
    gc.freeze()
    Path(f"{sock}.ready").touch()
    while True:
        turn = []
        for key, _ in selector.select():
            if key.data is None:
                conn, _ = listener.accept()
                conn.setblocking(False)
                selector.register(conn, selectors.EVENT_READ, wire.FrameReader(conn, wire.REQUESTS, greet=True))
                continue
            try:
                for message, segments in key.data.read():
                    if isinstance(message, wire.Infer):
                        turn.append((key.fileobj, message, segments, None))
                    else:  # Infers: several requests, each under its id
                        turn += [(key.fileobj, infer, its, ident) for ident, infer, its in message.split(segments)]
            except (wire.EngineGone, OSError):
                selector.unregister(key.fileobj)
                key.fileobj.close()
        if not turn:
            continue
        stacks = [np.frombuffer(segment, np.dtype(dtype)).reshape(shape)  # (N, C, H, W): a request's pixels
                  for _, message, segments, _ in turn for (dtype, shape), segment in zip(message.tensors, segments)]
        rows = [row for stack in stacks for row in stack]
        started, answers, forward_s, sizes = time.monotonic(), [], 0.0, []
        with torch.inference_mode():  # in batches of the engine's cap, as its batcher runs them
            for first in range(0, len(rows), batch_cap):
                stacked = np.stack(rows[first:first + batch_cap])  # the engine's collate
                sizes.append(len(stacked))
                forward_started = time.thread_time()  # the forward pass as the engine counts its own (run_batch)
                batch = torch.from_numpy(stacked).to(device)
                answers.append(split_outputs(module(batch))[0].softmax(dim=1).cpu().numpy())
                forward_s += time.thread_time() - forward_started
        forward_cpu.inc(forward_s)  # one counter write a turn, where the engine writes its own once a settle
        observe_many(series(BATCH_SIZE, MODEL, "1"), sizes)
        probabilities = np.concatenate(answers)
        run_s, batch_id, at = time.monotonic() - started, next(batch_ids), 0
        frames: dict[socket.socket, list[bytes]] = {}  # a connection's answers of this turn, sent in one call
        shared: dict[socket.socket, list[tuple[int, Any]]] = {}  # a shared connection's, in one Answers
        for conn, message, _, ident in turn:
            count = sum(shape[0] for _, shape in message.tensors)
            served = Served(probabilities[at:at + count], (BatchRun(count, batch_id, batch_cap, 0.0, run_s),), MODEL,
                            "1", wire.NO_LABELS, 0.0)
            at += count
            answer = wire.Answer(served, None, os.getpid())
            if ident is None:
                frames.setdefault(conn, []).append(wire.frame(answer))
            else:
                shared.setdefault(conn, []).append((ident, answer))
        for conn, answered in shared.items():
            frames.setdefault(conn, []).append(wire.frame(wire.Answers(tuple(i for i, _ in answered),
                                                                       tuple(a for _, a in answered))))
        for conn, answers in frames.items():
            _send_all(conn, b"".join(answers))


def _send_all(sock: Any, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view):]
        except BlockingIOError:  # the socket's buffer is full: on once the client has read some
            with selectors.DefaultSelector() as waiting:
                waiting.register(sock, selectors.EVENT_WRITE)
                waiting.select(10)



@functools.lru_cache(maxsize=None)
def _photo(form: str, seed: int) -> bytes:
    """Form "photo WxH"'s ``seed``-th JPEG: one of scikit-image's photos (in turn) at W x H."""
    from harness.photos import PHOTO_NAMES, jpeg, photo

    width, height = map(int, form.split()[1].split("x"))
    return jpeg(photo(PHOTO_NAMES[seed % len(PHOTO_NAMES)]), (width, height))


def _requests(wire: Any, form: str, count: int) -> list[tuple[Any, list[Any]]]:
    import numpy as np

    from bench.serving.tiny_work import INPUT, MODEL, padded_jpeg

    made = []
    for seed in range(8):
        common = dict(model=MODEL, version=None, client_key=None, timeout_s=10.0, parsed_version="1",
                      parsed_shape=tuple(INPUT), names=(None,) * count)
        if form == "jpeg":
            made.append((wire.Infer(**common), [padded_jpeg(seed + k) for k in range(count)]))
            continue
        if form.startswith("photo "):
            made.append((wire.Infer(**common), [_photo(form, seed + k) for k in range(count)]))
            continue
        rng = np.random.default_rng(seed)
        tensors = [rng.standard_normal(INPUT).astype(np.float32) for _ in range(count)]
        if wire.PROTOCOL >= 6:  # a request's pixels as one stack, one segment
            specs, segments = wire.tensor_segments([np.stack(tensors)])
            made.append((wire.Infer(**common, tensors=specs), segments))
        elif hasattr(wire, "tensor_segments"):  # a raw segment per image (PROTOCOL 3 to 5)
            specs, segments = wire.tensor_segments(tensors)
            made.append((wire.Infer(**common, tensors=specs), segments))
        else:  # before: pickled with the message
            made.append((wire.Infer(**common, tensors=tuple(tensors)), []))
    return made


def drive(checkout: Path, sock: Path, form: str, concurrency: int, seconds: float, engine: int,
          clients: str = "loop", links: int = LINKS) -> dict[str, Any]:
    """The client: C requests in flight for ``seconds`` after a second of warm-up, on C connections read by one
    loop (``clients``: "loop"; "messages": on ``links`` connections, several requests a message; "threads": a
    thread per connection); the engine's CPU over them."""
    if clients == "messages":
        return _drive_messages(checkout, sock, form, concurrency, seconds, engine, links)
    if clients == "threads":
        return _drive_threads(checkout, sock, form, concurrency, seconds, engine)
    _import_from(checkout)
    from app.link import wire

    assert Path(wire.__file__).is_relative_to(checkout), f"{wire.__file__} is not {checkout}'s"

    kind, count = FORMS[form]
    answer_of = wire.receive_answer
    if "grace_s" in inspect.signature(wire.receive_answer).parameters:  # read in one call (since the levers' stop)
        answer_of = functools.partial(wire.receive_answer, grace_s=10.0)
    requests = _requests(wire, kind, count)
    selector = selectors.DefaultSelector()
    for _ in range(concurrency):
        conn = wire.connect(sock, 5.0)
        wire.say_hello(conn)
        selector.register(conn, selectors.EVENT_READ)

    def run(duration: float) -> tuple[int, int]:
        sent = answered = errors = 0
        for key in list(selector.get_map().values()):
            wire.send(key.fileobj, *requests[sent % len(requests)])
            sent += 1
        end = time.monotonic() + duration
        while answered < sent:
            for key, _ in selector.select(5.0):
                answer = answer_of(key.fileobj)
                answered += 1
                errors += answer.error is not None
                if time.monotonic() < end:
                    wire.send(key.fileobj, *requests[sent % len(requests)])
                    sent += 1
        return answered, errors

    return _measured(run, engine, form, concurrency, seconds, count)


def _measured(run: Any, engine: int, form: str, concurrency: int, seconds: float, count: int) -> dict[str, Any]:
    """``run`` for a second of warm-up, then for ``seconds`` with the engine's CPU read around it, and what its
    metrics count (``engine_counts``: its decoding's and forward passes' CPU, its batches; read once every answer is
    in, so each batch's count is written: a batch's accounting settles before the answers of the batch that empties
    the queue)."""
    from app.hosting.procstat import cpu_and_memory

    run(1.0)
    counted_before = engine_counts()
    cpu_before, started = cpu_and_memory(engine)[0], time.monotonic()  # type: ignore[index]
    answered, errors = run(seconds)
    elapsed, cpu = time.monotonic() - started, cpu_and_memory(engine)[0] - cpu_before  # type: ignore[index]
    counted = {key: spent - counted_before.get(key, 0.0) for key, spent in engine_counts().items()}
    answered = max(answered - errors, 1)  # the requests answered with rows: an error is no request served
    images = answered * count
    # no decode counted: nothing was decoded (V2 tensors); no forward pass counted: an engine that does not count it
    # (another checkout's), whose figures beyond it are then unknown (None), not its whole CPU
    decode_s, forward_s = counted.get("decode", 0.0), counted.get("forward")
    batches = counted.get(BATCHES, 0.0)
    return {"form": form, "concurrency": concurrency, "requests_per_s": answered / elapsed,
            "engine_us_per_request": cpu / answered * 1e6, "engine_us_per_image": cpu / images * 1e6,
            "decode_us_per_image": decode_s / images * 1e6,
            "forward_us_per_image": None if forward_s is None else forward_s / images * 1e6,
            "beyond_us_per_image": None if forward_s is None else (cpu - decode_s - forward_s) / images * 1e6,
            "mean_batch": counted[BATCHED_IMAGES] / batches if batches else None, "errors": errors}


def median_of(points: Sequence[dict[str, Any]], key: str, digits: int = 0) -> str:
    """The median of ``key`` over ``points`` as a table shows it; "-" when a point has none (not counted)."""
    values = [p[key] for p in points]
    return "-" if any(value is None for value in values) else f"{statistics.median(values):.{digits}f}"


def engine_counts() -> dict[str, float]:
    """What the engine's metrics counted so far: CPU seconds per stage (decode, inference, forward), and its batches
    (``BATCHES``) and the images in them (``BATCHED_IMAGES``); read from the Prometheus multiprocess folder the
    engine writes (``_engine`` gives each its own)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=os.environ["PROMETHEUS_MULTIPROC_DIR"])
    counts: dict[str, float] = {BATCHES: 0.0, BATCHED_IMAGES: 0.0}
    for metric in registry.collect():
        for sample in metric.samples:
            if metric.name == STAGE_CPU_METRIC and sample.name.endswith("_total"):
                stage = sample.labels["stage"]  # (summed over the versions a checkout labels it with)
                counts[stage] = counts.get(stage, 0.0) + sample.value
            elif metric.name == BATCH_SIZE_METRIC and sample.name.endswith(("_count", "_sum")):
                key = BATCHES if sample.name.endswith("_count") else BATCHED_IMAGES
                counts[key] += sample.value
    return counts


def _drive_messages(checkout: Path, sock: Path, form: str, concurrency: int, seconds: float,
                    engine: int, links: int = LINKS) -> dict[str, Any]:
    """C requests in flight on ``links`` connections, several to a message, as HTTP workers' loop links send them:
    each connection's answered requests sent again together (``Infers``), their photos placed in its arena as a
    loop link places them (LINK_ARENA_MB, the checkout's default or the setting beside: ``--with-settings``); a
    checkout that predates them is driven as ``drive`` does (a connection and a frame per request)."""
    _import_from(checkout)
    from app.link import wire

    if not hasattr(wire, "Infers"):
        return drive(checkout, sock, form, concurrency, seconds, engine)
    kind, count = FORMS[form]
    requests = _requests(wire, kind, count)
    selector = selectors.DefaultSelector()
    shares = [concurrency // links + (index < concurrency % links) for index in range(links)]
    for share in shares:
        if share:
            conn = wire.connect(sock, 5.0)
            wire.say_hello(conn)
            arena = _offered_arena(wire, conn)
            conn.setblocking(False)
            selector.register(conn, selectors.EVENT_READ, (wire.FrameReader(conn, (wire.Answers,)), share, arena))
    ids = itertools.count(1)

    def run(duration: float) -> tuple[int, int]:
        sent = answered = errors = 0

        def send(conn: Any, many: int) -> None:
            nonlocal sent
            taken = [(next(ids), *requests[(sent + index) % len(requests)]) for index in range(many)]
            arena = selector.get_key(conn).data[2]
            wire.send(conn, *(wire.infers(taken, arena) if arena is not None else wire.infers(taken)))
            sent += many

        for key in list(selector.get_map().values()):
            send(key.fileobj, key.data[1])
        end = time.monotonic() + duration
        while answered < sent:
            for key, _ in selector.select(5.0):
                for answers, _ in key.data[0].read():
                    if key.data[2] is not None:
                        _free_places(key.data[2], answers)
                    answered += len(answers.ids)
                    errors += sum(answer.error is not None for answer in answers.answers)
                    if time.monotonic() < end:
                        send(key.fileobj, len(answers.ids))
        return answered, errors

    return _measured(run, engine, form, concurrency, seconds, count)


def _free_places(arena: Any, answers: Any) -> None:
    """What ``answers`` frees of a checkout's arena, as its loop link frees it: the places of the requests the engine
    let go of (``released``), or, in a checkout whose engine copied photos out as it read them, every place up to the
    latest request answered."""
    if hasattr(answers, "released"):
        arena.released(answers.released)
    elif answers.ids:
        arena.answered(max(answers.ids))


def _offered_arena(wire: Any, conn: Any) -> Any:
    """The arena a loop link of this checkout would offer on ``conn`` (its LINK_ARENA_MB: the default, or the
    setting in this process's environment), offered; None where it predates them or offers none."""
    if not hasattr(wire, "ArenaOffer"):
        return None
    from app.config import Settings
    from app.link.loop_link import offered_arena

    size = int(os.environ.get("VISIONSERVE_LINK_ARENA_MB", Settings.model_fields["link_arena_mb"].default)) << 20
    return offered_arena(conn, size) if size else None


def _drive_threads(checkout: Path, sock: Path, form: str, concurrency: int, seconds: float,
                   engine: int) -> dict[str, Any]:
    """C threads, each with its connection and one request at a time, waiting for its answer as an HTTP worker's
    request thread does (the checkout's ``wire.receive_answer`` on a blocking socket): the engine then has slack
    and each loop turn carries the few requests that came, as when HTTP workers are the bound."""
    import threading

    _import_from(checkout)
    from app.link import wire

    kind, count = FORMS[form]
    requests = _requests(wire, kind, count)
    connections = []
    for _ in range(concurrency):
        conn = wire.connect(sock, 5.0)
        wire.say_hello(conn)
        connections.append(conn)

    def run(duration: float) -> tuple[int, int]:
        answered, errors, end = [0] * concurrency, [0] * concurrency, time.monotonic() + duration

        def client(index: int) -> None:
            conn, sent = connections[index], index
            while time.monotonic() < end:
                wire.send(conn, *requests[sent % len(requests)])
                sent += concurrency
                answer = wire.receive_answer(conn, 10.0)
                answered[index] += 1
                errors[index] += answer.error is not None

        running = [threading.Thread(target=client, args=(index,)) for index in range(concurrency)]
        for thread in running:
            thread.start()
        for thread in running:
            thread.join()
        return sum(answered), sum(errors)

    return _measured(run, engine, form, concurrency, seconds, count)


def measure(checkout: Path, weights: Path, form: str, concurrency: int, seconds: float,
            floor: bool = False, device: str = "cpu", clients: str = "loop",
            max_batch_size: int = GPU_BATCH_CEILING, settings: dict[str, str] | None = None,
            links: int = LINKS) -> dict[str, Any]:
    """One engine started from ``checkout`` (``floor``: the floor's loop instead) with batches of up to
    ``max_batch_size`` images (0: its device's automatic ceiling) and ``settings`` (environment variables) beside,
    driven by that checkout's client (``clients``: as ``drive`` says), then stopped."""
    serve_args = (["--serve-floor", str(weights)] if floor else ["--serve", str(checkout), str(weights)])
    if floor:
        settings = {**(settings or {}), **FLOOR_SETTINGS}
    with _engine(checkout, serve_args, device, max_batch_size=max_batch_size, settings=settings) as (engine, sock,
                                                                                                     env):
        client = subprocess.run([sys.executable, "-m", "bench.serving.engine_only", "--drive", str(checkout),
                                 str(sock), form, str(concurrency), str(seconds), str(engine.pid), clients,
                                 str(links)],
                                cwd=ROOT, env=env, capture_output=True, text=True, check=True)
        return json.loads(client.stdout.strip().splitlines()[-1])


def whole_bursts(requests: int, burst: int) -> int:
    """How many requests ``count`` sends for ``requests`` at ``burst`` a time: its bursts are whole."""
    return -(-requests // burst) * burst


def instructions(checkout: Path, weights: Path, form: str, requests: int,
                 max_batch_size: int = GPU_BATCH_CEILING, burst: int = 1, floor: bool = False,
                 clients: str = "loop", links: int = LINKS) -> dict[str, Any]:
    """The engine of ``checkout`` under callgrind (valgrind installed), sent ``requests`` of ``form`` ``burst`` at a
    time (each on a connection of its own, the next ones once all are answered) by that checkout's client
    (``count``): its instructions per request and per image, the same from run to run where its CPU time moves
    10-20% on a VM. Requests that come alone (or ``burst`` together): their batches, their settle, no wake-up's cost
    (the kernel's and the caches' work is not counted). ``floor``: the floor's engine (``serve_floor``) instead;
    ``clients`` "messages": each burst on ``links`` connections, several requests a message (``Infers``), as HTTP
    workers' loop links send them (the path served requests take)."""
    with tempfile.TemporaryDirectory(prefix="visionserve-callgrind-") as folder:
        out = Path(folder) / "callgrind.out"
        from bench.serving.callgrind import callgrind_command, callgrind_total

        serve_args = ["--serve-floor", str(weights)] if floor else ["--serve", str(checkout), str(weights)]
        with _engine(checkout, serve_args, "cpu", callgrind_command(out), max_batch_size,
                     FLOOR_SETTINGS if floor else None) as (engine, sock, env):
            subprocess.run([sys.executable, "-m", "bench.serving.engine_only", "--count", str(checkout), str(sock),
                            form, str(requests), str(engine.pid), str(burst), clients, str(links)], cwd=ROOT, env=env,
                           capture_output=True, check=True)
        total = callgrind_total(out)
    sent = whole_bursts(requests, burst)
    return {"form": form, "instructions_per_request": total / sent,
            "instructions_per_image": total / (sent * FORMS[form][1])}


@contextlib.contextmanager
def _engine(checkout: Path, serve_args: list[str], device: str, wrapper: Sequence[str] = (),
            max_batch_size: int = GPU_BATCH_CEILING, settings: dict[str, str] | None = None
            ) -> Iterator[tuple[subprocess.Popen, Path, dict[str, str]]]:
    """An engine process (``serve_args``: --serve or --serve-floor and their paths; ``wrapper``: what runs it, such
    as valgrind; ``max_batch_size``: its MAX_BATCH_SIZE, 0 leaving it to the device; ``settings``: environment
    variables beside) on a socket of its own, once ready; killed after."""
    with tempfile.TemporaryDirectory() as scratch:
        sock = Path(scratch) / "engine.sock"
        env = {**os.environ, **(settings or {}), "PROMETHEUS_MULTIPROC_DIR": scratch}
        if max_batch_size:  # (an older checkout's settings refuse 0)
            env["VISIONSERVE_MAX_BATCH_SIZE"] = str(max_batch_size)
        engine = subprocess.Popen([*wrapper, sys.executable, "-m", "bench.serving.engine_only", *serve_args, str(sock),
                                   device], cwd=ROOT, env=env)
        try:
            while not Path(f"{sock}.ready").exists():
                if engine.poll() is not None:
                    raise RuntimeError(f"the engine of {checkout} ended with {engine.returncode}")
                time.sleep(0.1)
            yield engine, sock, env
        finally:
            engine.kill()
            engine.wait()
            if wrapper:  # killed under valgrind: the pipes its gdbserver made stay behind
                from bench.serving.callgrind import remove_vgdb_pipes

                remove_vgdb_pipes(engine.pid)


def count(checkout: Path, sock: Path, form: str, requests: int, engine: int, burst: int = 1,
          clients: str = "loop", links: int = LINKS) -> None:
    """``instructions``' client: requests of ``form`` ``burst`` at a time, each on a connection of its own (the
    checkout's wire; ``clients`` "messages": on ``links`` connections, several a message, photos placed in each
    connection's arena as ``_drive_messages`` places them), the next ones once every one is answered; a warm-up
    first; the engine's count zeroed before the measured ones and dumped after them."""
    from bench.serving.callgrind import callgrind_control  # this checkout's (before the other's is on the path)

    _import_from(checkout)
    from app.link import wire

    kind, images = FORMS[form]
    made = _requests(wire, kind, images)
    answer_of = wire.receive_answer
    if "grace_s" in inspect.signature(wire.receive_answer).parameters:
        answer_of = functools.partial(wire.receive_answer, grace_s=60.0)
    messages = clients == "messages" and hasattr(wire, "Infers")
    conns = [wire.connect(sock, 60.0) for _ in range(min(burst, links) if messages else burst)]
    for conn in conns:
        wire.say_hello(conn)
    readers = [wire.FrameReader(conn, (wire.Answers,)) for conn in conns] if messages else []
    arenas = [_offered_arena(wire, conn) for conn in conns] if messages else []  # photos placed as loop links do
    ids = itertools.count(1)

    def send_messages(total: int) -> None:
        for start in range(0, total, burst):
            shares = [burst // len(conns) + (index < burst % len(conns)) for index in range(len(conns))]
            for conn, share, arena in zip(conns, shares, arenas):
                taken = [(next(ids), *made[(start + index) % len(made)]) for index in range(share)]
                wire.send(conn, *(wire.infers(taken, arena) if arena is not None else wire.infers(taken)))
            for reader, share, arena in zip(readers, shares, arenas):
                answered = 0
                while answered < share:
                    for answers, _ in reader.read():
                        if arena is not None:
                            _free_places(arena, answers)
                        answered += len(answers.ids)
                        failed = [answer.error for answer in answers.answers if answer.error is not None]
                        if failed:
                            raise RuntimeError(f"{form}: {failed[0]}")

    def send(total: int) -> None:
        if messages:
            send_messages(total)
            return
        for start in range(0, total, burst):
            for index, conn in enumerate(conns):
                wire.send(conn, *made[(start + index) % len(made)])
            for conn in conns:
                answer = answer_of(conn)
                if answer.error is not None:
                    raise RuntimeError(f"{form}: {answer.error}")

    send(WARM_UP_REQUESTS)
    callgrind_control(engine, "--instr=on")
    callgrind_control(engine, "--zero")
    send(requests)
    callgrind_control(engine, "--dump")


def instruction_report(found: dict[tuple[str, Path], dict[str, Any]], requests: int, burst: int = 1,
                       clients: str = "loop", links: int = LINKS) -> str:
    """``--instructions``' table: each checkout's count per request and per image, by form."""
    sent = "one at a time" if burst == 1 else f"{burst} at a time"
    if clients == "messages":
        sent += f", on {min(burst, links)} connections several a message"
    lines = [f"The engine's instructions (callgrind), {whole_bursts(requests, burst)} requests a point sent {sent} "
             f"after {WARM_UP_REQUESTS} of warm-up", "",
             "| checkout | form | instructions / request | instructions / image |", "| --- | --- | --- | --- |"]
    for (form, checkout), point in found.items():
        name = {ROOT: "this", FLOOR: "floor"}.get(checkout, str(checkout))
        lines.append(f"| {name} | {form} | {point['instructions_per_request']:.0f} | "
                     f"{point['instructions_per_image']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", type=Path, action="append", default=[], help="another checkout beside")
    parser.add_argument("--forms", nargs="+", default=["jpeg", "v2 x1", "v2 x16"], choices=list(FORMS))
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--images-in-flight", type=int,
                        help="instead of --concurrency: each form's C is this many images over its images per request "
                        "(at least 1), so every form keeps as many images in flight: what k one-image requests would "
                        "cost the engine if they reached it as one k-image request")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=1, help="engine starts per checkout and form (medians)")
    parser.add_argument("--floor", action="store_true",
                        help="also the floor: a loop with this wire and model and nothing else (V2 forms)")
    parser.add_argument("--device", default="cpu", help="the engine's DEVICE (and the floor's)")
    parser.add_argument("--max-batch-size", type=int, default=GPU_BATCH_CEILING,
                        help="the engine's MAX_BATCH_SIZE (and the floor's batches): by default what a GPU host gets "
                        "(the host the budget is for; a 16-image request is one forward pass there); 0: the "
                        "device's own automatic value (8 on a CPU)")
    parser.add_argument("--clients", choices=("loop", "threads", "messages"), default="loop",
                        help="loop: one client thread keeps every request in flight (the engine the bound); threads: "
                        "a thread per connection, a request at a time (the engine with slack, as behind HTTP "
                        "workers); messages: on --links connections (two), several requests a message, as HTTP "
                        "workers' loop links send them")
    parser.add_argument("--instructions", action="store_true",
                        help="count the engine's instructions per request under callgrind (valgrind), requests sent "
                        "one at a time, instead of its CPU under load; one round")
    parser.add_argument("--requests", type=int, default=200, help="requests counted with --instructions")
    parser.add_argument("--burst", type=int, default=1,
                        help="with --instructions: requests sent at once, each on a connection of its own (a turn's; "
                        "--clients messages: on --links connections, several a message)")
    parser.add_argument("--links", type=int, default=LINKS,
                        help="with --clients messages: the connections the requests share, as as many HTTP workers' "
                        "loop links (a GPU host runs many)")
    parser.add_argument("--with-settings", nargs="+", metavar="KEY=VALUE", default=[],
                        help="also this checkout's engine with these settings (environment variables, such as "
                        "VISIONSERVE_ENGINE_LOOP_BATCH_MS=0), in the same rounds: a setting's A/B in one run")
    parser.add_argument("--out", type=Path, help="also write the report (Markdown) here")
    parser.add_argument("--serve", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--count", nargs=8, help=argparse.SUPPRESS)
    parser.add_argument("--serve-floor", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--drive", nargs=8, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.links < 1:
        parser.error("--links takes one connection at least")
    with_settings = dict(setting.split("=", 1) for setting in args.with_settings if "=" in setting)
    if len(with_settings) != len(args.with_settings):
        parser.error("--with-settings takes KEY=VALUE pairs")
    if args.serve:
        serve(Path(args.serve[0]), Path(args.serve[1]), Path(args.serve[2]), args.serve[3])
        return 0
    if args.serve_floor:
        serve_floor(Path(args.serve_floor[0]), Path(args.serve_floor[1]), args.serve_floor[2])
        return 0
    if args.count:
        checkout, sock, form, requests, engine, burst, clients, links = args.count
        count(Path(checkout), Path(sock), form, int(requests), int(engine), int(burst), clients, int(links))
        return 0
    if args.drive:
        checkout, sock, form, concurrency, seconds, engine, clients, links = args.drive
        print(json.dumps(drive(Path(checkout), Path(sock), form, int(concurrency), float(seconds), int(engine),
                               clients, int(links))))
        return 0

    from bench.serving.tiny_work import TINY_WEIGHTS, tiny_weights

    weights = tiny_weights(TINY_WEIGHTS)
    checkouts = [ROOT, *(c.resolve() for c in args.checkout)]
    if args.instructions:
        counted = {(form, checkout): instructions(checkout, weights, form, args.requests, args.max_batch_size,
                                                  args.burst, clients=args.clients, links=args.links)
                   for form in args.forms for checkout in checkouts}
        if args.floor:  # the floor's count beside (V2 forms: it decodes nothing)
            counted.update({(form, FLOOR): instructions(ROOT, weights, form, args.requests, args.max_batch_size,
                                                        args.burst, floor=True, clients=args.clients,
                                                        links=args.links)
                            for form in args.forms if FORMS[form][0] == "v2"})
        report = instruction_report(counted, args.requests, args.burst, args.clients, args.links)
        print(report)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{time.strftime('%Y-%m-%d')}-engine-only-instructions.md").write_text(report)
        return 0
    found: dict[tuple[str, Path], list[dict[str, Any]]] = {}
    clients_of = {form: (max(1, args.images_in_flight // FORMS[form][1]) if args.images_in_flight else
                         args.concurrency) for form in args.forms}

    def measured(key: tuple[str, Path], point: dict[str, Any]) -> None:
        """A point kept, and printed as it comes (a run stopped before its report still told it)."""
        found.setdefault(key, []).append(point)
        print(json.dumps({"engine": str(key[1]), "form": key[0], **point}), flush=True)

    for _ in range(args.rounds):
        for form in args.forms:
            concurrency = clients_of[form]
            for checkout in checkouts:
                measured((form, checkout), measure(checkout, weights, form, concurrency, args.seconds,
                                                   device=args.device, clients=args.clients,
                                                   max_batch_size=args.max_batch_size, links=args.links))
            if with_settings:
                measured((form, WITH_SETTINGS), measure(ROOT, weights, form, concurrency, args.seconds,
                                                        device=args.device, clients=args.clients,
                                                        max_batch_size=args.max_batch_size, settings=with_settings,
                                                        links=args.links))
            if args.floor and FORMS[form][0] == "v2":
                measured((form, FLOOR), measure(  # a frame each (the messages' floor is next)
                    ROOT, weights, form, concurrency, args.seconds, floor=True, device=args.device,
                    clients="loop" if args.clients == "messages" else args.clients,
                    max_batch_size=args.max_batch_size))
                measured((form, FLOOR_MESSAGES), measure(
                    ROOT, weights, form, concurrency, args.seconds, floor=True, clients="messages",
                    device=args.device, max_batch_size=args.max_batch_size))
    in_flight = (f"{args.images_in_flight} images in flight" if args.images_in_flight else f"C={args.concurrency}")
    lines = [f"The engine without HTTP on {args.device} ({os.cpu_count()} cores): {in_flight} "
             f"({CLIENTS[args.clients].format(links=args.links)}), {args.seconds:g} s per "
             f"point, median of {args.rounds}, MAX_BATCH_SIZE {args.max_batch_size or 'auto'}", "",
             "| checkout | form | C | req/s | mean batch | engine us / request | engine us / image | of which decode | "
             "of which forward | beyond decode and forward, us / image | errors |",
             "|" + " --- |" * 11]
    for (form, checkout), points in found.items():
        figures = [str(clients_of[form]), median_of(points, "requests_per_s"), median_of(points, "mean_batch", 1),
                   *(median_of(points, key) for key in ("engine_us_per_request", "engine_us_per_image",
                                                        "decode_us_per_image", "forward_us_per_image",
                                                        "beyond_us_per_image"))]
        name = {ROOT: "this", FLOOR: "floor", FLOOR_MESSAGES: "floor, several a message",
                WITH_SETTINGS: "this, " + " ".join(args.with_settings)}.get(checkout, str(checkout))
        lines.append(f"| {name} | {form} | " + " | ".join(figures) + f" | {sum(p['errors'] for p in points)} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{time.strftime('%Y-%m-%d')}-engine-only-{args.device}.md").write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
