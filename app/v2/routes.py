"""The Open Inference Protocol (KServe V2) REST endpoints beside /predict, on the same batcher.

Inputs: ``images`` (BYTES [N]: encoded image files, decoded by our pipeline) or ``pixels`` (FP32 [N, 3, H, W],
already preprocessed). Outputs: ``probabilities`` (FP32 [N, classes]; with ``parameters.classification = k`` it
holds the top k as "score:index:label" strings (BYTES [N, k]), as Triton's classification extension does) and, for a
model exported with one, ``embedding`` (FP32 [N, dim]: the pooled features before the classifier, L2-normalised),
from the same forward pass, only when a request names it.
"""
from __future__ import annotations

import json

import numpy as np
from flask import Blueprint, Response, request
from pydantic import BaseModel

from app import __version__
from app.engine.contract import CallFace, PixelsForTheDefault, Served, Signature
from app.errors import BadRequest, NotFound, NotReady, UnknownOutput, UnsupportedMediaType, check_image_count
from app.hosting.host import engine_mode
from app.v2.codec import (OUTPUT_FIELDS, InferRequest, InputCheck, Tensor, check_fields, encode_response, flag,
                           parameters, parse_request)
from app.v2.schemas import (ConfigParameter, ConfigTensor, DynamicBatching, InstanceGroup, Live, ModelConfig,
                            ModelMetadata, ModelReady, Ready, Reshape, ServerMetadata, TensorMetadata)
from app.web.inputs import check_deadline_floor, client_key, read_body, request_deadline_s
from app.web.services import arrival, client_gone, current_service
from app.web.timing import annotate

bp = Blueprint("v2", __name__, url_prefix="/v2")

IMAGES_INPUT, PIXELS_INPUT, OUTPUT, EMBEDDING = "images", "pixels", "probabilities", "embedding"
EXTENSIONS = ["classification", "binary_tensor_data", "model_repository"]
FORMS = ("multipart/form-data", "application/x-www-form-urlencoded")  # /predict's forms, never an inference request
_MODEL = "/models/<name>"
_VERSIONED = "/models/<name>/versions/<version>"


def _json(body: BaseModel) -> Response:
    return Response(body.model_dump_json(exclude_none=True), mimetype="application/json")


@bp.get("")
def server_metadata() -> Response:
    """Server name, version and the protocol extensions we implement."""
    return _json(ServerMetadata(name="visionserve", version=__version__, extensions=EXTENSIONS))


@bp.get("/health/live")
def live() -> tuple[Response, int]:
    """Live while the inference thread runs (the same check as /healthz)."""
    alive = current_service().alive
    return _json(Live(live=alive)), 200 if alive else 503


@bp.get("/health/ready")
def ready() -> tuple[Response, int]:
    """Ready as /readyz is: warmed up, canary passed, not draining."""
    ok = current_service().ready
    return _json(Ready(ready=ok)), 200 if ok else 503


@bp.get(_MODEL + "/ready")
@bp.get(_VERSIONED + "/ready")
def model_ready(name: str, version: str | None = None) -> tuple[Response, int]:
    """Readiness of a model (its default version) or of one version: true exactly when it takes requests."""
    service = current_service()
    try:
        service.require_loaded()
        alive = service.catalog.version(name, version).alive  # NotFound first: unknown is 404, not 503
        ok = service.ready and alive
    except NotReady:
        ok = False
    except NotFound:
        if not service.catalog.in_repository(name, version):  # there though not loaded: not ready, not unknown
            raise
        ok = False
    return _json(ModelReady(name=name, ready=ok)), 200 if ok else 503


# The metadata's platform, in Triton's names, by the format the version runs (its weights_format in /v1/models); an
# eager module (a state dict, an int8 one) or an AOTInductor package: "pytorch"
PLATFORMS = {"onnx": "onnxruntime_onnx", "torchscript": "pytorch_libtorch"}


