"""Workers that share one desired state and disagree about a version: a failure of one worker's own (less memory on
its device, a warm-up that fails there) neither undoes what another worker applied nor leaves it serving nothing;
the follow thread applies the others' changes however often it polls; and a poll whose model cannot be read goes on
to the others. Two workers in one process share a control directory, the second reporting under another live pid,
as in tests/app/test_model_lifecycle.py; their polls and follows are called by hand unless a test is about the
thread."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from app.config import Settings
from app.engine.catalog import Catalog
from app.engine.versions.controller import VersionsController
from app.engine.versions.desired import SharedDesiredState
from app.engine.service import Service
from app.errors import LoadFailed
from tests.support.fakes import FakeRepository, infer
from tests.support.imaging import RED, image_bytes


def _worker(settings: Settings, repository: FakeRepository,
            pid: int | None = None) -> tuple[VersionsController, Catalog]:
    """One worker's versions machinery (booted) and its catalog; ``pid``: the live process its report stands for
    (two workers in this process report under two pids), else this process's."""
    controller = VersionsController(settings, repository, on_report=lambda: None)  # type: ignore[arg-type]
    if pid is not None:
        controller.sync.desired = SharedDesiredState(settings.control_dir, pid=pid)  # type: ignore[arg-type]
    controller.boot()
    return controller, Catalog(settings, controller, wait_loaded=lambda timeout_s: None)


def _two_workers(settings: Settings) -> tuple[FakeRepository, FakeRepository, VersionsController, Catalog,
                                                VersionsController]:
    """Two workers sharing ``settings``' control directory, each with its own repository serving colour 1: this one
    (with its catalog) and another live process's (the parent's pid)."""
    here_repository, there_repository = FakeRepository(), FakeRepository()
    for repository in (here_repository, there_repository):
        repository.add("colour", "1")
    here, here_catalog = _worker(settings, here_repository)
    there, _ = _worker(settings, there_repository, pid=os.getppid())
    return here_repository, there_repository, here, here_catalog, there


def _stop(*controllers: VersionsController) -> None:
    for controller in controllers:
        controller.close()
        for loaded in controller.routes.all_versions():
            loaded.batcher.stop(5)


@pytest.fixture
def shared(settings: Settings, tmp_path: Path) -> Settings:
    """Settings whose workers share a control directory (several workers)."""
    return settings.model_copy(update={"control_dir": tmp_path / "control"})


def _serves(controller: VersionsController, name: str = "colour") -> list[str]:
    return controller.applier.serving().get(name, {}).get("versions", [])


@pytest.mark.slow  # a second or more (a run of the CLI, make, or workers sharing a state): the full suite's
def test_a_version_one_worker_refuses_does_not_undo_the_other_worker_s_pick(shared: Settings) -> None:
    # Version 2 loads in one worker and fails in the other (its own failure: out of memory in warm-up on its
    # device). Before: the second worker's poll picked version 1 without 2 and wrote it, the first followed and
    # dropped 2, its next poll loaded 2 again and wrote it: the desired state flipped every poll, 2 loaded each time.
    here_repository, there_repository, here, _, there = _two_workers(shared)
    try:
        for controller in (here, there):
            controller.close()  # no follow threads: each poll and follow below is the only one
        here_repository.add("colour", "2")
        there_repository.fail("colour", "2", "CUDA out of memory during warm-up (only on this worker's device)")
        for _ in range(3):
            here.writers.poll()
            there.writers.follow_newest()
            there.writers.poll()
            here.writers.follow_newest()
        assert here.sync.read()[1]["colour"]["versions"] == ["2"]  # as the worker that serves it wrote it
        assert _serves(here) == ["2"] and here_repository.loads.count(("colour", "2")) == 1
        assert _serves(there) == ["1"]  # what it could load serves on; its report says why not version 2
        (report,) = [r for r in here.sync.workers() if r["pid"] == os.getppid()]
        assert "CUDA out of memory during warm-up" in report["not_served"]["colour"]
    finally:
        _stop(here, there)


