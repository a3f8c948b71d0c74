"""/openapi.json is a valid OpenAPI 3.1 document, covers every route, and every answer matches it; /docs is offline."""
from __future__ import annotations

import base64
import io
import re
import threading
from typing import Any, Iterator

import jsonschema
import pytest
from flask import Flask
from flask.testing import FlaskClient
from openapi_spec_validator import validate

from app import EXTENSION_KEY

from app.factory import create_app
from app.config import Settings
from app.engine.loaded.predictor import Predictor
from app.engine.service import Service
from app.metrics import PROBES
from tests.support.answers import error_of
from tests.support.fakes import ColourModel, ConvColourModel, loading_app, tiny_manifest
from tests.support.imaging import RED, image_bytes

RED_B64 = base64.b64encode(image_bytes(RED)).decode()
V2_IMAGES = {"inputs": [{"name": "images", "datatype": "BYTES", "shape": [1], "data": [RED_B64]}]}
V2_TIFF = {"inputs": [{"name": "images", "datatype": "BYTES", "shape": [1],
                       "data": [base64.b64encode(image_bytes(RED, fmt="TIFF")).decode()]}]}

# (method, documented path, concrete URL, request keyword arguments)
CALLS: list[tuple[str, str, str, dict[str, Any]]] = [
    ("post", "/predict", "/predict?top_k=2", {"data": image_bytes(RED), "content_type": "image/jpeg"}),
    ("post", "/predict", "/predict", {"json": {"images": [RED_B64], "top_k": 1}}),
    ("post", "/predict", "/predict", {"data": b"not an image", "content_type": "image/jpeg"}),
    ("post", "/predict", "/predict", {"json": {"images": [RED_B64] * 99}}),
    ("post", "/predict", "/predict", {"data": "x", "content_type": "text/plain"}),
    ("post", "/predict", "/predict", {"json": {"images": "nope"}}),
    ("get", "/healthz", "/healthz", {}),
    ("get", "/readyz", "/readyz", {}),
    ("get", "/v1/models", "/v1/models", {}),
    ("get", "/v1/models", "/v1/models?labels=1", {}),
    ("get", "/openapi.json", "/openapi.json", {}),
    ("get", "/metrics", "/metrics", {}),
    ("get", "/v2", "/v2", {}),
    ("get", "/v2/health/live", "/v2/health/live", {}),
    ("get", "/v2/health/ready", "/v2/health/ready", {}),
    ("get", "/v2/models/{name}", "/v2/models/colour", {}),
    ("get", "/v2/models/{name}", "/v2/models/other", {}),
    ("get", "/v2/models/{name}/versions/{version}", "/v2/models/colour/versions/test", {}),
    ("get", "/v2/models/{name}/ready", "/v2/models/colour/ready", {}),
    ("get", "/v2/models/{name}/versions/{version}/ready", "/v2/models/colour/versions/test/ready", {}),
    ("post", "/v2/models/{name}/infer", "/v2/models/colour/infer", {"json": V2_IMAGES}),
    ("post", "/v2/models/{name}/versions/{version}/infer", "/v2/models/colour/versions/test/infer",
     {"json": {**V2_IMAGES, "outputs": [{"name": "probabilities", "parameters": {"classification": 2}}]}}),
    ("post", "/v2/models/{name}/infer", "/v2/models/colour/infer", {"json": {"inputs": []}}),
    ("post", "/v2/models/{name}/infer", "/v2/models/colour/infer", {"json": V2_TIFF}),  # 415: a format not served
    ("post", "/v2/models/{name}/versions/{version}/infer", "/v2/models/colour/versions/test/infer",
     {"json": V2_TIFF}),
]

