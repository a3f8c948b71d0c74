"""A CONTROL_DIR that cannot be written (read-only: EROFS, or full: ENOSPC), simulated by making the one write that
fails raise: a worker told to stop drains all the same, a load or unload call whose change cannot be written
(or a promotion, or a rollback) changes nothing in any worker and answers 503 saying why, and a ready mark that could not be written is written
again once it can (while readiness and its gauge agree meanwhile)."""
from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator

import pytest
from flask.testing import FlaskClient
from prometheus_client import REGISTRY

from app import EXTENSION_KEY
from app.config import Settings
from app.engine.lifecycle import not_ready
from app.engine.service import Service
from app.engine.versions import desired, writers
from app.factory import create_app
from app.hosting import control, drain
from app.link import client as client_module
from app.link import wire
from app.link.client import RemoteService
from app.metrics import BATCHER_ALIVE, READY
from tests.support.fakes import FakeRepository, wait_until
from tests.support.imaging import RED, image_bytes


def _ready_gauge() -> float | None:
    return REGISTRY.get_sample_value("visionserve_ready")


def _failing(monkeypatch: pytest.MonkeyPatch, method: str, path: Path, code: int) -> Callable[[bool], None]:
    """``Path.<method>`` of ``path`` raises OSError(``code``) until the returned switch is given False (the
    directory writable, or space freed, again); every other path's as ever."""
    original = getattr(Path, method)
    failing = [True]

    def replaced(self: Path, *args: object, **kwargs: object) -> object:
        if failing[0] and self == path:
            raise OSError(code, os.strerror(code), str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, method, replaced)
    return lambda on: failing.__setitem__(0, on)


# -- a worker told to stop -------------------------------------------------------------------------------------------


def test_a_sigterm_drains_when_the_ready_mark_cannot_be_removed(
        client: FlaskClient, service: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # Before: begin_drain's unlink raised EROFS inside the worker's SIGTERM handler: the worker crashed (exit 255)
    # and every request in flight was reset, with no drain.
    mark = tmp_path / "http-1.ready"
    mark.touch()
    service.ready_mark = mark
    handlers: dict[int, Callable[[int, object], None]] = {}
    stopped = threading.Event()
    monkeypatch.setattr(drain.signal, "getsignal", lambda signum: lambda signum_, frame: stopped.set())
    monkeypatch.setattr(drain.signal, "signal", lambda signum, handler: handlers.__setitem__(signum, handler))
    worker = SimpleNamespace()  # no gthread parts: the drain hands over to gunicorn's stop once the requests end
    drain.install(worker, lambda _: service, drain_s=0.0, limit_s=5.0)
    _failing(monkeypatch, "unlink", mark, errno.EROFS)
    assert client.get("/readyz").status_code == 200
    told: list[logging.LogRecord] = []  # the drain's own lines (caplog's handler is at WARNING in the block below)
    teller = logging.Handler(logging.INFO)
    teller.emit = told.append  # type: ignore[method-assign]
    monkeypatch.setattr(drain.logging.getLogger(drain.__name__), "handlers", [teller])
    caplog.set_level(logging.INFO, logger=drain.__name__)  # (restored after the test)
    with caplog.at_level(logging.WARNING, logger="app.engine.lifecycle"):
        handlers[signal.SIGTERM](signal.SIGTERM, None)
    assert service.draining and service.deadline_limit_s(30) <= 5  # a request accepted now ends within the drain
    assert any("could not remove the ready mark" in r.getMessage() and "Read-only file system" in r.getMessage()
               for r in caplog.records)
    assert client.get("/readyz").status_code == 503 and _ready_gauge() == 0.0
    assert stopped.wait(10)  # the drain went on to gunicorn's stop
    said = [r.getMessage() for r in told]  # (before: nothing, in process
    assert said[0].startswith(f"worker {os.getpid()} drains: not ready; new requests answered for 0 s")  # mode)
    assert said[1].startswith(f"worker {os.getpid()} drained in ") and len(said) == 2


# -- a load or unload call -------------------------------------------------------------------------------------------


@pytest.fixture
def shared(settings: Settings, tmp_path: Path) -> Settings:
    """Settings whose workers share a control directory (several workers)."""
    return settings.model_copy(update={"control_dir": tmp_path / "control"})


@pytest.fixture
def two_versions() -> FakeRepository:
    repository = FakeRepository()
    for version in ("1", "2"):
        repository.add("colour", version)
    return repository


@pytest.fixture
def shared_client(shared: Settings, two_versions: FakeRepository) -> Iterator[FlaskClient]:
    """A worker of a server whose workers share ``shared``'s control directory, serving colour 2 of 1 and 2."""
    app = create_app(shared, source=two_versions)  # type: ignore[arg-type]
    yield app.test_client()
    app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def _answered_by(client: FlaskClient) -> str:
    answer = client.post("/predict", data=image_bytes(RED), content_type="image/png")
    assert answer.status_code == 200, answer.get_json()
    return answer.get_json()["model"]["version"]


def _unwritable_state(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """Every file write into CONTROL_DIR fails with ``code``: the desired state and the reports alike."""
    def refused(path: Path, data: object) -> None:
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(desired, "_write_atomic", refused)


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC])
def test_a_load_call_that_cannot_write_the_desired_state_changes_nothing_and_answers_503(
        shared: Settings, shared_client: FlaskClient, two_versions: FakeRepository, monkeypatch: pytest.MonkeyPatch,
        code: int) -> None:
    # Before: the worker that took the call served version 1 (applied there first) and answered 500, while the
    # others, reading the desired state, kept version 2: 11 of 16 answers v1, 5 v2, until another call.
    assert _answered_by(shared_client) == "2"
    generation_before = json.loads((shared.control_dir / control.DESIRED).read_text())["generation"]
    _unwritable_state(monkeypatch, code)
    answer = shared_client.post("/v2/repository/models/colour/load",
                                json={"parameters": {"config": json.dumps({"default_version": "1"})}})
    assert answer.status_code == 503 and int(answer.headers["Retry-After"]) >= 1, answer.get_json()
    error = answer.get_json()["error"]  # the V2 protocol's error: its message
    assert str(shared.control_dir) in error and os.strerror(code) in error and "nothing was changed" in error
    assert ("colour", "1") in two_versions.loads  # it was applied here first, then put back
    catalog = shared_client.application.extensions[EXTENSION_KEY].catalog
    assert catalog.serving() == {"colour": {"versions": ["2"], "default": "2"}}
    assert _answered_by(shared_client) == "2"  # as every other worker, which follows the desired state, answers
    stored = json.loads((shared.control_dir / control.DESIRED).read_text())
    assert stored["generation"] == generation_before and stored["models"]["colour"]["default"] == "2"


