"""The overhead benchmark's inputs (bench/serving/overhead.py) are what it says: JPEG bodies of a photo's size that
the product decodes as 8x8 images, and V2 bodies whose header the server reads as the tensors they carry."""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import tempfile
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from bench.serving.overhead import Point, _median, bracket, forms, unit_by_c, verdicts
from bench.serving.tiny_work import BODY_BYTES, INPUT, padded_jpeg
from models.image_decode import DecodeLimits, decode_tensor

ROOT = Path(__file__).resolve().parents[2]


def test_a_padded_jpeg_is_a_photos_size_and_decodes_as_its_8x8_pixels() -> None:
    body = padded_jpeg(3)
    assert BODY_BYTES - 4 <= len(body) <= BODY_BYTES
    plain = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(plain, "JPEG",
                                                                                                quality=90)
    expected = np.asarray(Image.open(plain).convert("RGB"))
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(body)).convert("RGB")), expected)
    assert tuple(decode_tensor(body, DecodeLimits()).shape) == (3, 8, 8)


def test_v2_bodies_say_where_their_json_ends_and_carry_float32_pixels() -> None:
    for name, count in (("v2 x1", 1), ("v2 x16", 16)):
        form = forms([padded_jpeg(seed) for seed in range(3)])[name]
        size = int(dict(form.headers)["Inference-Header-Content-Length"])
        for body in form.bodies:
            header = json.loads(body[:size])
            (tensor,) = header["inputs"]
            assert tensor["shape"] == [count, *INPUT]
            assert len(body) - size == tensor["parameters"]["binary_data_size"] == count * int(np.prod(INPUT)) * 4


def test_each_figure_is_in_the_unit_read_before_and_after_its_servers_points_at_the_same_concurrency() -> None:
    def point(server: str, c: int, http: float, engine: float | None = None, forward: float | None = None) -> Point:
        return Point(server, "jpeg", 1, c, 1.0, 1.0, 1.0, 1.0, 0, http, engine, 80.0, forward)

    before = {1: point("bare", 1, 1000.0), 16: point("bare", 16, 700.0)}
    after = {1: point("bare", 1, 1000.0), 16: point("bare", 16, 900.0)}  # the machine slower meanwhile
    block = [point("process", 16, 2000.0, 600.0, 120.0), point("inline", 64, 3000.0),
             point("process", 16, 2000.0, 600.0)]
    bracket(block, before, after)
    assert block[0].unit_us == 800.0  # the mean of the readings on either side, at its C
    assert (block[0].http_units, block[0].engine_units) == (2.5, 0.5)  # (600 - 80 - 120) / 800
    assert block[1].http_units is None  # no unit read at C=64: no figure in units
    # an engine that does not count its forward pass (another checkout's): beyond it unknown, not its whole CPU
    assert (block[2].http_units, block[2].engine_units) == (2.5, None)
    assert unit_by_c([*before.values(), *block, *after.values()]) == {1: [1000.0, 1000.0], 16: [700.0, 900.0]}


def test_a_figure_in_units_is_the_median_of_each_rounds_figure_in_that_rounds_own_unit() -> None:
    def point(http: float) -> Point:
        return Point("process", "jpeg", 1, 16, 1.0, 1.0, 1.0, 1.0, 0, http, None)

    rounds = []
    for http, unit in ((900.0, 600.0), (1300.0, 1000.0), (1000.0, 800.0)):  # a round in a slow spell: both slower
        found = point(http)
        bracket([found], {16: Point("bare", "jpeg", 1, 16, 1.0, 1.0, 1.0, 1.0, 0, unit, None)},
                {16: Point("bare", "jpeg", 1, 16, 1.0, 1.0, 1.0, 1.0, 0, unit, None)})
        rounds.append(found)
    # the rounds' own: 1.5, 1.3, 1.25; the median of the CPU over the median of the units would say 1000 / 800
    assert _median(rounds).http_units == 1.3
    assert (_median(rounds).http_us, _median(rounds).unit_us) == (1000.0, 800.0)