# (method, documented path or None for a path the server does not have, concrete URL, request keyword arguments):
# refusals of names, unknown models and versions, methods and paths, HEAD, and the demo page's own answers.
EDGES: list[tuple[str, str | None, str, dict[str, Any]]] = [
    ("get", "/v2/models/{name}/ready", "/v2/models/nope/ready", {}),
    ("get", "/v2/models/{name}/ready", "/v2/models/%E2%98%83/ready", {}),
    ("get", "/v2/models/{name}/versions/{version}/ready", "/v2/models/colour/versions/nope/ready", {}),
    ("get", "/v2/models/{name}/versions/{version}/ready", "/v2/models/colour/versions/%E2%98%83/ready", {}),
    ("get", "/v2/models/{name}", "/v2/models/%E2%98%83", {}),
    ("get", "/v2/models/{name}/versions/{version}", "/v2/models/colour/versions/nope", {}),
    ("get", "/v2/models/{name}/versions/{version}", "/v2/models/colour/versions/%E2%98%83", {}),
    ("post", "/v2/models/{name}/infer", "/v2/models/%E2%98%83/infer", {"json": V2_IMAGES}),
    ("post", "/explain", "/explain", {"data": image_bytes(RED), "content_type": "image/jpeg"}),
    ("post", "/explain", "/explain?class_index=abc", {"data": image_bytes(RED), "content_type": "image/jpeg"}),
    ("post", "/v1/models/{name}/promote", "/v1/models/colour/promote", {}),
    ("post", "/v1/models/{name}/rollback", "/v1/models/colour/rollback", {"json": {"version": 1.5}}),
    ("post", "/v1/models/{name}/promote", "/v1/models/nope/promote", {"data": b"nope",
                                                                      "content_type": "application/json"}),
    ("post", "/v2/repository/index", "/v2/repository/index", {"json": {}}),
    ("post", "/v2/repository/index", "/v2/repository/index", {"json": {"ready": "x"}}),
    ("post", "/v2/repository/models/{name}/load", "/v2/repository/models/nope/load", {}),
    ("post", "/v2/repository/models/{name}/unload", "/v2/repository/models/nope/unload", {}),
    ("head", "/v1/models", "/v1/models", {}),
    ("head", "/healthz", "/healthz", {}),
    ("get", "/predict", "/predict", {}),
    ("head", "/predict", "/predict", {}),
    ("delete", "/v1/models", "/v1/models", {}),
    ("get", "/v2/models/{name}/infer", "/v2/models/colour/infer", {}),
    ("get", None, "/nope", {}),
    ("post", None, "/v2/nope", {}),
    ("get", None, "/%FF", {}),
    ("get", "/", "/", {}),
    ("get", "/", "/", {"headers": {"Range": "bytes=0-10"}}),
    ("get", "/", "/", {"headers": {"Range": "bytes=999999-"}}),
    ("get", "/favicon.ico", "/favicon.ico", {"headers": {"If-Modified-Since": "Wed, 21 Oct 2099 07:28:00 GMT"}}),
    ("get", "/favicon.ico", "/favicon.ico", {"headers": {"Range": "bytes=0-3"}}),
    ("get", "/favicon.ico", "/favicon.ico", {"headers": {"Range": "items=0-3"}}),
]


def test_a_range_of_another_unit_or_of_several_is_ignored_and_one_of_bytes_answered(client: FlaskClient) -> None:
    # Before: werkzeug answered Range: items=0-5 416; RFC 9110 14.2: an origin server must ignore a unit it does not
    # understand (a schema fuzz of the API), and may ignore several ranges (a review: /docs's files too)
    whole = client.get("/favicon.ico")
    for path in ("/favicon.ico", "/"):
        answer = client.get(path, headers={"Range": "items=0-5"})
        assert answer.status_code == 200 and "Content-Range" not in answer.headers, path
    assert client.get("/favicon.ico", headers={"Range": "items=0-5"}).data == whole.data
    several = client.get("/favicon.ico", headers={"Range": "bytes=0-1,4-5"})  # (werkzeug's 416; RFC 9110: may)
    assert several.status_code == 200 and several.data == whole.data
    docs_file = client.get("/docs/swagger-ui.css", headers={"Range": "items=0-5"})
    assert docs_file.status_code == 200, docs_file.status_code
    ranged = client.get("/favicon.ico", headers={"Range": "bytes=0-5"})
    assert ranged.status_code == 206 and ranged.data == whole.data[:6]
    assert client.get("/favicon.ico", headers={"Range": "bytes=99999-"}).status_code == 416


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    from app.factory import default_protocols
    from app.web.openapi import openapi_document

    return openapi_document(default_protocols())


