"""Rollouts (#33) in one worker with in-memory ColourModel versions: the plan (candidate, held default, promotion,
rollback), canary shares, shadow comparisons equal to the offline ones and never touching a live answer, shadow
work dropped under a burst, promotion and rollback by call and by the rules, the evidence in /v1/models and the V2
index. tests/server/test_rollouts.py does it with real exports under gunicorn."""
from __future__ import annotations

import base64
import collections
import json
import logging
import math
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import numpy as np
import torch
from prometheus_client import REGISTRY

from app import EXTENSION_KEY

from app.factory import create_app
from app.config import Settings
from app.engine.batching.types import BatchRun
from app.engine.rollouts.evidence import Comparison, merge_comparisons
from app.engine.rollouts.policy import PolicyError, VersionPolicy
from app.engine.rollouts.plan import (
    PromoteRule,
    RollbackRule,
    RolloutPolicy,
    plan,
    promoted,
    rolled_back,
    takes_canary,
)
from app.engine.rollouts.rules import judge
from app.engine.rollouts.shadow import offer
from app.engine.contract import Served
from app.engine.service import Service
from app.engine.versions.controller import VersionsController
from app.engine.versions.desired import SharedDesiredState
from app.errors import BadRequest, Conflict, LoadFailed
from tests.support.fakes import (LABELS, ColourModel, FakeRepository, OtherInputRepository, infer,
                                 served_over_http, wait_until)
from tests.support.imaging import BLUE, GREEN, RED, image_bytes

SHADES = [(230, 20, 20), (20, 230, 20), (20, 20, 230), (200, 180, 20), (20, 190, 180), (150, 30, 160),
          (200, 60, 60), (60, 60, 200), (90, 200, 90)]  # no grey: a near tie could flip with the batch
ALL_VERSIONS = Settings(device="cpu", log_level="warning", version_policy="all")
PHOTOS = [image_bytes(colour, size=(40, 30)) for colour in SHADES]


class GreenBlind(ColourModel):
    """Another version that confuses green with red: it disagrees with ColourModel on the green images only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        return torch.stack([logits[:, 0] + logits[:, 1], logits[:, 1] * 0.5, logits[:, 2], logits[:, 3]], dim=1)


def _repository(rollout: dict[str, object] | None = None, candidate: type[ColourModel] = GreenBlind) -> FakeRepository:
    repository = FakeRepository()
    repository.add("colour", "1")
    repository.held["colour"]["2"] = candidate()
    repository.stamps[("colour", "2")] = 1
    if rollout is not None:
        repository.policies["colour"] = {"rollout": rollout}
    return repository


@pytest.fixture
def shadowed(settings: Settings) -> Iterator[Service]:
    service = Service.build(settings, _repository({"shadow_percent": 100}))  # type: ignore[arg-type]
    yield service
    service.shutdown(timeout=5)


def _offline_answers(photos: list[bytes]) -> dict[str, list[str]]:
    """Versions 1 and 2's top-1 labels on ``photos``, computed with no shadow."""
    answers = {}
    for version in ("1", "2"):
        alone = Service.build(ALL_VERSIONS, _repository())  # type: ignore[arg-type]
        try:
            answers[version] = [LABELS[int(infer(alone, [p], version=version).probabilities().argmax())]
                                for p in photos]
        finally:
            alone.shutdown(timeout=5)
    return answers


def _compared(service: Service) -> int:
    """Images the shadow compared so far (over the workers' reports, shared now)."""
    service.controller.writers.share_evidence()
    return ((service.catalog.rollouts().get("colour") or {}).get("comparison") or {}).get("compared", 0)


def _one_by_one(service: Service, photos: list[bytes], send: Callable[[bytes], object] | None = None) -> None:
    """Each photo sent once its predecessor's shadow was compared: a loaded machine drops none as busy."""
    for photo in photos:
        before = _compared(service)
        (send or (lambda p: infer(service, [p])))(photo)
        wait_until(lambda: _compared(service) > before)


# -- the plan ---------------------------------------------------------------------------------------------------


def test_a_rollout_keeps_the_default_and_the_newest_version_arrives_as_its_candidate() -> None:
    latest, shadow = VersionPolicy.parse("latest"), RolloutPolicy(shadow_percent=100)
    first = plan(latest, shadow, ["1", "2"], None)
    assert (first["default"], first["rollout"]["candidate"], first["versions"]) == ("1", "2", ["1", "2"])
    serving_one = plan(latest, shadow, ["1"], None)
    assert (serving_one["default"], serving_one["rollout"]["candidate"]) == ("1", None)
    # version 3 lands: the default is held, 3 is the candidate
    after = plan(latest, shadow, ["1", "2", "3"], {"versions": ["1", "2"], "default": "1"})
    assert (after["default"], after["rollout"]["candidate"], after["versions"]) == ("1", "3", ["1", "3"])
    # without a rollout the newest takes over, as before
    assert plan(latest, RolloutPolicy(), ["1", "2"], {"default": "1"})["default"] == "2"


def test_promotion_and_rollback_are_entries_the_poll_keeps() -> None:
    latest = VersionPolicy.parse("latest")
    shadow = RolloutPolicy(shadow_percent=100, rollback=RollbackRule(within=50))  # the new default watched by it
    entry = plan(latest, shadow, ["1", "2"], None)
    up = promoted(entry, "2", baseline_p99_ms=12.0)
    assert (up["default"], up["previous_default"], up["watch"]["baseline_p99_ms"]) == ("2", "1", 12.0)
    polled = plan(latest, shadow, ["1", "2"], up)
    assert (polled["default"], polled["versions"], polled["rollout"]["candidate"]) == ("2", ["1", "2"], None)
    down = rolled_back(polled, "1")
    assert (down["default"], down["rolled_back"], down["versions"]) == ("1", ["2"], ["1"])
    polled = plan(latest, shadow, ["1", "2"], down)  # 2 is no candidate again ...
    assert (polled["default"], polled["rollout"]["candidate"], polled["versions"]) == ("1", None, ["1"])
    polled = plan(latest, shadow, ["1", "2", "3"], polled)  # ... but a newer version is
    assert (polled["default"], polled["rollout"]["candidate"]) == ("1", "3")
    # without a rollout, a call's default holds until the next load call
    held = promoted(plan(latest, RolloutPolicy(), ["1", "2"], None), "1", None)
    assert plan(latest, RolloutPolicy(), ["1", "2"], held)["default"] == "1"


def test_a_refused_candidate_is_left_out_and_the_default_kept() -> None:
    latest, shadow = VersionPolicy.parse("latest"), RolloutPolicy(shadow_percent=100)
    why = {"2": "colour version 2 cannot be served: sha256 differs"}
    named = plan(VersionPolicy.from_config({"default_version": "1"}, latest),
                 RolloutPolicy(shadow_percent=100, candidate="2"), ["1"], None, refused=why)
    assert (named["default"], named["versions"], named["rollout"]["candidate"]) == ("1", ["1"], None)
    assert named["rollout"]["candidate_refused"] == {"version": "2", "reason": why["2"]}
    # named and refused: no other version is made the candidate in its place
    held = plan(latest, RolloutPolicy(candidate="3", shadow_percent=100), ["1", "2"], {"default": "1"},
                refused={"3": "no"})
    assert (held["default"], held["rollout"]["candidate"], held["rollout"]["candidate_refused"]["version"]) == (
        "1", None, "3")
    first = plan(latest, RolloutPolicy(candidate="3", shadow_percent=100), ["1", "2"], None, refused={"3": "no"})
    assert (first["default"], first["versions"], first["rollout"]["candidate"]) == ("2", ["2"], None)  # below 3
    nothing = plan(latest, RolloutPolicy(candidate="1", shadow_percent=100), [], None, refused={"1": "no"})
    assert nothing["versions"] == [] and nothing["default"] is None  # nothing else: nothing is served
    # unnamed: the newest newer than the default was refused; the next newest is the candidate, and it is said
    newest = plan(latest, shadow, ["1", "2"], {"default": "1"}, refused={"3": "no"})
    assert (newest["rollout"]["candidate"], newest["rollout"]["candidate_refused"]["version"]) == ("2", "3")
    assert "candidate_refused" not in plan(latest, shadow, ["1", "2"], {"default": "1"})["rollout"]
    assert "candidate_refused" not in plan(VersionPolicy.parse("specific:1,2"), shadow, ["1", "2"], {"default": "1"},
                                           refused={"3": "no"})["rollout"]  # 3 would not be chosen anyway
    with pytest.raises(PolicyError, match="rollout candidate '4' is not in the repository"):
        plan(latest, RolloutPolicy(candidate="4", shadow_percent=100), ["1", "2"], None, refused={"3": "no"})


