"""Several models and versions in one worker (#20): policies, swaps with no failed request, refusals, unloads, the
repository API, and workers sharing loads. In-memory ColourModel versions (tests/support/fakes.FakeRepository): no disk,
no server; tests/server/test_model_swaps.py does the same under gunicorn with real exports."""
from __future__ import annotations

import base64
import fcntl
import gc
import json
import logging
import re
import socket
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import numpy as np
import pytest
import torch
from flask import Flask
from flask.testing import FlaskClient
from prometheus_client import REGISTRY

from app import EXTENSION_KEY

from app.factory import create_app
from app.config import Settings
from app.engine.loaded.predictor import Predictor
from app.engine.rollouts.entry import UNLOADED
from app.engine.versions.desired import SharedDesiredState
from app.engine.rollouts.plan import RolloutPolicy, plan
from app.engine.rollouts.policy import PolicyError, VersionPolicy
from app.engine.catalog import Catalog
from app.engine.versions.controller import VersionsController
from app.engine.versions.memory import device_bytes_taken
from app.engine.versions.sources import DirectorySource
from app.engine.versions.states import VersionStates
from app.engine.service import Service
from app.errors import (BadRequest, ClientGone, DeadlineExceeded, InferenceFailed, InsufficientMemory, LoadFailed,
                        LoadTimeout, NotFound, NotReady)
from app.link import client as client_module
from app.metrics import RequestTally
from app.link.client import RemoteService
from app.link.loop import EngineServer
from tests.support.fakes import ColourModel, FakeRepository, infer, tiny_manifest, wait_until
from tests.support.imaging import BLUE, GREEN, RED, image_bytes
from tests.training.test_export_versions import Means, Softmaxed, scripted_export

NOT_CHOSEN = "not chosen by the model's version policy when it last loaded (a load call, or a poll, loads it if chosen)"


@pytest.fixture
def repository() -> FakeRepository:
    repository = FakeRepository()
    repository.add("colour", "1")
    return repository


def _service(settings: Settings, repository: FakeRepository, **changes: object) -> Service:
    return Service.build(settings.model_copy(update=changes), repository)  # type: ignore[arg-type]


@pytest.fixture
def service(settings: Settings, repository: FakeRepository) -> Iterator[Service]:
    service = _service(settings, repository)
    yield service
    service.shutdown(timeout=5)


def _ask(service: Service, name: str | None = None, version: str | None = None) -> str:
    """The version that answers one red image."""
    served = infer(service, [image_bytes(RED)], name=name, version=version)
    assert served.probabilities().argmax() == 0
    return served.version


def test_policies_choose_versions_and_the_default() -> None:
    held = ["1", "2", "10", "canary"]
    assert VersionPolicy.parse("latest").choose(held) == ["10"]
    assert VersionPolicy.parse("latest:2").choose(held) == ["2", "10"]
    assert VersionPolicy.parse("all").choose(held) == held
    assert VersionPolicy.parse("specific:2,canary").choose(held) == ["2", "canary"]
    assert VersionPolicy.parse("all").default_of(held) == "10"  # the newest number, not the last name
    config = {"version_policy": {"latest": {"num_versions": 2}}, "default_version": "2"}
    pinned = VersionPolicy.from_config(config, VersionPolicy())
    assert pinned.choose(held) == ["2", "10"] and pinned.default_of(["2", "10"]) == "2"
    rollback = VersionPolicy.from_config('{"default_version": "1"}', VersionPolicy())  # keeps 1 loaded beside 10
    assert rollback.choose(held) == ["1", "10"] and rollback.default_of(["1", "10"]) == "1"
    for bad in ("newest", "latest:x", "specific:", "all:3"):
        with pytest.raises(PolicyError, match="latest:N, all or specific"):
            VersionPolicy.parse(bad)
    with pytest.raises(PolicyError, match="no version 7; the repository has 1, 2, 10, canary"):
        VersionPolicy.parse("specific:7").choose(held)
    with pytest.raises(PolicyError, match="unsupported config keys \\['max_batch_size'\\]"):
        VersionPolicy.from_config({"max_batch_size": 8}, VersionPolicy())
    # Before: a count that is not one raised ValueError from int() (not a PolicyError), which stopped the start
    latest = {"version_policy": {"latest": {"num_versions": "2"}}}  # protobuf's JSON writes counts as strings too
    assert VersionPolicy.from_config(latest, VersionPolicy()).choose(held) == ["2", "10"]
    for count in ("two", 2.5, True, None, [2]):
        with pytest.raises(PolicyError, match="num_versions must be a whole number"):
            VersionPolicy.from_config({"version_policy": {"latest": {"num_versions": count}}}, VersionPolicy())
    with pytest.raises(PolicyError, match="takes an object"):
        VersionPolicy.from_config({"version_policy": {"latest": 2}}, VersionPolicy())


def test_a_new_version_takes_new_requests_while_the_old_one_finishes_its_own(service: Service,
                                                                             repository: FakeRepository) -> None:
    old = repository.held["colour"]["1"]
    old.batch_sizes.clear()  # warm-up's
    old.gate = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(_ask, service)  # routed to version 1, stuck in its forward pass
        wait_until(lambda: bool(old.batch_sizes))
        repository.add("colour", "2")
        service.catalog.load("colour")
        assert _ask(service) == "2" and _ask(service, "colour", "2") == "2"
        with pytest.raises(NotFound, match="no model 'colour' version '1' is loaded; this server serves 'colour' "
                                           "version '2'"):
            _ask(service, "colour", "1")  # no new request reaches the version being retired
        retiring = [row for row in service.catalog.index() if row.version == "1"]
        assert retiring[0].state == "UNLOADING"
        old.gate.set()
        assert held.result(timeout=5) == "1"  # the request it held was answered by it
    wait_until(lambda: [r.state for r in service.catalog.index()] == ["UNAVAILABLE", "READY"])
    assert service.ready


class RelabelledRepository(FakeRepository):
    """FakeRepository whose version "2" names other classes, and "3" version 1's in another order."""

    def load(self, name: str, version: str):  # noqa: ANN201 - a Predictor
        from app.engine.loaded.predictor import Predictor

        predictor = super().load(name, version)
        labels = {"2": ["cat", "dog", "blue", "other"], "3": ["green", "red", "blue", "other"]}.get(version)
        if labels is None:
            return predictor
        manifest = predictor.manifest.model_copy(update={"labels": labels})
        return Predictor(predictor.module, manifest, device="cpu", weights_bytes=1024 * 1024)