_REFUSALS = {405: "MethodNotAllowed", 404: "NotFound"}  # what a path answers to a method it does not take, or
# a path the server does not have: no operation holds them, so the document's components do


def _documented(document: dict[str, Any], method: str, path: str | None, status: int) -> dict[str, Any]:
    """The documented response of ``method`` on ``path`` (a template; None: a path the server does not have) for
    ``status``: HEAD is answered as GET is, without a body."""
    operations = document["paths"].get(path, {}) if path is not None else {}
    operation = operations.get("get" if method == "head" and "get" in operations else method)
    if operation is None:
        assert status in _REFUSALS, f"{method.upper()} {path} answered {status}, which is not documented"
        return document["components"]["responses"][_REFUSALS[status]]
    spec = operation["responses"].get(str(status))
    assert spec is not None, f"{method.upper()} {path} answered {status}, which is not documented"
    return spec


def _check(document: dict[str, Any], method: str, path: str | None, response: Any) -> None:
    spec = _documented(document, method, path, response.status_code)
    # Every documented header is sent, except the binary framing one, which only binary answers carry.
    for header in set(spec.get("headers", {})) - {"Inference-Header-Content-Length"}:
        assert header in response.headers, f"{path} {response.status_code} lacks {header}"
    # and every header of the service's own it sends is documented (Before: /explain's X-Explained-* were not)
    for header in {name for name, _ in response.headers if name.startswith("X-")} - {"X-Request-ID"}:
        assert header in spec.get("headers", {}), f"{path} {response.status_code} sends {header}, not documented"
    if "content" not in spec or method == "head":
        assert response.get_data() == b"", f"{method.upper()} {path} {response.status_code} has a body"
        return
    media = spec["content"].get(response.mimetype)
    assert media is not None, f"{path} answered {response.mimetype}, documented {list(spec['content'])}"
    if response.mimetype == "application/json":
        schema = {**media["schema"], "components": document["components"]}
        jsonschema.Draft202012Validator(schema).validate(response.get_json())


def test_document_is_valid_openapi_3_1(document: dict[str, Any]) -> None:
    assert document["openapi"].startswith("3.1")
    validate(document)


def test_no_schema_has_a_null_default(document: dict[str, Any]) -> None:
    # Before: every optional field had "default": null, which openapi-typescript reads as always there: the documented
    # minimal /predict JSON (only "images") failed to type-check, and absent answer fields were typed as null (a web
    # developer's trial)
    def defaults(schema: Any) -> Iterator[Any]:
        if isinstance(schema, dict):
            if "default" in schema:
                yield schema["default"]
            for value in schema.values():
                yield from defaults(value)
        elif isinstance(schema, list):
            for value in schema:
                yield from defaults(value)

    assert None not in list(defaults(document))
    request = document["components"]["schemas"]["PredictJSONRequest"]
    assert request["required"] == ["images"] and "default" not in request["properties"]["top_k"]


def test_every_operation_has_its_own_name_and_takes_the_caller_s_request_id(document: dict[str, Any]) -> None:
    # Before: no operationId (generated clients named functions after paths: postV2ModelsByNameVersionsByVersionInfer)
    # and X-Request-ID undeclared, so a generated client could not send it (a web developer's trial)
    operations = [op for item in document["paths"].values() for method, op in item.items() if method in ("get", "post")]
    names = [op["operationId"] for op in operations]
    assert len(names) == len(set(names)) == 26 and all(re.fullmatch(r"[a-z][a-z0-9_]*", name) for name in names)
    assert {"predict", "explain", "v2_infer", "v2_infer_version", "v2_load_model", "readiness"} <= set(names)
    for op in operations:
        (said,) = [p for p in op["parameters"] if p["name"] == "X-Request-ID"]
        assert said["in"] == "header" and not said["required"] and re.fullmatch(said["schema"]["pattern"], "abc-1")


