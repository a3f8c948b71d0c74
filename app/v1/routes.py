"""/predict and /v1/models: read the request, hand it to the engine (``Service.admit``; models through
``Service.catalog``), shape the answer."""
from __future__ import annotations

import urllib.parse
from typing import Any

import pydantic
from flask import Blueprint, Response, request

from app.config import Settings
from app.engine.contract import Ranked, VersionInfo
from app.errors import BadRequest, NotFound, SchemaViolation
from app.v1.payload import LISTED, MODEL, VERSION, check_known, parse_explain, parse_predict, schema_details
from app.v1.schemas import (
    Batching,
    Crop,
    ExplainResponse,
    Rollout,
    RolloutChanged,
    VersionChoice,
    ClassScore,
    Limits,
    ModelInfo,
    ModelRef,
    ModelsResponse,
    PredictResponse,
    WorkerModels,
)
from app.web.auth import control_call
from app.web.inputs import client_key, each_once, parse_json, read_body, request_deadline_s
from app.web.services import arrival, client_gone, current_service
from app.web.timing import annotate
from models.export.manifest import Manifest
from models.export.repository import version_order

bp = Blueprint("v1", __name__)


def _prediction(top: list[Ranked], digits: int) -> dict[str, Any]:
    """One image's ``Prediction`` as the plain data ``PredictResponse.model_validate`` reads."""
    ranked = [{"label": c.label, "index": c.index, "score": round(c.score, digits)} for c in top]
    return {**ranked[0], "top_k": ranked}


@bp.post("/predict")
def predict() -> Response:
    """Classify one or more images."""
    service, req = current_service(), request._get_current_object()  # not a proxy lookup per field
    settings = service.settings
    timeout_s = request_deadline_s(service, req.headers)
    arrived = arrival(timeout_s)
    # (werkzeug's get raises and catches inside for one not given)
    query = each_once(req.args, "query parameter", LISTED)
    # Admitted only if the queue could take one image in time: refused before the body is parsed otherwise.
    with service.admit(query.get(MODEL), query.get(VERSION),
                       client_key(req.headers, settings.client_key_header), images=1, timeout_s=timeout_s) as call:
        parsed = parse_predict(req, query, default_top_k=settings.top_k, num_classes=call.model.num_classes,
                               max_images=settings.max_images)
        served = call.infer(parsed.images, names=parsed.names or (), client_gone=client_gone(), timeout_s=timeout_s,
                            embedding=parsed.embedding, arrived=arrived)
    predictions = ([_prediction(top, settings.score_digits) for top in served.top_k(parsed.top_k)] if parsed.labels
                   else None)
    # the answer validated in one call (its models made in pydantic's core), not a model made per class and image:
    # 10 against 14.6 us for one image's top 5, 119 against 184 for 16 images'
    body = PredictResponse.model_validate({
        "model": {"name": served.model, "version": served.version}, "predictions": predictions,
        "embeddings": served.embeddings().tolist() if parsed.embedding else None})
    return annotate(Response(body.model_dump_json(exclude_none=True), content_type="application/json"), served)


@bp.post("/explain")
def explain() -> Response:
    """Why the model chooses a class for one image: a Grad-CAM map as JSON, or drawn over the photo as a PNG."""
    service = current_service()
    timeout_s = request_deadline_s(service, request.headers)
    arrival(timeout_s)  # (an explanation's deadline counts from here: it passed already, 504)
    name, version = request.args.get("model"), request.args.get("version")
    service.require_ready()
    # The version whose labels the class is read with is the one that explains (named, so no canary draws it)
    signature = service.catalog.signature(name, version)
    parsed = parse_explain(request, signature.labels, service.settings.max_images)
    found = service.explain(parsed.image, signature.name, signature.version, parsed.index, png=parsed.png,
                            timeout_s=timeout_s)
    said = {"X-Explained-Class": urllib.parse.quote(found.label), "X-Explained-Index": str(found.index),
            "X-Explained-Score": f"{found.score:.{service.settings.score_digits}f}", "X-Model-Version": found.version}
    if parsed.png:
        return Response(found.png, mimetype="image/png", headers=said)
    body = ExplainResponse(model=ModelRef(name=found.model, version=found.version),
                           explained=ClassScore(label=found.label, index=found.index,
                                                score=round(found.score, service.settings.score_digits)),
                           method=found.method, layer=found.layer, weights=found.weights, grid=found.grid,
                           crop=Crop(**dict(zip(("left", "top", "right", "bottom"), found.crop))),
                           explain_ms=round(found.explain_ms, 1))
    return Response(body.model_dump_json(), mimetype="application/json", headers=said)