def test_an_unload_call_that_cannot_write_the_desired_state_changes_nothing_and_answers_503(
        shared_client: FlaskClient, monkeypatch: pytest.MonkeyPatch) -> None:
    _unwritable_state(monkeypatch, errno.EROFS)
    answer = shared_client.post("/v2/repository/models/colour/unload")
    assert answer.status_code == 503 and "nothing was changed" in answer.get_json()["error"]
    assert _answered_by(shared_client) == "2"


@pytest.mark.parametrize("action", ["promote", "rollback"])
def test_a_promotion_or_rollback_that_cannot_be_written_changes_nothing_and_answers_503(
        shared: Settings, two_versions: FakeRepository, monkeypatch: pytest.MonkeyPatch, action: str) -> None:
    # Before: applied here, then the write raised: 500, and this worker served the promoted default alone.
    two_versions.policies["colour"] = {"rollout": {"shadow_percent": 100}}  # 1 the default, 2 its candidate
    app = create_app(shared, source=two_versions)  # type: ignore[arg-type]
    client = app.test_client()
    try:
        if action == "rollback":  # 2 promoted first: rolling it back puts 1 back
            assert client.post("/v1/models/colour/promote").status_code == 200
        before = _answered_by(client)
        _unwritable_state(monkeypatch, errno.EROFS)
        answer = client.post(f"/v1/models/colour/{action}")
        assert answer.status_code == 503 and "nothing was changed" in answer.get_json()["error"]["message"]
        assert _answered_by(client) == before
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_a_change_written_whose_report_fails_is_kept_and_said_so(
        shared: Settings, shared_client: FlaskClient, monkeypatch: pytest.MonkeyPatch) -> None:
    # The desired state took it (the other workers follow it): putting it back here would leave this worker apart.
    def refused(self: desired.SharedDesiredState, *args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(desired.SharedDesiredState, "report", refused)
    answer = shared_client.post("/v2/repository/models/colour/load",
                                json={"parameters": {"config": json.dumps({"default_version": "1"})}})
    assert answer.status_code == 503
    assert "written for the other workers, but not this worker's report" in answer.get_json()["error"]
    stored = json.loads((shared.control_dir / control.DESIRED).read_text())
    assert stored["models"]["colour"]["default"] == "1" and _answered_by(shared_client) == "1"


@pytest.mark.slow  # a few rounds of following (2 s)
def test_a_control_dir_that_cannot_be_written_is_said_once_in_the_log_not_every_round(
        shared_client: FlaskClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Before: "reconciling the models failed" with a whole traceback, every second in every worker, for as long as
    # CONTROL_DIR stayed read-only.
    monkeypatch.setattr(writers, "EVIDENCE_S", 0.2)  # its report written every round (the write that fails)
    with caplog.at_level(logging.INFO, logger=writers.log.name):
        _unwritable_state(monkeypatch, errno.EROFS)
        wait_until(lambda: "following the other workers failed" in caplog.text)
        time.sleep(1.0)  # five rounds more
        said = [r for r in caplog.records if r.name == writers.log.name and r.levelno >= logging.WARNING]
        assert len(said) == 1 and os.strerror(errno.EROFS) in said[0].getMessage() and said[0].exc_info is None
        monkeypatch.undo()
        wait_until(lambda: "can be written again" in caplog.text)
    assert _answered_by(shared_client) == "2"  # it served on meanwhile


# -- a ready mark that could not be written --------------------------------------------------------------------------


def test_an_inline_worker_writes_its_ready_mark_again_once_it_can(
        shared: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Before: the mark was tried once, as the models first served: a worker whose write failed (CONTROL_DIR full
    # during a HUP) never had one, so while another worker had its mark it took no new connection, for good.
    monkeypatch.setattr(writers, "EVIDENCE_S", 0.0)  # a report each follow round, not each second
    monkeypatch.setattr(writers, "WATCH_S", 0.02)
    repository = FakeRepository()
    repository.add("colour", "1")
    shared.control_dir.mkdir()
    control.ready_mark(shared.control_dir, os.getppid()).touch()  # another live worker that serves
    mark = control.ready_mark(shared.control_dir, os.getpid())
    space = _failing(monkeypatch, "touch", mark, errno.ENOSPC)
    errors: list[BaseException] = []
    with caplog.at_level(logging.DEBUG, logger="app.engine.lifecycle"):
        service = Service.start(shared, repository, errors.append, ready_mark=mark)  # type: ignore[arg-type]
        try:
            wait_until(lambda: service.loaded)
            wait_until(lambda: sum("could not write the ready mark" in r.getMessage() for r in caplog.records) >= 3)
            assert not mark.exists() and not control.takes_connections(shared.control_dir, os.getpid())
            space(False)  # space freed
            wait_until(mark.exists)
            assert control.takes_connections(shared.control_dir, os.getpid()) and not errors
            # said just after the write (before: looked for after the shutdown, the line could come after the capture)
            wait_until(lambda: any("wrote the ready mark" in r.getMessage() for r in caplog.records))
        finally:
            service.shutdown(timeout=5)
    tries = [r for r in caplog.records if "could not write the ready mark" in r.getMessage()]
    assert [r.levelno for r in tries].count(logging.WARNING) == 1  # said once, not at every try
    assert not mark.exists()  # its drain took it away


@pytest.mark.parametrize("pidfd", [True, False])  # False: a host without pidfd_open, where the pid is looked for
def test_an_http_worker_writes_its_ready_mark_again_and_its_gauge_says_what_readyz_answers(
        settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pidfd: bool) -> None:
    # Before (ENGINE=process): a mark whose write failed was never tried again, so /readyz answered 503 on every
    # worker for good (it needs every worker's mark) while /predict answered 200, and visionserve_ready said 1.
    if not pidfd:
        monkeypatch.delattr(os, "pidfd_open")
    monkeypatch.setattr(client_module, "WATCH_S", 0.05)
    control_dir = tmp_path / "control"
    control_dir.mkdir()
    mark = control.ready_mark(control_dir, os.getpid())
    space = _failing(monkeypatch, "touch", mark, errno.ENOSPC)
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])

    def exchange(self: RemoteService, message: object, timeout_s: float, away: str, segments: object = ()) -> object:
        if engine.poll() is not None:
            raise not_ready(away)
        return self._value(wire.Answer(wire.EngineState(True, True, True, False), None, engine.pid, 1))

    monkeypatch.setattr(RemoteService, "_exchange", exchange)
    READY.set(0)
    BATCHER_ALIVE.set(0)  # as every process's gauges read from their import
    errors: list[BaseException] = []
    worker = RemoteService.start(settings.model_copy(update={"control_dir": control_dir}), 0, errors.append)
    try:
        wait_until(lambda: worker._started.is_set() and REGISTRY.get_sample_value("visionserve_batcher_alive") == 1)
        assert not worker.ready and _ready_gauge() == 0.0  # /readyz says 503: so does the gauge its reading sets
        assert "0 of 1 HTTP workers reached their engines" in worker.not_ready_reason  # and why: no check says it
        space(False)  # space freed
        wait_until(lambda: _ready_gauge() == 1.0)  # the link's watch of its engine, with no /readyz asked
        assert mark.exists() and worker.ready and not errors and worker.not_ready_reason is None
    finally:
        worker.shutdown()
        engine.kill()
        engine.wait()