def test_rollout_configs_are_read_and_bad_ones_refused() -> None:
    settings = Settings(canary_percent=5, promote_after=100)
    policy = RolloutPolicy.layered(settings, {"rollout": {"shadow_percent": 50, "promote": {"min_agreement": 0.9}}})
    assert (policy.canary_percent, policy.shadow_percent) == (5, 50)
    assert policy.promote == PromoteRule(after=100, min_agreement=0.9, max_latency_ratio=1.5)
    assert RolloutPolicy.layered(settings, {"rollout": {"promote": {"after": 0}}}).promote is None
    for bad in ({"canary_percent": 150}, {"canary": 5}, {"promote": {"after": 5, "sooner": 1}}, "ten",
                {"rollback": {"within": "x"}}):
        with pytest.raises(PolicyError):
            RolloutPolicy.layered(Settings(), {"rollout": bad})
    assert VersionPolicy.from_config({"rollout": {"canary_percent": 1}}, VersionPolicy()).kind == "latest"


def test_a_canary_share_is_sticky_per_client_and_within_its_bounds() -> None:
    keys = [f"client-{i}" for i in range(4000)]
    taken = [takes_canary(10, "colour", key, 0.99) for key in keys]
    share, sigma = sum(taken) / len(keys), math.sqrt(0.1 * 0.9 / len(keys))
    assert abs(share - 0.10) < 4 * sigma
    assert taken == [takes_canary(10, "colour", key, 0.0) for key in keys]  # the key decides, not the draw
    assert takes_canary(10, "colour", None, 0.05) and not takes_canary(10, "colour", None, 0.15)
    assert not takes_canary(0, "colour", "anyone", 0.0)


def test_the_rules_promote_on_agreement_and_roll_back_on_errors() -> None:
    entry = {"versions": ["1", "2"], "default": "1", "rollout": RolloutPolicy(
        shadow_percent=100, promote=PromoteRule(after=10, min_agreement=0.9)).as_entry("2")}

    def evidence(compared: int, agreed: float, errors: int = 0) -> dict[str, object]:
        return {"comparisons": {("m", "2", "1"): {"compared": compared, "top1_agreement": agreed, "errors": errors,
                                                   "live_forward_ms": {"p99": 10.0},
                                                   "candidate_forward_ms": {"p99": 11.0}}}, "traffic": {}}

    assert judge("m", entry, evidence(9, 1.0)) is None
    assert judge("m", entry, evidence(10, 0.8)) is None
    assert judge("m", entry, evidence(10, 1.0, errors=1)) is None
    assert judge("m", entry, evidence(10, 0.95))[:2] == ("promote", "2")  # type: ignore[index]
    watched = {"versions": ["1", "2"], "default": "2", "previous_default": "1",
               "rollout": RolloutPolicy(rollback=RollbackRule(within=50)).as_entry(None),
               "watch": {"version": "2", "previous": "1", "baseline_p99_ms": 10.0}}

    def traffic(requests: int, failures: int, p99: float) -> dict[str, object]:
        return {"comparisons": {}, "traffic": {("m", "2"): {"requests": requests, "failures": failures, "p99": p99}}}

    assert judge("m", watched, traffic(30, 0, 12.0)) is None
    assert judge("m", watched, traffic(30, 3, 12.0))[:2] == ("rollback", "1")  # type: ignore[index]
    assert judge("m", watched, traffic(30, 0, 25.0))[:2] == ("rollback", "1")  # type: ignore[index]
    assert judge("m", watched, traffic(50, 0, 12.0))[:2] == ("settle", "2")  # type: ignore[index]


# -- shadow -------------------------------------------------------------------------------------------------------


def test_the_shadow_agreement_equals_the_offline_one_and_live_answers_do_not_change(shadowed: Service) -> None:
    rollouts = shadowed.catalog.rollouts
    live: list[Served] = []
    _one_by_one(shadowed, PHOTOS, lambda photo: live.append(infer(shadowed, [photo])))
    assert {served.version for served in live} == {"1"}
    comparison = rollouts()["colour"]["comparison"]
    answers = _offline_answers(PHOTOS)
    offline = sum(a == b for a, b in zip(answers["1"], answers["2"])) / len(PHOTOS)
    assert 0 < offline < 1  # the versions disagree on some photos: the test can tell
    assert comparison["top1_agreement"] == pytest.approx(offline)
    assert comparison["errors"] == 0 and comparison["dropped"] == {}
    pairs = collections.Counter((a, b) for a, b in zip(answers["1"], answers["2"]) if a != b)
    assert {(d["live"], d["candidate"]): d["count"] for d in comparison["disagreements"]} == dict(pairs)
    alone = Service.build(ALL_VERSIONS, _repository())  # type: ignore[arg-type]
    try:  # the same answers, to the last digit, as version 1 with no shadow
        for photo, served in zip(PHOTOS, live):
            assert np.array_equal(infer(alone, [photo], version="1").probabilities(), served.probabilities())
    finally:
        alone.shutdown(timeout=5)


class Turnstile:
    """A forward-pass gate that lets one batch through per ``turn``."""

    def __init__(self) -> None:
        self._turns = threading.Semaphore(0)

    def wait(self, timeout: float) -> None:
        self._turns.acquire(timeout=timeout)

    def turn(self, count: int = 1) -> None:
        self._turns.release(count)


def test_shadow_work_is_dropped_under_a_burst_and_no_live_request_fails(shadowed: Service) -> None:
    live = shadowed.controller.applier.routes.find("colour", "1")
    live.predictor.module.gate = gate = Turnstile()

    def comparison() -> dict[str, object]:
        shadowed.controller.writers.share_evidence()
        return shadowed.catalog.rollouts()["colour"]["comparison"] or {"dropped": {}, "compared": 0, "errors": 0}

    with ThreadPoolExecutor(9) as pool:  # a batch of up to 4 runs (held), at least 5 queue
        answers = [pool.submit(infer, shadowed, [PHOTOS[i % len(PHOTOS)]], timeout_s=10) for i in range(9)]
        wait_until(lambda: live.batcher.depth >= 5)
        gate.turn()  # the first batch answers while the next one is held and more wait: its shadows are dropped
        wait_until(lambda: comparison()["dropped"].get("busy", 0) >= 1)
        gate.turn(10)
        served = [answer.result() for answer in answers]
    assert {s.version for s in served} == {"1"}
    wait_until(lambda: sum(comparison()[key] for key in ("compared", "errors"))  # type: ignore[misc]
               + sum(comparison()["dropped"].values()) == 9)  # type: ignore[attr-defined]
    assert comparison()["errors"] == 0