def test_a_new_version_with_other_classes_is_warned_of(settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    # Before: another model's export given the model's name (a 4-class one as ImageNet's next version) replaced it
    # for every client with no word in the log
    repository = RelabelledRepository()
    repository.add("colour", "1")
    service = _service(settings, repository)
    try:
        def warned() -> list[str]:
            return [r.getMessage() for r in caplog.records
                    if r.levelno == logging.WARNING and "classes" in r.getMessage()]

        with caplog.at_level(logging.WARNING, logger="app.engine.versions"):
            for version, said in (("2", "colour version 2 has 4 classes where version 1 has 4 (2 new: cat, dog; 2 "
                                        "gone: red, green): the answers of the requests it serves name other classes"),
                                  ("3", "colour version 3 has 4 classes where version 2 has 4 (2 new: green, red; 2 "
                                        "gone: cat, dog)"),
                                  ("4", "colour version 4 has 4 classes where version 3 has 4 (the same classes in "
                                        "another order: their indices change)")):
                caplog.clear()
                repository.add("colour", version)
                service.catalog.load("colour")
                assert _ask(service) == version and len(warned()) == 1 and warned()[0].startswith(said)
            caplog.clear()
            repository.add("colour", "5")  # version 4's classes again: nothing to say
            service.catalog.load("colour")
            assert _ask(service) == "5" and warned() == []
    finally:
        service.shutdown(timeout=5)


def test_a_version_retired_twice_at_once_is_held_until_both_copies_are_freed() -> None:
    # Unloaded while stuck in a request, loaded again and unloaded again: two copies of one version retire at once.
    # The first to stop must not take the other out of the memory check and the index.
    states = VersionStates()
    first, second = (SimpleNamespace(name="colour", version="1") for _ in range(2))
    states.retiring(first)  # type: ignore[arg-type]
    states.retiring(second)  # type: ignore[arg-type]
    states.retired(second)  # type: ignore[arg-type]
    assert states.retiring_versions() == [first]
    assert [row.state for row in states.rows("colour", [], set())] == ["UNLOADING"]
    states.retired(first)  # type: ignore[arg-type]
    assert states.retiring_versions() == [] and states.rows("colour", [], set()) == []


def test_a_version_another_worker_refused_is_said_refused_in_this_worker_s_index_too() -> None:
    # Before: with polling off, the worker that ran the load call said why it refused version 2; another worker,
    # which never tried it, said "not chosen by the model's version policy" (a TorchServe user's trial): now the
    # desired state records the refusal the load call planned around, and every worker's index reads it there
    why = "colour version 2 cannot be served: weights file x.pt has sha256 abc, the manifest says def"
    entry = plan(VersionPolicy.parse("latest"), RolloutPolicy(), ["1"], None, refused={"2": why})
    assert (entry["versions"], entry["default"], entry["refused"]) == (["1"], "1", {"2": why})
    untried = VersionStates()  # this worker never tried version 2
    assert [(row.version, row.state, row.reason) for row in untried.rows("colour", ["1", "2"], {"1"}, entry)] == [
        ("1", "READY", ""), ("2", "UNAVAILABLE", why)]
    assert "refused" not in plan(VersionPolicy.parse("latest"), RolloutPolicy(), ["1", "2"], None)


def test_a_version_that_fails_to_load_is_refused_and_the_old_one_serves(service: Service,
                                                                        repository: FakeRepository) -> None:
    repository.fail("colour", "2", "weights file x.pt has sha256 abc, the manifest says def")
    with pytest.raises(LoadFailed, match="colour version 2 cannot be served: weights file x.pt has sha256"):
        service.catalog.load("colour")
    assert _ask(service) == "1"
    (row,) = [r for r in service.catalog.index() if r.version == "2"]
    assert row.state == "UNAVAILABLE" and "sha256" in row.reason
    loads = len(repository.loads)
    service.controller.writers.poll()  # the poll does not retry an unchanged failed version...
    assert len(repository.loads) == loads and _ask(service) == "1"
    del repository.broken[("colour", "2")]
    repository.add("colour", "2")  # ...until it is written again
    service.controller.writers.poll()
    assert _ask(service) == "2"


def test_a_rollback_by_a_load_call_is_not_blocked_by_a_broken_newer_version_it_does_not_name(
        service: Service, repository: FakeRepository) -> None:
    # Before: the call that first met the broken version 3 (each worker's first) answered 422 with version 3's error,
    # the same call again 200: a rollback to 1 answered by which worker took it (a new user's trial, 2 workers).
    repository.add("colour", "2")
    service.catalog.load("colour", {"version_policy": {"all": {}}})
    assert _ask(service) == "2"
    repository.fail("colour", "3", "weights file x.pt has sha256 abc, the manifest says def")
    rollback = {"version_policy": {"all": {}}, "default_version": "1"}
    for _ in range(2):  # the first call tries version 3 and leaves it out, the next knows it refused: both 200
        service.catalog.load("colour", rollback)
        assert _ask(service) == "1" and _ask(service, version="2") == "2"
    (row,) = [r for r in service.catalog.index() if r.version == "3"]
    assert row.state == "UNAVAILABLE" and "sha256" in row.reason
    with pytest.raises(LoadFailed, match="colour version 3 .*the config's default version.* was refused"):
        service.catalog.load("colour", {"version_policy": {"all": {}}, "default_version": "3"})  # named: why


def test_a_policy_json_that_cannot_be_read_stops_no_poll_of_the_other_models(settings: Settings) -> None:
    # A model given a load call's config whose policy.json then could not be read: the poll's read of it raised a
    # PolicyError past its ServiceError handling, so every poll ended there: the models after it never got their
    # new versions, and those before were applied here but never written for the other workers.
    class UnreadablePolicies(FakeRepository):
        unreadable: set[str] = set()

        def policy(self, name: str) -> dict[str, object] | None:
            if name in self.unreadable:
                raise PolicyError(f"/repository/{name}/policy.json is not JSON: Expecting value")  # as a directory's
            return super().policy(name)

    repository = UnreadablePolicies()
    for name in ("alpha", "mid", "zulu"):
        repository.add(name, "1")
    service = _service(settings, repository)
    try:
        service.catalog.load("mid", {"version_policy": {"all": {}}})
        repository.unreadable.add("mid")
        repository.add("alpha", "2")
        repository.add("zulu", "2")
        service.controller.writers.poll()
        assert {name: entry["default"] for name, entry in service.controller.sync.read()[1].items()} == {
            "alpha": "2", "mid": "1", "zulu": "2"}
        assert _ask(service, "zulu") == "2" and _ask(service, "mid") == "1"  # mid serves on as it did
    finally:
        service.shutdown(timeout=5)


def test_a_load_call_with_no_version_that_can_load_changes_nothing(service: Service,
                                                                   repository: FakeRepository) -> None:
    # Every version of "shade" refused: the call's entry had no version, applying it unloaded the model, the call
    # answered 200, and the entry (the same as an unload's) kept the poll from trying shade again.
    repository.fail("shade", "1", "weights file x.pt has sha256 abc, the manifest says def")
    with pytest.raises(LoadFailed, match="shade version 1 cannot be served: weights file x.pt has sha256"):
        service.catalog.load("shade")  # tried, refused
    with pytest.raises(LoadFailed, match=r"no version of 'shade' can be served \(version 1: .*sha256"):
        service.catalog.load("shade")  # its files unchanged: not tried again, and nothing changed
    assert "shade" not in service.controller.sync.read()[1] and _ask(service) == "1"
    del repository.broken[("shade", "1")]
    repository.add("shade", "1")  # fixed: the poll serves it
    service.controller.writers.poll()
    assert _ask(service, "shade") == "1"


def test_a_fix_written_while_the_broken_files_load_is_tried_again(service: Service,
                                                                  repository: FakeRepository) -> None:
    # The refusal was stamped with the files as they stood after the load failed: a fix written meanwhile was taken
    # for the refused files, and the version was never tried again.
    repository.fail("colour", "2", "weights file x.pt has sha256 abc, the manifest says def")
    repository.gate = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        polled = pool.submit(service.controller.writers.poll)
        wait_until(lambda: ("colour", "2") in repository.loads)  # the broken files read, the load under way
        reason = repository.broken.pop(("colour", "2"))
        repository.add("colour", "2")  # the fix lands: its files rewritten
        repository.broken[("colour", "2")] = reason  # ... while the load goes on with what it read
        repository.gate.set()
        polled.result(timeout=10)
    repository.gate = None
    del repository.broken[("colour", "2")]
    assert _ask(service) == "1"
    service.controller.writers.poll()
    assert _ask(service) == "2"


def test_a_canary_that_fails_refuses_the_version(service: Service, repository: FakeRepository) -> None:
    repository.add("colour", "2").fail_when = -1.0  # every forward pass raises, the canary's too
    with pytest.raises(LoadFailed, match="colour version 2 cannot be served: .*fake forward failure"):
        service.catalog.load("colour")
    assert _ask(service) == "1" and service.ready


def test_a_version_whose_warm_up_does_not_return_is_refused_after_warmup_timeout_s_and_the_old_one_serves(
        settings: Settings, repository: FakeRepository, caplog: pytest.LogCaptureFixture) -> None:
    # Before: its load waited for ever: the version LOADING, every later change behind it (a trial).
    service = _service(settings, repository, warmup_timeout_s=0.5)
    try:
        hung = repository.add("colour", "2")
        hung.gate = threading.Event()  # every forward pass of version 2 waits (10 s at most) for it
        with caplog.at_level(logging.WARNING), pytest.raises(LoadFailed, match=re.escape(
                "colour version 2 cannot be served: its warm-up and canary did not end within WARMUP_TIMEOUT_S "
                "(0.5s): a forward pass that does not return")):
            service.catalog.load("colour")
        assert _ask(service) == "1" and service.ready and service.alive
        (row,) = [r for r in service.catalog.index() if r.version == "2"]
        assert row.state == "UNAVAILABLE" and "WARMUP_TIMEOUT_S" in row.reason
        assert any("refused colour version 2" in r.getMessage() for r in caplog.records)
        repository.add("other", "1")
        service.catalog.load("other")  # the next change is not held behind it
        stuck = [t for t in threading.enumerate() if t.name == "batcher-colour-2"]
        assert len(stuck) == 1
        hung.gate.set()
        stuck[0].join(5)
        assert not stuck[0].is_alive() and _ask(service, "colour") == "1"  # it ended without serving
    finally:
        service.shutdown(timeout=5)


def test_a_warm_up_that_does_not_return_at_start_stops_the_server_saying_why(settings: Settings) -> None:
    model = ColourModel()
    model.gate = threading.Event()
    with pytest.raises(LoadFailed, match="every version was refused: .* did not end within WARMUP_TIMEOUT_S"):
        create_app(settings.model_copy(update={"warmup_timeout_s": 0.5}), Predictor(model, tiny_manifest(),
                                                                                     device="cpu"))
    model.gate.set()


def test_two_load_calls_for_one_model_run_one_load(service: Service, repository: FakeRepository) -> None:
    repository.add("colour", "2")
    repository.gate = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(service.catalog.load, "colour") for _ in range(2)]
        wait_until(lambda: ("colour", "2") in repository.loads)
        repository.gate.set()
        for call in calls:
            call.result(timeout=10)
    assert repository.loads.count(("colour", "2")) == 1 and _ask(service) == "2"