def _file_checksums(manifest: Manifest) -> dict[str, str]:
    """The sha256 of every weights file the export holds, whichever one serves: each format's (by its name), the ONNX
    file's (``onnx``) and each compiled package's (by its file name)."""
    found = {fmt: entry.sha256 for fmt, entry in manifest.files.items()}
    if manifest.onnx is not None:
        found["onnx"] = manifest.onnx.sha256
    found.update({package.path: package.sha256 for package in manifest.packages})
    return found


def _model_info(settings: Settings, info: VersionInfo, ready: bool, show_labels: bool) -> ModelInfo:
    s, m = settings, info.manifest
    device_type = info.device.partition(":")[0]  # cpu, cuda
    return ModelInfo(
        name=m.name, version=m.version, arch=m.arch, num_classes=m.num_classes,
        input_shape=list(m.preprocess.input_shape), preprocess=m.preprocess, format=info.weights_format,
        device=info.device, dtype=info.dtype, memory_format=info.memory_format,
        files=_file_checksums(m), metrics=m.metrics, source=m.source,
        embedding=m.embedding,
        warmed_batch_sizes=info.warmed_batch_sizes, labels=m.labels if show_labels else None,
        ready=ready and info.alive, default=info.default, state="READY", role=info.role,
        memory_bytes=info.memory_bytes, device_memory_bytes=info.device_memory_bytes, monitoring=info.monitoring,
        batching=Batching(max_batch_size=s.batch_ceiling(device_type), batch_cap=info.batch_cap,
                          profile={k: round(v, 1) for k, v in info.profile.items()}, max_wait_ms=s.max_wait_ms,
                          current_max_batch_size=info.current_max_batch_size,
                          queue_size=s.resolved_queue_size(device_type), queue_depth=info.queue_depth),
        limits=Limits(max_body_bytes=s.max_body_bytes, max_pixels=s.max_pixels, max_images=s.max_images,
                      max_aspect_ratio=s.max_aspect_ratio, default_top_k=s.top_k,
                      request_timeout_s=s.request_timeout_s))


@bp.get("/v1/models")
def models() -> Response:
    """Every loaded model version: metadata, device and dtype, memory, batching; and what each worker serves."""
    return _models()


@bp.get("/v1/models/<name>")
def model(name: str) -> Response:
    """``models`` of one model: its loaded versions, its rollout, and what each worker serves of it."""
    return _models(name)


LABELS_SHOWN, LABELS_LEFT_OUT = ("1", "true", "yes"), ("0", "false", "no")  # ?labels=, in any case


def _labels_asked() -> bool:
    """Whether ``?labels=`` asks for each version's labels; BadRequest for another parameter or value (before: a
    misspelt ``?label=1`` or ``?labels=all`` answered without them, unsaid)."""
    check_known(request.args.keys(), {"labels"}, "query parameter")
    said = each_once(request.args, "query parameter").get("labels")  # (given twice: its first value, unsaid)
    if said is None or said.lower() in LABELS_LEFT_OUT:
        return False
    if said.lower() not in LABELS_SHOWN:
        raise BadRequest(f"labels must be one of {', '.join(LABELS_SHOWN + LABELS_LEFT_OUT)}, got {said!r}")
    return True


