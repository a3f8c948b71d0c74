"""ENGINE=process: an engine whose batch hangs on its batcher's thread past STALL_S still answers the master's state
queries (its loop is free), and its answer says the batch is stuck: the master kills it and starts it again, and
requests are answered once more. The engine is a real one (Service and EngineServer in a process of its own, the
master's supervisor.Engine watching it) on the fake colour model; the bounds are made small and every wait is for
a condition."""
from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

import pytest
from flask import Flask

from app.config import Settings
from app.factory import default_protocols
from app.hosting import control
from app.link import supervisor
from app.link.client import RemoteService
from app.web import init_app
from tests.support.fakes import wait_until
from tests.support.imaging import RED, image_bytes
from tests.support.master import engines_started_as

STALL_S = 1.0  # STALL_S of the engine and the master here: a batch of the colour model takes microseconds

# An engine process on the colour model, every batch on its batcher's thread (ENGINE_LOOP_BATCH_MS=0, as on a GPU
# without CUDA graphs: its loop stays free); with "hang", each forward pass after its start waits (10 s at most)
ENGINE = """
import sys, threading
from pathlib import Path
from app.config import Settings
from app.engine.loaded.predictor import Predictor
from app.engine.service import Service
from app.hosting import control
from app.link.loop import EngineServer
from tests.support.fakes import ColourModel, tiny_manifest
control_dir, hang, stall_s = Path(sys.argv[1]), sys.argv[2] == "hang", float(sys.argv[3])
settings = Settings(weights_dir=control_dir, control_dir=control_dir, device="cpu", max_batch_size=4, max_wait_ms=5,
                    stall_s=stall_s, engine_loop_batch_ms=0, auto_batch_size=False, log_level="warning")
model = ColourModel()
service = Service.build(settings, Predictor(model, tiny_manifest(), device="cpu"))  # its canary ran: no batch
if hang:
    model.gate = threading.Event()
server = EngineServer(service, control.socket_path(control_dir, 0))
server.bind()
server.listen()
"""


def _post(app: Flask) -> int:
    return app.test_client().post("/predict", data=image_bytes(RED), content_type="image/png").status_code


@pytest.mark.slow
def test_the_master_restarts_an_engine_whose_state_answer_says_a_batch_has_run_past_stall_s(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Before: the engine's loop answered every state query (saying `stalled`), so the master, which killed only an
    # engine that answered none for STALL_S, never restarted it: /healthz failed and its requests got 503 for good.
    spawned = engines_started_as(  # the first one's batches hang
        monkeypatch, lambda before: [ENGINE, str(tmp_path), "ok" if before else "hang", str(STALL_S)], answer_s=2.0)
    settings = Settings(weights_dir=tmp_path, control_dir=tmp_path, device="cpu", stall_s=STALL_S)
    worker = RemoteService(settings, 0)  # an HTTP worker of this engine
    worker._started.set()  # as RemoteService.start does once the engine says it is ready
    control.ready_mark(tmp_path, os.getpid()).touch()
    app = Flask(__name__)
    init_app(app, settings, worker, default_protocols())
    engine = supervisor.Engine(0, tmp_path, on_death=lambda pid: None, stall_s=STALL_S)
    statuses: list[int] = []
    with caplog.at_level(logging.WARNING, logger="gunicorn.error"):
        engine.start()
        try:
            wait_until(lambda: engine.answered_at is not None, timeout=60)
            first = engine.process
            assert first is not None and app.test_client().get("/readyz").status_code == 200
            held = threading.Thread(target=lambda: statuses.append(_post(app)))  # its batch hangs
            held.start()
            wait_until(lambda: engine.restarts == 1, timeout=60)
            assert first.wait(10) == -signal.SIGKILL and engine.process is spawned[1]
            held.join(30)
            assert statuses == [503]  # the engine ended while answering it: it is restarting
            wait_until(lambda: app.test_client().get("/readyz").status_code == 200, timeout=60)
            assert _post(app) == 200  # the new engine answers
        finally:
            engine.signal_stop()
            engine.wait_stopped(10)
    said = [r.getMessage() for r in caplog.records if "is stuck" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"engine 0 (pid {first.pid}) is stuck, its state answer says: ")
    assert "model colour version test: its batch has run" in said[0] and "past STALL_S (1 s)" in said[0]
    assert any(f"(pid {first.pid}) died with status -9; restarting it" in r.getMessage() for r in caplog.records)
    assert not any("state queries" in r.getMessage() for r in caplog.records)  # it was never silent
