"""deploy/k8s, checked offline against the Kubernetes API schemas (PyPI kubernetes-validate) and against the app."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from app.config import Settings

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBERNETES_VERSION = "1.33"


def _resources() -> dict[str, dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    resources = {}
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            resources[doc["kind"]] = doc
    return resources


def test_kustomization_lists_every_manifest() -> None:
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize("kind", ["ConfigMap", "Deployment", "Service", "HorizontalPodAutoscaler",
                                  "PodDisruptionBudget"])
def test_manifest_validates_against_the_kubernetes_schema(kind: str) -> None:
    # strict: unknown fields (a typo such as "livenesProbe") fail too.
    kubernetes_validate.validate(_resources()[kind], KUBERNETES_VERSION, strict=True)


def test_schema_check_catches_mistakes() -> None:
    deployment = _resources()["Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_deployment_gpu_probes_and_drain_match_the_service() -> None:
    resources = _resources()
    pod = resources["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    port = int(Settings().bind.rsplit(":", 1)[1])
    assert container["ports"] == [{"name": "http", "containerPort": port}]
    assert pod["securityContext"]["runAsUser"] == 10001  # the image's USER

    settings = resources["ConfigMap"]["data"]
    graceful = int(settings["VISIONSERVE_GRACEFUL_TIMEOUT_S"])
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop + graceful
    # a request accepted just before SIGTERM may wait its whole deadline: the drain (graceful - 1) outlasts it
    assert graceful - 1 > float(settings["VISIONSERVE_REQUEST_TIMEOUT_S"])
    assert settings.keys() <= {f"VISIONSERVE_{name.upper()}" for name in Settings.model_fields}
    # /healthz answers 200 while the models load: a startup probe on it never restarts a load that hangs
    assert container["startupProbe"]["httpGet"]["path"] == "/readyz"
    # without a CPU limit the server counts the node's cores (16 and more: 4 workers on a pod of a few)
    assert "cpu" in container["resources"]["limits"] or "VISIONSERVE_WORKERS" in settings
    # and the engine's decode threads: one per node core (64) in a pod of 8 requested
    requested = int(container["resources"]["requests"]["cpu"])
    assert "cpu" in container["resources"]["limits"] or int(settings["VISIONSERVE_ENGINE_DECODE_THREADS"]) == requested


def test_the_hpa_alone_says_how_many_replicas_run() -> None:
    # a replica count in the Deployment resets the HPA's on every `kubectl apply`, killing the pods it added
    assert "replicas" not in _resources()["Deployment"]["spec"]


def test_a_new_model_version_rolls_out_without_a_gap() -> None:
    # The supported reload (docs/deployment.md): a new pod must pass /readyz (model loaded, warmed, canary run)
    # before an old one is taken out of service; `kill -HUP` inside one pod gives 503s while the model loads.
    deployment = _resources()["Deployment"]["spec"]
    assert deployment["strategy"]["type"] == "RollingUpdate"
    assert deployment["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert deployment["strategy"]["rollingUpdate"]["maxSurge"] >= 1


def test_service_hpa_and_pdb_point_at_the_deployment() -> None:
    resources = _resources()
    labels = resources["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert resources["Service"]["spec"]["selector"].items() <= labels.items()
    assert resources["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    target = resources["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", resources["Deployment"]["metadata"]["name"])
    metric_names = [m["pods"]["metric"]["name"] for m in resources["HorizontalPodAutoscaler"]["spec"]["metrics"]
                    if m["type"] == "Pods"]
    from app import metrics

    assert metric_names == [metrics.QUEUE_DEPTH.describe()[0].name]


def _apply_json_patch(document: dict[str, Any], operations: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 "add" operations, as kustomize applies them (the only kind the overlay uses)."""
    for operation in operations:
        assert operation["op"] == "add", operation
        *parents, last = operation["path"].strip("/").split("/")
        target: Any = document
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        if last == "-":
            target.append(operation["value"])
        else:
            target[int(last) if isinstance(target, list) else last] = operation["value"]
    return document


def test_the_repository_overlay_serves_a_shared_volume() -> None:
    overlay = K8S.parent / "k8s-repository"
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../k8s", "pvc.yaml"]
    # kustomize refuses an overlay inside its own base ("cycle detected"): it sat in deploy/k8s/repository
    assert not overlay.resolve().is_relative_to((overlay / kustomization["resources"][0]).resolve())
    (patch,) = kustomization["patches"]
    deployment = _apply_json_patch(_resources()["Deployment"], yaml.safe_load((overlay / patch["path"]).read_text()))
    assert patch["target"] == {"kind": "Deployment", "name": deployment["metadata"]["name"]}
    kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    claim = yaml.safe_load((overlay / "pvc.yaml").read_text())
    kubernetes_validate.validate(claim, KUBERNETES_VERSION, strict=True)
    pod = deployment["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "models"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "models"]
    env = {e["name"]: e["value"] for e in container["env"]}
    settings = Settings(weights_dir=env["VISIONSERVE_WEIGHTS_DIR"],
                        repository_poll_s=env["VISIONSERVE_REPOSITORY_POLL_S"])
    assert str(settings.weights_dir) == mount["mountPath"] and mount["readOnly"] and settings.repository_poll_s > 0


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (its kustomize builds the overlays)")
def test_kubectl_builds_the_base_and_the_repository_overlay() -> None:
    for folder in (K8S, K8S.parent / "k8s-repository"):
        built = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
        assert built.returncode == 0, built.stderr
        kinds = [document["kind"] for document in yaml.safe_load_all(built.stdout)]
        assert "Deployment" in kinds and ("PersistentVolumeClaim" in kinds) == (folder != K8S), kinds