def test_parameters_say_the_values_the_server_takes(client: FlaskClient, document: dict[str, Any]) -> None:
    # Before: model and version names and ?labels= were any string in the document, the server refusing most with a
    # 400 (a contract fuzzer "mostly rejected" them; an API contract trial).
    def schema(path: str, method: str, name: str) -> dict[str, Any]:
        item = document["paths"][path]
        params = item[method].get("parameters", []) + item.get("parameters", [])
        return next(p["schema"] for p in params if p["name"] == name)

    for path, method, name in (("/predict", "post", "model"), ("/predict", "post", "version"),
                               ("/v1/models/{name}", "get", "name"), ("/v2/models/{name}/versions/{version}/infer",
                                                                      "post", "version")):
        pattern = re.compile(schema(path, method, name)["pattern"])
        assert pattern.fullmatch("colour") and pattern.fullmatch("2.1_b") and not pattern.search("a b")
    assert error_of(client.post("/predict?model=a%20b", data=image_bytes(RED), content_type="image/jpeg"), 400,
                    "invalid_request")
    labels = re.compile(schema("/v1/models", "get", "labels")["pattern"])
    for value, taken in (("TRUE", True), ("no", True), ("1", True), ("maybe", False), ("true ", False)):
        assert bool(labels.fullmatch(value)) == taken == (client.get(f"/v1/models?labels={value}").status_code == 200)


def test_every_route_is_documented(app: Flask, document: dict[str, Any]) -> None:
    routes = {re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule) for rule in app.url_map.iter_rules()
              if not rule.endpoint.endswith("static") and not rule.endpoint.startswith("swagger_ui")}
    assert routes == set(document["paths"])


def test_every_answer_matches_its_documented_schema(client: FlaskClient, service: Service,
                                                    document: dict[str, Any]) -> None:
    statuses = set()
    for method, path, url, kwargs in CALLS + EDGES:
        answer = client.open(url, method=method.upper(), **kwargs)
        _check(document, method, path, answer)
        statuses.add(answer.status_code)
    assert {200, 206, 304, 400, 404, 405, 409, 413, 415, 416, 422} <= statuses  # the edges reach what they are for
    service.begin_drain()  # the 503 forms
    for method, path, url, kwargs in CALLS + EDGES:
        _check(document, method, path, client.open(url, method=method.upper(), **kwargs))


def test_embeddings_and_explanations_match_their_documented_schemas(settings: Settings,
                                                                    document: dict[str, Any]) -> None:
    for model, manifest in ((ColourModel(embedding=True), tiny_manifest(embedding=True)),
                            (ConvColourModel(), tiny_manifest())):
        app = create_app(settings, Predictor(model, manifest, device="cpu"))
        try:
            client = app.test_client()
            red = {"data": image_bytes(RED, size=(32, 24)), "content_type": "image/jpeg"}
            embeds = manifest.embedding is not None
            for url, status in (("/predict?outputs=embedding", 200 if embeds else 400),
                                ("/predict?outputs=labels,embedding", 200 if embeds else 400),
                                ("/predict?outputs=x", 400)):
                answer = client.post(url, **red)
                assert answer.status_code == status, answer.data[:200]
                _check(document, "post", "/predict", answer)
            for url, status in (("/explain", 422 if embeds else 200),  # ColourModel has no feature map
                                ("/explain?format=png&label=green", 422 if embeds else 200),
                                ("/explain?class_index=9", 400)):
                answer = client.post(url, **red)
                assert answer.status_code == status, answer.data[:200]
                _check(document, "post", "/explain", answer)
        finally:
            app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_v2_infer_documents_every_status_predict_does_but_its_json_schema_s(document: dict[str, Any]) -> None:
    # Both run the same admission, decode and Call.infer, so what one can answer the other can; /predict alone has
    # a JSON schema (422). Before: V2 infer left out 415, which an image format no decoder serves (TIFF) answers.
    predict = set(document["paths"]["/predict"]["post"]["responses"]) - {"422"}
    for path in ("/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}/infer"):
        assert set(document["paths"][path]["post"]["responses"]) == predict, path


@pytest.mark.parametrize("schema, field, where", [
    ("InferRequest", "output", lambda body: body), ("InferInput", "mask", lambda body: body["inputs"][0]),
    ("RequestedOutput", "binary", lambda body: body["outputs"][0])])
