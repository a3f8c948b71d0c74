"""The rollout rules' settings and the evidence they are judged on (#33's review): numbers a policy may not hold
(infinity, NaN, booleans, fractions of a count), percentiles by nearest rank, the shadow's agreement by label in
/v1/models and in Prometheus alike, evidence that ends with the model's unload and with the role a request was
routed in, the rollback's error bound over its first ``within`` requests, promote rules that could never fire, and
a watch only where a rollback rule judges it. tests/app/test_rollouts.py has the rollouts themselves."""
from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from app import EXTENSION_KEY
from app.config import Settings
from app.engine.rollouts.evidence import merge_traffic, percentile
from app.engine.rollouts.plan import RollbackRule, RolloutPolicy
from app.engine.rollouts.policy import PolicyError
from app.engine.rollouts.rules import judge
from app.engine.service import Service
from app.errors import InferenceFailed
from app.factory import create_app
from tests.support.fakes import LABELS, ColourModel, FakeRepository, infer, tiny_manifest, wait_until
from tests.support.imaging import BLUE, GREEN, RED, image_bytes

PHOTOS = [image_bytes(colour) for colour in (RED, GREEN, BLUE, RED, GREEN)]


def _repository(rollout: dict[str, Any] | None = None) -> FakeRepository:
    repository = FakeRepository()
    for version in ("1", "2"):
        repository.add("colour", version)
    if rollout is not None:
        repository.policies["colour"] = {"rollout": rollout}
    return repository


def _comparison(service: Service) -> dict[str, Any]:
    """The shadow's figures over the workers' reports, shared now (none yet: compared 0)."""
    service.controller.writers.share_evidence()
    return (service.catalog.rollouts().get("colour") or {}).get("comparison") or {"compared": 0}


def _shadowed_one_by_one(service: Service, send: Any = None) -> None:
    """Each photo sent once its predecessor's shadow was compared (none dropped as busy)."""
    for photo in PHOTOS:
        before = _comparison(service)["compared"]
        (send or (lambda p: infer(service, [p])))(photo)
        wait_until(lambda: _comparison(service)["compared"] > before)


# -- the policy's numbers ---------------------------------------------------------------------------------------


def test_a_policy_number_past_any_float_is_a_400_and_keeps_only_its_own_model_out(settings: Settings) -> None:
    # int(1e999) raised OverflowError: a 500 on a load call, and a policy.json holding it failed the whole boot.
    app = create_app(settings, source=_repository())  # type: ignore[arg-type]
    client = app.test_client()
    try:
        for config in ('{"rollout": {"canary_percent": 5, "promote": {"after": 1e999}}}',
                       '{"rollout": {"promote": {"after": 5, "max_latency_ratio": 1%s}, "canary_percent": 5}}'
                       % ("0" * 400)):  # a JSON integer no float holds
            for parameters in (f'{{"config": {config}}}', json.dumps({"config": config})):  # an object, or text
                answer = client.post("/v2/repository/models/colour/load", data=f'{{"parameters": {parameters}}}',
                                     content_type="application/json")
                assert answer.status_code == 400, answer.get_data(as_text=True)
                assert "must be a finite number" in answer.get_json()["error"]
        assert client.post("/predict", data=PHOTOS[0], content_type="image/jpeg").status_code == 200
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)
    repository = _repository()
    repository.add("other", "1")
    repository.policies["colour"] = {"rollout": {"canary_percent": 5, "promote": {"after": float("inf")}}}
    service = Service.build(settings, repository)  # type: ignore[arg-type]
    try:  # json.load reads 1e999 in a policy.json as infinity: that model alone is not served, and says why
        assert set(service.catalog.serving()) == {"other"}
        assert "rollout: promote after must be a finite number, got inf" in service.controller.applier.not_served[
            "colour"]
    finally:
        service.shutdown(timeout=5)


