"""deploy/prometheus and deploy/grafana: the alert rules pass promtool and fire when they should (promtool test
rules), the dashboard's queries parse, and every metric the rules and the dashboard read is one the server declares
and a live server exposes (a renamed metric would otherwise leave a panel empty and an alert silent)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import requests
import yaml

from harness.servers import Running
from tests.support.imaging import RED, image_bytes

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROMTOOL = shutil.which("promtool")
METRIC = re.compile(r"\b((?:visionserve|process)_[a-z0-9_]+)\b")  # digits too: visionserve_top1_...
SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def _rule_exprs() -> list[str]:
    groups = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "visionserve.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


@pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian package prometheus)")
def test_alert_rules_pass_promtool() -> None:
    result = subprocess.run([PROMTOOL, "check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 8 rules found" in result.stdout


def test_the_alerts_cover_what_ops_page_for() -> None:
    alerts = {rule["alert"] for group in yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
              for rule in group["rules"]}
    assert alerts == {"VisionserveNotReady", "VisionserveBatcherDead", "VisionserveHigh5xxRatio",
                      "VisionserveHigh429Ratio", "VisionserveLatencyP99OverObjective", "VisionserveQueueWait",
                      "VisionservePredictionDrift", "VisionserveLowConfidence"}
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    # "target down" reads up{app="visionserve"}: a label the compose target carries and a k8s pod label map gives,
    # not a job name only one scrape config has (up{job="visionserve"} never fired under Kubernetes)
    assert 'up{app="visionserve"} == 0' in _alert("VisionserveNotReady")["expr"]
    (target,) = config["scrape_configs"][0]["static_configs"]
    assert target["labels"] == {"app": "visionserve"}
    deployment = yaml.safe_load((DEPLOY / "k8s" / "deployment.yaml").read_text())
    assert deployment["spec"]["template"]["metadata"]["labels"]["app"] == "visionserve"


def _alert(name: str) -> dict:
    groups = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
    return next(rule for group in groups for rule in group["rules"] if rule.get("alert") == name)


def _promtool_test(tmp_path: Path, series: dict[str, str], alert_tests: list[dict]) -> None:
    spec = {"rule_files": [str(DEPLOY / "prometheus" / "alerts.yml")], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": [{"series": k, "values": v} for k, v in series.items()],
                       "alert_rule_test": alert_tests}]}
    (tmp_path / "alerts_test.yml").write_text(yaml.safe_dump(spec))
    assert PROMTOOL is not None
    result = subprocess.run([PROMTOOL, "test", "rules", str(tmp_path / "alerts_test.yml")], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian package prometheus)")
def test_the_queue_alert_fires_on_the_time_images_wait_not_on_a_share_of_the_queue(tmp_path: Path) -> None:
    # Before: the queue's depth over 80% of its capacity, which the default queue (every worker's threads' images)
    # never reaches: 2.7% with the cores saturated by 128 clients (an SRE's trial)
    def waiting(slow_per_minute: int) -> dict[str, str]:  # 60 images a minute, ``slow_per_minute`` of them > 1 s
        series = {}
        for version, slow in (("1", slow_per_minute), ("2", 0)):  # another version of the model: never slow
            fast = 60 - slow
            buckets = {"0.1": fast, "0.5": fast, "1.0": fast, "2.5": 60, "+Inf": 60}
            series.update({f'visionserve_stage_duration_seconds_bucket{{model="cats",version="{version}",'
                           f'stage="queue",instance="a",le="{le}"}}': f"0+{per_minute}x30"
                           for le, per_minute in buckets.items()})
        return series

    said = {"severity": "ticket", "instance": "a", "model": "cats", "version": "1"}  # the slow version's alone
    annotations = {**_alert("VisionserveQueueWait")["annotations"],
                   "summary": "a: cats 1's images wait 2.05s (p95) in the inference queue: the engine is saturated; "
                              "add replicas or devices"}  # p95: 7 of the 10 images between 1 and 2.5 s
    _promtool_test(tmp_path, waiting(10), [  # a sixth of them over a second: p95 past 0.5 s
        {"eval_time": "8m", "alertname": "VisionserveQueueWait", "exp_alerts": []},  # not for 10 minutes yet
        {"eval_time": "20m", "alertname": "VisionserveQueueWait",
         "exp_alerts": [{"exp_labels": said, "exp_annotations": annotations}]}])
    _promtool_test(tmp_path, waiting(1), [  # one in sixty: p95 under 0.1 s
        {"eval_time": "20m", "alertname": "VisionserveQueueWait", "exp_alerts": []}])


@pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian package prometheus)")
def test_the_drift_alert_fires_for_a_version_over_0_2_for_30_minutes_only(tmp_path: Path) -> None:
    description = _alert("VisionservePredictionDrift")["annotations"]["description"]
    drifted = {"severity": "ticket", "model": "cats", "version": "2"}
    _promtool_test(tmp_path, {
        # version 2 drifted on one of two replicas: the highest counts
        'visionserve_prediction_drift_psi{model="cats",version="2",instance="a"}': "0.31x50",
        'visionserve_prediction_drift_psi{model="cats",version="2",instance="b"}': "0.05x50",
        'visionserve_prediction_drift_psi{model="cats",version="1",instance="a"}': "0.19x50",  # "watch", no alert
        'visionserve_prediction_drift_psi{model="cats",version="3",instance="a"}': "0.05x30 0.5x20",  # 20 min only
    }, [
        {"eval_time": "25m", "alertname": "VisionservePredictionDrift", "exp_alerts": []},  # pending, not firing
        {"eval_time": "45m", "alertname": "VisionservePredictionDrift", "exp_alerts": [
            {"exp_labels": drifted, "exp_annotations": {
                "summary": "cats 2: the predicted-class mix has drifted (PSI 0.31 > 0.2 for 30 min)",
                "description": description}}]},
    ])


@pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian package prometheus)")
def test_the_low_confidence_alert_fires_over_half_for_30_minutes(tmp_path: Path) -> None:
    description = _alert("VisionserveLowConfidence")["annotations"]["description"]
    _promtool_test(tmp_path, {
        'visionserve_low_confidence_ratio{model="cats",version="2",instance="a"}': "0.6x50",
        'visionserve_low_confidence_ratio{model="cats",version="1",instance="a"}': "0.4x50",
        'visionserve_low_confidence_ratio{model="dogs",version="1",instance="a"}': "0.9x20 0.1x30",  # it recovered
    }, [
        {"eval_time": "25m", "alertname": "VisionserveLowConfidence", "exp_alerts": []},  # pending, not firing
        {"eval_time": "45m", "alertname": "VisionserveLowConfidence", "exp_alerts": [
            {"exp_labels": {"severity": "ticket", "model": "cats", "version": "2"}, "exp_annotations": {
                "summary": "cats 2: 60% of recent predictions are low-confidence", "description": description}}]},
    ])


@pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian package prometheus)")
def test_the_latency_alert_reads_every_inference_route(tmp_path: Path) -> None:
    # Before: endpoint="/predict" only, and a KServe deployment, whose clients call V2's infer alone, never paged
    summary = _alert("VisionserveLatencyP99OverObjective")["annotations"]["summary"]
    bucket = 'visionserve_request_duration_seconds_bucket{instance="%s",endpoint="%s",le="%s"}'

    def slow(instance: str, endpoint: str) -> dict[str, str]:  # every request between 0.5 and 2.5 s: p99 2.48 s
        return {bucket % (instance, endpoint, "0.5"): "0+0x20", bucket % (instance, endpoint, "2.5"): "0+10x20",
                bucket % (instance, endpoint, "+Inf"): "0+10x20"}

    def paged(instance: str) -> dict:
        text = summary.replace("{{ $labels.instance }}", instance).replace("{{ $value | humanizeDuration }}", "2.48s")
        return {"exp_labels": {"severity": "ticket", "instance": instance}, "exp_annotations": {"summary": text}}

    _promtool_test(tmp_path, {
        **slow("a", "/v2/models/<name>/infer"), **slow("b", "/v2/models/<name>/versions/<version>/infer"),
        **slow("c", "/predict"), **slow("d", "/explain"),  # an explanation is not held to a prediction's objective
        **slow("e", "/v1/models"),
    }, [{"eval_time": "15m", "alertname": "VisionserveLatencyP99OverObjective",
         "exp_alerts": [paged("a"), paged("b"), paged("c")]}])
    # the dashboard's latency panel reads the same routes as the alert
    (matcher,) = set(re.findall(r'endpoint=~?"[^"]*"', _alert("VisionserveLatencyP99OverObjective")["expr"]))
    latency = [expr for expr in _dashboard_exprs() if "visionserve_request_duration_seconds_bucket" in expr]
    assert latency and all(matcher in expr for expr in latency)


@pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian package prometheus)")
def test_the_batcher_dead_alert_fires_with_a_version_serving_beside_a_retired_one(tmp_path: Path) -> None:
    # A retired version's info series reads 0: "min by (instance) (visionserve_model_info) == 1" never held again
    # once any version was replaced or unloaded, and the inference thread's death paged no one.
    info = 'visionserve_model_info{instance="%s",name="mine",version="%s",device="cpu",dtype="float32"}'
    summary = _alert("VisionserveBatcherDead")["annotations"]["summary"]

    def dead(instance: str) -> dict:
        return {"exp_labels": {"severity": "page", "instance": instance},
                "exp_annotations": {"summary": summary.replace("{{ $labels.instance }}", instance)}}

    _promtool_test(tmp_path, {
        'visionserve_batcher_alive{instance="a"}': "0x10",  # a version swapped, then its thread died
        info % ("a", "1"): "0x10",
        info % ("a", "2"): "1x10",
        'visionserve_batcher_alive{instance="b"}': "1x10",  # swapped too, its thread alive
        info % ("b", "1"): "0x10",
        info % ("b", "2"): "1x10",
        'visionserve_batcher_alive{instance="c"}': "0x10",  # every version unloaded: no thread to run
        info % ("c", "1"): "0x10",
        'visionserve_batcher_alive{instance="d"}': "1x1 0x9",  # its thread died at 2 min: firing from 3 min
        info % ("d", "2"): "1x10",
    }, [
        {"eval_time": "2m", "alertname": "VisionserveBatcherDead", "exp_alerts": [dead("a")]},
        {"eval_time": "5m", "alertname": "VisionserveBatcherDead", "exp_alerts": [dead("a"), dead("d")]},
    ])


@pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian package prometheus)")
def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    # promtool parses PromQL in rule files only: each panel's query as a recording rule.
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:query_{i}", "expr": expr}
                                                         for i, expr in enumerate(_dashboard_exprs())]}]}
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump(rules))
    result = subprocess.run([PROMTOOL, "check", "rules", str(tmp_path / "dashboard.yml")], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_dashboard_shows_drift_confidence_the_class_mix_and_shadow_comparisons() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "visionserve.json").read_text())
    panels = {name: [target["expr"] for target in panel["targets"]] for panel in dashboard["panels"]
              for name in METRIC.findall(" ".join(target["expr"] for target in panel["targets"]))}
    for metric in ("visionserve_prediction_drift_psi", "visionserve_low_confidence_ratio",
                   "visionserve_predicted_class_total", "visionserve_top1_confidence_bucket",
                   "visionserve_shadow_agreed_total", "visionserve_shadow_dropped_total"):
        assert metric in panels, metric
    assert any(expr.startswith("topk") for expr in panels["visionserve_predicted_class_total"])
    assert ("sum by (model, version) (rate(visionserve_shadow_agreed_total[5m])) / sum by (model, version) "
            "(rate(visionserve_shadow_compared_total[5m]))") in panels["visionserve_shadow_agreed_total"]
    assert ("sum by (model, version, reason) (rate(visionserve_shadow_dropped_total[5m]))"
            in panels["visionserve_shadow_dropped_total"])
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_every_metric_in_the_rules_and_the_dashboard_is_declared() -> None:
    # Without a server: metrics that have no series until something happens (the drift gauge before enough
    # predictions, the shadow counters without a rollout) are checked here against what app/metrics.py declares.
    from prometheus_client import REGISTRY

    import app.metrics  # noqa: F401 - declares them in the default registry

    declared = set()
    for family in REGISTRY.collect():
        declared.add(family.name)
        declared.update(family.name + suffix for suffix in SUFFIXES)
    used = {name for expr in _rule_exprs() + _dashboard_exprs() for name in METRIC.findall(expr)}
    assert not used - declared, sorted(used - declared)


def test_every_metric_in_the_rules_and_the_dashboard_is_exposed(live_server: Running) -> None:
    # One prediction first: request and stage series appear with their first observation.
    assert requests.post(f"{live_server.url}/predict", data=image_bytes(RED), headers={"Content-Type": "image/jpeg"},
                         timeout=30).status_code == 200
    text = requests.get(f"{live_server.url}/metrics", timeout=10).text
    samples = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    declared = set(re.findall(r"^# TYPE (\S+)", text, flags=re.M))  # GPU memory has no sample on a CPU
    used = {name for expr in _rule_exprs() + _dashboard_exprs() for name in METRIC.findall(expr)}
    assert len(used) >= 12
    missing = [name for name in used if name not in samples and
               not any(name.endswith(s) and name[: -len(s)] in declared for s in SUFFIXES) and name not in declared]
    assert not missing, missing