def _comparison(service: Service) -> dict[str, Any]:
    """The shadow's comparison so far (over the workers' reports, shared now)."""
    service.controller.writers.share_evidence()
    return ((service.catalog.rollouts().get("colour") or {}).get("comparison")
            or {"dropped": {}, "compared": 0, "errors": 0})


def _settled(comparison: dict[str, Any]) -> int:
    """Images whose shadow work is over: compared, failed or dropped."""
    return comparison["compared"] + comparison["errors"] + sum(comparison["dropped"].values())


def test_a_request_of_more_than_two_of_the_candidate_s_batches_is_compared_two_batches_at_a_time(
        settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: its shadow work was dropped as busy however idle the server (more than two of the candidate's batches
    # would wait), so agreement was measured on small requests only and a workload of large ones never promoted.
    service = Service.build(settings.model_copy(update={"max_images": 9, "queue_size": 16}),
                            _repository({"shadow_percent": 100}))  # type: ignore[arg-type]
    try:
        candidate = service.controller.applier.routes.find("colour", "2")
        pieces, submit_many = [], candidate.batcher.submit_many

        def counted(items: list[object], *args: object, **kwargs: object) -> object:
            pieces.append(len(items))
            return submit_many(items, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(candidate.batcher, "submit_many", counted)
        assert infer(service, PHOTOS).version == "1"  # nine images; the candidate's cap is four
        wait_until(lambda: _settled(_comparison(service)) == len(PHOTOS))
        comparison = _comparison(service)
        assert comparison["compared"] == len(PHOTOS) and comparison["dropped"] == {}
        assert pieces == [8, 1]  # two batches of its cap, then the rest once they were answered
        answers = _offline_answers(PHOTOS)
        assert comparison["top1_agreement"] == pytest.approx(
            sum(a == b for a, b in zip(answers["1"], answers["2"])) / len(PHOTOS))
    finally:
        service.shutdown(timeout=5)


def test_a_large_request_s_shadow_stops_between_its_pieces_once_live_work_waits(settings: Settings) -> None:
    # its first piece was taken with no live work waiting; a later one would run beside live work that waits
    service = Service.build(settings.model_copy(update={"max_images": 9, "queue_size": 16}),
                            _repository({"shadow_percent": 100}))  # type: ignore[arg-type]
    try:
        live, candidate = (service.controller.applier.routes.find("colour", v) for v in ("1", "2"))
        candidate.predictor.module.gate = turns = Turnstile()
        infer(service, PHOTOS)  # answered; its shadow's first piece, two of the candidate's batches, is held there
        wait_until(lambda: candidate.batcher.depth == 4)  # its first batch runs, the second waits
        live.predictor.module.gate = held = threading.Event()
        passes = len(live.predictor.module.batch_sizes)
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(infer, service, [PHOTOS[0]])
            wait_until(lambda: len(live.predictor.module.batch_sizes) > passes)  # held in its forward pass
            waiting = pool.submit(infer, service, [PHOTOS[1]])
            wait_until(lambda: live.batcher.depth == 1)  # live work waits
            turns.turn(2)  # the first piece answered: the rest is not handed over while live work waits
            wait_until(lambda: _comparison(service)["dropped"].get("busy", 0) >= len(PHOTOS))
            assert _comparison(service)["compared"] == 0
            held.set()
            turns.turn(10)
            assert running.result().version == waiting.result().version == "1"
    finally:
        service.shutdown(timeout=5)


def test_a_version_promoted_from_shadow_answers_its_first_requests_ahead_of_the_shadow_work_it_holds(
        settings: Settings) -> None:
    # Before: they waited behind it (a suite run's first requests on a promoted Lite0 waited 3.7-4.3 s on a starved
    # 2-core machine: bench/results/2026-12-02-suite-f5dfded-cpu-2cpu-vm.md)
    service = Service.build(settings.model_copy(update={"max_images": 9, "queue_size": 16}),
                            _repository({"shadow_percent": 100}))  # type: ignore[arg-type]
    try:
        candidate = service.controller.applier.routes.find("colour", "2")
        module = candidate.predictor.module
        module.gate = turns = Turnstile()
        retired, passes = _retired_shadow_work(), len(module.batch_sizes)
        assert infer(service, PHOTOS).version == "1"  # its shadow's first piece: two of the candidate's batches
        # its first batch in the forward pass (held), the second waits
        wait_until(lambda: module.batch_sizes[passes:] == [4] and candidate.batcher.depth == 4)
        assert service.catalog.promote("colour", "2")["default"] == "2"
        passes += 1
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(infer, service, [PHOTOS[0]])
            wait_until(lambda: candidate.batcher.depth == 5)
            turns.turn(2)  # the shadow batch running, then the next one
            assert first.result(timeout=10).version == "2"
            assert module.batch_sizes[passes:passes + 1] == [1]  # the request's, before the shadow's second batch
            turns.turn(10)
            wait_until(lambda: _retired_shadow_work() == retired + len(PHOTOS))  # its last image not handed over:
            # its comparison, of all nine, nobody reads now
            assert module.batch_sizes[passes + 1:] == [4]  # the shadow's second batch ran after the request
    finally:
        service.shutdown(timeout=5)


def test_the_shadow_s_top5_overlap_is_none_below_six_classes_where_it_is_one_by_construction() -> None:
    # Before: 1.0 for a 3-class model's versions, whatever they answered (training and models.predict drop top-5
    # there; a new user's trial).
    def overlap(classes: int) -> float | None:
        comparison = Comparison("colour", "2", "1")
        labels = [f"c{i}" for i in range(classes)]
        scores = torch.arange(classes, dtype=torch.float32).softmax(0)  # no ties: its top 5 are its last 5
        live, candidate = scores[None], scores.flip(0)[None]  # the candidate's top 5 are the first 5
        comparison.record(live, labels, candidate, labels, [1.0], [1.0])
        return merge_comparisons([comparison.dump()])["top5_overlap"]

    assert overlap(3) is None and overlap(5) is None
    assert overlap(6) == pytest.approx(4 / 5) and overlap(10) == 0.0
    before = Comparison("colour", "2", "1").dump()  # a worker of the code before (a HUP's drain) counts none apart
    del before["top5_compared"]
    assert merge_comparisons([before, Comparison("colour", "2", "1").dump()])["top5_overlap"] is None


def test_shadow_work_waiting_as_its_rollout_changes_is_dropped_as_retired_and_never_run() -> None:
    service = Service.build(ALL_VERSIONS, _repository())  # type: ignore[arg-type]
    try:
        live, candidate = (service.controller.applier.routes.find("colour", v) for v in ("1", "2"))
        passes, retired = len(candidate.predictor.module.batch_sizes), _retired_shadow_work()
        live.predictor.module.gate = held = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(infer, service, [PHOTOS[0]], version="1")
            wait_until(lambda: live.batcher.running_since() is not None)  # its batch held: the job below waits
            comparison = Comparison("colour", "2", "1")
            offer(live, candidate, comparison, [PHOTOS[1]], (), (), [np.full(len(LABELS), 1 / len(LABELS))],
                  [BatchRun(1, 1, 1, 0.0, 0.001)], max_age_s=60, queue_limit=64)
            comparison.ended = True  # as the rollout changes (Evidence.restart, a promotion)
            held.set()
            assert running.result(timeout=10).version == "1"
        wait_until(lambda: _retired_shadow_work() == retired + 1)
        assert len(candidate.predictor.module.batch_sizes) == passes and comparison.compared == 0
    finally:
        service.shutdown(timeout=5)


def test_shadow_work_waiting_behind_live_work_keeps_its_own_copy_of_images_the_engine_s_link_lent() -> None:
    # Before: the job held the request's views of the worker's arena (app/link/arena.py) for as long as it waited,
    # and with them the worker's ring from their place on.
    service = Service.build(ALL_VERSIONS, _repository())  # type: ignore[arg-type]
    try:
        live, candidate = (service.controller.applier.routes.find("colour", v) for v in ("1", "2"))
        live.predictor.module.gate = held = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(infer, service, [PHOTOS[0]], version="1")
            wait_until(lambda: live.batcher.running_since() is not None)  # its batch held: the job below waits
            lent = np.frombuffer(bytearray(PHOTOS[1]), np.uint8)  # as the link lends a photo: a view of an array
            gone = weakref.ref(lent)
            comparison = Comparison("colour", "2", "1")
            offer(live, candidate, comparison, [memoryview(lent)], (), (), [np.full(len(LABELS), 1 / len(LABELS))],
                  [BatchRun(1, 1, 1, 0.0, 0.001)], max_age_s=60, queue_limit=64)
            del lent
            assert gone() is None  # let go of while the job waits
            held.set()
            assert running.result(timeout=10).version == "1"
        wait_until(lambda: comparison.compared == 1)  # and compared from its own copy
    finally:
        service.shutdown(timeout=5)


def _retired_shadow_work() -> float:
    """Shadow images of version 2 dropped as ``retired`` in this process so far."""
    return REGISTRY.get_sample_value("visionserve_shadow_dropped_total",
                                     {"model": "colour", "version": "2", "reason": "retired"}) or 0.0


def test_a_request_of_more_images_than_the_shadow_queue_holds_is_compared_when_no_other_shadow_work_waits(
        settings: Settings) -> None:
    # Before: dropped as full with nothing waiting: a request larger than SHADOW_QUEUE_SIZE was never compared.
    service = Service.build(settings.model_copy(update={"shadow_queue_size": 2}),
                            _repository({"shadow_percent": 100}))  # type: ignore[arg-type]
    try:
        infer(service, PHOTOS[:3])
        wait_until(lambda: _settled(_comparison(service)) == 3)
        comparison = _comparison(service)
        assert comparison["compared"] == 3 and comparison["dropped"] == {}
    finally:
        service.shutdown(timeout=5)


def test_promote_and_rollback_by_call_with_evidence_in_the_api(settings: Settings) -> None:
    app = create_app(settings, source=_repository({"shadow_percent": 100}))  # type: ignore[arg-type]
    client = app.test_client()
    try:
        service = app.extensions[EXTENSION_KEY]
        _one_by_one(service, PHOTOS, lambda photo: client.post("/predict", data=photo, content_type="image/jpeg"))
        assert client.get("/v1/models").get_json()["rollouts"][0]["comparison"]["compared"] == len(PHOTOS)
        assert {client.post("/predict?version=1", data=p, content_type="image/jpeg").get_json()["model"]["version"]
                for p in PHOTOS[:2]} == {"1"}
        body = client.get("/v1/models").get_json()
        assert {m["version"]: m["role"] for m in body["models"]} == {"1": "live", "2": "shadow"}
        rollout = body["rollouts"][0]
        assert (rollout["live"], rollout["candidate"], rollout["shadow_percent"]) == ("1", "2", 100)
        index = client.post("/v2/repository/index", json={}).get_json()
        assert {r["version"]: r.get("role") for r in index} == {"1": "live", "2": "shadow"}
        assert next(r for r in index if r["version"] == "2")["comparison"] == rollout["comparison"]
        assert client.post("/v1/models/colour/rollback").status_code == 409  # nothing before 1
        answer = client.post("/v1/models/colour/promote")
        assert answer.status_code == 200, answer.get_json()
        assert (answer.get_json()["default"], answer.get_json()["previous"]) == ("2", "1")
        assert client.post("/predict", data=PHOTOS[0], content_type="image/jpeg").get_json()["model"]["version"] == "2"
        assert client.post("/v1/models/colour/promote").status_code == 409  # no candidate left
        assert client.post("/v1/models/colour/rollback").get_json()["rolled_back"] == ["2"]
        assert client.post("/predict", data=PHOTOS[0], content_type="image/jpeg").get_json()["model"]["version"] == "1"
        assert client.post("/v1/models/nope/promote").status_code == 404
        assert client.post("/v1/models/colour/promote", json={"version": "9"}).status_code == 404
        assert client.post("/v1/models/colour/promote", data="{", content_type="application/json").status_code == 400
        # a body not of the schema: 422 with its details, as every other body (before: 400, a pydantic class named)
        mistyped = client.post("/v1/models/colour/promote", json={"versions": "2"})
        assert mistyped.status_code == 422 and mistyped.get_json()["error"]["details"][0]["loc"] == ["versions"]
        listed = client.post("/v1/models/colour/promote", json=["2"]).get_json()["error"]
        assert listed["code"] == "validation_error" and listed["message"].endswith(": Input should be a JSON object")
        empty = client.post("/v1/models/colour/promote", json={"version": ""})  # before: promoted the candidate
        assert empty.status_code == 422 and "an empty version names none" in empty.get_json()["error"]["message"]
        assert client.post("/v1/models/colour/promote", json={"version": "2"}).get_json()["default"] == "2"
        to_live = client.post("/v1/models/colour/rollback", json={"version": "2"})  # a 500 before
        assert to_live.status_code == 409 and "is the live version already" in to_live.get_json()["error"]["message"]
        assert client.post("/predict", data=PHOTOS[0], content_type="image/jpeg").get_json()["model"]["version"] == "2"
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_a_plain_load_call_keeps_a_rolled_back_version_out(settings: Settings) -> None:
    # A load call with no config gave the plan the default alone: the rolled-back version came back as the canary.
    service = Service.build(settings, _repository({"canary_percent": 10}))  # type: ignore[arg-type]
    try:
        service.catalog.promote("colour")
        assert service.catalog.rollback("colour")["rolled_back"] == ["2"]
        service.catalog.load("colour")
        routes = service.controller.applier.routes
        assert routes.candidate("colour") is None and routes.routes()["colour"][1] == "1"
        assert service.controller.sync.read()[1]["colour"]["rolled_back"] == ["2"]
        # Before (an operator's trial): a load call naming it the default was 400 "default version '2' is not in
        # the repository", where it is, rolled back
        with pytest.raises(BadRequest, match="model 'colour': version 2 was rolled back, and serves again once a "
                                             "promotion names it: POST /v1/models/colour/promote with "
                                             '{"version": "2"}'):
            service.catalog.load("colour", '{"default_version": "2"}')
    finally:
        service.shutdown(timeout=5)


def test_a_rolled_back_version_stays_out_through_an_unload_and_a_load(settings: Settings) -> None:
    # The unload call's entry dropped the rolled-back marks: the next load call made version 2 the canary again
    service = Service.build(settings, _repository({"canary_percent": 10}))  # type: ignore[arg-type]
    try:
        service.catalog.promote("colour")
        assert service.catalog.rollback("colour")["rolled_back"] == ["2"]
        rolled_back = ("UNAVAILABLE", "rolled back (it serves again once a promotion names it)")
        wait_until(lambda: {row.version: (row.state, row.reason) for row in service.catalog.index()} == {
            "1": ("READY", ""), "2": rolled_back})  # once freed (UNLOADING until then)
        service.catalog.unload("colour")
        wait_until(lambda: {row.reason for row in service.catalog.index()} == {"unloaded"})
        service.catalog.load("colour")
        routes = service.controller.applier.routes
        assert routes.candidate("colour") is None and routes.routes()["colour"][1] == "1"
        assert service.catalog.rollouts()["colour"]["rolled_back"] == ["2"]
        service.catalog.promote("colour", "2")  # a promotion naming it serves it again
        assert routes.routes()["colour"][1] == "2" and "rolled_back" not in service.controller.sync.read()[1]["colour"]
    finally:
        service.shutdown(timeout=5)


def _roles(version: str) -> dict[str, float | None]:
    return {role: REGISTRY.get_sample_value("visionserve_rollout_role", {"model": "colour", "version": version,
                                                                        "role": role})
            for role in ("live", "canary", "shadow", "previous")}


def test_the_rollout_role_gauge_drops_the_versions_an_unload_took_away(settings: Settings) -> None:
    # Before (an operator's trial): after a rollback and an unload, {role="live",version="1"} still read 1 while the
    # index said every version unloaded; after a load with another default, two versions read live.
    service = Service.build(settings, _repository({"canary_percent": 10}))  # type: ignore[arg-type]
    try:
        assert _roles("1")["live"] == 1 and _roles("2")["canary"] == 1
        service.catalog.unload("colour")
        wait_until(lambda: {row.reason for row in service.catalog.index()} == {"unloaded"})
        assert set(_roles("1").values()) == set(_roles("2").values()) == {0}
        service.catalog.load("colour", {"default_version": "2", "version_policy": {"all": {}}})
        assert _roles("2")["live"] == 1 and set(_roles("1").values()) == {0}
    finally:
        service.shutdown(timeout=5)


def test_a_candidate_is_promoted_on_the_canary_traffic_it_was_routed_as_candidate(settings: Settings) -> None:
    # Its traffic from before (as the default) was not started afresh when it became the candidate, and requests
    # that named it counted as canary requests: the first judge promoted it with no canary request at all.
    repository = FakeRepository()
    for version in ("1", "2"):
        repository.add("colour", version)
    service = Service.build(settings, repository)
    try:
        for _ in range(20):
            infer(service, [image_bytes(RED)])  # 2 answers them, as the default
        service.catalog.load("colour", {"default_version": "1", "version_policy": {"all": {}}, "rollout": {
            "candidate": "2", "canary_percent": 1, "promote": {"after": 20}}})
        for _ in range(20):
            infer(service, [image_bytes(RED)], version="2")  # named: no canary request
        service.controller.writers.share_evidence()  # what the follow thread does every second
        assert service.controller.applier.routes.routes()["colour"][1] == "1"
        assert service.catalog.rollouts()["colour"]["promotion"] == "waiting: 0 of 20 canary requests"
    finally:
        service.shutdown(timeout=5)


def test_the_rules_judge_only_the_evidence_of_workers_that_serve_the_newest_generation(
        settings: Settings, tmp_path: Path) -> None:
    # A worker that had not applied a promotion yet still reported the candidate's canary requests: merged into the
    # new default's watch, they settled it (no request had been served by it as the default).
    import os

    shared = settings.model_copy(update={"control_dir": tmp_path / "control", "repository_sync_timeout_s": 20})
    repository = _repository({"canary_percent": 50, "rollback": {"within": 10}})
    here, there = (VersionsController(shared, repository, on_report=lambda: None) for _ in range(2))  # type: ignore
    there.sync.desired = SharedDesiredState(shared.control_dir, pid=os.getppid())  # another live process's report
    try:
        for controller in (here, there):
            controller.boot()
            controller.close()  # no follow thread: each applies the other's generation only when told
        for _ in range(15):
            there.evidence.traffic("colour", "2").record([0.005], False)  # its canary requests to 2
        there.writers.share_evidence()
        with ThreadPoolExecutor(1) as pool:  # the promotion waits for the other worker: not applied there yet
            promoting = pool.submit(here.rollout_changes.promote, "colour")
            wait_until(lambda: here.sync.read()[1]["colour"]["default"] == "2")
            here.writers.share_evidence()  # this worker's next judge
            assert "watch" in here.sync.read()[1]["colour"]  # still watched: the other's requests were the canary's
            there.writers.follow_newest()
            promoting.result(timeout=10)
    finally:
        for controller in (here, there):
            controller.close()
            for loaded in controller.routes.all_versions():
                loaded.batcher.stop(5)


def test_a_canary_answers_its_share_and_each_client_stays_on_its_side(settings: Settings) -> None:
    app = create_app(settings, source=_repository({"canary_percent": 30}))  # type: ignore[arg-type]
    client = app.test_client()
    try:
        versions = []
        for i in range(200):
            answer = client.post("/predict", data=PHOTOS[0], content_type="image/jpeg",
                                 headers={"X-Client-ID": f"user-{i}"})
            versions.append(answer.get_json()["model"]["version"])
            again = client.post("/predict", data=PHOTOS[0], content_type="image/jpeg",
                                headers={"X-Client-ID": f"user-{i}"})
            assert again.get_json()["model"]["version"] == versions[-1]
        share, sigma = versions.count("2") / 200, math.sqrt(0.3 * 0.7 / 200)
        assert abs(share - 0.3) < 4 * sigma
        named = client.post("/predict?version=1", data=PHOTOS[0], content_type="image/jpeg",
                            headers={"X-Client-ID": "x"})
        assert named.get_json()["model"]["version"] == "1"  # a named version is never rerouted
        roles = {m["version"]: m["role"] for m in client.get("/v1/models").get_json()["models"]}
        assert roles == {"1": "live", "2": "canary"}
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_the_rules_promote_a_candidate_that_agrees_and_roll_back_one_that_fails(settings: Settings) -> None:
    repository = _repository({"shadow_percent": 100,
                              "promote": {"after": 5, "min_agreement": 0.0, "max_latency_ratio": 1000},
                              "rollback": {"within": 50, "max_error_ratio": 0.1, "min_requests": 5,
                                           "max_p99_ratio": 1000}})  # rolled back on its errors alone
    service = Service.build(settings, repository)  # type: ignore[arg-type]
    try:
        _one_by_one(service, PHOTOS[:4])  # compared one by one, then the fifth comparison promotes
        infer(service, [PHOTOS[4]])
        wait_until(lambda: (service.controller.writers.share_evidence() or True)
                   and service.controller.applier.routes.routes()["colour"][1] == "2")
        assert service.catalog.rollouts()["colour"]["watch"]["version"] == "2"
        failing = service.controller.applier.routes.find("colour", "2").predictor.module
        failing.fail_when = -10.0  # every batch now fails
        failures = 0
        for photo in PHOTOS[:6]:  # 6 of its first 50 fail: more than 10% of the 50 whatever follows
            try:
                infer(service, [photo])
            except Exception:  # noqa: BLE001 - the failing version's answers
                failures += 1
        assert failures == 6
        service.controller.writers.share_evidence()
        assert service.controller.applier.routes.routes()["colour"][1] == "1"  # rolled back by the rules
        assert infer(service, [PHOTOS[0]]).version == "1"
        assert service.catalog.rollouts()["colour"]["rolled_back"] == ["2"]
    finally:
        service.shutdown(timeout=5)


def test_calls_without_anything_to_change_are_conflicts(settings: Settings) -> None:
    service = Service.build(settings, _repository())  # type: ignore[arg-type]
    try:
        with pytest.raises(Conflict):
            service.catalog.promote("colour")  # no rollout: no candidate
        assert service.catalog.promote("colour", "1")["default"] == "1"
        assert infer(service, [PHOTOS[0]]).version == "1"
        assert service.catalog.rollback("colour")["default"] == "2"
    finally:
        service.shutdown(timeout=5)


@pytest.mark.parametrize("rollout", [None, {"canary_percent": 10, "shadow_percent": 100}])
def test_a_promotion_or_a_rollback_holds_through_the_poll_after_a_load_call_named_another_default(
        settings: Settings, rollout: dict[str, object] | None) -> None:
    # Before: after a load call's {"default_version": "1"} (docs/models.md's rollback), a promotion answered 200,
    # was logged and counted, and the next poll served 1 again (an operator's trial, with and without a rollout)
    repository = _repository(rollout, candidate=ColourModel)
    service = Service.build(settings, repository)  # type: ignore[arg-type]
    try:
        assert service.catalog.load("colour", {"default_version": "1"})["default"] == "1"
        assert service.catalog.promote("colour", "2")["default"] == "2"
        service.controller.writers.poll()
        assert service.catalog.serving()["colour"]["default"] == "2" and infer(service, [PHOTOS[0]]).version == "2"
        assert service.catalog.rollback("colour", "1")["default"] == "1"
        service.controller.writers.poll()
        assert service.catalog.serving()["colour"]["default"] == "1" and infer(service, [PHOTOS[0]]).version == "1"
        assert service.catalog.promote("colour", "2")["default"] == "2"
        # the model's policy.json changes: its choice now (the docs' rule for a call's choice)
        repository.policies["colour"] = {**repository.policies.get("colour", {}), "default_version": "1"}
        service.controller.writers.poll()
        assert service.catalog.serving()["colour"]["default"] == "1"
    finally:
        service.shutdown(timeout=5)


def test_a_call_naming_no_version_suggests_only_versions_it_could_name(settings: Settings) -> None:
    app = create_app(settings, source=_repository({"shadow_percent": 100}))  # type: ignore[arg-type]
    client = app.test_client()
    try:
        promoted = client.post("/v1/models/colour/promote").get_json()
        assert promoted["name"] == "colour" and "model" not in promoted  # the key the V2 load answer uses
        assert client.post("/v1/models/colour/rollback").get_json()["rolled_back"] == ["2"]
        again = client.post("/v1/models/colour/rollback")  # 1 is live, nothing older, 2 was rolled back
        assert again.status_code == 409, again.get_json()
        error = again.get_json()["error"]
        assert error["message"] == ("model 'colour' has no previous default to roll back to, and no version older "
                                    "than the live 1 that could serve") and error["details"] == {"versions": []}
        nothing = client.post("/v1/models/colour/promote")  # no candidate: 2 was rolled back, but can be named
        assert nothing.status_code == 409
        error = nothing.get_json()["error"]
        assert error["message"] == ("model 'colour' has no rollout candidate to promote; name one of its versions "
                                    '2 (rolled back) ({"version": "2"})') and error["details"] == {"versions": ["2"]}
        example = client.post("/v1/models/colour/promote", json={"version": "2"})  # the example is a real one
        assert example.status_code == 200 and example.get_json()["default"] == "2"
        # A rollback that named a newer version: the one it replaced is rolled back, and still a rollback may name
        # it. Before: a bare rollback then said no version could be named (details.versions []), and naming 1 worked
        assert client.post("/v1/models/colour/rollback", json={"version": "1"}).get_json()["rolled_back"] == ["2"]
        assert client.post("/v1/models/colour/rollback", json={"version": "2"}).get_json()["rolled_back"] == ["1"]
        error = client.post("/v1/models/colour/rollback").get_json()["error"]
        assert error["message"] == ("model 'colour' has no previous default to roll back to; name one of its "
                                    'versions 1 (rolled back) ({"version": "1"})') and error["details"] == {
                                        "versions": ["1"]}
        assert client.post("/v1/models/colour/rollback", json={"version": "1"}).get_json()["default"] == "1"
        loaded = client.post("/v2/repository/models/colour/load").get_json()
        assert loaded["name"] == "colour" and set(loaded) <= set(example.get_json())
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)
    repository = _repository()
    repository.fail("colour", "3", "weights file x.pt has sha256 abc, the manifest says def")
    service = Service.build(settings, repository)  # type: ignore[arg-type]
    try:  # 3 cannot load: 2 serves, and only 1 is suggested
        assert service.catalog.serving()["colour"]["default"] == "2"
        for call, message in ((service.catalog.promote, "no rollout candidate to promote; name one of its "
                               'versions 1 ({"version": "1"})'),
                              (service.catalog.rollback, "no previous default to roll back to; name one of its "
                               'versions 1 ({"version": "1"})')):
            with pytest.raises(Conflict) as refused:
                call("colour")
            assert refused.value.message == f"model 'colour' has {message}" and refused.value.details == {
                "versions": ["1"]}
    finally:
        service.shutdown(timeout=5)
    alone = FakeRepository()
    alone.add("colour", "1")
    # a version this worker never tried whose manifest says it cannot serve (another worker's load call refused it:
    # a folder copied by hand). Before: named as the one to promote, whose promotion then answered 422 (an
    # operator's trial)
    alone.misplace("colour", "2", "manifest.json says colour version 1, but the repository holds it as version 2")
    alone.policies["colour"] = {"version_policy": {"specific": {"versions": [1]}}}
    service = Service.build(settings, alone)  # type: ignore[arg-type]
    try:
        assert ("colour", "2") not in alone.loads
        with pytest.raises(Conflict, match="no rollout candidate to promote, and no version but the live 1 that "
                                           "could serve$"):
            service.catalog.promote("colour")
    finally:
        service.shutdown(timeout=5)


def test_requests_naming_their_version_are_counted_as_named(settings: Settings) -> None:
    from prometheus_client import REGISTRY

    def count(version: str, role: str) -> float:
        return REGISTRY.get_sample_value("visionserve_version_requests_total", {
            "model": "colour", "version": version, "role": role, "outcome": "ok"}) or 0.0

    service = Service.build(settings.model_copy(update={"version_policy": "all"}), _repository())  # type: ignore
    try:  # 1 and 2 loaded, 2 the default
        before = count("1", "named"), count("2", "live")
        assert infer(service, [PHOTOS[0]], version="1").version == "1"
        assert infer(service, [PHOTOS[0]]).version == "2"
        assert (count("1", "named"), count("2", "live")) == (before[0] + 1, before[1] + 1)
        assert count("1", "version") == 0  # a role the documentation does not name
    finally:
        service.shutdown(timeout=5)


def test_a_rollout_set_by_a_load_call_or_a_setting(settings: Settings) -> None:
    app = create_app(settings, source=_repository())  # type: ignore[arg-type]
    client = app.test_client()
    try:  # no rollout: the newest serves
        assert client.post("/predict", data=PHOTOS[0], content_type="image/jpeg").get_json()["model"]["version"] == "2"
        config = {"rollout": {"candidate": "2", "canary_percent": 100}, "default_version": "1"}
        answer = client.post("/v2/repository/models/colour/load", json={"parameters": {"config": json.dumps(config)}})
        assert answer.status_code == 200, answer.get_json()
        roles = {m["version"]: m["role"] for m in client.get("/v1/models").get_json()["models"]}
        assert roles == {"1": "live", "2": "canary"}
        assert client.post("/predict", data=PHOTOS[0], content_type="image/jpeg").get_json()["model"]["version"] == "2"
        bad = client.post("/v2/repository/models/colour/load",
                          json={"parameters": {"config": {"rollout": {"shadow_percent": -1}}}})
        assert bad.status_code == 400 and "shadow_percent" in bad.get_json()["error"]
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)
    service = Service.build(settings.model_copy(update={"shadow_percent": 100.0}), _repository())  # type: ignore
    try:
        assert service.catalog.roles() == {("colour", "1"): "live", ("colour", "2"): "shadow"}
    finally:
        service.shutdown(timeout=5)


def test_the_python_client_keeps_its_side_of_a_canary(settings: Settings) -> None:
    from visionserve_client import Client

    app = create_app(settings, source=_repository({"canary_percent": 50}))  # type: ignore[arg-type]
    try:
        with served_over_http(app) as url:
            seen = {}
            for name in ("alice", "bob", "carol", "dave", "erin", "frank"):
                with Client(url, client_id=name) as client:
                    seen[name] = {client.predict(PHOTOS[0]).version for _ in range(4)}
        assert all(len(versions) == 1 for versions in seen.values()), seen
        assert set.union(*seen.values()) == {"1", "2"}  # with 6 clients at 50%, both sides (fixed by the hash)
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_a_candidate_with_other_preprocessing_decodes_the_shadow_images_itself(settings: Settings) -> None:
    repository = OtherInputRepository()  # version 2 takes 16x16 inputs: the shadow decodes the images for it itself
    repository.add("colour", "1")
    repository.add("colour", "2")
    repository.policies["colour"] = {"rollout": {"shadow_percent": 100}}
    service = Service.build(settings, repository)  # type: ignore[arg-type]
    try:
        live, candidate = (service.controller.applier.routes.find("colour", v) for v in ("1", "2"))
        assert candidate.predictor.manifest.preprocess.input_shape != live.predictor.manifest.preprocess.input_shape
        sizes: list[tuple[int, ...]] = []
        candidate.predictor.module.register_forward_hook(lambda _, inputs, __: sizes.append(inputs[0].shape[2:]))
        _one_by_one(service, PHOTOS)
        comparison = service.catalog.rollouts()["colour"]["comparison"]
        assert comparison["top1_agreement"] == 1.0 and comparison["errors"] == 0  # the same model, other size
        assert sizes and set(sizes) == {(16, 16)}  # the shadow images were decoded at the candidate's own size
    finally:
        service.shutdown(timeout=5)


def _v2_pixels(shape: tuple[int, ...]) -> dict[str, object]:
    return {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, *shape],
                        "data": np.zeros((1, *shape), np.float32).ravel().tolist()}]}