def test_the_v2_request_schemas_refuse_what_the_server_refuses_and_take_what_it_takes(
        client: FlaskClient, document: dict[str, Any], schema: str, field: str, where: Any) -> None:
    # Before: no additionalProperties in them, model_name and model_version left out: a client generated from the
    # document took an unknown field for one allowed, which the server refuses (a raw V2 client's trial)
    schemas = document["components"]["schemas"]
    assert schemas[schema]["additionalProperties"] is False
    assert {"model_name", "model_version"} <= set(schemas["InferRequest"]["properties"])
    body = {"inputs": [{"name": "images", "datatype": "BYTES", "shape": [1],
                        "data": [base64.b64encode(image_bytes(RED)).decode()]}],
            "outputs": [{"name": "probabilities"}], "model_name": "colour", "model_version": "test"}
    assert client.post("/v2/models/colour/infer", json=body).status_code == 200
    where(body)[field] = 1
    answer = client.post("/v2/models/colour/infer", json=body)
    assert answer.status_code == 400 and f"unknown field {field!r}" in answer.get_json()["error"]


def test_a_response_that_strays_from_its_schema_fails_the_check(client: FlaskClient,
                                                                 document: dict[str, Any]) -> None:
    response = client.get("/v1/models")
    response.set_data(response.get_data().replace(b'"num_classes":4', b'"num_classes":"four"'))
    with pytest.raises(jsonschema.ValidationError):
        _check(document, "get", "/v1/models", response)


def test_docs_page_works_offline_and_without_a_key(settings: Settings, predictor: Predictor) -> None:
    app = create_app(Settings.model_validate({**settings.model_dump(), "api_key": "s3cret"}), predictor)
    try:
        client = app.test_client()
        page = client.get("/docs/")
        assert page.status_code == 200 and page.mimetype == "text/html"
        html = page.get_data(as_text=True)
        assert "/openapi.json" in html and not re.search(r"""(src|href)=["']https?://""", html)
        assert client.get("/docs/swagger-ui-bundle.js").status_code == 200
        # /docs to /docs/ by a Location of this server's, whatever Host says (before: werkzeug's absolute one,
        # http://evil.example/docs/, a client's to set; a security review)
        moved = client.get("/docs?x=1", headers={"Host": "evil.example"})
        assert (moved.status_code, moved.headers["Location"], moved.get_data()) == (308, "/docs/?x=1", b"")
        assert client.get("/docs", follow_redirects=True).request.path == "/docs/"
        assert client.get("/openapi.json").status_code == 200
        assert client.get("/v1/models").status_code == 401
        # The demo page too: open, offline, and counted as a page rather than as traffic.
        page = client.get("/")
        assert page.status_code == 200 and page.mimetype == "text/html"
        html = page.get_data(as_text=True)
        assert 'src="/demo/demo.js"' in html and not re.search(r"""(src|href)=["']https?://""", html)
        for asset, mimetype in (("/demo/demo.js", "text/javascript"), ("/demo/demo.css", "text/css")):
            answer = client.get(asset)
            assert answer.status_code == 200 and answer.mimetype == mimetype
        before = PROBES.labels("/", "200")._value.get()
        client.get("/")
        assert PROBES.labels("/", "200")._value.get() == before + 1
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_docs_try_it_out_offers_file_pickers_and_working_examples(client: FlaskClient,
                                                                  document: dict[str, Any]) -> None:
    # Before: the multipart form had text boxes instead of a file picker (no format: binary, which Swagger UI
    # needs for array items), and a top_k form box pre-filled with 0, so "Try it out" answered 400.
    body = document["paths"]["/predict"]["post"]["requestBody"]["content"]
    multipart = body["multipart/form-data"]["schema"]
    assert multipart["properties"]["image"]["items"]["format"] == "binary"
    assert set(multipart["properties"]) == {"image"}
    for raw in ("image/*", "application/octet-stream"):
        assert body[raw]["schema"]["format"] == "binary"
    (top_k,) = [p for p in document["paths"]["/predict"]["post"]["parameters"] if p["name"] == "top_k"]
    assert "default" not in top_k["schema"] and "example" not in top_k
    # What the pickers send, and the JSON example as Swagger UI would send it, are answered 200.
    picked = client.post("/predict", data={"image": [(io.BytesIO(image_bytes()), "photo.jpg")]})
    assert picked.status_code == 200, picked.get_json()
    example = client.post("/predict", json=body["application/json"]["example"])
    assert example.status_code == 200, example.get_json()