@pytest.mark.slow
def test_a_change_call_that_cannot_start_in_time_is_a_504_and_changes_nothing(settings: Settings,
                                                                             repository: FakeRepository) -> None:
    # Before: a call waited without bound for another change under way (here a load call's load), then answered 200
    # once that ended: REPOSITORY_SYNC_TIMEOUT_S bounded only its wait for the other workers.
    settings = settings.model_copy(update={"repository_sync_timeout_s": 0.3})
    app = create_app(settings, source=repository)  # type: ignore[arg-type]
    client = app.test_client()
    repository.add("colour", "2")
    repository.add("other", "1")
    repository.gate = threading.Event()
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.post, "/v2/repository/models/colour/load")
            wait_until(lambda: ("colour", "2") in repository.loads)  # its load holds the change lock
            loaded = client.post("/v2/repository/models/other/load")
            unloaded = client.post("/v2/repository/models/colour/unload")
            promoted = client.post("/v1/models/colour/promote", json={"version": "1"})
            assert not first.done()  # answered while the change they waited for was still under way
            repository.gate.set()
            assert first.result(timeout=10).get_json() == {"name": "colour", "versions": ["2"], "default": "2"}
        for answer in (loaded, unloaded):
            assert answer.status_code == 504
            assert "another change of the models is under way" in answer.get_json()["error"]
            assert "nothing was changed" in answer.get_json()["error"]
        assert promoted.status_code == 504 and promoted.get_json()["error"]["code"] == "load_timeout"
        assert ("other", "1") not in repository.loads  # nothing was changed
        catalog = app.extensions[EXTENSION_KEY].catalog
        assert catalog.serving() == {"colour": {"versions": ["2"], "default": "2"}}
        assert client.post("/v2/repository/models/other/load").status_code == 200  # once the change ended
    finally:
        repository.gate.set()
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


