"""A server that stops making progress without dying: a forward pass that hangs (inline and across the link, where
the probes read the engine's state answer), and an engine process that stops answering (a loop stuck, SIGSTOP): new
requests are refused at once, and the master kills such an engine so that it is restarted. The settings' bounds
are made small; every wait is for a condition."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from flask import Flask
from flask.testing import FlaskClient

from app import EXTENSION_KEY
from app.config import Settings
from app.engine.batching.batcher import Batcher
from app.engine.loaded.predictor import Predictor
from app.engine.service import Service
from app.errors import NotReady
from app.factory import create_app, default_protocols
from app.hosting import control
from app.link import client as client_module
from app.link import supervisor, wire
from app.link.client import RemoteService
from app.link.loop import EngineServer
from app.web import init_app
from tests.support.answers import error_of
from tests.support.fakes import ColourModel, infer, wait_until
from tests.support.imaging import RED, image_bytes
from tests.support.master import engines_started_as

STALL_S = 0.2  # STALL_S in these tests


@contextlib.contextmanager
def _engine_loop_stuck(linked: Linked, hold_s: float = 10) -> Iterator[None]:
    """The engine's loop stuck (at most ``hold_s``) for the block: it answers nothing, as one stopped would."""
    entered, stuck = threading.Event(), threading.Event()
    linked.server._post(lambda: (entered.set(), stuck.wait(hold_s)))
    try:
        assert entered.wait(10)
        yield
    finally:
        stuck.set()


def _post(client: FlaskClient) -> int:
    return client.post("/predict", data=image_bytes(RED), content_type="image/png").status_code


# -- the batcher records the batch running now -------------------------------------------------------------------


def test_the_batch_running_now_is_timed_from_its_start_on_any_thread_and_warm_up_is_no_batch() -> None:
    gate, warming, warm = threading.Event(), threading.Event(), threading.Event()

    def predict(items: list[int]) -> list[int]:
        gate.wait(10)
        return items

    def prepare() -> None:
        warming.set()
        warm.wait(10)

    batcher: Batcher[int, int] = Batcher(predict, max_batch_size=4, max_wait_ms=0, queue_size=8,
                                         inline_when_idle=True)
    starting = threading.Thread(target=batcher.start, args=(prepare,))
    starting.start()
    try:
        assert warming.wait(10) and batcher.running_since() is None  # warm-up (prepare) runs: no batch
        warm.set()
        starting.join(10)
        before = time.monotonic()
        caller = threading.Thread(target=lambda: batcher.submit(1).result(10))  # runs on its own thread (idle)
        caller.start()
        wait_until(lambda: batcher.running_since() is not None)
        assert before <= batcher.running_since() <= time.monotonic() and batcher.batches_inline == 1
        gate.set()
        caller.join(10)
        assert batcher.running_since() is None  # none runs
        gate.clear()
        held = batcher.submit_many([1, 2], inline=False)  # the worker's thread
        wait_until(lambda: batcher.running_since() is not None)
        gate.set()
        assert [f.result(10).value for f in held] == [1, 2]
        wait_until(lambda: batcher.running_since() is None)
    finally:
        warm.set()
        gate.set()
        batcher.stop(5)


# -- a forward pass that hangs, inline -------------------------------------------------------------------------------


def test_a_batch_past_stall_s_fails_liveness_and_readiness_naming_it_and_its_requests_get_503(
        settings: Settings, predictor: Predictor, model: ColourModel, caplog: pytest.LogCaptureFixture) -> None:
    # Before: /healthz and /readyz only asked whether the batcher's thread existed: with a forward pass blocked,
    # both said 200 while every request waited out its deadline (504) and the queue grew; nothing restarted it.
    app = create_app(settings.model_copy(update={"stall_s": STALL_S}), predictor)
    client = app.test_client()
    try:
        assert client.get("/healthz").status_code == 200 and client.get("/readyz").status_code == 200
        model.gate = threading.Event()
        held = threading.Thread(target=_post, args=(client,))
        with caplog.at_level(logging.ERROR, logger="app.engine.service"):
            held.start()
            wait_until(lambda: client.get("/healthz").status_code == 503)
            health, ready = client.get("/healthz").get_json(), client.get("/readyz")
            assert health["status"] == "dead" and not health["checks"]["batcher_thread"]
            assert "colour version test: its batch has run" in health["reason"] and "STALL_S" in health["reason"]
            assert ready.status_code == 503 and ready.get_json()["reason"].startswith("model colour version test")
            refused = client.post("/predict", data=image_bytes(RED), content_type="image/png")
            assert "stuck" in error_of(refused, 503, "not_ready")["message"] and refused.headers["Retry-After"]
            assert client.get("/v2/health/live").status_code == 503
        said = [r.getMessage() for r in caplog.records if "liveness fails" in r.getMessage()]
        assert len(said) == 1 and "colour version test" in said[0]  # once a batch, however often it is asked
        model.gate.set()
        held.join(10)
        assert client.get("/healthz").status_code == 200 and client.get("/readyz").status_code == 200
        assert "reason" not in client.get("/healthz").get_json() and _post(client) == 200
    finally:
        if model.gate is not None:
            model.gate.set()
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