@bp.get(_MODEL)
@bp.get(_VERSIONED)
def model_metadata(name: str, version: str | None = None) -> Response:
    """Inputs and outputs with datatypes and shapes; -1 is the batch dimension."""
    service = current_service()
    service.require_loaded()
    info = service.catalog.version(name, version)
    manifest = info.manifest
    loaded = service.catalog.serving().get(name, {"versions": [manifest.version], "default": None})["versions"]
    versions = loaded if version is None else [version]
    return _json(ModelMetadata(
        name=manifest.name, versions=versions, platform=PLATFORMS.get(info.weights_format, "pytorch"),
        inputs=[TensorMetadata(name=IMAGES_INPUT, datatype="BYTES", shape=[-1]),
                TensorMetadata(name=PIXELS_INPUT, datatype="FP32", shape=[-1, *manifest.preprocess.input_shape])],
        outputs=[TensorMetadata(name=OUTPUT, datatype="FP32", shape=[-1, manifest.num_classes]),
                 *([TensorMetadata(name=EMBEDDING, datatype="FP32", shape=[-1, manifest.embedding.dim])]
                   if manifest.embedding is not None else [])]))


# Triton's backend by platform, for the configuration
BACKENDS = {"onnxruntime_onnx": "onnxruntime", "pytorch_libtorch": "pytorch", "pytorch": "pytorch"}


@bp.get(_MODEL + "/config")
@bp.get(_VERSIONED + "/config")
def model_config(name: str, version: str | None = None) -> Response:
    """The version's configuration in Triton's JSON form: ``max_batch_size`` the images one request may carry
    (MAX_IMAGES), the inputs and outputs without that batch dimension, the batching (MAX_WAIT_MS, the batch cap)
    and where it runs."""
    service = current_service()
    service.require_loaded()
    info = service.catalog.version(name, version)
    manifest, settings = info.manifest, service.settings
    apart = engine_mode(settings.engine, settings.device) == "process"  # engines of their own: that many a device
    platform = PLATFORMS.get(info.weights_format, "pytorch")
    files = {fmt: file.path for fmt, file in manifest.files.items()}
    if manifest.onnx is not None:
        files["onnx"] = manifest.onnx.path
    classes = ConfigTensor(name=OUTPUT, data_type="TYPE_FP32", dims=[manifest.num_classes])
    return _json(ModelConfig(
        name=manifest.name, platform=platform, backend=BACKENDS[platform], max_batch_size=settings.max_images,
        input=[ConfigTensor(name=IMAGES_INPUT, data_type="TYPE_STRING", dims=[1], format="FORMAT_NONE",
                            reshape=Reshape(shape=[])),
               ConfigTensor(name=PIXELS_INPUT, data_type="TYPE_FP32", dims=list(manifest.preprocess.input_shape),
                            format="FORMAT_NCHW")],
        output=[classes, *([ConfigTensor(name=EMBEDDING, data_type="TYPE_FP32", dims=[manifest.embedding.dim])]
                           if manifest.embedding is not None else [])],
        dynamic_batching=DynamicBatching(max_queue_delay_microseconds=round(settings.max_wait_ms * 1000),
                                         preferred_batch_size=[min(info.batch_cap, settings.max_images)]),
        # a copy in each engine of the device, or inline in each worker
        instance_group=[InstanceGroup(kind="KIND_GPU" if info.device.startswith("cuda") else "KIND_CPU",
                                      count=settings.engines_per_device if apart else settings.model_processes())],
        default_model_filename=files.get(info.weights_format),
        parameters={"preprocess": ConfigParameter(string_value=manifest.preprocess.model_dump_json())}))