@pytest.mark.slow
def test_an_engine_still_applying_a_change_is_a_504_saying_so_not_an_engine_away(
        settings: Settings, repository: FakeRepository, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: under ENGINE=process the HTTP worker gave up on a change after REPOSITORY_SYNC_TIMEOUT_S + 10 s and
    # answered 503 "the engine is not reachable", while the engine, healthy, went on applying it.
    monkeypatch.setattr(client_module, "CATALOG_GRACE_S", 2.0)  # the HTTP side gives up after 2 * 0.2 + 2 s
    settings = settings.model_copy(update={"repository_sync_timeout_s": 0.2})
    service = _service(settings, repository)
    server = EngineServer(service)

    def connect() -> socket.socket:  # as the engine's listener would: each connection served by its loop
        worker_end, engine_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        threading.Thread(target=server.serve, args=(engine_end,), daemon=True).start()
        return worker_end

    worker = RemoteService(settings.model_copy(update={"control_dir": tmp_path / "control"}), 0, connect=connect)
    worker._started.set()  # as RemoteService.start does once the engine says it is ready
    repository.add("colour", "2")
    repository.add("other", "1")
    gate = repository.gate = threading.Event()
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(worker.catalog.load, "colour")
            wait_until(lambda: ("colour", "2") in repository.loads)  # its load holds the engine's change lock
            with pytest.raises(LoadTimeout, match="another change of the models is under way.*nothing was changed"):
                worker.catalog.load("other")  # the engine's own answer: it could not start
            with pytest.raises(LoadTimeout, match="has not answered this load call .*the change may still be applying"):
                first.result(timeout=10)
        assert not gate.is_set()  # the engine was still at that load
        gate.set()
        wait_until(lambda: service.catalog.serving().get("colour", {}).get("default") == "2")  # the change went on
        assert "other" not in service.catalog.serving()
    finally:
        gate.set()
        server.stop(5)  # as at a SIGTERM: the counts its loop holds written too


def test_a_version_that_would_not_fit_is_refused_before_loading(settings: Settings, repository: FakeRepository,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    # Each fake version takes 1 MiB and needs 2 MiB to load: the first fits in 2 MiB, a second beside it not.
    service = _service(settings, repository, model_memory_limit_mb=2)
    try:
        repository.add("colour", "2")
        with caplog.at_level(logging.DEBUG, logger="app.engine.versions.apply"):
            for _ in range(3):  # a call, then the polls that try it again
                with pytest.raises(InsufficientMemory, match="colour version 2 needs about 2 MiB; the loaded models "
                                                             "take 1 MiB of MODEL_MEMORY_LIMIT_MB=2"):
                    service.catalog.load("colour")
        assert ("colour", "2") not in repository.loads and _ask(service) == "1"
        # Before: a warning at every try (each poll, in each worker); now one, the tries after it at debug
        refusals = [r.levelno for r in caplog.records if "refused colour version 2" in r.getMessage()]
        assert refusals == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    finally:
        service.shutdown(timeout=5)


@pytest.mark.slow  # a second or more (a run of the CLI, make, or workers sharing a state): the full suite's
def test_a_version_short_of_memory_says_so_in_the_index_and_is_warned_of_once(
        settings: Settings, repository: FakeRepository, caplog: pytest.LogCaptureFixture) -> None:
    # Before: the index listed it as UNAVAILABLE "unloaded", and every poll warned of it again (in every worker).
    import jsonschema

    app = create_app(settings.model_copy(update={"model_memory_limit_mb": 2}), source=repository)  # type: ignore
    client, writers = app.test_client(), app.extensions[EXTENSION_KEY].controller.writers
    try:
        repository.add("colour", "2")
        with caplog.at_level(logging.DEBUG, logger="app.engine.versions"):
            for _ in range(3):
                writers.poll()
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warned) == 1 and warned[0].startswith("refused colour version 2: colour version 2 needs about")
        rows = client.post("/v2/repository/index").get_json()
        assert [(r["version"], r["state"]) for r in rows] == [("1", "READY"), ("2", "UNAVAILABLE")]
        assert rows[1]["reason"].startswith("short of memory (tried again at each poll and load call): colour version "
                                            "2 needs about 2 MiB; the loaded models take 1 MiB")
        document = client.get("/openapi.json").get_json()  # the reason fits the index's served schema
        schema = document["paths"]["/v2/repository/index"]["post"]["responses"]["200"]["content"]
        jsonschema.Draft202012Validator({**schema["application/json"]["schema"],
                                         "components": document["components"]}).validate(rows)
        assert client.post("/v2/repository/models/colour/unload").status_code == 200
        assert client.post("/v2/repository/models/colour/load").status_code == 200  # alone, version 2 fits
        assert client.post("/v2/repository/models/colour/unload").status_code == 200
        assert [(r["version"], r["reason"]) for r in client.post("/v2/repository/index").get_json()] == [
            ("1", "unloaded"), ("2", "unloaded")]  # loaded since: no longer short of memory
        # Nothing loaded: not ready for want of a model, no batcher dead (Before: /readyz said batcher_thread false
        # where /healthz and visionserve_batcher_alive said it ran)
        ready, live = client.get("/readyz"), client.get("/healthz")
        assert ready.status_code == 503 and ready.get_json()["checks"] == {
            "model_loaded": False, "warmed_up": False, "batcher_thread": True, "not_draining": True,
            "accepting": True}
        assert live.status_code == 200 and live.get_json()["checks"] == {"batcher_thread": True}
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


@pytest.mark.slow  # a second or more (a run of the CLI, make, or workers sharing a state): the full suite's
def test_a_policy_naming_a_refused_version_says_why_it_was_refused(settings: Settings, repository: FakeRepository,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    # Before: "model 'colour': no version 2; the repository has 1" (400), hiding why version 2 was left out.
    repository.fail("colour", "2", "weights file x.pt has sha256 abc, the manifest says def")
    with pytest.raises(LoadFailed, match=r"model 'colour': its policy names version 2, refused \(version 2: colour "
                                         r"version 2 cannot be served: weights file x.pt has sha256 abc"):
        _service(settings, repository, version_policy="specific:2")
    service = _service(settings, repository)  # latest:1: version 2 refused, 1 serves
    try:
        with pytest.raises(LoadFailed, match=r"colour version 2 \(the config's specific version\) was refused and "
                                             "its files have not changed since: .*sha256 abc"):
            service.catalog.load("colour", {"version_policy": {"specific": {"versions": ["1", "2"]}}})
        repository.policies["colour"] = {"default_version": "2"}
        caplog.clear()  # what the start-ups said
        with caplog.at_level(logging.WARNING, logger="app.engine.versions.writers"):
            for _ in range(3):
                service.controller.writers.poll()
        assert sum("its policy names version 2, refused" in r.getMessage() for r in caplog.records) == 1  # once
        assert _ask(service) == "1"
    finally:
        service.shutdown(timeout=5)


def test_a_turn_s_requests_alike_are_admitted_in_one_pass_each_its_own_and_all_counted_as_they_leave(
        settings: Settings, repository: FakeRepository) -> None:
    repository.add("colour", "2")
    service = _service(settings, repository, version_policy="latest:2")
    try:
        default, named = service.enter_many("colour", None, None, 3), service.enter_many("colour", "1", None, 2)
        assert [a.call.model.version for a in default + named] == ["2", "2", "2", "1", "1"]  # type: ignore[union-attr]
        two, one = service.loaded_version("colour", "2"), service.loaded_version("colour", "1")
        assert service.in_flight.count() == 5 and (two.in_use.count(), one.in_use.count()) == (3, 2)
        assert two.arrivals.count() == 3  # each on its way to a batch until queued, or its end
        for admission in default + named:
            admission.leave()  # type: ignore[union-attr]
        assert service.in_flight.count() == 0 and (two.in_use.count(), one.in_use.count(), two.arrivals.count()) == (
            0, 0, 0)
        assert service.controller.evidence.traffic("colour", "2").dump()["requests"] == 3  # named: no rollout's
        with pytest.raises(NotFound):
            service.enter_many("colour", "9", None, 4)
        assert service.in_flight.count() == 0  # refused all at once: nothing held
    finally:
        service.shutdown(timeout=5)


def test_a_turn_s_requests_leave_together_each_counted_with_its_outcome_and_once(service: Service) -> None:
    alike, named = service.enter_many("colour", None, None, 3), service.enter_many("colour", "1", None, 1)
    counted = service.counts = RequestTally()  # as an engine's loop counts them
    alike[2].leave()  # type: ignore[union-attr]  # left before: not again
    service.leave_many([(alike[0], None), (alike[1], NotFound("gone")), (alike[2], None),  # type: ignore[list-item]
                        (named[0], InferenceFailed("broke")), (alike[0], None)])  # type: ignore[list-item]
    assert dict(counted._outcomes) == {("colour", "1", "live", "ok"): 2, ("colour", "1", "live", "refused"): 1,
                                       ("colour", "1", "named", "failed"): 1}
    assert service.in_flight.count() == 0 and service.loaded_version("colour", "1").in_use.count() == 0
    assert service.controller.evidence.traffic("colour", "1").dump()["requests"] == 2  # its live ones counted


def test_a_turn_s_requests_admitted_as_one_share_a_call_and_each_is_counted_as_it_leaves(service: Service) -> None:
    counted = service.counts = RequestTally()  # as an engine's loop counts them
    loaded = service.loaded_version("colour", "1")
    photos = service.enter_many("colour", None, None, 2, one_call=True)  # encoded, decoded on the CPU: each its own
    assert photos[0] is not photos[1] and photos[0].call is not photos[1].call  # type: ignore[union-attr]
    service.leave_many([(photo, None) for photo in photos])  # type: ignore[misc]
    shared = service.enter_many("colour", None, None, 5, one_call=True, decode_runs=(3, 2))  # a call a decode share
    assert [id(each) for each in shared] == [id(shared[0])] * 3 + [id(shared[3])] * 2 and shared[0] is not shared[3]
    assert [shared[0].call.requests, shared[3].call.requests] == [3, 2]  # type: ignore[union-attr]
    assert loaded.arrivals.count() == 2
    service.leave_many([(shared[0], None), (shared[3], None)])  # type: ignore[list-item]
    counted._outcomes.clear()
    bundle = service.enter_many("colour", None, None, 4, pixels=True, one_call=True)
    one = bundle[0]
    assert all(each is one for each in bundle) and one.requests == 4  # type: ignore[union-attr]
    assert (service.in_flight.count(), loaded.in_use.count(), loaded.arrivals.count()) == (4, 4, 1)
    one.leave_one(ClientGone("left"))  # type: ignore[union-attr]  # one of them ends first
    assert (one.requests, service.in_flight.count(), loaded.in_use.count()) == (3, 3, 3)  # type: ignore[union-attr]
    call = one.call  # type: ignore[union-attr]
    apart = one.apart()  # type: ignore[union-attr]  # one of them from here on its own, its call one request's
    assert apart is not one and one.requests == 2 and apart.call is not call  # type: ignore[union-attr]
    assert (apart.call.requests, apart.call.model, call.requests) == (1, call.model, 4)
    service.leave_many([(one, None), (apart, InferenceFailed("broke")), (one, None)])  # type: ignore[list-item]
    assert dict(counted._outcomes) == {("colour", "1", "live", "refused"): 1, ("colour", "1", "live", "ok"): 2,
                                       ("colour", "1", "live", "failed"): 1}
    assert (service.in_flight.count(), loaded.in_use.count(), loaded.arrivals.count()) == (0, 0, 0)
    assert service.controller.evidence.traffic("colour", "1").dump()["requests"] == 2 + 5 + 3  # the photos first;
    # the refusal is no evidence


def test_a_turn_s_requests_queued_together_each_get_their_own_answer_whatever_another_s_refusal_raises(
        service: Service) -> None:
    from app.engine.call import queue_prepared

    class Unformattable(float):  # a length the 504's message cannot format (a Fraction formats from Python 3.12 on)
        def __format__(self, spec: str) -> str:
            raise TypeError(f"no format {spec!r}")

    admitted = service.enter_many("colour", None, None, 3)
    calls = [admission.call for admission in admitted]  # type: ignore[union-attr]
    pixels = [torch.zeros(3, 8, 8)]
    requests = [calls[0].prepare((), pixels, timeout_s=5.0),  # a deadline past, of a length that does not
                calls[1].prepare((), pixels, timeout_s=Unformattable(0.1), arrived=0.0),  # format as the 504 says
                calls[2].prepare((), pixels, timeout_s=1.0, arrived=0.0)]  # past, not too short: the 504
    first, second, third = queue_prepared(calls, requests)
    assert first is requests[0] and first.group is not None  # type: ignore[union-attr]
    assert isinstance(second, TypeError) and isinstance(third, DeadlineExceeded)
    loaded = service.loaded_version("colour", "1")
    assert loaded.batcher.depth == 1 and loaded.arrivals.count() == 0  # the first queued; none on its way
    loaded.batcher.run_queued(10.0)
    assert first.group.wait(10)  # type: ignore[union-attr]
    for admission in admitted:
        admission.leave()  # type: ignore[union-attr]


def test_a_turn_s_requests_for_a_version_whose_batcher_ended_are_each_refused_and_hold_nothing(
        service: Service) -> None:
    ended = service.loaded_version("colour", "1")
    ended.batcher.stop(timeout=5)  # as if its thread had died
    refused = service.enter_many("colour", None, None, 3)
    assert [type(each) for each in refused] == [NotReady] * 3
    assert service.in_flight.count() == 0 and ended.in_use.count() == 0 and ended.arrivals.count() == 0


def test_a_version_whose_batcher_ended_refuses_its_requests_and_the_others_still_serve(
        settings: Settings, repository: FakeRepository) -> None:
    repository.add("colour", "2")
    service = _service(settings, repository, version_policy="latest:2")
    try:
        ended = service.loaded_version("colour", "1")
        ended.batcher.stop(timeout=5)  # as if its thread had died
        with pytest.raises(NotReady, match="the model is not ready"):
            _ask(service, "colour", "1")
        assert _ask(service, "colour", "2") == "2" and not service.alive  # liveness says it: the engine restarts
        assert service.in_flight.count() == 0 and ended.in_use.count() == 0  # the refusal left nothing held
    finally:
        service.shutdown(timeout=5)


def test_a_version_loaded_after_the_start_up_froze_is_freed_by_a_collection_that_thaws_nothing(
        settings: Settings, repository: FakeRepository) -> None:
    # An engine freezes what its start-up imported before its models load (app/link/server.py). A retired version
    # was collected by thawing everything frozen first: on the 2-core VM about 0.1 s of the engine's interpreter
    # lock at every unload or swap, every request waiting. Now what was frozen stays frozen through it.
    gc.collect()  # the earlier tests' garbage first: what is frozen is never collected
    gc.freeze()  # (left frozen, as this process's start-up is: tests/conftest.py; a thaw would thaw that too)
    frozen = gc.get_freeze_count()
    service = _service(settings, repository)
    loaded = weakref.ref(service.loaded_version("colour", "1"))
    try:
        service.catalog.unload("colour")
        assert loaded() is None  # collected
        # and nothing thawed: a thaw and freeze again would have frozen what came since too (the service: thousands
        # of objects); frozen objects freed as their last reference goes only make the count smaller
        assert gc.get_freeze_count() <= frozen
    finally:
        service.shutdown(timeout=5)


def test_a_gpu_version_s_unload_shows_the_memory_it_gave_back(service: Service,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # The GPU memory gauge was written only as a version's batches settled: after an unload it kept reading the
    # unloaded version's memory until another version served a batch (with none left, for ever).
    from app.engine.versions import apply
    from app.metrics import GPU_MEMORY

    service.loaded_version("colour", "1").predictor.device = torch.device("cuda", 0)  # as if it served on a GPU
    read: list[torch.device] = []
    monkeypatch.setattr(apply, "device_memory_stats", lambda device: read.append(device) or {"allocated": 5 << 20,
                                                                                             "reserved": 8 << 20})
    GPU_MEMORY.labels("allocated").set(900 << 20)
    service.catalog.unload("colour")
    assert read == [torch.device("cuda", 0)]  # read once the version was freed
    assert GPU_MEMORY.labels("allocated")._value.get() == 5 << 20
    assert GPU_MEMORY.labels("reserved")._value.get() == 8 << 20


def test_processes_sharing_a_gpu_check_its_memory_and_load_onto_it_one_at_a_time(
        settings: Settings, repository: FakeRepository, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two engines of one GPU (or inline workers) each read the device's free memory before the other had taken its
    # share: both loads passed the check. The check and the load now hold the device's lock in CONTROL_DIR.
    from app.engine.versions import apply
    from app.hosting import control

    service = _service(settings, repository, control_dir=tmp_path)
    checked = threading.Event()
    monkeypatch.setattr(apply.Applier, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(apply, "check_fits", lambda *args: checked.set())  # the GPU's free memory read
    repository.add("colour", "2")
    try:
        with open(control.device_loads_lock(tmp_path, "cuda:0"), "a+") as other:  # another process loading
            fcntl.flock(other, fcntl.LOCK_EX)
            with ThreadPoolExecutor(1) as pool:
                loading = pool.submit(service.catalog.load, "colour")
                assert not checked.wait(0.5) and ("colour", "2") not in repository.loads  # waits for the other
                fcntl.flock(other, fcntl.LOCK_UN)
                loading.result(timeout=10)
        assert checked.is_set() and _ask(service) == "2"
    finally:
        service.shutdown(timeout=5)


def test_a_load_s_device_memory_is_at_least_its_weights() -> None:
    # Measured as allocated bytes after the load less those before: a version retiring meanwhile on its own thread
    # frees memory, and the difference read less than the weights, or below 0 (then the memory check undercounted).
    assert device_bytes_taken(100 << 20, 160 << 20, 20 << 20) == 60 << 20
    assert device_bytes_taken(100 << 20, 90 << 20, 20 << 20) == 20 << 20


def test_unload_stops_a_model_and_unknown_names_are_404(service: Service, repository: FakeRepository) -> None:
    with pytest.raises(NotFound, match="the repository has no model 'nope'; it has: colour"):
        service.catalog.load("nope")
    service.catalog.unload("colour")
    assert not service.ready and [r.state for r in service.catalog.index()] == ["UNAVAILABLE"]
    with pytest.raises(NotReady, match="no model is loaded") as refused:
        _ask(service)
    # Before: "no model is loaded" with Retry-After: 5, so clients tried again for a model nothing would bring back
    assert "Retry-After" not in (refused.value.headers or {})
    assert "a load call loads one (POST /v2/repository/models/NAME/load" in refused.value.message
    service.controller.writers.poll()  # an unloaded model stays unloaded until a load call
    assert not service.ready
    service.catalog.load("colour")
    assert _ask(service) == "1" and service.ready


def test_two_models_side_by_side_and_the_default_model(settings: Settings, repository: FakeRepository) -> None:
    repository.add("other", "7")
    service = _service(settings, repository)
    try:
        assert _ask(service, "colour") == "1" and _ask(service, "other") == "7"
        assert service.loaded_version("colour").batcher is not service.loaded_version("other").batcher  # one batcher each
        with pytest.raises(BadRequest, match="serves 2 models \\(colour, other\\) and none is the default "
                                             "\\(DEFAULT_MODEL, or repository.json\\): name one"):
            _ask(service)
        repository.default = "other"  # the repository names its default: the next poll reads it
        service.controller.writers.poll()
        assert _ask(service) == "7" and service.catalog.default_model() == "other"
    finally:
        service.shutdown(timeout=5)
    named = _service(settings, repository, default_model="colour")  # the setting wins over the repository
    try:
        assert _ask(named) == "1"
    finally:
        named.shutdown(timeout=5)


def test_a_default_model_the_server_does_not_serve_is_refused_at_start_and_kept_out_later(
        settings: Settings, repository: FakeRepository, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    # Before: DEFAULT_MODEL (or repository.json) naming a model the repository lacks started a ready server whose
    # every request naming no model was 404, nothing said; repository.json changed so while it ran, the same.
    repository.add("other", "7")
    with pytest.raises(NotFound, match="DEFAULT_MODEL names 'nosuch' as the default model, but the repository has no "
                                       "such model; it serves: colour, other: name one of them, or none"):
        _service(settings, repository, default_model="nosuch")
    with pytest.raises(NotFound, match="names 'other' as the default model, but MODELS leaves it out"):
        _service(settings, repository, default_model="other", models="colour")
    with pytest.raises(NotFound, match="names 'gone' as the default model, but the repository has no such model"):
        _service(settings, repository, default_model="gone", models="colour,gone")  # named, but not there
    # Before: only that MODELS left the default out, never that MODELS named a model the repository lacks
    with pytest.raises(NotFound, match=r"names 'other' as the default model, but MODELS leaves it out \(MODELS "
                                       r"names 'nosuch', which the repository has not; it has: colour, other\)"):
        _service(settings, repository, default_model="other", models="nosuch")
    repository.default = "other"
    settings = settings.model_copy(update={"control_dir": tmp_path / "control"})  # shared with a joining worker
    service = _service(settings, repository)
    try:
        assert _ask(service) == "7"
        repository.default = "nosuch"  # while it runs: the default stays, said once
        with caplog.at_level(logging.WARNING, logger="app.engine.versions.writers"):
            for _ in range(2):
                service.controller.writers.poll()
        assert _ask(service) == "7" and service.catalog.default_model() == "other"
        assert [r.getMessage() for r in caplog.records if "nosuch" in r.getMessage()] == [
            "the repository's repository.json names 'nosuch' as the default model, but the repository has no such "
            "model; it serves: colour, other: the default model stays other"]
        # a worker (or an engine) joining the running server then starts as the poll goes on (before: it stopped
        # on it, and with it the server)
        joined, _ = _worker(settings, repository)
        _stop(joined)
    finally:
        service.shutdown(timeout=5)


def test_the_policy_keeps_versions_and_names_the_default(settings: Settings, repository: FakeRepository) -> None:
    repository.add("colour", "2")
    service = _service(settings, repository, version_policy="latest:2")
    try:
        assert _ask(service) == "2" and _ask(service, "colour", "1") == "1"
        service.catalog.load("colour", '{"default_version": "1"}')  # a rollback without unloading 2
        assert _ask(service) == "1" and _ask(service, "colour", "2") == "2"
        with pytest.raises(BadRequest, match="specific needs at least one version"):
            service.catalog.load("colour", {"version_policy": {"specific": {}}})
    finally:
        service.shutdown(timeout=5)


def test_a_rollback_by_a_call_holds_across_polls_until_policy_json_changes(settings: Settings,
                                                                          repository: FakeRepository) -> None:
    repository.add("colour", "2")
    service = _service(settings, repository)
    try:
        service.catalog.load("colour", '{"default_version": "1"}')
        service.controller.writers.poll()
        assert _ask(service) == "1"  # the poll applied the policy again and undid the rollback, before
        repository.add("colour", "3")
        service.controller.writers.poll()
        assert _ask(service) == "1" and _ask(service, "colour", "3") == "3"  # new versions followed, default kept
        repository.policies["colour"] = {"version_policy": {"latest": {"num_versions": 1}}}
        service.controller.writers.poll()
        assert _ask(service) == "3" and service.catalog.serving()["colour"]["versions"] == ["3"]
        service.catalog.load("colour", {"default_version": "2"})
        service.catalog.load("colour")  # another call, without a config: the policy again
        assert _ask(service) == "3"
    finally:
        service.shutdown(timeout=5)


def _worker(settings: Settings, repository: FakeRepository, boot: bool = True) -> tuple[VersionsController, Catalog]:
    """A worker's models without its service: its versions machinery (booted) and the catalog calls change it by."""
    controller = VersionsController(settings, repository, on_report=lambda: None)  # type: ignore[arg-type]
    if boot:
        controller.boot()
    return controller, Catalog(settings, controller, wait_loaded=lambda timeout_s: None)


def _stop(controller: VersionsController) -> None:
    controller.close()
    for loaded in controller.routes.all_versions():
        loaded.batcher.stop(5)


def test_calls_survive_a_restart_only_with_a_kept_control_dir(settings: Settings, tmp_path: Path,
                                                             repository: FakeRepository) -> None:
    kept = settings.model_copy(update={"control_dir": tmp_path / "kept"})
    repository.add("colour", "2")
    repository.add("other", "1")
    first, catalog = _worker(kept, repository)
    catalog.load("colour", {"default_version": "1"})
    catalog.unload("other")
    _stop(first)
    restarted, catalog = _worker(kept, repository)
    assert catalog.serving() == {"colour": {"versions": ["1", "2"], "default": "1"}}  # the unload holds too
    _stop(restarted)
    # gunicorn's default: a new temporary directory, so the repository and its policies again
    fresh, catalog = _worker(settings.model_copy(update={"control_dir": tmp_path / "new"}), repository)
    assert catalog.serving() == {"colour": {"versions": ["2"], "default": "2"},
                                 "other": {"versions": ["1"], "default": "1"}}
    _stop(fresh)


def test_a_version_that_cannot_load_is_skipped_at_start(settings: Settings, repository: FakeRepository,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    repository.fail("colour", "2", "weights file x.pt has sha256 abc, the manifest says def")
    with caplog.at_level(logging.WARNING):
        service = _service(settings, repository)  # stopped the start, before: every model went down
    try:
        assert _ask(service) == "1"
        (row,) = [r for r in service.catalog.index() if r.version == "2"]
        assert row.state == "UNAVAILABLE" and "sha256" in row.reason
        assert sum("sha256" in record.getMessage() for record in caplog.records) == 1  # said once
        service.controller.writers.poll()
        assert _ask(service) == "1" and sum("sha256" in r.getMessage() for r in caplog.records) == 1
    finally:
        service.shutdown(timeout=5)
    repository.fail("colour", "1", "cannot load state_dict weights from x.pt: missing keys")
    with pytest.raises(LoadFailed, match="nothing can be served"):
        _service(settings, repository)  # only when nothing at all can be served does the start fail


def test_a_policy_that_cannot_be_read_is_shown_by_the_index_and_logged_once_per_change(
        settings: Settings, repository: FakeRepository, caplog: pytest.LogCaptureFixture) -> None:
    # Before: its versions were listed as UNAVAILABLE "unloaded", every poll logged the policy's error again, and the
    # default model's 404 did not say why it was not loaded.
    repository.add("other", "1")
    repository.default = "colour"
    repository.policies["colour"] = {"version_policy": "newest"}

    def said(words: str) -> int:
        return sum(words in record.getMessage() for record in caplog.records)

    def colour_rows() -> list[tuple[str, str, str]]:
        return [(r.version, r.state, r.reason) for r in service.catalog.index() if r.name == "colour"]

    with caplog.at_level(logging.WARNING, logger="app.engine.versions.writers"):
        service = _service(settings, repository)
        try:
            broken = ("model 'colour': version_policy must be {\"latest\": {\"num_versions\": N}}, {\"all\": {}} or "
                      '{"specific": {"versions": [...]}}')
            assert colour_rows() == [("1", "UNAVAILABLE", broken)]
            with pytest.raises(NotFound, match="no model 'colour' \\(the default model\\) is loaded: model 'colour': "
                                               "version_policy must be"):
                _ask(service)
            for _ in range(3):
                service.controller.writers.poll()
            assert said("version_policy must be") == 1  # at start, not again by each poll
            repository.policies["colour"] = {"max_batch_size": 8}  # broken another way: said once more
            for _ in range(3):
                service.controller.writers.poll()
            assert said("version_policy must be") == 1 and said("unsupported config keys ['max_batch_size']") == 1
            assert "unsupported config keys ['max_batch_size']" in colour_rows()[0][2]
            repository.policies["colour"] = {"default_version": "1"}  # fixed: the poll serves it
            service.controller.writers.poll()
            assert _ask(service) == "1" and colour_rows() == [("1", "READY", "")]
            repository.add("colour", "2")
            repository.policies["colour"] = {"version_policy": "newest"}  # broken while it serves: version 1 stays
            for _ in range(3):
                service.controller.writers.poll()
            assert _ask(service) == "1" and said("version_policy must be") == 2
            assert colour_rows() == [("1", "READY", ""), ("2", "UNAVAILABLE", broken)]  # why 2 is not taken
            del repository.policies["colour"]
            service.controller.writers.poll()
            assert _ask(service) == "2"
            wait_until(lambda: colour_rows() == [("1", "UNAVAILABLE", NOT_CHOSEN), ("2", "READY", "")])
        finally:
            service.shutdown(timeout=5)


def test_a_worker_that_joins_a_running_server_shows_why_a_model_is_not_served(
        settings: Settings, tmp_path: Path, repository: FakeRepository, caplog: pytest.LogCaptureFixture) -> None:
    import os

    shared = settings.model_copy(update={"control_dir": tmp_path / "control"})
    repository.add("colour", "2")
    repository.add("other", "1")
    repository.policies["colour"] = {"version_policy": "newest"}
    here, _ = _worker(shared, repository)  # the first worker: writes the desired state, without colour
    there, there_catalog = _worker(shared, repository, boot=False)
    there.sync.desired = SharedDesiredState(shared.control_dir, pid=os.getppid())
    caplog.clear()  # what the first worker said
    try:
        with caplog.at_level(logging.WARNING, logger="app.engine.versions.writers"):
            there.boot()  # joins: serves the desired state, and checks the models it lacks (no poll here)
            there.writers.poll()
        assert [(r.name, r.state) for r in there_catalog.index()] == [("colour", "UNAVAILABLE")] * 2 + [
            ("other", "READY")]
        assert all(r.reason.startswith("model 'colour': version_policy must be") for r in there_catalog.index()[:2])
        assert sum("version_policy must be" in r.getMessage() for r in caplog.records) == 1
        repository.policies["colour"] = {"version_policy": {"specific": {"versions": ["1"]}}}
        here.writers.poll()  # the first worker serves colour again; the other applies it and no longer says why not
        wait_until(lambda: "colour" in there_catalog.serving())
        assert [(r.version, r.state, r.reason) for r in there_catalog.index()] == [
            ("1", "READY", ""), ("2", "UNAVAILABLE", NOT_CHOSEN), ("1", "READY", "")]
    finally:
        for controller in (here, there):
            _stop(controller)


@pytest.fixture
def app(settings: Settings, repository: FakeRepository) -> Iterator[Flask]:
    app = create_app(settings, source=repository)  # type: ignore[arg-type]
    yield app
    app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_the_repository_api(client: FlaskClient, repository: FakeRepository) -> None:
    assert client.post("/v2/repository/index").get_json() == [
        {"name": "colour", "version": "1", "state": "READY", "reason": "", "default": True, "role": "live"}]
    repository.add("colour", "2")
    assert client.post("/v2/repository/index", json={"ready": True}).get_json()[0]["version"] == "1"
    refused = client.post("/v2/repository/index", json={"ready": "yes"})  # before: read as true
    assert refused.status_code == 422 and "boolean" in refused.get_json()["error"]
    refused = client.post("/v2/repository/index", json={"ready_only": True})  # before: every version listed
    assert refused.status_code == 422 and "ready_only" in refused.get_json()["error"]
    loaded = client.post("/v2/repository/models/colour/load")
    assert loaded.status_code == 200 and loaded.get_json() == {"name": "colour", "versions": ["2"], "default": "2"}
    assert client.post("/predict", data=image_bytes(RED), content_type="image/jpeg").get_json()["model"] == {
        "name": "colour", "version": "2"}
    repository.fail("colour", "3", "cannot load state_dict weights from x.pt: missing keys")
    refused = client.post("/v2/repository/models/colour/load")
    assert refused.status_code == 422 and "missing keys" in refused.get_json()["error"]
    cases = [("/v2/repository/models/nope/load", {}, 404, "no model 'nope'"),
             ("/v2/repository/models/colour/load", {"parameters": {"file:1/model.pt": "eA=="}}, 400, "unsupported"),
             ("/v2/repository/models/colour/load", {"parameters": {"config": "{"}}, 400, "not JSON"),
             # (before: a 500, json.loads' RecursionError: a security review)
             ("/v2/repository/models/colour/load", {"parameters": {"config": "[" * 100_000}}, 400, "nested too deeply"),
             ("/v2/repository/models/colour/load", {"other": 1}, 422, "does not match"),
             ("/v2/repository/index", [1], 422, "does not match")]
    for url, body, status, message in cases:
        answer = client.post(url, json=body)
        assert answer.status_code == status and message in answer.get_json()["error"], (url, answer.get_json())
    assert client.post("/v2/repository/models/colour/unload", json={"parameters": {"unload_dependents": False}}
                       ).get_json() == {"name": "colour", "versions": [], "default": None}
    assert client.get("/v2/models/colour/ready").status_code == 503  # in the repository, not loaded
    assert client.get("/v1/models").get_json()["models"] == []  # nothing loaded: an empty listing, no 404
    assert client.get("/v2/models/nope/ready").status_code == 404
    assert client.post("/predict?model=colour", data=image_bytes(RED), content_type="image/jpeg").status_code == 404


def test_v1_models_lists_every_version_with_its_state_memory_and_worker(client: FlaskClient,
                                                                         repository: FakeRepository) -> None:
    repository.add("colour", "2")
    client.post("/v2/repository/models/colour/load", json={"parameters": {"config": {
        "version_policy": {"latest": {"num_versions": 2}}}}})
    body = client.get("/v1/models").get_json()
    assert [(m["version"], m["default"], m["state"]) for m in body["models"]] == [("1", False, "READY"),
                                                                                 ("2", True, "READY")]
    assert all("memory_bytes" in m for m in body["models"])
    (worker,) = body["workers"]
    assert worker["models"] == {"colour": {"versions": ["1", "2"], "default": "2"}}
    assert body["default_model"] == "colour"  # the only model
    repository.add("other", "1")
    client.post("/v2/repository/models/other/load")
    assert client.get("/v1/models").get_json()["default_model"] is None  # two, and none named: requests name one
    # each model's default version, as /v1/models says (before: the server's default model's alone, none here)
    assert [(r["name"], r["version"], r["default"]) for r in client.post("/v2/repository/index").get_json()] == [
        ("colour", "1", False), ("colour", "2", True), ("other", "1", True)]


@pytest.mark.slow  # two workers following each other (2 s)
def test_workers_sharing_a_control_directory_apply_each_others_loads(settings: Settings, tmp_path: Path,
                                                                     repository: FakeRepository) -> None:
    import os

    shared = settings.model_copy(update={"control_dir": tmp_path / "control"})
    here, here_catalog = _worker(shared, repository)
    there, there_catalog = _worker(shared, repository, boot=False)
    there.sync.desired = SharedDesiredState(shared.control_dir, pid=os.getppid())  # another live process's report
    try:
        there.boot()
        repository.add("colour", "2")
        here_catalog.load("colour")  # answers once the other worker serves version 2 too
        assert there_catalog.serving() == {"colour": {"versions": ["2"], "default": "2"}}
        assert {w["pid"]: w["models"]["colour"]["versions"] for w in here_catalog.workers()} == {
            os.getpid(): ["2"], os.getppid(): ["2"]}
        repository.add("other", "1")
        there.applier.apply("other", {"versions": ["1"], "default": "1"})  # only there, as if its load call had not written yet
        here_catalog.unload("colour")
        assert there_catalog.serving() == {}  # a generation is the whole set: "other" was not in it
    finally:
        for controller in (here, there):
            _stop(controller)


def test_a_call_that_changes_nothing_does_not_take_another_worker_s_change_for_applied(
        settings: Settings, tmp_path: Path, repository: FakeRepository) -> None:
    # Another worker unloaded "other" and wrote generation 2; a poll or call here that changed nothing got 2 back as
    # the newest generation, took it for its own (applied + 1), and never unloaded "other": the unload answered 200.
    import os

    shared = settings.model_copy(update={"control_dir": tmp_path / "control"})
    repository.add("other", "1")
    here, here_catalog = _worker(shared, repository)
    there, _ = _worker(shared, repository, boot=False)
    there.sync.desired = SharedDesiredState(shared.control_dir, pid=os.getppid())  # another live process's report
    try:
        there.boot()
        for controller in (here, there):
            controller.close()  # no follow thread: this worker applies the other's generation only when told
        with there.applier.changing():  # the other worker's unload call, applied and written there
            there.applier.apply("other", UNLOADED)
            unloaded, _ = there.sync.write({"other": UNLOADED})
        here.writers.poll()  # changes nothing: each model serves as its policy picks (a load call's write too)
        assert here.sync.applied < unloaded and here.sync.is_behind()
        here.writers.follow_newest()
        assert "other" not in here_catalog.serving() and here.sync.applied == unloaded
    finally:
        for controller in (here, there):
            _stop(controller)


def test_a_model_that_cannot_be_served_fails_no_call_for_another(settings: Settings,
                                                                 repository: FakeRepository) -> None:
    # One worker: "shade"'s policy.json could not be read at start. That error stayed in the worker's report for
    # good, and every later load, unload, promote or rollback of any model answered 422 "refused by other workers",
    # its change applied all the same; even once shade's policy was fixed and the poll served it.
    repository.add("shade", "1")
    repository.policies["shade"] = {"version_policy": "nonsense"}
    service = _service(settings, repository)
    try:
        repository.add("colour", "2")
        service.catalog.load("colour")  # shade's trouble is not this call's
        assert _ask(service) == "2" and "shade" in service.catalog.workers()[0]["error"]
        repository.policies.pop("shade")  # fixed
        service.controller.writers.poll()
        service.catalog.unload("colour")
        service.catalog.load("colour")
        assert service.catalog.workers()[0]["error"] is None and _ask(service, "shade") == "1"
    finally:
        service.shutdown(timeout=5)


def test_calls_for_different_models_on_different_workers_both_take_effect(tmp_path: Path) -> None:
    first, second = SharedDesiredState(tmp_path, pid=1), SharedDesiredState(tmp_path, pid=2)
    one, two, five = ({"versions": [v], "default": v} for v in ("1", "2", "5"))
    assert first.seed({"x": one, "y": one}) == 1 and second.seed({"x": two}) == 1  # the first seed stands
    assert first.write({"x": two}) == (2, True)
    # The second worker's call for y, written before it applied generation 2, keeps the first call's x 2.
    assert second.write({"y": five}) == (3, True)
    assert first.read() == (3, {"x": two, "y": five})
    assert second.write({"y": five}) == (3, False)  # nothing changed: no new generation for the workers to apply
    assert second.write({"y": UNLOADED}) == (4, True) and first.read()[1]["y"] == UNLOADED  # the poll leaves it
    assert second.write({"y": None}) == (5, True) and list(first.read()[1]) == ["x"]  # left the repository


def test_a_poll_decided_before_a_call_does_not_undo_the_call(tmp_path: Path) -> None:
    # Before: a poll in one worker read the state, a rollback call in another wrote its entry, and the poll then
    # wrote its choice over it (the docs walkthrough saw version 2 answer after rolling back to 1).
    poller, caller = SharedDesiredState(tmp_path, pid=1), SharedDesiredState(tmp_path, pid=2)
    newest = {"versions": ["1", "2"], "default": "2"}
    rollback = {"versions": ["1", "2"], "default": "1", "config": {"default_version": "1"}, "policy_file": None}
    poller.seed({"mine": {"versions": ["1"], "default": "1"}, "other": newest})
    _, read = poller.read()
    assert caller.write({"mine": rollback}) == (2, True)
    assert poller.write_unless_changed({"mine": newest, "other": UNLOADED}, read) == (3, True, False)  # other
    # written, mine left as the call put it
    assert caller.read()[1] == {"mine": rollback, "other": UNLOADED}
    assert poller.write_unless_changed({"mine": newest}, read) == (3, False, False)  # nothing to write


def test_a_version_that_fails_to_load_is_freed_at_once(service: Service, repository: FakeRepository,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # its version, predictor and batcher are a reference cycle, held by its error's traceback too: left to the
    # collector (switched off here: an engine's next full collection may be far off) it would keep its device memory
    import gc
    import weakref

    made: list[weakref.ref] = []
    load = repository.load

    def loading(name: str, version: str):  # noqa: ANN202 - a Predictor
        predictor = load(name, version)
        made.append(weakref.ref(predictor))
        return predictor

    monkeypatch.setattr(repository, "load", loading)
    repository.add("colour", "2").fail_when = -1.0  # every forward pass raises, the canary's too
    gc.disable()
    try:
        with pytest.raises(LoadFailed, match="fake forward failure"):
            service.catalog.load("colour")
        assert len(made) == 1 and made[0]() is None
    finally:
        gc.enable()
    assert _ask(service) == "1" and service.ready


# -- a model that answers NaN or infinity for some images --------------------------------------------------------------

class NanOnGreen(ColourModel):
    """ColourModel answering NaN for a green image (a model that overflows on some inputs), the others as before."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        green = x[:, 1].mean(dim=(1, 2)) > 0.5
        return torch.where(green[:, None], torch.full_like(logits, float("nan")), logits)


@pytest.fixture
def nan_app(settings: Settings) -> Iterator[Flask]:
    model = NanOnGreen()
    app = create_app(settings, Predictor(model, tiny_manifest(), device="cpu"))
    app.config["model"] = model
    yield app
    app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def _version_requests(outcome: str) -> float:
    return REGISTRY.get_sample_value("visionserve_version_requests_total", {
        "model": "colour", "version": "test", "role": "live", "outcome": outcome}) or 0.0


def test_an_image_the_model_answers_nan_for_fails_alone_and_its_batch_runs_once(nan_app: Flask) -> None:
    # Before: the NaN row was answered as a class (/predict 200 with score null; V2 200 with NaN in its JSON).
    model, service, client = nan_app.config["model"], nan_app.extensions[EXTENSION_KEY], nan_app.test_client()
    version = service.loaded_version()
    model.gate = threading.Event()  # the worker parked in a forward pass, so the next two requests share a batch
    parked_at = len(model.batch_sizes)  # the warm-up's and the canary's
    with ThreadPoolExecutor(3) as pool:
        parked = pool.submit(client.post, "/predict", data=image_bytes(BLUE), content_type="image/jpeg")
        wait_until(lambda: len(model.batch_sizes) > parked_at)
        before = len(model.batch_sizes)
        red, green = (pool.submit(client.post, "/predict", data=image_bytes(colour), content_type="image/jpeg")
                      for colour in (RED, GREEN))
        wait_until(lambda: version.batcher.depth == 2)
        model.gate.set()
        assert parked.result(10).status_code == 200
        red_answer, green_answer = red.result(10), green.result(10)
    assert red_answer.status_code == 200 and red_answer.json["predictions"][0]["label"] == "red"
    assert green_answer.status_code == 500 and green_answer.json["error"]["code"] == "non_finite_output"
    assert "produced non-finite output (NaN or infinity)" in green_answer.json["error"]["message"]
    assert model.batch_sizes[before:] == [2]  # one forward pass for both: none ran again
    version.settle()
    assert version.monitor.snapshot().predictions_total == 2  # blue's and red's rows: the batch's finite ones


class NanAlways(ColourModel):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full_like(super().forward(x), float("nan"))


def test_a_model_that_answers_nan_for_the_canary_is_refused_at_load_saying_so(
        settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING), pytest.raises(LoadFailed, match="every version was refused") as stopped:
        create_app(settings, Predictor(NanAlways(), tiny_manifest(), device="cpu"))
    refused = [r.getMessage() for r in caplog.records if r.name == "app.engine.versions.apply"]
    reason = ("colour version test cannot be served: canary inference failed: colour version test: the model's output "
              "is not finite (NaN or infinity) for 1 of the batch's 1 images")
    assert refused == [f"refused colour version test: {reason}"]
    # the start's last word says why (Before: "listed by the repository index", of a server that stopped)
    assert stopped.value.message == f"nothing can be served: every version was refused: {reason}"


def test_v2_answers_a_nan_row_with_a_500_in_strict_json_counted_as_the_version_s_failure(nan_app: Flask) -> None:
    client = nan_app.test_client()
    failed = _version_requests("failed")
    body = {"inputs": [{"name": "images", "datatype": "BYTES", "shape": [1],
                        "data": [base64.b64encode(image_bytes(GREEN)).decode()]}]}
    for parameters in ({}, {"outputs": [{"name": "probabilities", "parameters": {"classification": 2}}]}):
        answer = client.post("/v2/models/colour/infer", json={**body, **parameters})
        assert answer.status_code == 500
        strict = json.loads(answer.get_data(as_text=True), parse_constant=lambda name: pytest.fail(name))
        assert "non-finite output" in strict["error"]
    assert _version_requests("failed") == failed + 2
    # a client's own pixels in a preprocessing's scale the model answers NaN for: the model's fault still (a 400 is
    # for pixels of values no preprocessing makes, tests/app/test_errors.py)
    green = np.zeros((1, 3, 8, 8), np.float32)
    green[:, 1] = 1.0
    pixels = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 3, 8, 8], "data": green.ravel().tolist()}]}
    answer = client.post("/v2/models/colour/infer", json=pixels)
    assert answer.status_code == 500 and "non-finite output" in answer.get_json()["error"]
    assert _version_requests("failed") == failed + 3


def test_nan_rows_never_reach_the_drift_monitor(nan_app: Flask) -> None:
    client, version = nan_app.test_client(), nan_app.extensions[EXTENSION_KEY].loaded_version()

    def monitored() -> int:
        version.settle()
        return version.monitor.snapshot().predictions_total

    before = monitored()
    assert client.post("/predict", data=image_bytes(GREEN), content_type="image/jpeg").status_code == 500
    assert monitored() == before
    assert client.post("/predict", data=image_bytes(RED), content_type="image/jpeg").status_code == 200
    assert monitored() == before + 1


def test_a_version_whose_model_ends_in_softmax_is_refused_saying_so(settings: Settings, tmp_path: Path) -> None:
    repository = tmp_path / "repository"
    scripted_export(repository / "tiny" / "1", Means())
    settings = settings.model_copy(update={"weights_dir": repository})
    service = Service.build(settings, DirectorySource(settings))
    try:
        scripted_export(repository / "tiny" / "2", Softmaxed(), version="2")
        with pytest.raises(LoadFailed, match="tiny version 2 cannot be served: the model's output rows are already "
                                             "probabilities .* export the model without its final softmax"):
            service.catalog.load("tiny")
        assert infer(service, [image_bytes(RED)]).version == "1"
    finally:
        service.shutdown(timeout=5)


def test_a_policy_json_edited_after_a_call_ends_the_calls_hold_even_when_put_back_as_it_was(
        settings: Settings, repository: FakeRepository, caplog: pytest.LogCaptureFixture) -> None:
    # Before: the call's default came back once the file read as the call had found it again (an operator's typo,
    # then the fix: the file said 1, the server served 2; a multi-model operator's trial)
    repository.add("colour", "2")
    repository.policies["colour"] = {"version_policy": {"all": {}}, "default_version": "1"}
    service = _service(settings, repository)
    try:
        service.catalog.load("colour", {"default_version": "2"})
        service.controller.writers.poll()
        assert _ask(service) == "2"  # the call holds over the file it was given over
        repository.policies["colour"] = {"version_policy": {"all": {}}, "default_version": "9"}  # a typo
        with caplog.at_level(logging.WARNING):
            service.controller.writers.poll()
        assert "'9'" in caplog.text and _ask(service) == "2"  # refused: what serves keeps serving
        repository.policies["colour"] = {"version_policy": {"all": {}}, "default_version": "1"}  # fixed
        service.controller.writers.poll()
        assert _ask(service) == "1" and service.catalog.serving()["colour"]["default"] == "1"
        service.controller.writers.poll()
        assert _ask(service) == "1"
    finally:
        service.shutdown(timeout=5)


def test_a_model_whose_folder_leaves_the_repository_is_unloaded_saying_why(
        settings: Settings, repository: FakeRepository, caplog: pytest.LogCaptureFixture) -> None:
    # Before: only "unloaded other", the line an unload call writes too (a multi-model operator's trial)
    repository.add("other", "1")
    service = _service(settings, repository)
    try:
        del repository.held["other"]
        with caplog.at_level(logging.INFO):
            service.controller.writers.poll()
            service.controller.writers.poll()
        assert "other" not in service.catalog.serving() and _ask(service) == "1"
        said = [r.getMessage() for r in caplog.records if "no version in the repository" in r.getMessage()]
        assert said == ["other has no version in the repository any more (its folder was removed, or holds no "
                        "export): unloading it"]  # once, not at every poll
    finally:
        service.shutdown(timeout=5)


@pytest.mark.parametrize("named, said", [(None, "serving 2 models (colour, other) and none is the default: a request "
                                                "that names no model is answered 400"),
                                         ("other", "serving 2 models (colour, other); requests that name none get "
                                                   "other")])
def test_the_start_says_which_model_requests_naming_none_get(settings: Settings, repository: FakeRepository,
                                                             caplog: pytest.LogCaptureFixture, named: str | None,
                                                             said: str) -> None:
    # Before: nothing, until the first request naming no model was answered 400 (a multi-model operator's trial)
    repository.add("other", "1")
    repository.default = named
    with caplog.at_level(logging.INFO):
        service = _service(settings, repository)
    service.shutdown(timeout=5)
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("serving 2 models")][0].startswith(said)


def test_a_request_for_an_unloaded_model_is_told_why_and_what_serves_it_again(settings: Settings,
                                                                             repository: FakeRepository) -> None:
    # Before: "no model 'other' is loaded; this server serves ...", word for word a misspelt name's answer (a
    # multi-model operator's trial)
    repository.add("other", "1")
    repository.default = "colour"
    service = _service(settings, repository)
    try:
        service.catalog.unload("other")
        with pytest.raises(NotFound, match=r"no model 'other' is loaded: unloaded by a call \(POST "
                                           r"/v2/repository/models/other/load serves it again\); this server serves"):
            _ask(service, "other")
        with pytest.raises(NotFound, match=r"no model 'othr' is loaded; this server serves"):
            _ask(service, "othr")
        service.catalog.load("other")
        assert _ask(service, "other") == "1"
        del repository.held["other"]
        service.controller.writers.poll()
        with pytest.raises(NotFound, match="'other' is loaded: it has no version in the repository any more;"):
            _ask(service, "other")
    finally:
        service.shutdown(timeout=5)