# -- across the link ---------------------------------------------------------------------------------------------


class Linked:
    """An engine (Service + EngineServer, its batches on the batcher's thread) and an HTTP worker's app over its
    RemoteService, joined by socket pairs as tests/app/test_link.py joins them."""

    def __init__(self, settings: Settings, predictor: Predictor, control_dir: Path) -> None:
        control_dir.mkdir(exist_ok=True)
        self.engine = Service.build(settings, predictor)
        self.server = EngineServer(self.engine)
        self.server._loop_batch_s = 0.0  # every batch on the batcher's thread, as on a GPU: the loop stays free
        self.connections: list[socket.socket] = []
        self.worker = RemoteService(settings.model_copy(update={"control_dir": control_dir}), 0,
                                    connect=self._connect)
        self.worker._started.set()  # as RemoteService.start does once the engine says it is ready
        control.ready_mark(control_dir, os.getpid()).touch()
        self.app = Flask(__name__)
        init_app(self.app, settings, self.worker, default_protocols())
        self.client = self.app.test_client()

    def _connect(self) -> socket.socket:
        worker_end, engine_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.connections.append(engine_end)
        self.server.serve(engine_end)
        return worker_end


@pytest.fixture
def linked(settings: Settings, predictor: Predictor, tmp_path: Path) -> Iterator[Linked]:
    joined = Linked(settings.model_copy(update={"stall_s": STALL_S}), predictor, tmp_path / "control")
    yield joined
    joined.server.stop(5)  # as at a SIGTERM: the counts its loop holds written too


@pytest.mark.slow
def test_an_engine_whose_batch_runs_past_stall_s_says_so_in_its_state_answer_and_the_worker_s_probes_fail(
        linked: Linked, model: ColourModel) -> None:
    # Before (ENGINE=process): the engine's state answer said alive and ready with its forward pass blocked, so the
    # HTTP workers' /healthz and /readyz said 200 while every request got 504.
    client = linked.client
    assert client.get("/healthz").status_code == 200 and client.get("/readyz").status_code == 200
    model.gate = threading.Event()
    held = threading.Thread(target=lambda: infer(linked.worker, [image_bytes(RED)], timeout_s=10))
    held.start()
    try:
        # the engine's loop answers its state queries while its batcher's thread is held by the batch
        wait_until(lambda: client.get("/healthz").status_code == 503)
        health, ready = client.get("/healthz").get_json(), client.get("/readyz")
        assert health["status"] == "dead" and "model colour version test: its batch has run" in health["reason"]
        assert ready.status_code == 503 and "STALL_S" in ready.get_json()["reason"]
        refused = client.post("/predict", data=image_bytes(RED), content_type="image/png")
        assert "stuck" in error_of(refused, 503, "not_ready")["message"]  # refused by the engine, at once
    finally:
        model.gate.set()
    held.join(10)
    wait_until(lambda: client.get("/healthz").status_code == 200)
    assert client.get("/readyz").status_code == 200 and _post(client) == 200