def test_a_refused_version_no_other_worker_serves_is_picked_without(shared: Settings) -> None:
    # The entry stays only while another worker serves the version: once none does (it left), a poll picks anew.
    repository = FakeRepository()
    repository.add("colour", "1")
    here, _ = _worker(shared, repository)
    try:
        here.close()
        repository.fail("colour", "2", "weights file x.pt has sha256 abc, the manifest says def")
        with here.applier.changing():  # as a worker that has since gone wrote it
            here.sync.desired.write({"colour": {"versions": ["2"], "default": "2"}})
        here.writers.follow_newest()  # refused here
        here.writers.poll()
        assert here.sync.read()[1]["colour"] == {  # the refusal recorded: every worker's index says it
            "versions": ["1"], "default": "1",
            "refused": {"2": "colour version 2 cannot be served: weights file x.pt has sha256 abc, the manifest says "
                             "def"}}
        assert _serves(here) == ["1"]
    finally:
        _stop(here)


def test_a_worker_joining_that_cannot_load_the_desired_version_serves_the_newest_that_loads(
        shared: Settings) -> None:
    # A worker restarted (a crash, kill -HUP) while the desired state says colour 2, which fails there. Before: it
    # served no version of colour, reported ready, and answered colour's requests 404.
    running_repository = FakeRepository()
    for name, version in (("colour", "1"), ("colour", "2"), ("other", "1")):
        running_repository.add(name, version)
    running, _ = _worker(shared, running_repository, pid=os.getppid())
    joining_repository = FakeRepository()
    joining_repository.add("colour", "1")
    joining_repository.fail("colour", "2", "CUDA out of memory during warm-up")
    joining_repository.add("other", "1")
    joining = Service.build(shared, joining_repository)  # type: ignore[arg-type]
    try:
        assert joining.ready and infer(joining, [image_bytes(RED)], name="colour").version == "1"
        assert running.sync.read()[1]["colour"]["versions"] == ["2"]  # the shared entry is not rewritten
        assert "CUDA out of memory" in joining.controller.applier.not_served["colour"]  # its report says why
        joining.controller.writers.poll()  # the poll leaves it so: the running worker serves 2
        assert running.sync.read()[1]["colour"]["versions"] == ["2"] and _serves(joining.controller) == ["1"]
        assert [(r.version, r.state) for r in joining.catalog.index() if r.name == "colour"] == [
            ("1", "READY"), ("2", "UNAVAILABLE")]
    finally:
        joining.shutdown(timeout=5)
        _stop(running)


@pytest.mark.slow  # a second or more (a run of the CLI, make, or workers sharing a state): the full suite's
def test_a_joining_worker_short_of_memory_for_the_desired_versions_serves_what_fits(shared: Settings) -> None:
    # Each fake version takes 1 MiB and needs 2 MiB to load: with 2 MiB the joining worker fits one of the two.
    repository = FakeRepository()
    for version in ("1", "2"):
        repository.add("colour", version)
    running, _ = _worker(shared.model_copy(update={"version_policy": "latest:2"}), repository)
    joining, _ = _worker(shared.model_copy(update={"version_policy": "latest:2", "model_memory_limit_mb": 2}),
                         repository, pid=os.getppid())
    try:
        assert _serves(joining) == ["1"] and running.sync.read()[1]["colour"]["versions"] == ["1", "2"]
        assert "needs about 2 MiB" in joining.applier.not_served["colour"]
    finally:
        _stop(running, joining)


@pytest.mark.slow  # a second or more (a run of the CLI, make, or workers sharing a state): the full suite's
def test_a_poll_as_often_as_the_follow_rounds_still_applies_the_other_workers_changes(shared: Settings) -> None:
    # REPOSITORY_POLL_S at or under WATCH_S (0.2 s): every round polled and none followed, so another worker's
    # unload never applied here and its call answered 504 after REPOSITORY_SYNC_TIMEOUT_S, saying this worker had
    # not applied it.
    fast = shared.model_copy(update={"repository_poll_s": 0.01, "repository_sync_timeout_s": 5})
    repository = FakeRepository()
    for name in ("colour", "other"):
        repository.add(name, "1")
    here, here_catalog = _worker(fast, repository)
    there, _ = _worker(fast, repository, pid=os.getppid())
    try:
        assert here_catalog.unload("other") == {"versions": [], "default": None}  # answers once both serve it
        assert sorted(there.applier.serving()) == ["colour"]
    finally:
        _stop(here, there)