def test_every_answer_about_a_rollout_matches_its_documented_schema(settings: Settings,
                                                                      document: dict[str, Any]) -> None:
    # /v1/models documents every rollout field as required and nullable ("null: none now"): before the shadow has
    # compared anything, after a promotion (no candidate), after a rollback, each answer must carry them all.
    from tests.support.fakes import ColourModel, FakeRepository

    repository = FakeRepository()
    repository.add("colour", "1")
    repository.held["colour"]["2"] = ColourModel()
    repository.stamps[("colour", "2")] = 1
    repository.policies["colour"] = {"rollout": {"shadow_percent": 100}}
    app = create_app(settings, source=repository)  # type: ignore[arg-type]
    client = app.test_client()
    calls = [("get", "/v1/models", "/v1/models", {}),
             ("post", "/v2/repository/index", "/v2/repository/index", {"json": {}}),
             ("post", "/v1/models/{name}/promote", "/v1/models/colour/promote", {}),
             ("get", "/v1/models", "/v1/models", {}),
             ("post", "/v1/models/{name}/promote", "/v1/models/colour/promote", {}),  # 409: no candidate left
             ("post", "/v1/models/{name}/rollback", "/v1/models/colour/rollback", {}),
             ("get", "/v1/models", "/v1/models?labels=1", {}),
             ("post", "/v1/models/{name}/rollback", "/v1/models/nope/rollback", {}),
             ("post", "/v2/repository/models/{name}/load", "/v2/repository/models/colour/load", {"json": {}}),
             ("post", "/v2/repository/models/{name}/unload", "/v2/repository/models/colour/unload", {}),
             ("post", "/v2/repository/index", "/v2/repository/index", {"json": {"ready": True}})]
    try:
        first = client.get("/v1/models").get_json()["rollouts"][0]
        assert first["comparison"] is None and first["candidate"] == "2" and "watch" in first
        for method, path, url, kwargs in calls:
            _check(document, method, path, getattr(client, method)(url, **kwargs))
        assert client.post("/v1/models/colour/promote").status_code == 404  # unloaded now
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


_PAGES = frozenset({"/", "/openapi.json", "/favicon.ico"})  # open whatever the key (app/web/auth.py)
# a model's V2 readiness is a health endpoint too (before: 401 without the key, read by tritonclient as not ready)
_HEALTH = frozenset({"/healthz", "/readyz", "/metrics", "/v2/health/live", "/v2/health/ready",
                     "/v2/models/{name}/ready", "/v2/models/{name}/versions/{version}/ready"})
_METHODS = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})