def test_pixels_shaped_as_the_metadata_says_go_to_the_default_when_the_canary_takes_another_input(
        settings: Settings) -> None:
    # Before: a request of pixels shaped for the default (the input GET /v2/models/colour shows) that routing sent
    # to a canary of another input size was refused 400 (inline) or 503 "send it again" (process, for good: the
    # sticky client's every retry), and counted as the canary's.
    from prometheus_client import REGISTRY

    def count(version: str, role: str, outcome: str) -> float:
        return REGISTRY.get_sample_value("visionserve_version_requests_total", {
            "model": "colour", "version": version, "role": role, "outcome": outcome}) or 0.0

    repository = OtherInputRepository()
    repository.add("colour", "1")
    repository.add("colour", "2")
    repository.policies["colour"] = {"rollout": {"canary_percent": 100}}
    app = create_app(settings, source=repository)  # type: ignore[arg-type]
    client = app.test_client()
    try:
        shape = client.get("/v2/models/colour").get_json()["inputs"][1]["shape"][1:]
        assert shape == [3, 8, 8]  # the default's
        before = {key: count(*key) for key in (("1", "live", "ok"), ("2", "canary", "ok"), ("2", "canary", "refused"),
                                                ("2", "canary", "failed"))}
        answer = client.post("/v2/models/colour/infer", json=_v2_pixels((3, 8, 8)))
        assert answer.status_code == 200 and answer.get_json()["model_version"] == "1"
        photo = {"inputs": [{"name": "images", "datatype": "BYTES", "shape": [1], "data": [
            base64.b64encode(PHOTOS[0]).decode()]}], "parameters": {"binary_data_output": False}}
        images = client.post("/v2/models/colour/infer", json=photo)
        assert images.status_code == 200 and images.get_json()["model_version"] == "2"  # images: the canary's
        refused = client.post("/v2/models/colour/infer", json=_v2_pixels((3, 16, 16)))  # as the default would be
        assert refused.status_code == 400 and "must have shape [1, 3, 8, 8]" in refused.get_json()["error"]
        named = client.post("/v2/models/colour/versions/2/infer", json=_v2_pixels((3, 16, 16)))
        assert named.status_code == 200 and named.get_json()["model_version"] == "2"
        after = {key: count(*key) for key in before}
        assert after[("1", "live", "ok")] == before[("1", "live", "ok")] + 1
        assert after[("2", "canary", "ok")] == before[("2", "canary", "ok")] + 1  # the images only
        assert after[("2", "canary", "refused")] == before[("2", "canary", "refused")]
        assert after[("2", "canary", "failed")] == before[("2", "canary", "failed")]  # no evidence against it
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


