"""ENGINE=process without a server: an HTTP worker's ready mark is away while the master restarts its engine, so
the worker leaves new connections to the workers whose engine serves (app/hosting/worker.py), and is there again
once the restarted engine is ready, unless the worker drains meanwhile."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, NamedTuple

import pytest
from prometheus_client import REGISTRY

from app.config import Settings
from app.hosting import control
from app.link.client import RemoteService
from tests.app.test_engine_process_metrics import Engines
from tests.support.fakes import wait_until


def _reaches_its_engine() -> bool:
    """The worker's part of the batcher_alive gauge: 1 while it reaches a ready engine (``_show_engine``)."""
    return REGISTRY.get_sample_value("visionserve_batcher_alive") == 1.0


class _Linked(NamedTuple):
    worker: RemoteService
    engines: Engines
    control_dir: Path
    errors: list[BaseException]


@pytest.fixture
def linked(settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Linked]:
    """An HTTP worker's service over a fake engine the test starts and kills, its marks in its own CONTROL_DIR."""
    control_dir = tmp_path / "control"
    control_dir.mkdir()
    engines = Engines()
    monkeypatch.setattr(RemoteService, "_exchange", lambda self, message, timeout_s, away, segments=():
                        engines.exchange(self, message, timeout_s, away))
    errors: list[BaseException] = []
    engines.start()
    worker = RemoteService.start(settings.model_copy(update={"control_dir": control_dir}), 0, errors.append)
    try:
        yield _Linked(worker, engines, control_dir, errors)
    finally:
        worker.shutdown()
        engines.kill()


def test_an_http_worker_s_ready_mark_is_away_from_its_engine_s_end_until_the_restarted_engine_is_ready(
        linked: _Linked) -> None:
    # Before: the mark stayed while the master restarted the engine, so the worker took its share of the new
    # connections and answered them 503 not_ready while the workers of the other engines would have served them.
    worker, engines, control_dir = linked.worker, linked.engines, linked.control_dir
    mark = control.ready_mark(control_dir, os.getpid())
    control.ready_mark(control_dir, os.getppid()).touch()  # another live worker, whose engine serves
    wait_until(mark.exists)
    engines.kill()  # the master restarts it
    wait_until(lambda: not mark.exists())
    assert not control.takes_connections(control_dir, os.getpid())  # left to the other worker meanwhile
    engines.start()  # the restart is ready
    wait_until(mark.exists)
    assert control.takes_connections(control_dir, os.getpid())
    engines.kill()
    wait_until(lambda: not _reaches_its_engine())
    worker.begin_drain()  # a drain while the engine is away: the mark stays away for good
    engines.start()
    wait_until(_reaches_its_engine)
    assert not mark.exists() and not linked.errors and engines.started == 3


def test_a_draining_worker_whose_engine_ends_no_longer_says_it_still_answers(linked: _Linked) -> None:
    # Before: its leaving mark stayed until its drain's window ended, so a HUP's new worker, still loading, left the
    # new connections to a worker that answered them 503 (no engine) instead of taking them itself.
    leaving = control.leaving_mark(linked.control_dir, os.getpid())
    wait_until(control.ready_mark(linked.control_dir, os.getpid()).exists)
    linked.worker.begin_drain()  # its drain still answers: it says so
    assert leaving.exists() and not linked.worker.refusing
    linked.engines.kill()
    wait_until(lambda: not leaving.exists())
    linked.engines.start()  # back within the drain, which answers again: it says so again
    wait_until(leaving.exists)
    assert not linked.errors
