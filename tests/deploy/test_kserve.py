"""deploy/kserve: KServe's ServingRuntime and InferenceService, checked offline against KServe's CRD schemas
(copied into deploy/kserve/schemas from KServe's config/crd/full, Apache-2.0) and against the app."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from app.config import Settings
from app.link.client import CONNECT_TIMEOUT_S
from app.web.auth import OPEN_PATHS

KSERVE = Path(__file__).resolve().parents[2] / "deploy" / "kserve"
SCHEMAS = {"ServingRuntime": "kserve-servingruntime-v1alpha1.json",
           "InferenceService": "kserve-inferenceservice-v1beta1.json"}
FILES = {"ServingRuntime": "servingruntime.yaml", "InferenceService": "inferenceservice.yaml"}
KNATIVE_QUEUE_PROXY_DRAIN_S = 30  # the least the queue-proxy's preStop waits before the app gets SIGTERM (Knative's
# drainSleepDuration), out of the pod's grace period


def _manifest(kind: str) -> dict[str, Any]:
    return yaml.safe_load((KSERVE / FILES[kind]).read_text())


def _validate(kind: str, manifest: dict[str, Any]) -> None:
    schema = json.loads((KSERVE / "schemas" / SCHEMAS[kind]).read_text())
    jsonschema.Draft7Validator(schema).validate(manifest)


@pytest.mark.parametrize("kind", sorted(FILES))
def test_manifest_validates_against_kserves_crd_schema(kind: str) -> None:
    manifest = _manifest(kind)
    assert manifest["kind"] == kind
    _validate(kind, manifest)


def test_the_schema_check_catches_mistakes() -> None:
    runtime = _manifest("ServingRuntime")
    runtime["spec"]["multiModel"] = "no"  # a boolean in KServe's schema
    with pytest.raises(jsonschema.ValidationError):
        _validate("ServingRuntime", runtime)
    service = _manifest("InferenceService")
    del service["spec"]["predictor"]["model"]["modelFormat"]["name"]  # required
    with pytest.raises(jsonschema.ValidationError):
        _validate("InferenceService", service)


def test_the_runtime_speaks_v2_on_the_port_and_probes_the_app_answers() -> None:
    spec = _manifest("ServingRuntime")["spec"]
    assert spec["protocolVersions"] == ["v2"]
    (container,) = spec["containers"]
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env.keys() <= {f"VISIONSERVE_{name.upper()}" for name in Settings.model_fields}
    port = int(Settings(bind=env["VISIONSERVE_BIND"]).bind.rsplit(":", 1)[1])
    assert container["ports"] == [{"containerPort": port, "protocol": "TCP"}]
    for probe, path in (("readinessProbe", "/v2/health/ready"), ("livenessProbe", "/v2/health/live")):
        assert container[probe]["httpGet"] == {"path": path, "port": port} and path in OPEN_PATHS
        # a probe may wait for a new connection to a silent engine (then answers 503): Kubernetes' default 1 s
        # would count that as a timeout, and three in a row restart a container whose engine the master restarts
        assert container[probe]["timeoutSeconds"] > CONNECT_TIMEOUT_S


def test_the_inference_service_uses_the_runtime_with_a_gpu_and_the_mounted_export() -> None:
    runtime = _manifest("ServingRuntime")
    model = _manifest("InferenceService")["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["protocolVersion"] == "v2" and model["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"name": "VISIONSERVE_WEIGHTS_DIR", "value": "/mnt/models"} in model["env"]  # where KServe puts it
    # a GPU predictor tolerates the GPU nodes' taint as deploy/k8s's pods do (else it stays Pending there)
    k8s = yaml.safe_load((Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "deployment.yaml").read_text())
    predictor = _manifest("InferenceService")["spec"]["predictor"]
    assert predictor["tolerations"] == k8s["spec"]["template"]["spec"]["tolerations"]


def test_the_runtime_serves_a_cpu_inference_service_and_the_gpu_one_computes_in_half_precision() -> None:
    # Before: the runtime set VISIONSERVE_DTYPE=float16, so an InferenceService without a GPU crash-looped (exit 3,
    # "float16 needs a CUDA device"; a KServe trial): the dtype belongs to the InferenceService that asks for the GPU
    from app.config import DeviceSettings, dtype_fits_device

    runtime_env = {e["name"]: e.get("value") for e in _manifest("ServingRuntime")["spec"]["containers"][0]["env"]}
    dtype = runtime_env.get("VISIONSERVE_DTYPE", DeviceSettings.model_fields["dtype"].default)
    assert dtype_fits_device(dtype, "cpu") is None and dtype_fits_device(dtype, "cuda") is None
    model = _manifest("InferenceService")["spec"]["predictor"]["model"]
    assert {"name": "VISIONSERVE_DTYPE", "value": "float16"} in model["env"]
    assert model["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_a_pod_outlives_the_graceful_timeout_which_outlives_a_request_s_deadline() -> None:
    # Before: GRACEFUL_TIMEOUT_S 30, the default deadline, and Kubernetes' default grace of 30 s, which the drain
    # (SHUTDOWN_DRAIN_S, inside the graceful timeout) and the last requests' deadlines outlasted: SIGKILL mid-request
    (container,) = _manifest("ServingRuntime")["spec"]["containers"]
    env = {item["name"]: item["value"] for item in container["env"]}
    settings = Settings(graceful_timeout_s=env["VISIONSERVE_GRACEFUL_TIMEOUT_S"])
    assert settings.graceful_timeout_s - 1 > settings.request_timeout_s  # the drain's second included
    predictor = _manifest("InferenceService")["spec"]["predictor"]
    # Serverless (KServe's default): Knative's webhook refuses terminationGracePeriodSeconds in the pod spec (KServe
    # issues #1546, #1723) and sets it from the revision's timeout, which `timeout` is; the grace goes first to the
    # queue-proxy's drain (its preStop), then to the runtime's graceful timeout
    assert "terminationGracePeriodSeconds" not in predictor
    assert predictor["timeout"] > KNATIVE_QUEUE_PROXY_DRAIN_S + settings.graceful_timeout_s


def test_the_runtime_sizes_its_workers_for_the_pod_not_the_node() -> None:
    # without a CPU limit the server counts the node's cores (auto: 4 HTTP workers on a 64-core node in a 4-core pod)
    (container,) = _manifest("ServingRuntime")["spec"]["containers"]
    env = {item["name"]: item["value"] for item in container["env"]}
    resources = _manifest("InferenceService")["spec"]["predictor"]["model"]["resources"]
    assert "cpu" not in resources.get("limits", {})  # (with one, the server would count the pod's cores itself)
    requested = int(resources["requests"]["cpu"])
    assert 1 <= int(env["VISIONSERVE_WORKERS"]) <= max(1, requested // 4)  # auto's one per 4 cores, of the pod's
    assert int(env["VISIONSERVE_ENGINE_DECODE_THREADS"]) == requested  # the engine's decode threads too
