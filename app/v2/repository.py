"""The Open Inference Protocol's model repository extension: what tritonclient's ``get_model_repository_index``,
``load_model`` and ``unload_model`` call. A load verifies, warms up and canaries the new versions before they take
traffic; the versions they replace finish their requests first. Under gunicorn the call reaches every worker and
answers once all of them serve the result (app/engine/versions/desired.py)."""
from __future__ import annotations

from typing import Any, Mapping, TypeVar

import pydantic
from flask import Response, request

from app.errors import BadRequest, SchemaViolation
from app.v2.routes import bp
from app.v2.schemas import Loaded, LoadRequest, RepositoryIndex, RepositoryIndexRequest, RepositoryModel, UnloadRequest
from app.web.auth import control_call
from app.web.inputs import parse_json, read_body
from app.web.services import current_service

B = TypeVar("B", bound=pydantic.BaseModel)


def _body(schema: type[B]) -> B:
    data = read_body(request)
    try:
        return schema.model_validate(parse_json(data, "the body") if data.strip() else {})
    except pydantic.ValidationError as exc:
        details = [{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()]
        first = details[0]  # where it is too: "Extra inputs are not permitted" alone named no key
        where = ".".join(str(part) for part in first["loc"])
        raise SchemaViolation(f"the body does not match {schema.__name__}: {where + ': ' if where else ''}"
                              f"{first['msg']}", details=details) from None


def _loaded(name: str, spec: Mapping[str, Any]) -> Response:
    body = Loaded(name=name, versions=spec["versions"], default=spec["default"])
    return Response(body.model_dump_json(), mimetype="application/json")


@bp.post("/repository/index")
def repository_index() -> Response:
    """Every model version in the repository or loaded, with its state (READY, LOADING, UNLOADING, UNAVAILABLE)."""
    only_ready = _body(RepositoryIndexRequest).ready
    overview = current_service().catalog.repository_overview()  # one exchange with an engine process
    roles = overview.roles
    compared = {(name, r["candidate"]): r.get("comparison") for name, r in overview.rollouts.items()}
    rows = [RepositoryModel(name=r.name, version=r.version, state=r.state, reason=r.reason,  # type: ignore[arg-type]
                            default=r.state == "READY" and roles.get((r.name, r.version)) == "live",
                            role=roles.get((r.name, r.version)) if r.state == "READY" else None,
                            comparison=compared.get((r.name, r.version)) if r.state == "READY" else None)
            for r in overview.index if r.state == "READY" or not only_ready]
    return Response(RepositoryIndex(rows).model_dump_json(exclude_none=True), mimetype="application/json")


@bp.post("/repository/models/<name>/load")
@control_call
def load(name: str) -> Response:
    """Load or reload a model as its version policy says; the old versions serve until the new ones are ready."""
    parameters = _body(LoadRequest).parameters
    unknown = sorted(set(parameters) - {"config"})
    if unknown:
        raise BadRequest(f"unsupported load parameters {unknown}: this server takes \"config\" (version_policy, "
                         "default_version); models load from the repository, not from uploaded files")
    return _loaded(name, current_service().catalog.load(name, parameters.get("config")))


@bp.post("/repository/models/<name>/unload")
@control_call
def unload(name: str) -> Response:
    """Stop serving every version of a model once the requests they hold are answered."""
    _body(UnloadRequest)
    return _loaded(name, current_service().catalog.unload(name))