@pytest.mark.parametrize(("rollout", "refusal"), [
    ({"promote": {"after": 5, "max_latency_ratio": float("nan")}}, "promote max_latency_ratio must be a finite "),
    ({"rollback": {"within": 5, "max_p99_ratio": float("nan")}}, "rollback max_p99_ratio must be a finite number"),
    ({"rollback": {"within": 5, "max_p99_ratio": float("inf")}}, "rollback max_p99_ratio must be a finite number"),
    ({"rollback": {"within": 5, "min_requests": -3}}, "rollback min_requests must be a whole number, at least 0"),
    ({"rollback": {"within": 5, "min_requests": 2.5}}, "rollback min_requests must be a whole number, got 2.5"),
    ({"promote": {"after": 0.5}}, "promote after must be a whole number, got 0.5"),
    ({"rollback": {"within": 10.5}}, "rollback within must be a whole number, got 10.5"),
    ({"promote": {"after": 5, "min_agreement": True}}, "promote min_agreement must be a number, got true"),
    ({"promote": {"after": True}}, "promote after must be a number, got true"),
    ({"canary_percent": True}, "canary_percent must be a number, got true"),
    ({"shadow_percent": float("nan")}, "shadow_percent must be a finite number, got nan"),
    ({"rollback": {"within": 5, "max_error_ratio": "often"}}, "rollback max_error_ratio must be a number, got"),
])
def test_a_rule_setting_that_is_no_finite_number_in_its_bounds_is_refused_naming_it(
        rollout: dict[str, Any], refusal: str, settings: Settings) -> None:
    # NaN passed "max_latency_ratio <= 0", min_requests was never checked, JSON's true read as 1, 0.5 was cut to 0.
    policy = {"canary_percent": 10, **rollout}
    with pytest.raises(PolicyError, match=refusal):
        RolloutPolicy.layered(Settings(), {"rollout": policy})
    app = create_app(settings, source=_repository())  # type: ignore[arg-type]
    try:  # a load call's config: a 400 naming the field, and nothing changed
        answer = app.test_client().post("/v2/repository/models/colour/load",
                                        json={"parameters": {"config": {"rollout": policy}}})
        assert answer.status_code == 400 and refusal in answer.get_json()["error"]
        assert app.extensions[EXTENSION_KEY].catalog.rollouts() == {}
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_whole_numbers_written_as_floats_and_in_bounds_settings_are_read() -> None:
    policy = RolloutPolicy.layered(Settings(), {"rollout": {
        "shadow_percent": 100, "promote": {"after": 500.0, "min_agreement": 1},
        "rollback": {"within": 200, "min_requests": 0, "max_error_ratio": 0}}})
    assert policy.promote is not None and policy.promote.after == 500 and isinstance(policy.promote.after, int)
    assert policy.rollback == RollbackRule(within=200, max_error_ratio=0.0, max_p99_ratio=2.0, min_requests=0)


# -- the evidence -------------------------------------------------------------------------------------------------


def test_a_percentile_is_the_nearest_rank() -> None:
    # round(q * n + 0.5) rounds half to even: p99 of 100 latencies was their largest, p50 of two the larger.
    for count, q, rank in ((100, 0.99, 99), (300, 0.99, 297), (2, 0.5, 1), (10, 0.9, 9), (200, 0.99, 198),
                           (1, 0.99, 1), (101, 0.99, 100)):
        assert percentile([float(v) for v in range(count, 0, -1)], q) == rank
    assert percentile([], 0.99) is None
    latencies = [float(ms) for ms in range(1, 101)]  # one slow outlier (100 ms) is not the p99 of 100 requests
    assert merge_traffic([{"requests": 100, "failures": 0, "latencies_ms": latencies}])["p99"] == 99.0


class SwappedLabels(FakeRepository):
    """Version 2 lists green before red (the same classes, another order) and answers as version 1 does, each
    class in its own column: the same top-1 label on every image, at other indices."""

    def load(self, name: str, version: str):  # noqa: ANN201 - a Predictor
        from app.engine.loaded.predictor import Predictor

        predictor = super().load(name, version)
        if version != "2":
            return predictor
        manifest = tiny_manifest(name, version).model_copy(update={"labels": [LABELS[1], LABELS[0], *LABELS[2:]]})
        return Predictor(ColumnsSwapped(), manifest, device="cpu", weights_bytes=1024 * 1024)


class ColumnsSwapped(ColourModel):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        return logits[:, [1, 0, 2, 3]]