def _operations(document: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(method, documented path, a concrete URL of it) for every operation the document lists."""
    return [(method, path, path.replace("{name}", "colour").replace("{version}", "test"))
            for path, item in document["paths"].items() for method in item if method in _METHODS]


def _app_with(settings: Settings, predictor: Predictor, **changes: Any) -> Flask:
    return create_app(Settings.model_validate({**settings.model_dump(), **changes}), predictor)


@pytest.mark.parametrize("health_open", [False, True])
def test_every_operation_asks_for_the_api_key_as_documented(settings: Settings, predictor: Predictor,
                                                            document: dict[str, Any], health_open: bool) -> None:
    # Before: 401 was documented on the POST routes only: no GET (/v1/models, /v2...) said it, nor the health paths
    # when AUTH_HEALTH_OPEN is off.
    app = _app_with(settings, predictor, api_key="s3cret", auth_health_open=health_open)
    try:
        client = app.test_client()
        for method, path, url in _operations(document):
            answer = client.open(url, method=method.upper())
            keyless = path in _PAGES or (health_open and path in _HEALTH)
            assert (answer.status_code == 401) is not keyless, (method, path, answer.status_code)
            _check(document, method, path, answer)
        head = client.head("/v1/models")
        assert head.status_code == 401
        _check(document, "head", "/v1/models", head)
        # a path the server does not have: the key is asked first there too (the document's description says so)
        assert client.get("/nope").get_json()["error"]["code"] == "unauthorized"
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_every_operation_refuses_a_body_over_the_limit_as_documented(client: FlaskClient, settings: Settings,
                                                                      document: dict[str, Any]) -> None:
    # Before: 413 was documented on /predict and the V2 infer routes only; app/web/hooks.py refuses an announced
    # body over MAX_BODY_BYTES on every route.
    for method, path, url in _operations(document):
        answer = client.open(url, method=method.upper(), data=b"\0" * (settings.max_body_bytes + 1),
                             content_type="application/json")
        assert answer.status_code == 413, (method, path, answer.status_code)
        _check(document, method, path, answer)


class _StalledBody:
    """A request body whose client stopped sending: every read times out as the socket's would."""

    def read(self, *_: Any) -> bytes:
        raise TimeoutError("timed out")

    readline = read


def test_every_operation_that_reads_a_body_answers_a_stalled_one_408_as_documented(
        client: FlaskClient, document: dict[str, Any]) -> None:
    # Before: 408 was documented on /predict and the V2 infer routes only, not on /explain, promote and rollback or
    # the repository calls, which read their bodies too.
    for method, path, url in _operations(document):
        # a worker's loop reads a body announced on any route, a GET's too: one that stalls is its 408 there
        # (tests/server/test_http_framing.py), which the document says (before: on the operations that read one)
        assert "408" in document["paths"][path][method]["responses"], (method, path)
        if method != "post":
            continue
        answer = client.post(url, content_type="application/json", headers={"Content-Length": "100"},
                             environ_overrides={"wsgi.input": _StalledBody(), "wsgi.input_terminated": True})
        assert answer.status_code == 408, (path, answer.status_code, answer.data[:200])
        _check(document, method, path, answer)


def test_every_answer_while_the_models_load_matches_the_document(settings: Settings,
                                                                 document: dict[str, Any]) -> None:
    # Before: GET /v1/models and GET /v2/models/{name}[/versions/{v}] answered an undocumented 503 while loading.
    with loading_app(settings) as loading:  # the load waits until the test is done
        client = loading.app.test_client()
        image = {"data": image_bytes(RED), "content_type": "image/jpeg"}
        bodies = {"/predict": image, "/explain": image, "/v2/models/{name}/infer": {"json": V2_IMAGES},
                  "/v2/models/{name}/versions/{version}/infer": {"json": V2_IMAGES}}
        statuses = {}
        for method, path, url in _operations(document):
            if "/promote" in path or "/rollback" in path or "/repository/models/" in path:
                continue  # these wait for the load to end (the change lock)
            answer = client.open(url.replace("/test", "/1"), method=method.upper(), **bodies.get(path, {}))
            _check(document, method, path, answer)
            statuses[path] = answer.status_code
        for path in ("/v1/models", "/v2/models/{name}", "/v2/models/{name}/versions/{version}", "/predict",
                     "/readyz"):
            assert statuses[path] == 503, statuses
        assert not loading.failures


def test_every_answer_of_a_worker_still_starting_matches_the_document(document: dict[str, Any]) -> None:
    # Before: a worker's first seconds (app/hosting/starting.py) answered /openapi.json, /metrics, /v2 and the
    # repository index 503, which the document did not list, and a model's V2 readiness in the error shape, not
    # ModelReady's (a new user's trial).
    from werkzeug.test import Client

    from app.hosting.starting import StartingApp

    opened = threading.Event()

    def load() -> Any:
        opened.wait(30)  # never built in this test: the worker stays starting
        raise RuntimeError("not built")

    starting = StartingApp(load, on_error=lambda exc: None, max_body_bytes=1000).start()
    client = Client(starting)
    try:
        for method, path, url in _operations(document):
            answer = client.open(url, method=method.upper())
            response = Flask.response_class(answer.get_data(), status=answer.status, headers=answer.headers)
            _check(document, method, path, response)
    finally:
        opened.set()