def test_a_model_whose_files_cannot_be_read_stops_no_poll_of_the_others(
        settings: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Before: an OSError (or ModelLoadError) reading one model ended the whole poll round, skipping every model
    # after it, the round's follow and its evidence sharing.
    repository = FakeRepository()
    for name in ("broken", "colour"):
        repository.add(name, "1")
    here, catalog = _worker(settings, repository)
    try:
        here.close()
        listed = repository.versions

        def versions(name: str) -> list[str]:
            if name == "broken":
                raise PermissionError(f"[Errno 13] Permission denied: 'repository/{name}'")
            return listed(name)

        monkeypatch.setattr(repository, "versions", versions)
        repository.add("colour", "2")
        with caplog.at_level(logging.WARNING, logger="app.engine.versions.writers"):
            here.writers.poll()
        assert _serves(here) == ["2"] and _serves(here, "broken") == ["1"]  # what served serves on
        assert "Permission denied" in here.applier.not_served["broken"]
        index = catalog.index()  # answers all the same: what it serves of the model, and the other models
        assert [(r.version, r.state) for r in index if r.name == "broken"] == [("1", "READY")]
        assert ("2", "READY") in [(r.version, r.state) for r in index if r.name == "colour"]
        assert any("poll: broken: model 'broken': [Errno 13]" in r.getMessage() for r in caplog.records)
    finally:
        _stop(here)


@pytest.mark.slow  # a second or more (a run of the CLI, make, or workers sharing a state): the full suite's
def test_a_load_call_another_worker_refuses_says_so_and_is_not_undone_by_its_poll(shared: Settings) -> None:
    # The call's answer names the worker that refused; that worker's poll then keeps the call's entry.
    here_repository, there_repository, here, here_catalog, there = _two_workers(shared)
    try:
        here_repository.add("colour", "2")
        there_repository.fail("colour", "2", "CUDA out of memory during warm-up")
        with pytest.raises(LoadFailed, match=f"refused by other workers .*worker {os.getppid()}: colour version 2"):
            here_catalog.load("colour")
        there.writers.poll()
        assert here.sync.read()[1]["colour"]["versions"] == ["2"] and _serves(here) == ["2"]
    finally:
        _stop(here, there)


def _refused_by_a_load_call(shared: Settings, why: str, policy: dict | None = None) -> tuple[
        FakeRepository, FakeRepository, VersionsController, VersionsController]:
    """Two workers without follow threads or polls (only what a call writes reaches the other), colour 2 failing
    to load in both (``policy``: colour's policy.json), refused by a load call to the first, followed by the other."""
    here_repository, there_repository, here, here_catalog, there = _two_workers(shared)
    for controller in (here, there):
        controller.close()
    for repository in (here_repository, there_repository):
        if policy is not None:
            repository.policies["colour"] = policy
        repository.fail("colour", "2", why)
    with pytest.raises(LoadFailed, match=f"colour version 2 cannot be served: {why}"):
        here_catalog.load("colour")
    there.writers.follow_newest()
    return here_repository, there_repository, here, there


def test_a_load_call_refused_for_a_version_that_cannot_load_is_said_in_every_worker_s_index(shared: Settings) -> None:
    # Before: the call's 422 changed nothing, so only the worker that took it knew why: the other's index said
    # version 2 was "not chosen by the model's version policy" until a poll or a second call (a rollout trial).
    why = "weights file x.pt has sha256 abc, the manifest says def"
    _, there_repository, here, there = _refused_by_a_load_call(shared, why)
    try:
        for controller in (here, there):
            (row,) = [r for r in controller.applier.index(controller.sync.read()[1]) if r.version == "2"]
            assert (row.state, row.reason) == ("UNAVAILABLE", f"colour version 2 cannot be served: {why}")
            assert _serves(controller) == ["1"]
        assert there_repository.loads.count(("colour", "2")) == 0  # told, not tried again
        assert here.sync.read()[1]["colour"]["versions"] == ["1"]  # what serves is what served
    finally:
        _stop(here, there)


def test_a_rollout_whose_candidate_a_load_call_found_broken_says_so_in_every_worker(shared: Settings) -> None:
    # Before: /v1/models' candidate_refused and visionserve_rollout_candidate_refused appeared only after a second
    # load call (a rollout trial).
    _, _, here, there = _refused_by_a_load_call(shared, "the file is cut short", {"rollout": {"shadow_percent": 100}})
    try:
        entry = there.sync.read()[1]["colour"]
        assert (entry["versions"], entry["rollout"]["candidate_refused"]["version"]) == (["1"], "2")
        assert REGISTRY.get_sample_value("visionserve_rollout_candidate_refused",
                                         {"model": "colour", "version": "2"}) == 1
    finally:
        _stop(here, there)
