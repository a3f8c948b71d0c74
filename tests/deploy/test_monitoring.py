"""deploy/prometheus and deploy/grafana: the alert rules pass promtool, and every metric the rules and the dashboard
read is one a live server exposes (a renamed metric would otherwise leave a panel empty and an alert silent)."""
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
METRIC = re.compile(r"\b((?:visionserve|process)_[a-z_]+)\b")
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
    assert "SUCCESS: 6 rules found" in result.stdout


def test_the_alerts_cover_what_ops_page_for() -> None:
    alerts = {rule["alert"] for group in yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
              for rule in group["rules"]}
    assert alerts == {"VisionserveNotReady", "VisionserveBatcherDead", "VisionserveHigh5xxRatio",
                      "VisionserveHigh429Ratio", "VisionserveLatencyP99OverObjective", "VisionserveQueueSaturated"}
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]


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
