"""Rollouts (#33) in one worker with in-memory ColourModel versions: the plan (candidate, held default, promotion,
rollback), canary shares, shadow comparisons equal to the offline ones and never touching a live answer, shadow
work dropped under a burst, promotion and rollback by call and by the rules, the evidence in /v1/models and the V2
index. tests/server/test_rollouts.py does it with real exports under gunicorn."""
from __future__ import annotations

import collections
import json
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import pytest
import torch

from app import EXTENSION_KEY

from app.factory import create_app
from app.config import Settings
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
from app.engine.call import Served
from app.engine.service import Service
from app.errors import Conflict
from tests.support.fakes import LABELS, ColourModel, FakeRepository, infer, served_over_http, wait_until
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
    service.catalog.writers.share_evidence()
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
    latest, shadow = VersionPolicy.parse("latest"), RolloutPolicy(shadow_percent=100)
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
            assert torch.equal(infer(alone, [photo], version="1").probabilities(), served.probabilities())
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
    live = shadowed.catalog.applier.routes.find("colour", "1")
    live.predictor.module.gate = gate = Turnstile()

    def comparison() -> dict[str, object]:
        shadowed.catalog.writers.share_evidence()
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
        assert client.post("/v1/models/colour/promote", json={"versions": "2"}).status_code == 400
        assert client.post("/v1/models/colour/promote", json={"version": "2"}).get_json()["default"] == "2"
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


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
                              "rollback": {"within": 50, "max_error_ratio": 0.1, "min_requests": 5}})
    service = Service.build(settings, repository)  # type: ignore[arg-type]
    try:
        _one_by_one(service, PHOTOS[:4])  # compared one by one, then the fifth comparison promotes
        infer(service, [PHOTOS[4]])
        wait_until(lambda: (service.catalog.writers.share_evidence() or True)
                   and service.catalog.applier.routes.routes()["colour"][1] == "2")
        assert service.catalog.rollouts()["colour"]["watch"]["version"] == "2"
        service.catalog.applier.routes.find("colour", "2").predictor.module.fail_when = -10.0  # every batch now fails
        failures = 0
        for photo in PHOTOS[:5]:
            try:
                infer(service, [photo])
            except Exception:  # noqa: BLE001 - the failing version's answers
                failures += 1
        assert failures == 5
        service.catalog.writers.share_evidence()
        assert service.catalog.applier.routes.routes()["colour"][1] == "1"  # rolled back by the rules
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


class OtherPreprocessing(FakeRepository):
    """Version 2 takes 16x16 inputs (another eval transform): the shadow decodes the images for it itself."""

    def load(self, name: str, version: str):  # noqa: ANN201 - a Predictor
        from app.engine.loaded.predictor import Predictor
        from tests.support.fakes import tiny_manifest

        predictor = super().load(name, version)
        if version != "2":
            return predictor
        manifest = tiny_manifest(name, version)
        manifest = manifest.model_copy(update={"preprocess": manifest.preprocess.model_copy(
            update={"resize_size": 16, "crop_size": 16})})
        return Predictor(predictor.module, manifest, device="cpu", weights_bytes=1024 * 1024)


def test_a_candidate_with_other_preprocessing_decodes_the_shadow_images_itself(settings: Settings) -> None:
    repository = OtherPreprocessing()
    repository.add("colour", "1")
    repository.add("colour", "2")
    repository.policies["colour"] = {"rollout": {"shadow_percent": 100}}
    service = Service.build(settings, repository)  # type: ignore[arg-type]
    try:
        live, candidate = (service.catalog.applier.routes.find("colour", v) for v in ("1", "2"))
        assert candidate.predictor.manifest.preprocess.input_shape != live.predictor.manifest.preprocess.input_shape
        sizes: list[tuple[int, ...]] = []
        candidate.predictor.module.register_forward_hook(lambda _, inputs, __: sizes.append(inputs[0].shape[2:]))
        _one_by_one(service, PHOTOS)
        comparison = service.catalog.rollouts()["colour"]["comparison"]
        assert comparison["top1_agreement"] == 1.0 and comparison["errors"] == 0  # the same model, other size
        assert sizes and set(sizes) == {(16, 16)}  # the shadow images were decoded at the candidate's own size
    finally:
        service.shutdown(timeout=5)