@pytest.mark.slow
def test_a_worker_sends_no_request_to_an_engine_whose_latest_state_query_went_unanswered(
        linked: Linked, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: requests were sent to an engine that answered nothing (SIGSTOP, its loop stuck) and each waited twice
    # its deadline plus 5 s for a 504, however often the engine's state had gone unanswered.
    monkeypatch.setattr(client_module, "STATE_TIMEOUT_S", 0.2)
    client = linked.client
    assert _post(client) == 200
    # The watch of the engine (as _follow_engine runs it) starts once the loop answers again: while it is stuck,
    # each of the watch's queries would take a new connection (an unanswered one's is closed), and the count of
    # connections below tells that no request was sent (on a loaded machine a query fell between the counts).
    watch = threading.Thread(target=linked.worker._engine_gone, daemon=True)
    with _engine_loop_stuck(linked):
        ready = client.get("/readyz")  # its state query goes unanswered: the reason says so
        assert ready.status_code == 503 and "did not answer its state query" in ready.get_json()["reason"]
        assert client.get("/healthz").status_code == 200  # the master restarts a silent engine (below)
        connections = len(linked.connections)
        with pytest.raises(NotReady, match="did not answer its latest state query") as refused:
            infer(linked.worker, [image_bytes(RED)], timeout_s=0.5)
        assert refused.value.headers["Retry-After"]
        assert len(linked.connections) == connections  # not sent: no connection tried
        answer = client.post("/predict", data=image_bytes(RED), content_type="image/png")
        error_of(answer, 503, "not_ready")
        assert answer.headers.get("Connection") != "close"  # no other worker serves: reconnecting would gain nothing
        other = control.ready_mark(linked.worker.control_dir, os.getppid())
        other.touch()  # another live worker, whose engine serves
        answer = client.post("/predict", data=image_bytes(RED), content_type="image/png")
        error_of(answer, 503, "not_ready")
        assert answer.headers["Connection"] == "close"  # a client kept on this worker reconnects, maybe to that one
        other.unlink()
        assert len(linked.connections) == connections
    watch.start()
    # No probe asks again: the watch of the engine does, within WAIT_S, not at the end of its WATCH_S (5 s) wait
    wait_until(lambda: _post(client) == 200, timeout=2.5)
    linked.worker._stopped.set()
    watch.join(5)


@pytest.mark.slow
def test_an_engine_silent_past_silent_away_s_takes_its_worker_out_of_serving_until_it_answers_again(
        linked: Linked, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Before: a stopped engine's worker kept its ready mark, so the other workers' /readyz said 200 while its own
    # said 503 (readiness flipped from call to call behind one port: an ops trial with two engines, one stopped), it
    # took its share of new connections to answer them 503, and each of its probes waited for a state query.
    monkeypatch.setattr(client_module, "STATE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(client_module, "SILENT_AWAY_S", 0.3)
    worker, client = linked.worker, linked.client
    asked: list[str] = []  # the threads that asked the engine its state
    exchange = worker._exchange

    def counted(message: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(message, wire.StateQuery):
            asked.append(threading.current_thread().name)
        return exchange(message, *args, **kwargs)

    monkeypatch.setattr(worker, "_exchange", counted)
    other = control.ready_mark(worker.control_dir, os.getppid())  # another live worker, whose engine serves
    other.touch()
    assert _post(client) == 200
    watch = threading.Thread(target=worker._engine_gone, name="watch", daemon=True)  # as _follow_engine runs it
    watch.start()
    try:
        with caplog.at_level(logging.INFO, logger=client_module.log.name):
            with _engine_loop_stuck(linked):
                assert client.get("/readyz").status_code == 503  # a probe finds it silent (or the watch's next query)
                wait_until(lambda: not worker.ready_mark.exists(), timeout=5)
                assert not control.takes_connections(worker.control_dir, os.getpid())  # left to the other worker
                asked.clear()
                for _ in range(4):  # each past the state's time to live: a probe would have asked again
                    time.sleep(2 * client_module.STATE_TTL_S)
                    assert client.get("/readyz").status_code == 503 and client.get("/healthz").status_code == 200
                assert threading.current_thread().name not in asked  # the probes took the watch's answer
            wait_until(worker.ready_mark.exists, timeout=5)  # answering again: serving again
            # said right after the mark is written again (read at once, it was unsaid once in 50 runs)
            wait_until(lambda: any("engine 0 answers again" in r.getMessage() for r in caplog.records), timeout=5)
        assert control.takes_connections(worker.control_dir, os.getpid()) and _post(client) == 200
        said = [r.getMessage() for r in caplog.records]
        assert any("engine 0, this HTTP worker's, does not answer its state queries" in line for line in said)
        with _engine_loop_stuck(linked):  # silent again, and a drain begins meanwhile (a HUP, a SIGTERM)
            wait_until(lambda: client.get("/readyz").status_code == 503)
            wait_until(lambda: worker._silent_shown, timeout=5)
            worker.begin_drain()
            assert not worker.leaving_mark.exists()  # it answers nothing new: no worker leaves its connections to it
        wait_until(worker.leaving_mark.exists, timeout=5)  # answering again within its drain: it says so
    finally:
        other.unlink(missing_ok=True)
        worker._stopped.set()
        watch.join(5)


def test_a_drain_that_read_the_ready_mark_as_the_engine_fell_silent_writes_no_leaving_mark(
        linked: Linked, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the drain read the ready mark (there: it served), the watch then took both marks away as the engine fell
    # silent, and the drain wrote its leaving mark after that: a worker answering nothing new said it still answers,
    # so a HUP's new worker left the new connections to it (503s). Seen once in the suite; here the watch's step runs
    # at that moment every time.
    monkeypatch.setattr(client_module, "STATE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(client_module, "SILENT_AWAY_S", 0.0)
    worker = linked.worker
    mark_leaving = worker._mark_leaving

    def watch_first() -> None:
        worker._engine_serves()  # the watch's look, between the drain's reading of the ready mark and its write
        assert worker._silent_shown and not worker.ready_mark.exists()
        mark_leaving()

    monkeypatch.setattr(worker, "_mark_leaving", watch_first)
    assert _post(linked.client) == 200 and worker.ready_mark.exists()
    with _engine_loop_stuck(linked):
        worker.begin_drain()
        assert not worker.leaving_mark.exists()  # it answers nothing new: no worker leaves its connections to it
    monkeypatch.setattr(worker, "_mark_leaving", mark_leaving)
    wait_until(lambda: (worker._engine_serves(), not worker._silent_shown)[1], timeout=5)
    assert worker.leaving_mark.exists()  # answering again within its drain: it says so


@pytest.mark.slow
def test_a_request_sent_before_any_state_query_went_unanswered_is_answered_within_its_deadline_and_the_grace(
        linked: Linked, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: a request sent to an engine that had just stopped answering (no state query had found it silent yet)
    # waited twice its deadline plus the grace for its 504: 4.2 s here, 65 s with the default REQUEST_TIMEOUT_S.
    monkeypatch.setattr(client_module, "ANSWER_GRACE_S", 0.2)
    client = linked.client
    assert _post(client) == 200
    with _engine_loop_stuck(linked):
        assert not linked.worker._engine_silent  # so the request is sent
        started = time.monotonic()
        answer = client.post("/predict", data=image_bytes(RED), content_type="image/png",
                             headers={"X-Request-Timeout": "2000"})
        took_s = time.monotonic() - started
        assert "no answer from the engine" in error_of(answer, 504, "deadline_exceeded")["message"]
        assert took_s < 2 + 0.2 + 1  # its deadline and the grace, with room for a loaded machine
    wait_until(lambda: _post(client) == 200)


@pytest.mark.slow
def test_no_catalog_call_is_sent_to_an_engine_whose_latest_state_query_went_unanswered_and_the_probes_answer(
        settings: Settings, predictor: Predictor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: only requests were refused then: /v1/models, a model's metadata, the repository index and a load were
    # sent, each waiting out its limit on an idle connection (REPOSITORY_SYNC_TIMEOUT_S + 10 s, 130 s by default; a
    # load's twice REPOSITORY_SYNC_TIMEOUT_S + 10 s) or the hello of a new one (2 s, here), for its 503 or 504.
    monkeypatch.setattr(client_module, "STATE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(client_module, "CATALOG_GRACE_S", 0.5)
    linked = Linked(settings.model_copy(update={"stall_s": STALL_S, "repository_sync_timeout_s": 3.0}), predictor,
                    tmp_path / "control")
    client = linked.client
    try:
        assert client.get("/v1/models").status_code == 200 and _post(client) == 200
        with _engine_loop_stuck(linked, hold_s=20):
            wait_until(lambda: client.get("/readyz").status_code == 503)  # its next state query goes unanswered
            assert client.get("/healthz").status_code == 200  # the master restarts a silent engine
            connections = len(linked.connections)
            calls = {"v1 models": lambda: client.get("/v1/models"),
                     "v2 metadata": lambda: client.get("/v2/models/colour"),
                     "v2 model ready": lambda: client.get("/v2/models/colour/ready"),
                     "repository index": lambda: client.post("/v2/repository/index", json={}),
                     "load": lambda: client.post("/v2/repository/models/colour/load", json={})}
            for what, call in calls.items():
                started = time.monotonic()
                answer = call()
                took_s = time.monotonic() - started
                assert answer.status_code == 503, what
                assert len(linked.connections) == connections, what  # not sent: no connection tried
                assert took_s < 1.5, what  # at once, not at the end of the call's limit
                if what == "v2 model ready":
                    assert answer.get_json()["ready"] is False
                else:
                    assert answer.headers["Retry-After"], what
            said = error_of(client.get("/v1/models"), 503, "not_ready")["message"]
            assert "did not answer its latest state query" in said
            assert "did not answer its latest state query" in client.get("/v2/models/colour").get_json()["error"]
            assert len(linked.connections) == connections
            assert client.get("/readyz").status_code == 503 and client.get("/healthz").status_code == 200
        wait_until(lambda: client.get("/readyz").status_code == 200)  # its next state query is answered
        assert client.get("/v1/models").status_code == 200 and _post(client) == 200
    finally:
        linked.engine.shutdown(timeout=5)


# -- the master and a silent engine ----------------------------------------------------------------------------------

# An engine as far as the master's state queries go: it listens on its socket and answers each (hello, StateQuery)
FAKE_ENGINE = """
import os, socket, sys
from app.link import wire
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[1])
listener.listen(64)
while True:
    conn, _ = listener.accept()
    with conn:
        try:
            head, _ = wire._receive_frame(conn)
            wire._answer_hello(conn, head)
            wire._receive_frame(conn)
            wire.send(conn, wire.Answer(wire.EngineState(True, True, True, False), None, os.getpid(), 1))
        except (wire.EngineGone, OSError):
            pass
"""


@pytest.mark.slow
def test_the_master_kills_an_engine_that_answers_no_state_query_for_stall_s_and_starts_it_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Before: an engine stopped (SIGSTOP) or with its loop stuck was never restarted: it kept its socket, the
    # workers kept sending it requests, and the master watched only for its exit.
    stall_s = 0.5
    spawned = engines_started_as(monkeypatch, lambda before: [FAKE_ENGINE, str(engine.socket)], answer_s=0.2)
    engine = supervisor.Engine(0, tmp_path, on_death=lambda pid: None, stall_s=stall_s)
    with caplog.at_level(logging.WARNING, logger="gunicorn.error"):
        engine.start()
        try:
            wait_until(lambda: engine.answered_at is not None, timeout=30)
            first, answering_since = engine.process, engine.answered_at
            wait_until(lambda: engine.answered_at - answering_since > 2 * stall_s)  # an engine that answers lives
            assert engine.restarts == 0 and first.poll() is None
            os.kill(first.pid, signal.SIGSTOP)
            wait_until(lambda: engine.restarts == 1, timeout=30)
            assert first.wait(10) == -signal.SIGKILL and engine.process is spawned[1]
            stopped_at = time.monotonic()
            wait_until(lambda: engine.answered_at > stopped_at, timeout=30)  # the new one answers
        finally:
            engine.signal_stop()
            for child in spawned:
                if child.poll() is None:
                    os.kill(child.pid, signal.SIGCONT)
            engine.wait_stopped(10)
    said = [r.getMessage() for r in caplog.records if "state queries" in r.getMessage()]
    assert len(said) == 1 and f"engine 0 (pid {first.pid})" in said[0] and "stopped or stuck" in said[0]
    assert any(f"(pid {first.pid}) died with status -9; restarting it" in r.getMessage() for r in caplog.records)


def test_a_worker_forked_while_the_master_asks_an_engine_closes_its_copy_of_that_connection() -> None:
    # Without it, the worker gunicorn forks in the instant a state query is open keeps a copy of the connection for
    # its whole life, and the engine keeps it open, idle.
    ours, engine_end = socket.socketpair()
    supervisor._QUERYING.add(ours.fileno())
    try:
        child = os.fork()
        if child == 0:  # pragma: no cover - the forked worker
            try:
                os.fstat(ours.fileno())
                os._exit(1)  # still open here
            except OSError:
                os._exit(0)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        os.fstat(ours.fileno())  # the master's own is untouched
    finally:
        supervisor._QUERYING.discard(ours.fileno())
        ours.close()
        engine_end.close()


@pytest.mark.slow
def test_a_requests_deadline_in_the_engine_counts_from_its_arrival_a_wait_for_a_decode_thread_included(
        linked: Linked) -> None:
    # Before: the engine counted it from the start of the request's decode, so one that waited for a decode thread
    # past its deadline was still decoded, run and answered 200, after it (the HTTP side waits only its deadline and
    # a grace for the engine's answer: a longer wait there was answered 504 by the HTTP side, the work done anyway)
    server, gate = linked.server, threading.Event()
    for _ in range(server.decode_shares.threads):  # every decode thread busy
        server._decoders.submit(gate.wait, 10)
    answers: list[Any] = []
    sent = threading.Thread(target=lambda: answers.append(linked.client.post(
        "/predict", data=image_bytes(RED), content_type="image/png", headers={"X-Request-Timeout": "300"})))
    sent.start()
    try:
        wait_until(lambda: server._decoders._work_queue.qsize() > 0)  # it waits for a decode thread
        time.sleep(0.5)  # past its deadline
    finally:
        gate.set()
    sent.join(10)
    assert "deadline" in error_of(answers[0], 504, "deadline_exceeded")["message"]
    assert _post(linked.client) == 200