def _input_check(call: CallFace, max_images: int) -> InputCheck:
    """What ``parse_request`` checks of each input once its shape is read, before its data is decoded: the one
    input, images (BYTES [N] or [N, 1]) or pixels (FP32 [N, *model.input_shape]), and its N images against
    MAX_IMAGES (413), so a refused request costs no decode (N tiny elements would each be cut, or decoded from
    base64, before Call.infer counted them). Pixels in a call that cannot take them (a canary of another input)
    raise PixelsForTheDefault before anything is decoded."""
    model, names_sent = call.model, []

    def check(index: int, name: str, datatype: str, shape: list[int]) -> None:
        if index:
            sent = f"input {name!r} twice" if name in names_sent else f"a second input, {name!r}"
            raise BadRequest(f"{sent}: send exactly one input, {IMAGES_INPUT!r} (BYTES) or {PIXELS_INPUT!r} (FP32)")
        names_sent.append(name)
        if not shape:  # a scalar: no batch dimension to count its images by
            raise BadRequest(f"input {name!r} has shape [] (a scalar): its first dimension counts its images, "
                             f"[1] for one")
        count = shape[0]
        if count == 0:
            raise BadRequest(f"input {name!r} holds no images")
        if name == IMAGES_INPUT and datatype == "BYTES":
            if shape not in ([count], [count, 1]):
                raise BadRequest(f"input {IMAGES_INPUT!r} must have shape [N] or [N, 1], got {shape}")
        elif name == PIXELS_INPUT and datatype == "FP32":
            if not call.takes_pixels:
                raise PixelsForTheDefault()
            # the model and version named: several models of other input sizes may serve (a multi-model trial)
            whose = f"{model.name} version {model.version}'s"
            if len(shape) != 1 + len(model.input_shape):  # the images' count first, then one image's shape
                raise BadRequest(f"{whose} input {PIXELS_INPUT!r} must have shape "
                                 f"[N, {', '.join(map(str, model.input_shape))}] (N images first), got {shape}")
            expected = [count, *model.input_shape]
            if shape != expected:
                raise BadRequest(f"{whose} input {PIXELS_INPUT!r} must have shape {expected}, got {shape}")
        elif name in (IMAGES_INPUT, PIXELS_INPUT):  # a known input of another datatype
            wanted = "BYTES" if name == IMAGES_INPUT else "FP32"
            raise BadRequest(f"input {name!r} must have datatype {wanted}, got {datatype}")
        else:
            raise BadRequest(f"unknown input {name!r} ({datatype}); send {IMAGES_INPUT!r} as BYTES or "
                             f"{PIXELS_INPUT!r} as FP32")
        check_image_count(count, max_images)

    return check


def _inputs(infer: InferRequest) -> tuple[list[bytes], list[np.ndarray] | np.ndarray]:
    """The one input, parsed under ``_input_check``: encoded images (BYTES) or preprocessed pixels (FP32, as one
    (N, C, H, W) array)."""
    (tensor,) = infer.inputs
    if tensor.datatype == "BYTES":
        return [bytes(item) for item in tensor.data.reshape(-1)], []
    if not np.isfinite(tensor.data).all():
        raise BadRequest(f"input {PIXELS_INPUT!r} holds NaN or infinite values")
    return [], np.array(tensor.data, dtype=np.float32)  # (N, C, H, W), a copy: the body's buffer is read-only


def _output_plan(infer: InferRequest, model: Signature) -> list[tuple[str, int, bool]]:
    """(name, classification k, binary?) per requested output, checked against ``model`` before any inference is
    spent."""
    binary_default = flag(infer.parameters, "binary_data_output", False, "the request")
    if "classification" in infer.parameters:  # (read there, it would be ignored: answered as probabilities)
        where = {"outputs": [{"name": OUTPUT, "parameters": {"classification": infer.parameters["classification"]}}]}
        raise BadRequest(f"parameters.classification is an output's, not the request's: {json.dumps(where)}, as "
                         "Triton reads it")
    known = [OUTPUT, EMBEDDING] if model.embedding_dim else [OUTPUT]
    plan = []
    # none asked ("outputs" left out, or []: Triton's reading of an empty list) is the default output
    for item in infer.outputs or [{"name": OUTPUT}]:
        name = item.get("name")
        if not isinstance(name, str):
            raise BadRequest(f"each output needs its 'name' ({', '.join(map(repr, known))}), got {name!r}")
        check_fields(item, OUTPUT_FIELDS, f"output {name!r}")
        if name == EMBEDDING:
            model.check_embedding()
        elif name != OUTPUT:
            raise UnknownOutput(f"unknown output {name!r}; {model.name} version {model.version} has "
                                f"{', '.join(map(repr, known))}")
        params = parameters(item, f"output {name!r}")
        k = params.get("classification", 0)
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise BadRequest(f"parameters.classification must be a non-negative integer, got {json.dumps(k)}")
        if k and name == EMBEDDING:
            raise BadRequest(f"parameters.classification is for {OUTPUT!r}; {EMBEDDING!r} is a vector per image")
        plan.append((name, k, flag(params, "binary_data", binary_default, f"output {name!r}")))
    return plan