def _loaded_models(versions: list[VersionInfo]) -> list[dict[str, object]]:
    """Each model loaded, with its versions and default: a 404 ``not_found``'s ``details.models``, in the shape
    every other one has (before: names alone here, objects on /predict's; a multi-model operator's trial)."""
    models: dict[str, dict[str, Any]] = {}
    for info in versions:
        model = models.setdefault(info.manifest.name, {"name": info.manifest.name, "versions": [], "default": None})
        model["versions"].append(info.manifest.version)
        if info.default:
            model["default"] = info.manifest.version
    return [{**model, "versions": sorted(model["versions"], key=version_order)} for _, model in sorted(models.items())]


def _models(name: str | None = None) -> Response:
    """GET /v1/models's answer, of model ``name`` alone when given (NotFound, 404, when none of it is loaded)."""
    show_labels = _labels_asked()
    service = current_service()
    service.require_loaded()
    overview = service.catalog.overview()
    versions = [info for info in overview.versions if name is None or info.manifest.name == name]
    if name is not None and not versions:  # (the listing of nothing loaded is an empty one)
        raise NotFound(f"no model {name!r} is loaded; GET /v1/models lists those that are",
                       details={"models": _loaded_models(overview.versions)})
    ready = service.ready  # once: under ENGINE=process a look at the engine's state
    infos = [_model_info(service.settings, info, ready, show_labels) for info in versions]
    workers = [WorkerModels(**{**worker, "models": _of_model(worker.get("models") or {}, name)})
               for worker in overview.workers]
    default_model = overview.default_model
    rollouts = [Rollout(model=model_name, **rollout) for model_name, rollout in overview.rollouts.items()
                if name is None or model_name == name]
    # Every documented field is there, null where it says "null: none" (a client reads rollout["comparison"] before
    # the shadow compared anything); only the labels are left out unless asked for.
    hidden = None if show_labels else {"models": {"__all__": {"labels"}}}
    body = ModelsResponse(default_model=default_model, models=infos, workers=workers, rollouts=rollouts)
    return Response(body.model_dump_json(exclude=hidden), mimetype="application/json")


def _of_model(served: dict[str, Any], name: str | None) -> dict[str, Any]:
    """What a worker serves (name -> versions and default), of model ``name`` alone when given."""
    return served if name is None else {model: what for model, what in served.items() if model == name}


def _version_named() -> str | None:
    """The optional ``{"version": "3"}`` body of a promote or rollback call."""
    data = read_body(request)
    try:
        return VersionChoice.model_validate(parse_json(data, "the body") if data.strip() else {}).version
    except pydantic.ValidationError as exc:  # (422 as every body that does not match its schema)
        details = schema_details(exc, {"model_type": "Input should be a JSON object"})
        raise SchemaViolation(f'the body must be empty or {{"version": "<version>"}}: {details[0]["msg"]}',
                              details=details) from None


def _rollout_call(name: str, action: str) -> Response:
    """The catalog's ``promote`` or ``rollback`` with the body's optional version; answers the model as it is now."""
    version = _version_named()
    entry = getattr(current_service().catalog, action)(name, version)
    body = RolloutChanged(name=name, default=str(entry["default"]), versions=list(entry["versions"]),
                          previous=entry.get("previous_default"), rolled_back=list(entry.get("rolled_back", [])))
    return Response(body.model_dump_json(), mimetype="application/json")


@bp.post("/v1/models/<name>/promote")
@control_call
def promote(name: str) -> Response:
    """Make a version (default: the rollout's candidate) the model's default in every worker."""
    return _rollout_call(name, "promote")


@bp.post("/v1/models/<name>/rollback")
@control_call
def rollback(name: str) -> Response:
    """Serve a version (default: the previous default) again in every worker; the one it replaces is rolled back."""
    return _rollout_call(name, "rollback")