# -- a candidate that cannot load (#46) ------------------------------------------------------------------------------


SHA = "weights file x.pt has sha256 abc, the manifest says def"


def _refused_gauge(version: str) -> float | None:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("visionserve_rollout_candidate_refused", {"model": "colour", "version": version})


def test_a_candidate_that_cannot_load_at_start_leaves_the_live_version_serving(
        settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    repository = FakeRepository()
    repository.add("colour", "1")
    repository.fail("colour", "2", SHA)
    repository.policies["colour"] = {"rollout": {"shadow_percent": 100, "candidate": "2"}, "default_version": "1"}
    with caplog.at_level(logging.WARNING, logger="app.engine.versions"):
        app = create_app(settings, source=repository)  # type: ignore[arg-type]
    client = app.test_client()
    try:
        assert "colour: rollout candidate 2 refused (colour version 2 cannot be served: weights file" in caplog.text
        assert "version 1 serves without a candidate" in caplog.text
        answer = client.post("/predict", data=PHOTOS[0], content_type="image/jpeg")
        assert answer.status_code == 200 and answer.get_json()["model"]["version"] == "1"
        body = client.get("/v1/models").get_json()
        assert {m["version"]: m["role"] for m in body["models"]} == {"1": "live"}
        (rollout,) = body["rollouts"]
        assert (rollout["live"], rollout.get("candidate"), rollout["shadow_percent"]) == ("1", None, 100)
        assert rollout["candidate_refused"] == {"version": "2", "reason": f"colour version 2 cannot be served: {SHA}"}
        index = {r["version"]: r for r in client.post("/v2/repository/index", json={}).get_json()}
        assert index["2"]["state"] == "UNAVAILABLE" and SHA in index["2"]["reason"]
        metrics = client.get("/metrics").get_data(as_text=True)
        assert 'visionserve_rollout_candidate_refused{model="colour",version="2"} 1.0' in metrics
        assert client.post("/v1/models/colour/promote").status_code == 409  # nothing to promote
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_a_candidate_that_breaks_at_run_time_is_refused_by_the_poll_and_a_load_call(settings: Settings) -> None:
    repository = _repository({"shadow_percent": 100})
    del repository.held["colour"]["2"]
    service = Service.build(settings, repository)  # type: ignore[arg-type]
    rollouts = service.catalog.rollouts
    try:
        assert service.catalog.serving()["colour"] == {"versions": ["1"], "default": "1"}
        repository.fail("colour", "2", SHA)  # version 2 arrives, named as the candidate, and cannot load
        repository.policies["colour"] = {"rollout": {"shadow_percent": 100, "candidate": "2"}, "default_version": "1"}
        service.controller.writers.poll()
        assert service.catalog.serving()["colour"] == {"versions": ["1"], "default": "1"}
        assert infer(service, [PHOTOS[0]]).version == "1"
        assert rollouts()["colour"]["candidate"] is None and rollouts()["colour"]["candidate_refused"]["version"] == "2"
        assert _refused_gauge("2") == 1
        loads = len(repository.loads)
        service.controller.writers.poll()  # not tried again while its files are the same ...
        assert len(repository.loads) == loads
        repository.fail("colour", "2", "still broken")  # ... rewritten, still broken: a load call says so
        with pytest.raises(LoadFailed, match="colour version 2 cannot be served: still broken"):
            service.catalog.load("colour")
        assert infer(service, [PHOTOS[0]]).version == "1"  # the live version served throughout
        service.catalog.load("colour")  # refused now, so left out: the live version alone, and why
        assert rollouts()["colour"]["candidate_refused"] == {
            "version": "2", "reason": "colour version 2 cannot be served: still broken"}
        del repository.broken[("colour", "2")]
        repository.add("colour", "2")  # mended: the next poll makes it the candidate
        service.controller.writers.poll()
        assert service.catalog.roles() == {("colour", "1"): "live", ("colour", "2"): "shadow"}
        assert "candidate_refused" not in rollouts()["colour"] or rollouts()["colour"]["candidate_refused"] is None
        assert _refused_gauge("2") == 0
    finally:
        service.shutdown(timeout=5)


def test_a_newer_version_that_cannot_load_leaves_the_next_newest_the_candidate_and_says_so(
        settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    # Before (an operator's trial): after a load call the rollout went on with version 2 as the candidate and 3
    # refused, and nothing was logged; the line logged at start and by the poll said "version 1 serves without a
    # candidate" where 2 was one.
    repository = _repository({"shadow_percent": 100})
    service = Service.build(settings, repository)  # type: ignore[arg-type]
    try:
        assert service.catalog.roles() == {("colour", "1"): "live", ("colour", "2"): "shadow"}
        repository.fail("colour", "3", SHA)
        with pytest.raises(LoadFailed, match=SHA):
            service.catalog.load("colour")
        with caplog.at_level(logging.WARNING, logger="app.engine.versions"):
            service.catalog.load("colour")  # refused now: left out
        assert service.catalog.roles() == {("colour", "1"): "live", ("colour", "2"): "shadow"}
        assert service.catalog.rollouts()["colour"]["candidate_refused"]["version"] == "3"
        assert f"colour: rollout candidate 3 refused (colour version 3 cannot be served: {SHA}); version 2 is the " \
               "candidate in its place, version 1 live" in caplog.text
    finally:
        service.shutdown(timeout=5)


def test_a_load_call_naming_a_refused_version_says_so_and_changes_nothing(settings: Settings) -> None:
    repository = _repository()
    service = Service.build(settings.model_copy(update={"version_policy": "all"}), repository)  # type: ignore
    try:
        assert service.catalog.serving()["colour"]["default"] == "2"
        service.catalog.rollback("colour", "1")  # 1 serves, 2 is rolled back
        repository.add("colour", "3")
        repository.fail("colour", "3", "truncated")
        before = (service.catalog.serving(), service.catalog.rollouts())
        config = {"rollout": {"shadow_percent": 100, "candidate": "3"}}
        with pytest.raises(LoadFailed, match="cannot be served: truncated"):  # the first try: its load fails
            service.catalog.load("colour", config)
        for asked in (config, json.dumps(config), {"default_version": 3}):  # known refused now: said, not tried
            loads = len(repository.loads)
            with pytest.raises(LoadFailed, match="colour version 3 .* was refused .*: colour version 3 cannot be "
                               "served: truncated; nothing was changed") as refused:
                service.catalog.load("colour", asked)
            assert refused.value.details["version"] == "3" and len(repository.loads) == loads
            assert (service.catalog.serving(), service.catalog.rollouts()) == before
        assert before[0]["colour"]["default"] == "1"
    finally:
        service.shutdown(timeout=5)


def test_a_candidate_that_does_not_fit_beside_the_live_version_at_start_is_left_out(settings: Settings) -> None:
    # Each fake version takes 1 MiB and needs 2 MiB to load: the live one fits in 2 MiB, the candidate beside it not.
    repository = _repository({"shadow_percent": 100, "candidate": "2"})
    service = Service.build(settings.model_copy(update={"model_memory_limit_mb": 2}), repository)  # type: ignore
    try:
        assert service.catalog.serving()["colour"] == {"versions": ["1"], "default": "1"}
        assert infer(service, [PHOTOS[0]]).version == "1"
        refused = service.catalog.rollouts()["colour"]["candidate_refused"]
        assert refused["version"] == "2" and "colour version 2 needs about 2 MiB; the loaded models take 1 MiB" in \
            refused["reason"]
        assert not service.controller.applier.known_refused("colour", "2")  # memory may be freed: tried again later
    finally:
        service.shutdown(timeout=5)


@pytest.mark.parametrize("rollout, version, drawn", [
    ({"canary_percent": 10}, None, True),  # the default or the candidate, by the draw
    ({"shadow_percent": 100}, None, False),  # the default answers every one (the shadow runs beside it)
    ({"canary_percent": 10}, "1", False),  # named: always that version
    (None, None, False),
])
def test_a_backlog_s_refusal_says_until_when_only_of_a_route_that_sends_each_of_its_requests_one_way(
        settings: Settings, rollout: dict[str, object] | None, version: str | None, drawn: bool) -> None:
    # The worker's loop refuses a route's requests for a while after the engine refused one of them for its backlog
    # (app/hosting/recent_refusals.py): not where a canary's draw sends the route's requests to two versions, one of
    # which may have room.
    from app.engine.batching.types import DeadlineUnreachable
    from app.engine.call import service_error

    service = Service.build(settings, _repository(rollout))  # type: ignore[arg-type]
    try:
        routes = service.controller.applier.routes
        held = [routes.hold("colour", version, f"client-{n}") for n in range(20)]
        assert {route.drawn for route in held} == {drawn}
        for route in held:
            routes.release(route)
        with service.admit("colour", version, "client-1", images=1, timeout_s=5.0) as call:
            assert call.drawn == drawn  # its refusals say so (app/engine/call.py)
        backlog = DeadlineUnreachable("the queue ahead may need up to 0.400s", retry_after_s=0.2, busy_until=12.5)
        said = service_error(backlog, 0.3, drawn).backlog
        assert said == (None if drawn else (12.5, 0.0, 0.0))
    finally:
        service.shutdown(timeout=5)


def test_a_shadow_candidate_s_predictions_on_mirrored_requests_count_under_its_version(shadowed: Service) -> None:
    # As docs/metrics.md says (a TorchServe user's trial found it unsaid): its class mix and confidence on live
    # traffic are what its rollout weighs; the requests are counted once, by visionserve_requests_total
    from prometheus_client import REGISTRY

    def predicted(version: str) -> float:
        shadowed.catalog.settle_figures()
        return REGISTRY.get_sample_value("visionserve_top1_confidence_count",
                                         {"model": "colour", "version": version}) or 0.0

    before = {version: predicted(version) for version in ("1", "2")}
    _one_by_one(shadowed, [image_bytes(RED), image_bytes(BLUE), image_bytes(RED)])
    assert {version: predicted(version) - before[version] for version in ("1", "2")} == {"1": 3, "2": 3}