def _output(served: Served, name: str, k: int, digits: int) -> Tensor:
    if name == EMBEDDING:
        embeddings = served.embeddings()
        return Tensor(EMBEDDING, "FP32", list(embeddings.shape), embeddings)
    if not k:
        probabilities = served.probabilities()
        return Tensor(OUTPUT, "FP32", list(probabilities.shape), probabilities)
    rows = [[f"{c.score:.{digits}f}:{c.index}:{c.label}".encode() for c in top] for top in served.top_k(k)]
    return Tensor(OUTPUT, "BYTES", [len(rows), len(rows[0])], np.array(rows, dtype=object))


def _timeout_s(announced_s: float, infer: InferRequest, minimum_ms: float) -> float:
    """The request's deadline: the one its headers announced (``deadline_s``), lowered by its body's ``timeout``
    parameter (tritonclient's per-request timeout, in microseconds; 0 or absent: none, as Triton reads it). A
    value that is no such number is 400, not dropped: the caller meant a deadline; so is one under ``minimum_ms``
    (MIN_REQUEST_TIMEOUT_MS: ShortDeadline)."""
    micros = infer.parameters.get("timeout")
    if micros is None:
        return announced_s
    if isinstance(micros, bool) or not isinstance(micros, (int, float)) or not 0 <= micros < float("inf"):
        raise BadRequest(f"parameters.timeout must be a number of microseconds, 0 or more (0: none), got {micros!r}")
    if micros == 0:
        return announced_s
    if micros >= announced_s * 1e6:  # (a huge int would not divide)
        return announced_s
    check_deadline_floor(micros / 1000, minimum_ms, f"parameters.timeout {micros!r} (microseconds)")
    return micros / 1e6


@bp.post(_MODEL + "/infer")
@bp.post(_VERSIONED + "/infer")
def infer(name: str, version: str | None = None) -> Response:
    """Inference through the same admission, ``Call.infer`` and batcher as /predict. Pixels routed to a canary
    whose input differs from the default's are admitted again, to the default they were shaped for (as the
    model's metadata shows its input)."""
    body: list[bytes] = []  # read once, in the first admission
    try:
        return _infer(name, version, body, pixels=False)
    except PixelsForTheDefault:
        return _infer(name, version, body, pixels=True)


def _infer(name: str, version: str | None, body: list[bytes], pixels: bool) -> Response:
    service, req = current_service(), request._get_current_object()  # not a proxy lookup per field
    headers, floor_ms = req.headers, service.settings.min_request_timeout_ms
    if req.mimetype in FORMS:  # never an inference request: refused before it is admitted or read
        raise UnsupportedMediaType(f"the body is a form ({req.mimetype}), not an inference request: send the image "
                                   "as a BYTES input (base64 in JSON, or binary_tensor_data), or POST the form to "
                                   "/predict")
    # the body may lower it
    announced_timeout_s = request_deadline_s(service, headers)
    arrived = arrival(announced_timeout_s)
    # Admitted only if the queue could take one image in time: refused before the body is parsed otherwise.
    with service.admit(name, version, client_key(headers, service.settings.client_key_header), images=1,
                       timeout_s=announced_timeout_s, pixels=pixels) as call:
        if not body:
            body.append(read_body(req))
        parsed = parse_request(body[0], headers.get("Inference-Header-Content-Length"),
                               _input_check(call, service.settings.max_images))
        plan = _output_plan(parsed, call.model)
        images, tensors = _inputs(parsed)
        served = call.infer(images, tensors, timeout_s=_timeout_s(announced_timeout_s, parsed, floor_ms),
                            client_gone=client_gone(), embedding=any(name == EMBEDDING for name, _, _ in plan),
                            arrived=arrived)
    digits = service.settings.score_digits
    outputs = [_output(served, name, k, digits) for name, k, _ in plan]
    body, header_length = encode_response(model_name=served.model, model_version=served.version,
                                          request_id=parsed.id, outputs=outputs,
                                          binary=[is_binary for _, _, is_binary in plan])
    response = Response(body, content_type="application/json" if header_length is None else "application/octet-stream")
    if header_length is not None:
        response.headers["Inference-Header-Content-Length"] = str(header_length)
    return annotate(response, served)