def test_a_round_reads_the_unit_before_its_first_server_and_after_each_and_brackets_each_servers_points(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.serving import overhead

    taken: list[tuple[str, int, float]] = []
    started: list[str] = []

    def measure(server: str, _: object, form: overhead.Form, concurrency: int, seconds: float, warmup: float
                ) -> Point:
        taken.append((server, concurrency, warmup))
        http = 500.0 + 100.0 * sum(1 for s, _, _ in taken if s == "bare") if server == "bare" else 2000.0
        return Point(server, form.name, 1, concurrency, 1.0, 1.0, 1.0, 1.0, 0, http, None)

    class Server:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_ready(self) -> "Server":
            started.append(self.name)
            return self

        def stop(self) -> None:
            started.append(f"{self.name} stopped")

    monkeypatch.setattr(overhead, "measure", measure)
    args = argparse.Namespace(concurrency=[16, 64], forms=["jpeg"], seconds=1.0, warmup=2.0)
    chosen = {name: (lambda name=name: Server(name)) for name in ("bare", "inline", "process")}
    found = overhead._round(args, chosen, forms([padded_jpeg(0)]), round_index=1)  # an odd round: in reverse
    assert started == ["bare", "process", "process stopped", "inline", "inline stopped", "bare stopped"]
    assert [(s, c) for s, c, _ in taken] == [("bare", 16), ("bare", 64), ("process", 16), ("process", 64),
                                             ("bare", 16), ("bare", 64), ("inline", 16), ("inline", 64),
                                             ("bare", 16), ("bare", 64)]
    assert [w for s, _, w in taken if s == "bare"] == [2.0, 2.0] + [overhead.UNIT_REWARM_S] * 4  # warm already
    units = {(p.server, p.concurrency): p.unit_us for p in found}
    # the readings 600, 700 (before), 800, 900 (after process), 1000, 1100 (after inline), by C
    assert units[("process", 16)] == 700.0 and units[("process", 64)] == 800.0
    assert units[("inline", 16)] == 900.0 and units[("inline", 64)] == 1000.0
    assert sorted(p.http_us for p in found if p.server == "bare") == [600.0, 700.0, 800.0, 900.0, 1000.0, 1100.0]
    assert {p.http_units for p in found if p.server == "bare"} == {1.0}


def test_a_point_with_a_reading_of_the_unit_on_one_side_alone_has_no_units() -> None:
    found = Point("process", "jpeg", 1, 16, 1.0, 1.0, 1.0, 1.0, 0, 900.0, None)
    bracket([found], {16: Point("bare", "jpeg", 1, 16, 1.0, 1.0, 1.0, 1.0, 0, 600.0, None)}, {})
    assert (found.unit_us, found.http_units) == (None, None)


def test_the_budget_is_checked_at_every_concurrency_measured_each_in_its_own_unit() -> None:
    def point(server: str, form: str, c: int, http: float, engine: float | None = None) -> Point:
        return Point(server, form, 1, c, 1.0, 1.0, 1.0, 1.0, 0, http, engine, 0.0 if engine else None,
                     10.0 if engine else None)

    unit = {64: point("bare", "jpeg", 64, 600.0), 16: point("bare", "jpeg", 16, 500.0)}
    points = [point("process", "jpeg", 16, 800.0, 70.0), point("process", "jpeg", 64, 840.0, 70.0),
              point("process", "jpeg", 1, 900.0, 70.0)]  # no unit at C=1: nothing to check there
    bracket(points, unit, unit)
    lines = verdicts(points, [64, 16, 1, 16])
    assert [line for line in lines if line.startswith("At C=")] == ["At C=16:", "At C=64:"]
    at_16, at_64 = lines[:lines.index("At C=64:")], lines[lines.index("At C=64:"):]
    # 800 / 500 = 1.6 units over the 1.5, 840 / 600 = 1.4 within; the engine's (70 - 10) / 500 and / 600
    assert "- process: HTTP side per one-image request (raw): 1.600 units, budget 1.5 (OVER)" in at_16
    assert "- process: HTTP side per one-image request (raw): 1.400 units, budget 1.5 (within)" in at_64
    assert any(line.startswith("- process: engine per image beyond decode and forward, 1 per request: 0.120 units")
               and line.endswith("(OVER)") for line in at_16)
    assert any(line.startswith("- process: engine per image beyond decode and forward, 1 per request: 0.100 units")
               and line.endswith("(within)") for line in at_64)


def test_a_server_tree_s_cpu_counts_no_engine_that_restarted_in_between() -> None:
    from bench.usage import tree_cpu_spent

    engine = "python -m app.link.server 0"
    before = {1: ("gunicorn: master", 1.0), 2: ("gunicorn: worker", 5.0), 3: (engine, 10.0)}
    assert tree_cpu_spent(before, {1: ("gunicorn: master", 1.5), 2: ("gunicorn: worker", 7.0),
                                   3: (engine, 13.0)}) == (5.5, 3.0)
    # the engine restarted (pid 4): neither its CPU nor its predecessor's is in both readings; it read 0 before
    assert tree_cpu_spent(before, {1: ("gunicorn: master", 1.5), 2: ("gunicorn: worker", 7.0),
                                   4: (engine, 0.4)}) == (2.5, None)
    assert tree_cpu_spent({1: ("bare", 1.0)}, {1: ("bare", 2.0)}) == (1.0, None)  # no engine


def test_the_engine_alone_counts_only_the_requests_it_answered_with_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    import app.hosting.procstat
    from bench.serving import engine_only

    cpu = iter([10.0, 12.0])  # 2 s of the engine's CPU in the measured run
    monkeypatch.setattr(app.hosting.procstat, "cpu_and_memory", lambda pid: (next(cpu), 0))
    counts = iter([{}, {"decode": 0.0, "forward": 0.5, engine_only.BATCHES: 10.0, engine_only.BATCHED_IMAGES: 100.0}])
    monkeypatch.setattr(engine_only, "engine_counts", lambda: next(counts))
    runs = iter([(50, 0), (2000, 1000)])  # the warm-up, then 2,000 answers of which 1,000 errors
    measured = engine_only._measured(lambda seconds: next(runs), 1, "v2 x1", 16, 1.0, 1)
    assert measured["engine_us_per_image"] == pytest.approx(2000.0)  # 2 s over the 1,000 answered with rows
    assert measured["beyond_us_per_image"] == pytest.approx(1500.0) and measured["errors"] == 1000


def test_the_engine_alone_s_photo_forms_send_real_photos_of_their_size_in_turn() -> None:
    import io

    from PIL import Image

    from app.link import wire
    from bench.serving import engine_only

    kind, count = engine_only.FORMS["photo 320x240 x16"]
    requests = engine_only._requests(wire, kind, count)
    assert len(requests) == 8 and all(len(photos) == 16 for _, photos in requests)
    photos = requests[0][1]
    assert {Image.open(io.BytesIO(data)).size for data in photos} == {(320, 240)}
    assert len(set(photos)) == 5  # scikit-image's six photos in turn (its "cat" is "chelsea"), not one repeated
    assert engine_only.FORMS["photo 500x375"] == ("photo 500x375", 1)


@pytest.mark.slow
def test_the_engine_alone_and_the_floor_answer_tensor_requests_and_their_cpu_is_counted_per_image(
        tmp_path: Path) -> None:
    # bench.serving.engine_only: an engine process of this checkout driven over its socket with no HTTP worker
    from bench.serving import engine_only
    from bench.serving.tiny_work import tiny_weights

    weights = tiny_weights(tmp_path / "weights")
    point = engine_only.measure(engine_only.ROOT, weights, "v2 x16", concurrency=2, seconds=0.5)  # one start: ~6 s
    assert point["errors"] == 0 and point["requests_per_s"] > 0 and point["engine_us_per_request"] > 0
    assert point["engine_us_per_image"] * 16 == pytest.approx(point["engine_us_per_request"])
    # the forward passes' CPU as the engine's metrics count it, the rest beyond it (V2 tensors: no decode)
    assert 0 < point["forward_us_per_image"] < point["engine_us_per_image"] and point["decode_us_per_image"] == 0
    assert 16 <= point["mean_batch"] <= 32  # its batches as its metrics count them: whole requests, two at most
    # the floor with its requests several to a message (--clients messages, as loop links send them), and apart with
    # a client thread per connection (--clients threads): ~2 s each; its forward passes counted as the engine counts
    # its own
    for clients in ("messages", "threads"):
        floor = engine_only.measure(engine_only.ROOT, weights, "v2 x1", concurrency=2, seconds=0.5, floor=True,
                                    clients=clients)
        assert floor["errors"] == 0 and floor["requests_per_s"] > 0 and floor["engine_us_per_request"] > 0
        assert 0 < floor["forward_us_per_image"] < floor["engine_us_per_image"]
        assert 1 <= floor["mean_batch"] <= 2  # as the engine counts its own: two clients, one image each


@pytest.mark.slow
def test_the_instruction_count_s_client_sends_a_burst_several_requests_a_message_as_loop_links_do(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # --instructions --clients messages: each burst on two connections, several requests a message (Infers), every
    # one answered before the next burst; the count zeroed after the warm-up and dumped after the counted ones
    from bench.serving import callgrind, engine_only
    from bench.serving.tiny_work import tiny_weights

    from app.link import wire

    weights, told, sent = tiny_weights(tmp_path / "weights"), [], []
    monkeypatch.setattr(callgrind, "callgrind_control", lambda pid, option: told.append(option))
    real_send = wire.send
    monkeypatch.setattr(wire, "send", lambda sock, message, segments=(): (sent.append(message),
                                                                          real_send(sock, message, segments)))
    with engine_only._engine(engine_only.ROOT, ["--serve", str(engine_only.ROOT), str(weights)], "cpu") as (
            engine, sock, _):
        engine_only.count(engine_only.ROOT, sock, "v2 x1", 12, engine.pid, burst=6, clients="messages")
        infers = [message for message in sent if isinstance(message, wire.Infers)]
        assert told == ["--instr=on", "--zero", "--dump"] and len(infers) == len(sent)
        assert [len(message.ids) for message in infers] == [3] * (2 * (9 + 2))  # the warm-up's 54, then 12: by 3
        sent.clear()  # --links 3: as three HTTP workers' loop links, by 2
        engine_only.count(engine_only.ROOT, sock, "v2 x1", 12, engine.pid, burst=6, clients="messages", links=3)
    assert [len(message.ids) for message in sent] == [2] * (3 * (9 + 2))


def test_the_engine_alone_and_its_floor_are_told_beyond_their_forward_passes_in_the_run_s_unit() -> None:
    from bench.serving.overhead import AT_HEADLINE, AT_SERVED, alone_table

    def found(beyond: float | None, errors: int = 0, clients: int = 16,
              batch: float | None = 9.0) -> dict[str, float | None]:
        return {"concurrency": clients, "mean_batch": batch, "requests_per_s": 1000.0,
                "engine_us_per_image": (beyond or 0.0) + 50.0, "forward_us_per_image": None if beyond is None else 50.0,
                "beyond_us_per_image": beyond, "errors": errors}

    alone = {("engine alone", "v2 x1", AT_HEADLINE): [found(400.0), found(200.0, errors=2, batch=7.0), found(100.0)],
             ("engine alone", "v2 x1", AT_SERVED): [found(300.0, clients=5, batch=3.5)],
             ("floor", "v2 x16", AT_HEADLINE): [found(10.0, batch=None)]}
    rows = [line.split(" | ") for line in alone_table(alone, 500.0, 16)
            if line.startswith(("| engine alone", "| floor"))]
    # medians (not means, firsts or lasts) in us and in the run's unit, the budget of the form, the errors summed;
    # the clients and the batches each ran ("-": not counted)
    assert [row[2:4] + row[7:] for row in rows] == [["16", "9.0", "200", "0.400", "0.1", "2 |"],
                                                    ["5", "3.5", "300", "0.600", "0.1", "0 |"],
                                                    ["16", "-", "10", "0.020", "0.04", "0 |"]]
    assert alone_table(alone, None, 16)[4].split(" | ")[8] == "-"  # no unit measured at that C: no figure in units
    # an engine that does not count its forward passes (another checkout's): nothing told beyond them
    [unknown] = [line for line in alone_table({("engine alone", "v2 x1", AT_HEADLINE): [found(None)]}, 500.0, 16)
                 if line.startswith("| engine alone")]
    assert unknown.split(" | ")[6:9] == ["-", "-", "-"]


def test_the_engine_alone_and_its_floor_run_again_at_the_batches_the_served_engine_ran() -> None:
    from bench.serving.overhead import AT_HEADLINE, AT_SERVED, alone_clients

    def served(batch: float | None, images: int = 1) -> Point:
        return Point("process", f"v2 x{images}", images, 16, 1.0, 1.0, 1.0, 1.0, 0, 900.0, 200.0, mean_batch=batch)

    assert alone_clients(served(5.3), 16) == {AT_HEADLINE: 16, AT_SERVED: 5}
    assert alone_clients(served(29.3, images=16), 16) == {AT_HEADLINE: 16, AT_SERVED: 2}  # batches of requests
    assert alone_clients(served(0.4), 16) == {AT_HEADLINE: 16, AT_SERVED: 1}
    assert alone_clients(served(15.6), 16) == {AT_HEADLINE: 16}  # the same clients: not run twice
    assert alone_clients(served(None), 16) == alone_clients(None, 16) == {AT_HEADLINE: 16}  # no batches counted


def test_an_engine_that_runs_smaller_batches_than_its_clients_is_run_again_with_more_until_it_reaches_the_served_ones(
        ) -> None:
    from bench.serving.overhead import at_batch

    ran: list[int] = []

    def run(batch_of: dict[int, float | None]) -> object:
        def at(clients: int) -> dict[str, float | None]:
            ran.append(clients)
            return {"concurrency": clients, "mean_batch": batch_of[clients]}
        return at

    assert at_batch(run({5: 2.0, 10: 4.0, 16: 6.0}), 5, 5.3, 16)["concurrency"] == 16 and ran == [5, 10, 16]
    ran.clear()
    assert at_batch(run({5: 4.8}), 5, 5.3, 16)["concurrency"] == 5 and ran == [5]  # within a tenth: as it is
    ran.clear()
    assert at_batch(run({5: 1.0}), 5, None, 16)["concurrency"] == 5 and ran == [5]  # no batch to reach
    ran.clear()
    assert at_batch(run({16: 3.0}), 16, 5.3, 16)["concurrency"] == 16 and ran == [16]  # never past the headline C
    ran.clear()
    assert at_batch(run({5: None, 10: 6.0}), 5, 5.3, 16)["concurrency"] == 10  # none counted: below any batch


@pytest.mark.slow
def test_the_http_side_breakdown_runs_every_step_against_an_engine_and_reports_it() -> None:
    # bench.serving.http_side, as docs/performance.md shows it: an engine process, the app through WSGI (~15 s)
    short = Path(tempfile.mkdtemp(prefix="vs-"))  # its temporary folder (a pytest one is too long a socket's path)
    try:
        done = subprocess.run([sys.executable, "-m", "bench.serving.http_side", "--smoke", "--forms", "v2 x1"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "TMPDIR": str(short)})
        assert done.returncode == 0, done.stderr[-2000:]
        assert not list(short.glob("visionserve-http-side-*"))  # its CONTROL_DIR and metrics gone (one left a run)
    finally:
        shutil.rmtree(short, ignore_errors=True)
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| v2 x1 |")]
    assert [row[1] for row in rows] == ["bare app", "the app", "without the exchange", "and the timing headers",
                                        "and the hooks"]
    assert all(float(row[2]) > 0 for row in rows)


def test_instructions_per_request_are_callgrind_s_count_of_the_requests_alone(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # http_side --instructions: counting zeroed before a step's requests, dumped after them, the dump's total per
    # request (a stand-in callgrind_control writes the dumps valgrind's would, numbered as callgrind numbers them)
    import bench.serving.bare_app as bare
    from bench.serving import http_side
    from bench.serving.overhead import forms
    from bench.serving.tiny_work import padded_jpeg

    calls = tmp_path / "calls"
    control = tmp_path / "bin" / "callgrind_control"
    control.parent.mkdir()
    control.write_text(f'#!/bin/sh\necho "$1" >> {calls}\nif [ "$1" = --dump ]; then n=$(grep -c -- --dump {calls}); '
                       f'printf "events: Ir\\nsummary: $((n * 1000))\\n" > {tmp_path}/callgrind.out.$n; fi\n')
    control.chmod(0o755)
    monkeypatch.setenv("PATH", f"{control.parent}:{os.environ['PATH']}")
    monkeypatch.setenv(http_side.CALLGRIND_OUT, str(tmp_path / "callgrind.out"))
    monkeypatch.setattr(http_side.gc, "collect", lambda: 0)  # a second a call in a process this large: not counted
    jpeg = forms([padded_jpeg(0)])["jpeg"]
    assert http_side.instructions_per_request(bare.app, jpeg, 4) == 250  # the first dump: 1,000 over 4 requests
    for _ in range(9):  # the tenth dump is the newest, not the last by name
        http_side.instructions_per_request(bare.app, jpeg, 4)
    assert http_side.instructions_per_request(bare.app, jpeg, 4) == 2750
    assert calls.read_text().split()[:3] == ["--instr=on", "--zero", "--dump"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed (apt-get install valgrind)")
def test_the_http_side_counts_instructions_under_valgrind_as_docs_performance_shows() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.serving.http_side", "--instructions", "--smoke", "--forms",
                           "v2 x1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| v2 x1 |")]
    assert [row[1] for row in rows][:2] == ["bare app", "the app"] and all(float(row[2]) > 1000 for row in rows)


def test_the_floor_s_instruction_count_offers_it_no_arena_as_its_timed_run_does(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # --instructions --floor --clients messages: the floor reads no arena offer, so its client must make none (as
    # ``measure`` tells it); the engine of this checkout is offered one as its loop links offer it
    import contextlib
    import types

    from bench.serving import callgrind, engine_only

    started: list[tuple[list[str], dict[str, str]]] = []

    @contextlib.contextmanager
    def engine(checkout: Path, serve_args: list[str], device: str, wrapper: tuple[str, ...] = (),
               max_batch_size: int = 0, settings: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
        started.append((serve_args, dict(settings or {})))
        yield types.SimpleNamespace(pid=1), tmp_path / "engine.sock", {**os.environ, **(settings or {})}

    monkeypatch.setattr(engine_only, "_engine", engine)
    monkeypatch.setattr(engine_only.subprocess, "run", lambda *args, **kwargs: None)
    monkeypatch.setattr(callgrind, "callgrind_total", lambda out: 1_920_000)
    for floor in (True, False):
        counted = engine_only.instructions(engine_only.ROOT, tmp_path, "v2 x1", 192, burst=16, floor=floor,
                                           clients="messages")
        assert counted["instructions_per_request"] == 10_000
    assert started[0][0][0] == "--serve-floor" and started[0][1]["VISIONSERVE_LINK_ARENA_MB"] == "0"
    assert started[1][0][0] == "--serve" and "VISIONSERVE_LINK_ARENA_MB" not in started[1][1]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed (apt-get install valgrind)")
def test_the_engine_counts_instructions_under_valgrind_for_requests_sent_a_few_at_a_time() -> None:
    # two at a time, each on a connection of its own (a turn's requests: --burst), counted per request sent
    done = subprocess.run([sys.executable, "-m", "bench.serving.engine_only", "--instructions", "--forms", "v2 x16",
                           "--requests", "3", "--burst", "2"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "requests a point sent 2 at a time" in done.stdout
    [row] = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| this | v2 x16 |")]
    per_request, per_image = float(row[2]), float(row[3].rstrip(" |"))
    assert per_request > 100_000 and per_image == pytest.approx(per_request / 16, rel=1e-3)


def test_the_engine_s_instruction_count_puts_the_floor_s_beside_for_the_v2_forms(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # --instructions --floor: each form counted on this checkout, and the V2 ones on the floor's engine too (the floor
    # decodes nothing); the report names the floor's rows (the counts here stand in for callgrind's)
    from bench.serving import engine_only
    from bench.serving import tiny_work

    counted: list[tuple[str, bool]] = []

    def count(checkout: Path, weights: Path, form: str, requests: int, max_batch_size: int, burst: int,
              floor: bool = False, clients: str = "loop", links: int = 2) -> dict[str, float]:
        counted.append((form, floor))
        return {"form": form, "instructions_per_request": 200_000 if floor else 300_000,
                "instructions_per_image": 200_000 if floor else 300_000}

    monkeypatch.setattr(engine_only, "instructions", count)
    monkeypatch.setattr(tiny_work, "tiny_weights", lambda out: tmp_path)
    assert engine_only.main(["--instructions", "--floor", "--forms", "v2 x1", "jpeg"]) == 0
    assert sorted(counted) == [("jpeg", False), ("v2 x1", False), ("v2 x1", True)]
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert "| floor | v2 x1 | 200000 | 200000 |" in rows and "| this | v2 x1 | 300000 | 300000 |" in rows
    assert not any(row.startswith("| floor | jpeg") for row in rows)


def test_the_engine_alone_with_settings_beside_runs_in_the_same_rounds_and_its_engine_gets_them(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # --with-settings: this checkout's engine again with those environment variables, round by round beside the
    # plain one, its rows named by them (the points here stand in for the engines')
    from bench.serving import engine_only
    from bench.serving import tiny_work

    measured: list[dict[str, str] | None] = []

    def measure(checkout: Path, weights: Path, form: str, concurrency: int, seconds: float, device: str, clients: str,
                max_batch_size: int, settings: dict[str, str] | None = None, links: int = 2) -> dict[str, float]:
        measured.append(settings)
        return {"requests_per_s": 200.0 if settings else 100.0, "mean_batch": 4.0, "engine_us_per_request": 10.0,
                "engine_us_per_image": 10.0, "decode_us_per_image": 0.0, "forward_us_per_image": 1.0,
                "beyond_us_per_image": 9.0, "errors": 0}

    monkeypatch.setattr(engine_only, "measure", measure)
    monkeypatch.setattr(tiny_work, "tiny_weights", lambda out: tmp_path)
    setting = "VISIONSERVE_ENGINE_LOOP_BATCH_MS=0"
    assert engine_only.main(["--forms", "v2 x1", "--rounds", "2", "--with-settings", setting]) == 0
    assert measured == [None, {"VISIONSERVE_ENGINE_LOOP_BATCH_MS": "0"}] * 2  # alternating, round by round
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| this")]
    assert [row.split(" | ")[:4] for row in rows] == [["| this", "v2 x1", "16", "100"],
                                                      [f"| this, {setting}", "v2 x1", "16", "200"]]
    with pytest.raises(SystemExit):
        engine_only.main(["--with-settings", "VISIONSERVE_ENGINE_LOOP_BATCH_MS"])  # not a KEY=VALUE pair

    started: list[dict[str, str]] = []

    class Engine:  # what _engine starts, standing in for the engine's process: ready at once
        returncode = None

        def __init__(self, command: list[str], cwd: Path, env: dict[str, str]) -> None:
            started.append(env)
            Path(f"{command[-2]}.ready").touch()

        def poll(self) -> None:
            return None

        def kill(self) -> None:
            pass

        def wait(self) -> int:
            return 0

    monkeypatch.setattr(engine_only.subprocess, "Popen", Engine)
    with engine_only._engine(engine_only.ROOT, ["--serve"], "cpu", settings={"VISIONSERVE_ENGINE_LOOP_BATCH_MS": "0"}):
        pass
    assert started[0]["VISIONSERVE_ENGINE_LOOP_BATCH_MS"] == "0" and "PROMETHEUS_MULTIPROC_DIR" in started[0]


def test_the_bare_app_with_a_wait_sleeps_that_long_before_it_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    # bare-wait: the unit's request when it waits, as a request in process mode waits for its engine
    import bench.serving.bare_app as bare

    slept: list[float] = []
    monkeypatch.setattr(bare.time, "sleep", slept.append)
    client = bare.app.test_client()
    assert client.post("/predict", data=b"abc").get_json() == {"bytes": 3, "label": "bare"} and slept == []
    monkeypatch.setattr(bare, "WAIT_S", 0.02)
    assert client.post("/predict", data=b"abcd").get_json() == {"bytes": 4, "label": "bare"} and slept == [0.02]


def test_the_benchmarks_gpu_ceiling_is_the_servers_automatic_one_on_a_gpu() -> None:
    # engine_only keeps its own copy: it may not import app before it chose which checkout's app to run
    from app.config import AUTO_MAX_BATCH_SIZE
    from bench.serving import engine_only

    assert engine_only.GPU_BATCH_CEILING == AUTO_MAX_BATCH_SIZE["cuda"]


def test_our_servers_warm_up_on_cuda_as_served_there_and_not_on_the_cpu(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    # on CUDA the warm-up captures the forward passes as CUDA graphs: a device's figures are then the served path's
    from bench.serving import overhead

    started: list[dict[str, str]] = []
    monkeypatch.setattr(overhead, "visionserve", lambda weights, logs, *args, **settings: started.append(settings))
    for device in ("cpu", "cuda"):
        args = argparse.Namespace(device=device, workers=2, max_batch_size=0, servers=["process", "inline"],
                                  checkout=[], bare_wait_ms=0.0)
        for start in overhead.starters(args, tmp_path, tmp_path).values():
            start()
    assert [(s["device"], s["engine"], s["warmup"]) for s in started] == [
        ("cpu", "process", "false"), ("cpu", "inline", "false"), ("cuda", "process", "true"), ("cuda", "inline", "true")]


def test_the_engine_alone_warms_up_on_cuda_as_served_there_and_not_on_the_cpu(tmp_path: Path) -> None:
    from app.config import Settings
    from bench.serving.engine_only import engine_settings

    assert [engine_settings(Settings, tmp_path, device).warmup for device in ("cpu", "cuda", "cuda:1")] == [
        False, True, True]