def test_the_shadow_agreement_is_by_label_in_prometheus_too_and_differences_of_other_columns_are_null(
        settings: Settings) -> None:
    # visionserve_shadow_agreed_total compared top-1 indices (0 of 5 here) while /v1/models compared labels (5 of
    # 5); the probabilities of differently ordered labels were not compared, yet their mean and max read 0.0.
    from prometheus_client import REGISTRY

    def counted(series: str) -> float:
        return REGISTRY.get_sample_value(f"visionserve_shadow_{series}_total", {
            "model": "colour", "version": "2", "live_version": "1"}) or 0.0

    repository = SwappedLabels()
    for version in ("1", "2"):
        repository.add("colour", version)
    repository.policies["colour"] = {"rollout": {"shadow_percent": 100}}
    app = create_app(settings, source=repository)  # type: ignore[arg-type]
    client = app.test_client()
    try:
        service = app.extensions[EXTENSION_KEY]
        before = counted("compared"), counted("agreed")
        _shadowed_one_by_one(service, lambda photo: client.post("/predict", data=photo, content_type="image/jpeg"))
        answer = client.get("/v1/models")
        comparison = answer.get_json()["rollouts"][0]["comparison"]
        assert (comparison["compared"], comparison["top1_agreement"]) == (len(PHOTOS), 1.0)
        assert counted("compared") - before[0] == counted("agreed") - before[1] == len(PHOTOS)
        assert comparison["mean_probability_difference"] is None and comparison["max_probability_difference"] is None
        document = client.get("/openapi.json").get_json()  # null there is what the served schema allows
        schema = document["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
        jsonschema.Draft202012Validator({**schema, "components": document["components"]}).validate(answer.get_json())
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_an_unloaded_model_s_evidence_ends_and_a_version_loaded_afresh_starts_its_own(settings: Settings) -> None:
    # A load after an unload found the old comparison (and its count toward the promotion) of the versions' names.
    service = Service.build(settings, _repository({"shadow_percent": 100, "promote": {"after": 1000}}))  # type: ignore
    evidence = service.controller.evidence
    try:
        _shadowed_one_by_one(service)
        service.catalog.unload("colour")
        dumped = evidence.dump()
        assert [c for c in dumped["comparisons"] if c["model"] == "colour"] == []
        assert [t for t in dumped["traffic"] if t["model"] == "colour"] == []
        service.catalog.load("colour")
        rollout = service.catalog.rollouts()["colour"]
        assert (rollout["candidate"], _comparison(service)["compared"]) == ("2", 0)
        assert service.catalog.rollouts()["colour"]["promotion"] == "waiting: 0 of 1000 comparisons"
    finally:
        service.shutdown(timeout=5)


def test_a_pair_served_by_versions_loaded_afresh_is_compared_afresh(settings: Settings) -> None:
    # The evidence restarted by version names: the same candidate and live version, loaded again, kept the old
    # comparison. The routing table emptied behind the evidence's back, as nothing but an unload does today.
    service = Service.build(settings, _repository({"shadow_percent": 100, "promote": {"after": 1000}}))  # type: ignore
    applier = service.controller.applier
    try:
        _shadowed_one_by_one(service)
        for loaded in applier.routes.remove("colour"):
            loaded.batcher.stop(5)
        with applier.changing():
            applier.apply("colour", service.controller.sync.read()[1]["colour"])  # 1 and 2 loaded afresh
        assert _comparison(service)["compared"] == 0
        infer(service, [PHOTOS[0]])
        wait_until(lambda: _comparison(service)["compared"] == 1)
    finally:
        service.shutdown(timeout=5)


def _one_of_a_turn(service: Service, photo: bytes) -> None:
    """``photo`` answered as an engine's loop admits a turn's requests alike (``Service.enter_many``), alone in it."""
    [admission] = service.enter_many("colour", None, None, 1)
    try:
        admission.call.infer([photo], timeout_s=5)  # type: ignore[union-attr]
    finally:
        admission.leave()  # type: ignore[union-attr]


def test_a_turn_s_requests_are_drawn_one_by_one_for_a_canary_and_a_lone_one_keeps_its_shadow(
        settings: Settings) -> None:
    service = Service.build(settings, _repository({"canary_percent": 50}))  # type: ignore[arg-type]
    try:
        admitted = service.enter_many("colour", None, None, 40)
        versions = [admission.call.model.version for admission in admitted]  # type: ignore[union-attr]
        assert set(versions) == {"1", "2"}  # each drawn: 40 alike at 50% (all one way: 2 in 10^12)
        routes = service.controller.applier.routes
        assert [routes.find("colour", v).in_use.count() for v in ("1", "2")] == [versions.count("1"),
                                                                                versions.count("2")]
        for admission in admitted:
            admission.leave()  # type: ignore[union-attr]
        assert service.in_flight.count() == 0 and routes.find("colour", "2").in_use.count() == 0
    finally:
        service.shutdown(timeout=5)
    service = Service.build(settings, _repository({"shadow_percent": 100, "promote": {"after": 1000}}))  # type: ignore
    try:
        _shadowed_one_by_one(service, lambda photo: _one_of_a_turn(service, photo))
        assert _comparison(service)["compared"] == len(PHOTOS)
    finally:
        service.shutdown(timeout=5)


def _held_canary(service: Service, infer_with: Any) -> None:
    """A canary request to version 2 held in its forward pass (and failing) while 2 is promoted; its answer after."""
    candidate = service.controller.applier.routes.find("colour", "2").predictor.module
    candidate.gate, candidate.fail_when = threading.Event(), -10.0  # its batch waits, then fails
    seen = len(candidate.batch_sizes)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(infer_with, [PHOTOS[0]])
        wait_until(lambda: len(candidate.batch_sizes) > seen)  # in the candidate's forward pass, as the canary
        service.catalog.promote("colour")
        candidate.gate.set()
        with pytest.raises(InferenceFailed):
            answer.result(timeout=10)
    candidate.fail_when = None  # mended: its requests as the default are answered


ONE_FAILURE_ROLLS_BACK = {"canary_percent": 100, "rollback": {"within": 5, "max_error_ratio": 0.1,
                                                              "max_p99_ratio": 1000}}


def test_a_canary_request_in_flight_through_a_promotion_is_no_evidence_of_the_new_default(settings: Settings) -> None:
    # Traffic was looked up by version as the request left: a canary request that failed after the promotion was
    # counted as the new default's, and the rules rolled back a default none of whose requests had failed.
    service = Service.build(settings, _repository(ONE_FAILURE_ROLLS_BACK))  # type: ignore[arg-type]
    try:
        _held_canary(service, lambda photos: infer(service, photos))
        assert service.controller.evidence.traffic("colour", "2").dump()["requests"] == 0
        service.controller.writers.share_evidence()
        assert service.controller.applier.routes.routes()["colour"][1] == "2"
        assert service.catalog.rollouts()["colour"]["rolled_back"] == []
        infer(service, [image_bytes(GREEN)])  # its own requests as the default count
        assert service.controller.evidence.traffic("colour", "2").dump()["requests"] == 1
    finally:
        service.shutdown(timeout=5)


def test_the_engine_process_counts_a_canary_request_in_its_routed_role_too(settings: Settings, tmp_path: Path) -> None:
    # ENGINE=process: the engine's loop admits and ends each request through the same Service.enter and leave.
    from tests.app.test_link import Link

    service = Service.build(settings, _repository(ONE_FAILURE_ROLLS_BACK))  # type: ignore[arg-type]
    link = Link(settings.model_copy(update={"control_dir": tmp_path / "control"}), service).start()
    try:
        _held_canary(service, lambda photos: infer(link.worker, photos))
        assert service.controller.evidence.traffic("colour", "2").dump()["requests"] == 0
        service.controller.writers.share_evidence()
        assert service.controller.applier.routes.routes()["colour"][1] == "2"
    finally:
        service.shutdown(timeout=5)


# -- the rules ----------------------------------------------------------------------------------------------------


def test_the_rollback_rule_bounds_the_error_ratio_of_its_first_within_requests() -> None:
    # One failure among the first requests rolled back ("failures >= ratio * min_requests"), though 1 of 200 is
    # 0.5%, within the 1% the rule allows of its first 200.
    entry = {"versions": ["1", "2"], "default": "2", "previous_default": "1",
             "rollout": RolloutPolicy(rollback=RollbackRule(within=200, max_error_ratio=0.01)).as_entry(None),
             "watch": {"version": "2", "previous": "1", "baseline_p99_ms": 10.0}}

    def verdict(requests: int, failures: int) -> str | None:
        traffic = {("m", "2"): {"requests": requests, "failures": failures, "p99": 5.0}}
        found = judge("m", entry, {"comparisons": {}, "traffic": traffic})
        return None if found is None else found[0]

    assert verdict(3, 1) is None and verdict(60, 2) is None  # 2 of 200 may fail: whatever follows, not yet over
    assert verdict(60, 3) == "rollback"  # 3 of its first 200 have failed, more than 1% whatever follows
    assert verdict(200, 1) == verdict(200, 2) == "settle"
    assert verdict(250, 2) == "settle"  # counted past them before a judge: the ratio of those counted


def test_a_canary_whose_own_requests_cross_the_rollback_rule_is_aborted_and_a_shadow_alone_is_not() -> None:
    # Before: a canary failing its share of the clients kept failing them until someone acted (a rollout trial):
    # the rollback rule watched only a promoted default.
    rollback = RollbackRule(within=200, max_error_ratio=0.01, max_p99_ratio=2.0)

    def verdict(requests: int, failures: int, p99: float = 5.0, canary: float = 10.0, rule: RollbackRule | None = rollback,
                live_p99: float | None = 4.0) -> tuple[str, str, str] | None:
        entry = {"versions": ["1", "2"], "default": "1",
                 "rollout": RolloutPolicy(canary_percent=canary, shadow_percent=0 if canary else 100,
                                          rollback=rule).as_entry("2")}
        traffic = {("m", "2"): {"requests": requests, "failures": failures, "p99": p99},
                   ("m", "1"): {"requests": 1000, "failures": 0, "p99": live_p99}}
        return judge("m", entry, {"comparisons": {}, "traffic": traffic})

    assert verdict(60, 2) is None and verdict(500, 5) is None  # within 1% of its first 200, and of all 500
    assert verdict(60, 3) == ("abort", "2", "3 of its 60 canary requests failed (more than 1.0% of 200)")
    assert verdict(500, 6)[:2] == ("abort", "2")  # type: ignore[index]
    assert verdict(60, 0, p99=9.0) == ("abort", "2", "p99 9.0 ms over its 60 canary requests, more than 2x the live "
                                                      "version's 4.0 ms")
    assert verdict(10, 0, p99=9.0) is None and verdict(60, 0, p99=9.0, live_p99=None) is None  # too few; no baseline
    assert verdict(60, 30, canary=0) is None  # a shadow fails no client: its promotion is held by its errors
    assert verdict(60, 30, rule=None) is None  # no rollback rule: by call only


def test_a_failing_canary_is_taken_out_by_the_rules_and_the_live_version_answers_its_clients(
        settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    service = Service.build(settings, _repository(ONE_FAILURE_ROLLS_BACK))  # type: ignore[arg-type]
    try:
        candidate = service.controller.applier.routes.find("colour", "2").predictor.module
        candidate.fail_when = -10.0  # every request of its canary share fails (its canary at load passed)
        with pytest.raises(InferenceFailed):
            infer(service, [image_bytes(RED)])
        with caplog.at_level(logging.INFO, logger="app.engine.versions.rollout_changes"):
            service.controller.writers.share_evidence()  # the rules judge every worker's evidence
        rollouts = service.catalog.rollouts()["colour"]
        assert (rollouts["candidate"], rollouts["rolled_back"]) == (None, ["2"])
        assert infer(service, [image_bytes(RED)]).version == "1"  # its clients answered by the live version
        assert [v.version for v in service.controller.applier.routes.routes()["colour"][0]] == ["1"]  # unloaded
        (line,) = [r for r in caplog.records if getattr(r, "event", None) == "rollout"]
        assert line.getMessage() == ("colour abort: candidate 2 taken out, version 1 serves without it, by the rules: "
                                     "1 of its 1 canary requests failed (more than 10.0% of 5)")
        assert (line.from_version, line.to_version) == ("2", "1")  # type: ignore[attr-defined]
        service.controller.writers.poll()
        assert [v.version for v in service.controller.applier.routes.routes()["colour"][0]] == ["1"]  # not again
    finally:
        service.shutdown(timeout=5)


def test_the_traffic_shown_is_of_the_versions_served_not_of_one_a_load_call_dropped(settings: Settings) -> None:
    # Before: rollouts[].traffic listed version 1's old counts for ever after a load call unloaded it (a rollout
    # trial).
    repository = _repository({"canary_percent": 100})
    service = Service.build(settings, repository)  # type: ignore[arg-type]
    try:
        infer(service, [image_bytes(RED)], version="1")
        infer(service, [image_bytes(RED)])  # the canary, 2
        service.controller.writers.share_evidence()
        assert sorted(service.catalog.rollouts()["colour"]["traffic"]) == ["1", "2"]
        service.catalog.promote("colour")
        repository.add("colour", "3")
        service.catalog.load("colour")  # 3 the candidate; 1, the previous default, no longer loaded
        infer(service, [image_bytes(RED)])
        service.controller.writers.share_evidence()
        served = [v.version for v in service.controller.applier.routes.routes()["colour"][0]]
        assert "1" not in served and set(service.catalog.rollouts()["colour"]["traffic"]) <= set(served)
        kept = {(t["model"], t["version"]) for t in service.controller.evidence.dump()["traffic"]}
        assert ("colour", "2") in kept and ("colour", "1") not in kept  # this worker's own counts too
    finally:
        service.shutdown(timeout=5)


def test_a_promote_rule_with_no_share_of_the_traffic_is_refused(settings: Settings) -> None:
    # A candidate with canary 0 and shadow 0 gathers no evidence (requests naming it are none): "waiting: 0 of 5"
    # for ever.
    with pytest.raises(PolicyError, match="rollout promote needs canary_percent or shadow_percent above 0"):
        RolloutPolicy.layered(Settings(), {"rollout": {"promote": {"after": 5}}})
    with pytest.raises(PolicyError, match="needs canary_percent or shadow_percent"):  # a share set to 0 by a layer
        RolloutPolicy.layered(Settings(canary_percent=5, promote_after=10), {"rollout": {"canary_percent": 0}})
    with pytest.raises(PolicyError, match="VISIONSERVE_PROMOTE_AFTER=0"):  # the settings' rule named as set (before:
        RolloutPolicy.layered(Settings(promote_after=10))  # in policy.json's terms alone, an operator's trial)
    layered = RolloutPolicy.layered(Settings(), {"rollout": {"promote": {"after": 5}}},  # policy.json, then a call
                                    {"rollout": {"shadow_percent": 50}})
    assert layered.promote is not None and layered.shadow_percent == 50
    assert RolloutPolicy.layered(Settings(), {"rollout": {"promote": None}}).promote is None
    # PROMOTE_AFTER for every model, the share from one model's policy.json: served
    assert RolloutPolicy.layered(Settings(promote_after=5), {"rollout": {"canary_percent": 10}}).promote is not None
    app = create_app(settings, source=_repository())  # type: ignore[arg-type]
    try:
        answer = app.test_client().post("/v2/repository/models/colour/load",
                                        json={"parameters": {"config": {"rollout": {"promote": {"after": 5}}}}})
        assert answer.status_code == 400 and "needs canary_percent or shadow_percent" in answer.get_json()["error"]
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_a_promotion_is_watched_only_where_a_rollback_rule_judges_the_watch(settings: Settings) -> None:
    # Every promotion recorded a watch; with no rollback rule nothing judged it and rollouts[].watch showed it for
    # ever.
    for rollout, watched in (({"shadow_percent": 100}, False), ({"shadow_percent": 100, "rollback": {"within": 50}},
                                                                 True)):
        service = Service.build(settings, _repository(rollout))  # type: ignore[arg-type]
        try:
            service.catalog.promote("colour")
            infer(service, [PHOTOS[0]])
            service.controller.writers.share_evidence()
            watch = service.catalog.rollouts()["colour"]["watch"]
            assert (watch is not None) == watched
            assert ("watch" in service.controller.sync.read()[1]["colour"]) == watched
            assert watch is None or watch["version"] == "2"
        finally:
            service.shutdown(timeout=5)


def test_a_candidate_failing_before_enough_comparisons_is_said_held_by_its_errors_not_waiting() -> None:
    # Before: "waiting: 0 of 20 comparisons" for ever: images the candidate fails on are never compared (a TorchServe
    # user's trial)
    from app.engine.rollouts.plan import PromoteRule
    from app.engine.rollouts.rules import promotion_status

    rule = PromoteRule(after=20)
    shadow = {"shadow_percent": 100.0, "candidate": "2"}
    failing = {"traffic": {}, "comparisons": {("colour", "2", "1"): {"compared": 0, "errors": 4}}}
    assert promotion_status(rule, shadow, "colour", "2", "1", failing) == (False, "held: 4 errors (0 of 20 comparisons)")
    quiet = {"traffic": {}, "comparisons": {("colour", "2", "1"): {"compared": 3, "errors": 0}}}
    assert promotion_status(rule, shadow, "colour", "2", "1", quiet) == (False, "waiting: 3 of 20 comparisons")
    done = {"traffic": {}, "comparisons": {("colour", "2", "1"): {"compared": 25, "errors": 1}}}
    assert promotion_status(rule, shadow, "colour", "2", "1", done) == (False, "held: 1 errors")
