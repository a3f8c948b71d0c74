"""Every error status: the full list of bad inputs, limits, deadlines, auth, overload and failures, each answered with
its code and the next good request still served; through the app factory with the fake colour model."""
from __future__ import annotations

import base64
import io
import logging
import re
import struct
import threading
import time
import zlib
from unittest import mock
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flask.testing import FlaskClient
from gunicorn.http.errors import NoMoreData
from PIL import Image
from werkzeug.test import TestResponse

from app import EXTENSION_KEY

from app.factory import create_app
from app.config import Settings
from app.engine.loaded.predictor import Predictor
from app.engine.service import Service
from tests.support.answers import error_of, labels_of
from tests.support.fakes import ColourModel, wait_until
from tests.support.imaging import BLUE, RED, encode, image_bytes


def _ok(client: FlaskClient) -> None:
    """The server still answers a good request correctly."""
    response = client.post("/predict", data=image_bytes(BLUE), content_type="image/jpeg")
    assert response.status_code == 200 and response.get_json()["predictions"][0]["label"] == "blue"


def _png_header_only(width: int, height: int) -> bytes:
    """A tiny PNG that claims ``width`` x ``height``: a decompression bomb's header, with no real pixel data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def _animated_gif() -> bytes:
    frames = [Image.new("RGB", (16, 16), c) for c in (BLUE, RED)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    return buffer.getvalue()


def _broken_exif_jpeg() -> bytes:
    return encode(Image.new("RGB", (16, 16), BLUE), "JPEG", exif=b"Exif\x00\x00II*\x00\xff\xff\xff\x7f")


def _raw(data: bytes, content_type: str = "image/jpeg") -> dict:
    return {"data": data, "content_type": content_type}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# Every bad input we know of: (request, status, error code). Good-but-unusual images answer 200.
BAD_INPUTS = {
    "empty body": ({**_raw(b""), "environ_overrides": {"CONTENT_LENGTH": "0"}}, 400, "invalid_image"),
    "no body, no length said": (_raw(b""), 400, "bad_request"),  # what follows the head is not its body
    "empty body, no content type": ({"data": b""}, 415, "unsupported_media_type"),
    "wrong content type": (_raw(b"hello", "text/plain"), 415, "unsupported_media_type"),
    "not an image": (_raw(b"not an image"), 400, "invalid_image"),
    "tiff (not served)": (_raw(image_bytes(fmt="TIFF"), "image/tiff"), 415, "unsupported_image_format"),
    "svg (not served, PIL reads none)": (_raw(b'<svg xmlns="http://www.w3.org/2000/svg"/>', "image/svg+xml"), 415,
                                         "unsupported_image_format"),
    "truncated jpeg": (_raw(image_bytes(size=(64, 64))[:300]), 400, "invalid_image"),
    "text file named .jpg": ({"data": {"image": (io.BytesIO(b"just some text"), "cat.jpg")}}, 400, "invalid_image"),
    "zip bomb header (50000x50000)": (_raw(_png_header_only(50000, 50000), "image/png"), 413, "image_too_large"),
    "over the pixel limit": (_raw(image_bytes(fmt="PNG", size=(600, 400)), "image/png"), 413, "image_too_large"),
    "0x0 image": (_raw(_png_header_only(0, 0), "image/png"), 400, "invalid_image"),
    "1xN image": (_raw(image_bytes(fmt="PNG", size=(1, 300)), "image/png"), 400, "invalid_image"),
    "not base64": ({"json": {"images": ["***"]}}, 400, "invalid_base64"),
    "not json": (_raw(b"{'images': [", "application/json"), 400, "invalid_json"),
    "json nested 50000 deep": (_raw(b'{"images": ' + b"[" * 50000 + b"]" * 50000 + b"}", "application/json"), 400,
                              "invalid_json"),
    "images a string": ({"json": {"images": "abc"}}, 422, "validation_error"),  # images 5: the schema test below
    "no images": ({"json": {"images": []}}, 422, "validation_error"),
    "an unknown field": ({"json": {"images": ["AAAA"], "extra": 1}}, 422, "validation_error"),
    "json not an object": ({"json": [1, 2]}, 422, "validation_error"),
    "image not a string": ({"json": {"images": [3]}}, 422, "validation_error"),
    "top_k 0": ({"json": {"images": [_b64(image_bytes())], "top_k": 0}}, 422, "validation_error"),
    "top_k -1": ({"json": {"images": [_b64(image_bytes())], "top_k": -1}}, 422, "validation_error"),
    "top_k 10^9": ({"json": {"images": [_b64(image_bytes())], "top_k": 10**9}}, 400, "invalid_request"),
    "top_k true": ({"json": {"images": [_b64(image_bytes())], "top_k": True}}, 422, "validation_error"),
    "top_k abc": ({"json": {"images": [_b64(image_bytes())], "top_k": "abc"}}, 422, "validation_error"),
    # before: taken as 3 and 2 (pydantic's lax mode), where V2 refuses a numeric string
    "top_k '3'": ({"json": {"images": [_b64(image_bytes())], "top_k": "3"}}, 422, "validation_error"),
    "top_k 2.0": ({"json": {"images": [_b64(image_bytes())], "top_k": 2.0}}, 422, "validation_error"),
    "too many images": ({"json": {"images": [_b64(image_bytes())] * 5}}, 413, "too_many_images"),
    "too many images, multipart": ({"data": {"image": [(io.BytesIO(image_bytes()), f"{i}.jpg") for i in range(5)]}},
                                   413, "too_many_images"),
    "body over the limit": (_raw(b"\0" * (300 * 1024)), 413, "request_entity_too_large"),
    "bad X-Request-Timeout": ({**_raw(image_bytes()), "headers": {"X-Request-Timeout": "soon"}}, 400,
                              "invalid_request"),
}
GOOD_ODD_INPUTS = {
    "animated gif": (_raw(_animated_gif(), "image/gif"), "blue"),
    "16-bit png": (_raw(encode(Image.new("I;16", (16, 16), 40000), "PNG"), "image/png"), None),
    "cmyk jpeg": (_raw(image_bytes((255, 255, 0, 0), mode="CMYK")), "blue"),
    "broken exif": (_raw(_broken_exif_jpeg()), "blue"),
    "1x1 image": (_raw(image_bytes(BLUE, fmt="PNG", size=(1, 1)), "image/png"), "blue"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_gets_its_4xx_and_the_server_goes_on(client: FlaskClient, name: str) -> None:
    kwargs, status, code = BAD_INPUTS[name]
    error_of(client.post("/predict", **kwargs), status, code)
    _ok(client)


@pytest.mark.parametrize("name", list(GOOD_ODD_INPUTS))
def test_unusual_but_valid_images_are_served(client: FlaskClient, name: str) -> None:
    kwargs, label = GOOD_ODD_INPUTS[name]
    response = client.post("/predict", **kwargs)
    assert response.status_code == 200, response.get_data(as_text=True)
    if label is not None:
        assert response.get_json()["predictions"][0]["label"] == label


def test_a_deadline_passed_in_the_queue_is_504_and_costs_no_forward_pass(client: FlaskClient,
                                                                         model: ColourModel) -> None:
    before = len(model.batch_sizes)  # warm-up and canary passes
    model.gate = threading.Event()
    blocked = threading.Thread(target=client.post, args=("/predict",), kwargs=_raw(image_bytes()))
    blocked.start()
    deadline = time.monotonic() + 10
    while len(model.batch_sizes) < before + 1:  # wait until the worker is parked in that forward pass
        assert time.monotonic() < deadline, f"never parked: {model.batch_sizes}"
        time.sleep(0.001)
    response = client.post("/predict", headers={"X-Request-Timeout": "50"}, **_raw(image_bytes(RED)))
    assert response.status_code == 504 and response.get_json()["error"]["code"] == "deadline_exceeded"
    model.gate.set()
    blocked.join(timeout=10)
    assert len(model.batch_sizes) == before + 1  # the timed-out image never ran
    _ok(client)


@pytest.fixture
def keyed_client(settings: Settings, predictor: Predictor, tmp_path: Path) -> FlaskClient:
    key_file = tmp_path / "api_key"
    key_file.write_text("s3cret-key\n")
    app = create_app(settings.model_copy(update={"api_key_file": key_file}), predictor)
    yield app.test_client()
    app.extensions[EXTENSION_KEY].shutdown(timeout=5)


@pytest.mark.parametrize("headers, status", [
    ({}, 401), ({"Authorization": "Bearer wrong"}, 401), ({"X-API-Key": "s3cret-ke"}, 401),
    ({"Authorization": "Basic s3cret-key"}, 401),
    ({"Authorization": "Bearer s3cret-key"}, 200), ({"X-API-Key": "s3cret-key"}, 200),
])
def test_api_key(keyed_client: FlaskClient, headers: dict[str, str], status: int) -> None:
    response = keyed_client.post("/predict", headers=headers, **_raw(image_bytes()))
    assert response.status_code == status
    if status == 401:
        assert response.get_json()["error"]["code"] == "unauthorized"
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert keyed_client.get("/v1/models").status_code == 401
    for open_path in ("/healthz", "/readyz", "/metrics"):
        assert keyed_client.get(open_path).status_code == 200


@pytest.mark.parametrize("source", ["setting", "file"])
@pytest.mark.parametrize("empty", ["", "  \n"])
def test_an_empty_api_key_is_no_key_and_the_start_warns(settings: Settings, predictor: Predictor, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch, source: str,
                                                        empty: str) -> None:
    # Before: VISIONSERVE_API_KEY="" (or blanks) turned auth on with a key no request can present (a header's value
    # is stripped): every protected path 401; an empty key file was no key, and said nothing.
    fields = {name: value for name, value in settings.model_dump().items() if name not in ("api_key", "api_key_file")}
    if source == "setting":
        monkeypatch.setenv("VISIONSERVE_API_KEY", empty)
    else:
        (tmp_path / "api_key").write_text(empty, encoding="utf-8")
        fields["api_key_file"] = tmp_path / "api_key"
    with mock.patch("app.config.log.warning") as warning:
        app = create_app(Settings.model_validate(fields), predictor)
    try:
        (message, *args), _ = warning.call_args
        assert warning.call_count == 1  # once a process (before: twice, a trial)
        assert (message % tuple(args)).startswith("the API key setting is empty (")
        assert "auth is off" in message
        client = app.test_client()
        assert client.get("/v1/models").status_code == 200
        _ok(client)
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_too_many_json_images_are_413_before_any_is_base64_decoded(client: FlaskClient, settings: Settings) -> None:
    # Before: every image was base64-decoded, then counted: 3 million tiny ones cost 2 s of CPU before the 413.
    n = settings.max_images + 1
    with mock.patch("app.v1.payload.decode_base64") as decode:
        response = client.post("/predict", json={"images": [_b64(image_bytes())] * n})
    error = error_of(response, 413, "too_many_images")
    assert error["message"] == f"{n} images in one request; the limit is {settings.max_images}"
    assert decode.call_count == 0
    _ok(client)


@pytest.mark.parametrize("top_k", ["0", "-1", "1000000000", "abc", "5", "", "%EF%BC%93", "1_0", "%2B1", "%201"])
def test_bad_top_k_parameter(client: FlaskClient, top_k: str) -> None:
    # Before: empty took the default (where an empty model, version or outputs is refused), and "３" (full-width)
    # was 3, as Python's int() reads every script's digits; "1_0" was 10, "+1" and " 1" 1 (int() takes an
    # underscore, a plus and spaces: a schema fuzz of the API).
    response = client.post(f"/predict?top_k={top_k}", data=image_bytes(), content_type="image/jpeg")
    assert "top_k" in error_of(response, 400, "invalid_request")["message"]


@pytest.mark.parametrize("query, said", [("class_index=", "class_index is empty"), ("label=", "label is empty"),
                                         ("format=", "format is empty"),
                                         ("class_index=%EF%BC%93", "class_index must be an integer")])
def test_an_explanation_s_empty_or_non_ascii_parameter_is_refused(client: FlaskClient, query: str, said: str) -> None:
    response = client.post(f"/explain?{query}", data=image_bytes(), content_type="image/jpeg")
    assert error_of(response, 400, "invalid_request")["message"].startswith(said)


def test_schema_violation_lists_the_fields(client: FlaskClient) -> None:
    details = error_of(client.post("/predict", json={"images": 5}), 422, "validation_error")["details"]
    assert details[0]["loc"] == ["images"]


def test_a_json_body_of_millions_of_items_is_refused_before_pydantic_looks_at_each(client: FlaskClient,
                                                                                   settings: Settings) -> None:
    # Before (a security review): {"images": [0, 0, ...]} of 9 million zeros, 18 MB, took a worker to 10 GB (one
    # validation error per item) until gunicorn killed it; 100,000 unknown fields and a long "outputs" alike.
    body = b'{"images": [' + b",".join([b"0"] * 100_000) + b"]}"  # (within the test settings' 256 KiB body)
    error_of(client.post("/predict", data=body, content_type="application/json"), 413, "too_many_images")
    many = error_of(client.post("/predict", json={f"x{i}": 0 for i in range(15_000)}), 422, "validation_error")
    assert len(many["details"]) == 20 and many["details"][0]["loc"] == ["x0"]
    outputs = error_of(client.post("/predict", json={"images": ["aGk="], "outputs": [0] * 50_000}), 422,
                       "validation_error")
    assert "'outputs' lists 50000 items; at most 64" in outputs["message"]
    wrong = error_of(client.post("/predict", json={"images": [0] * settings.max_images}), 422, "validation_error")
    assert len(wrong["details"]) == settings.max_images  # within the count: each said, as before


@pytest.mark.parametrize("path, body, hint", [
    ("/explain", {"images": ["aGk="]}, "an explanation is of one image: 'image'"),
    ("/predict", {"image": "aGk="}, "/predict takes a list: 'images'"),
])
def test_a_field_of_another_request_form_is_422_saying_what_to_send(client: FlaskClient, path: str, body: dict,
                                                                    hint: str) -> None:
    # Before: "the JSON body does not match the request schema" alone, and "Extra inputs are not permitted" in its
    # details (a new user's trial: /explain takes 'image', /predict 'images').
    message = error_of(client.post(path, json=body), 422, "validation_error")["message"]
    assert message.endswith(f"the request schema; {hint}"), message


def test_unknown_route_and_method_are_json(client: FlaskClient) -> None:
    error_of(client.get("/nope"), 404, "not_found")
    error_of(client.get("/predict"), 405, "method_not_allowed")


@pytest.mark.parametrize("path, allowed", [("/predict", "OPTIONS, POST"), ("/v1/models", "GET, HEAD, OPTIONS"),
                                           ("/v2/models/colour/infer", "OPTIONS, POST")])
def test_options_answers_204_with_the_methods_the_path_takes(client: FlaskClient, path: str, allowed: str) -> None:
    # Before (CORS off): Flask's 200 saying Content-Type text/html on an empty body, its Allow in a set's order
    # (another from one server start to the next), the one answer of the API that was neither JSON nor empty
    response = client.options(path, headers={"X-Request-ID": "opt-1"})
    assert (response.status_code, response.headers["Allow"], response.get_data()) == (204, allowed, b"")
    assert "Content-Type" not in response.headers and response.headers["X-Request-ID"] == "opt-1"
    error_of(client.options("/nope"), 404, "not_found")


@pytest.mark.parametrize("method, path, allowed", [
    ("get", "/predict", {"POST", "OPTIONS"}), ("head", "/predict", {"POST", "OPTIONS"}),
    ("delete", "/v1/models", {"GET", "HEAD", "OPTIONS"}), ("get", "/v2/models/colour/infer", {"POST", "OPTIONS"})])
def test_a_405_names_the_methods_the_path_takes_in_allow(client: FlaskClient, method: str, path: str,
                                                         allowed: set[str]) -> None:
    # Before: the JSON 405 had no Allow header (RFC 9110 requires one; docs/api.md promises it).
    response = getattr(client, method)(path, headers={"X-Request-ID": "allow-1"})
    assert response.status_code == 405
    assert response.headers["Allow"] == ", ".join(sorted(allowed))  # in one order (before: a set's, per start)
    assert response.mimetype == "application/json"
    # (before: werkzeug's "The method is not allowed for the requested URL.", no word of which it takes)
    message = f"{method.upper()} is not allowed on {path}; it takes " + ", ".join(sorted(allowed - {"HEAD", "OPTIONS"}))
    if method == "head":
        assert response.get_data() == b""
    elif path.startswith("/v2/"):
        assert response.get_json() == {"error": message}  # the Open Inference Protocol's shape
    else:
        assert response.get_json() == {"error": {"code": "method_not_allowed", "message": message,
                                                 "request_id": "allow-1"}}


@pytest.mark.parametrize("method", ["post", "get"])
@pytest.mark.parametrize("verb", ["predict", "explain"])
def test_kserve_s_v1_verbs_are_404_saying_the_protocol_is_not_served_and_what_to_call(
        client: FlaskClient, method: str, verb: str) -> None:
    # Before: a KServe V1 client's POST /v1/models/colour:predict was a 405 saying the path takes GET, and the GET
    # was a 404 for a model named "colour:predict" (a KServe trial)
    response = getattr(client, method)(f"/v1/models/colour:{verb}", json={"instances": [[1, 2, 3]]})
    error = error_of(response, 404, "not_found")
    assert error["message"] == ("KServe's V1 protocol is not served here: POST /v2/models/colour/infer (the Open "
                                "Inference Protocol, KServe V2) or POST /predict (docs/api.md)")
    assert "Allow" not in response.headers
    error_of(client.post("/v1/models/colour"), 405, "method_not_allowed")  # any other path as before


@pytest.mark.parametrize("path, said", [
    ("/predict/", "no such path: /predict/ (without the trailing slash: /predict); the routes are in /openapi.json "
                  "(and /docs)"),
    ("/v1/model", "no such path: /v1/model; the routes are in /openapi.json (and /docs)"),
])
def test_a_404_names_the_path_and_where_the_routes_are(client: FlaskClient, path: str, said: str) -> None:
    # Before: werkzeug's "The requested URL was not found on the server. If you entered the URL manually please
    # check your spelling and try again." (a new user's trial)
    method = client.post if path == "/predict/" else client.get
    assert error_of(method(path), 404, "not_found")["message"] == said


def test_a_doubled_slash_is_a_404_not_a_redirect_built_from_the_host(client: FlaskClient) -> None:
    # Before (a security review): GET /demo//x with Host: evil.example was a 308 to http://evil.example/demo/x, in
    # HTML
    answer = client.get("/demo//x", headers={"Host": "evil.example"})
    assert "Location" not in answer.headers
    error_of(answer, 404, "not_found")
    error_of(client.post("//predict"), 404, "not_found")


def test_failing_forward_is_500_json_and_the_server_goes_on(client: FlaskClient, model: ColourModel) -> None:
    model.fail_when = 0.5  # red images make the forward pass raise
    failed = error_of(client.post("/predict", data=image_bytes(RED), content_type="image/jpeg"), 500,
                      "inference_failed")
    # the model's own words (before: its kind alone, "Error" for any TorchScript model's; a TorchServe user's trial)
    assert failed["message"] == "the model failed on this request's images: RuntimeError: fake forward failure"
    assert client.get("/healthz").status_code == 200
    assert labels_of(client.post("/predict", data=image_bytes(BLUE), content_type="image/jpeg")) == ["blue"]


def test_full_queue_is_429_with_retry_after(client: FlaskClient, model: ColourModel, service: Service) -> None:
    model.batch_sizes.clear()
    model.gate = threading.Event()  # park the worker inside a forward pass
    blocked = ThreadPoolExecutor(1).submit(
        client.post, "/predict", data=image_bytes(), content_type="image/jpeg")
    wait_until(lambda: bool(model.batch_sizes) and service.loaded_version().batcher.depth == 0)
    filler = [service.loaded_version().decoder.prepare(image_bytes())] * service.settings.queue_size
    queued = service.loaded_version().batcher.submit_many(filler)
    response = client.post("/predict", data=image_bytes(), content_type="image/jpeg")
    error_of(response, 429, "overloaded")
    assert int(response.headers["Retry-After"]) >= 1
    # Refused before its body is parsed or decoded: a body that is no image at all, or no JSON, is still the
    # queue's 429, not a 400 after work the server would throw away; and no image reached the decoder.
    decoder = service.loaded_version().decoder
    with mock.patch.object(decoder, "prepare", side_effect=AssertionError("decoded under overload")):
        error_of(client.post("/predict", data=b"not an image", content_type="image/jpeg"), 429, "overloaded")
        v2 = client.post("/v2/models/colour/infer", data=b"{not json", content_type="application/json")
        assert v2.status_code == 429 and "queue is full" in v2.get_json()["error"] and v2.headers["Retry-After"]
    model.gate.set()
    assert blocked.result(timeout=10).status_code == 200
    assert all(f.result(timeout=10).batch_size >= 1 for f in queued)


def test_a_backlog_s_refusal_tells_its_worker_until_when_that_route_s_like_would_be_refused(
        settings: Settings, predictor: Predictor) -> None:
    # A storm's 429s went through the app and the engine each; the engine's refusal for its backlog now says until
    # when that backlog answers no more image, and the app remembers it for the worker's loop, which refuses the
    # route's requests whose deadline ends sooner before the app sees them (app/hosting/recent_refusals.py).
    from app.hosting.recent_refusals import RECENT

    app = create_app(settings.model_copy(update={"refusal_memory_ms": 60_000}), predictor)
    client, model, service = app.test_client(), predictor.module, app.extensions[EXTENSION_KEY]
    head = b"POST /predict HTTP/1.1\r\nX-Request-Timeout: 1500\r\n\r\n"
    try:
        model.delay_s = 0.25
        _ok(client)  # a batch timed: 0.25 s an image (the backlog below then clears in 2 s at least)
        model.gate = threading.Event()  # then the worker parked in a forward pass, seven images queued behind it
        blocked = ThreadPoolExecutor(1).submit(client.post, "/predict", **_raw(image_bytes()))
        batcher = service.loaded_version().batcher
        wait_until(lambda: batcher._busy and batcher.depth == 0)
        queued = batcher.submit_many([service.loaded_version().decoder.prepare(image_bytes())] * 7)
        assert RECENT.refusal(head, time.monotonic(), None) is None  # nothing refused yet
        asked = time.monotonic()
        response = client.post("/predict?top_k=1", headers={"X-Request-Timeout": "1500"}, **_raw(image_bytes()))
        assert error_of(response, 429, "deadline_unreachable")["message"].startswith("the queue ahead may need")
        refused = RECENT.refusal(head, asked, None)  # a request of that route, as old, with that deadline
        assert refused is not None and b"Retry-After: " + response.headers["Retry-After"].encode() in refused.answer
        assert RECENT.refusal(head.replace(b"1500", b"9000"), time.monotonic(), None) is None  # the backlog meets it
        # one that may be too short for a request of MAX_IMAGES (4) images alone (the app's 400 deadline_too_short)
        assert RECENT.refusal(head.replace(b"1500", b"800"), asked, None) is None
        assert RECENT.refusal(head.replace(b"/predict", b"/predict?model=colour"), asked, None) is None  # another
        model.gate.set()
        assert blocked.result(timeout=10).status_code == 200 and all(f.result(timeout=10) for f in queued)
    finally:
        model.gate.set()
        model.delay_s = 0.0
        service.shutdown(timeout=5)
        RECENT.configure(0.0, 30.0, 16, None)


@pytest.mark.parametrize("path", ["/predict", "/v2/models/colour/infer"])
def test_a_streamed_body_over_the_limit_is_413_not_cut_short(client: FlaskClient, settings: Settings,
                                                            path: str) -> None:
    # A chunked body has no Content-Length; the server marks its end itself (wsgi.input_terminated).
    def post(size: int, content_type: str) -> Any:
        return client.post(path, input_stream=io.BytesIO(b"\0" * size), content_type=content_type,
                           environ_overrides={"wsgi.input_terminated": True})

    content_type = "image/jpeg" if path == "/predict" else "application/json"
    over = post(settings.max_body_bytes + 1, content_type)
    assert over.status_code == 413 and over.headers["Connection"] == "close"
    assert post(settings.max_body_bytes, content_type).status_code == 400  # at the limit: read, and not an image


class _CountedStream(io.BytesIO):
    reads: list[int]

    def read(self, size: int | None = -1) -> bytes:  # type: ignore[override]
        self.reads.append(-1 if size is None else size)
        return super().read(size)


def test_a_body_of_a_known_length_from_a_server_that_ends_it_is_read_in_one_call(client: FlaskClient) -> None:
    # gunicorn says it ends the input itself (wsgi.input_terminated): a Content-Length body is one read of that length
    photo = image_bytes(RED)
    stream = _CountedStream(photo)
    stream.reads = []
    response = client.post("/predict", input_stream=stream, content_length=len(photo), content_type="image/jpeg",
                           environ_overrides={"wsgi.input_terminated": True})
    assert response.status_code == 200 and response.get_json()["predictions"][0]["label"] == "red"
    assert stream.reads == [len(photo)]


class _CutStream(io.BytesIO):
    """A request body cut short: a read that needs more than the bytes that came raises ``error``, as gunicorn's
    stream does when the client hangs up (NoMoreData: the connection ended mid-chunk; ConnectionResetError) or
    stalls (TimeoutError: the socket timeout)."""

    def __init__(self, data: bytes, error: OSError) -> None:
        super().__init__(data)
        self.error = error

    def _left(self) -> int:
        return len(self.getbuffer()) - self.tell()

    def read(self, size: int | None = -1) -> bytes:  # type: ignore[override]
        if size is None or size < 0 or size > self._left():
            raise self.error
        return super().read(size)

    def readinto(self, buffer: Any) -> int:  # type: ignore[override]
        if len(buffer) > self._left():
            raise self.error
        return super().readinto(buffer)


def _predict_requests(client: FlaskClient, status: int) -> float:
    """/metrics' count of /predict requests answered ``status``."""
    found = re.search(rf'^visionserve_requests_total{{endpoint="/predict",status="{status}"}} (\S+)$',
                      client.get("/metrics").get_data(as_text=True), re.M)
    return float(found.group(1)) if found else 0.0


def _version_requests(outcome: str) -> float:
    from prometheus_client import REGISTRY

    return sum(sample.value for metric in REGISTRY.collect() if metric.name == "visionserve_version_requests"
               for sample in metric.samples
               if sample.name.endswith("_total") and sample.labels.get("outcome") == outcome)


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("error, status, code", [
    (NoMoreData(), 499, "client_closed_request"), (ConnectionResetError(), 499, "client_closed_request"),
    (TimeoutError(), 408, "request_timeout")])
def test_a_client_that_hangs_up_mid_body_is_499_not_400(client: FlaskClient, caplog: pytest.LogCaptureFixture,
                                                        chunked: bool, error: OSError, status: int,
                                                        code: str) -> None:
    # Before: a chunked body cut off by its client was answered, logged and counted 400 bad_request (the client's
    # request at fault) where the client had left; only a stalled body (the socket timeout) is 408.
    photo = image_bytes(RED)
    environ: dict[str, Any] = {"wsgi.input_terminated": True}  # as gunicorn says of its stream
    if not chunked:
        environ["CONTENT_LENGTH"] = str(len(photo))  # announced whole, half of it sent
    headers = {"Transfer-Encoding": "chunked"} if chunked else {}
    counted = {s: _predict_requests(client, s) for s in (400, status)}
    outcomes = {outcome: _version_requests(outcome) for outcome in ("failed", "refused")}
    caplog.set_level(logging.INFO, logger="visionserve.access")
    response = client.post("/predict", input_stream=_CutStream(photo[:len(photo) // 2], error), headers=headers,
                           content_type="image/jpeg", environ_overrides=environ)
    error_of(response, status, code)
    assert response.headers["Connection"] == "close"  # the body was not read to its end
    assert _predict_requests(client, status) == counted[status] + 1
    assert _predict_requests(client, 400) == counted[400]
    # the client's doing, not its version's failure (a rollout's evidence, a watched default's rollback)
    assert (_version_requests("failed"), _version_requests("refused")) == (outcomes["failed"], outcomes["refused"] + 1)
    logged = [r.status for r in caplog.records if r.name == "visionserve.access" and r.route == "/predict"]
    assert logged == [status]
    _ok(client)


@pytest.mark.parametrize("path", ["/predict", "/v2/models/colour/infer", "/v1/models", "/nowhere"])
def test_a_body_announced_over_the_limit_is_our_413_on_every_route(client: FlaskClient, settings: Settings,
                                                                   path: str) -> None:
    # Before: werkzeug's own 413 ("The data value transmitted exceeds the capacity limit.", nothing of the limit)
    # where the route read the body, and 405 or 404 with the connection kept open on the unread body elsewhere.
    response = client.post(path, data=b"\0" * (settings.max_body_bytes + 1), content_type="application/json",
                           headers={"X-Request-ID": "big-1"})
    assert response.status_code == 413 and response.headers["Connection"] == "close"
    assert response.content_type == "application/json" and response.headers["X-Request-ID"] == "big-1"
    limit = f"the request body is over the {settings.max_body_bytes} byte limit"
    if path.startswith("/v2/"):
        assert response.get_json() == {"error": limit}  # the Open Inference Protocol's shape
    else:
        assert error_of(response, 413, "request_entity_too_large") == {
            "code": "request_entity_too_large", "message": limit, "request_id": "big-1"}
    at_limit = client.post("/predict", data=b"\0" * settings.max_body_bytes, content_type="image/jpeg")
    assert at_limit.status_code == 400  # read, and not an image


def test_a_bad_image_among_several_is_named_by_index_and_file_name(client: FlaskClient) -> None:
    # Before: one 400 that did not say which of the images was bad.
    files = [(io.BytesIO(image_bytes(RED)), "cat.jpg"), (io.BytesIO(b"not an image"), "notes.txt")]
    error = error_of(client.post("/predict", data={"image": files}), 400, "invalid_image")
    assert error["message"].startswith("image 1 (notes.txt): ")
    assert error["details"]["image"] == 1 and error["details"]["filename"] == "notes.txt"
    body = {"images": [base64.b64encode(image_bytes(RED)).decode(), base64.b64encode(b"nope").decode()]}
    error = error_of(client.post("/predict", json=body), 400, "invalid_image")
    assert error["message"].startswith("image 1: ") and error["details"]["image"] == 1


def test_every_image_whose_header_is_refused_is_named_in_one_answer_not_only_the_first(
        settings: Settings, predictor: Predictor) -> None:
    # Before: only the first bad image was named; a client fixed it, sent again, and met the next (a trial).
    app = create_app(settings.model_copy(update={"max_images": 8}), predictor)
    client = app.test_client()
    tiff = encode(Image.new("RGB", (8, 8)), "TIFF")
    files = [(io.BytesIO(b"not an image"), "notes.txt"), (io.BytesIO(image_bytes(RED)), "cat.jpg"),
             (io.BytesIO(b""), "empty.jpg"), (io.BytesIO(tiff), "scan.tiff"), (io.BytesIO(image_bytes(BLUE)), "b.jpg")]
    error = error_of(client.post("/predict", data={"image": files}), 400, "invalid_image")
    assert error["message"] == ("image 0 (notes.txt): the data is not an image in a format we can read; also refused: "
                                "image 2 (empty.jpg), image 3 (scan.tiff) (details' also_refused)")
    assert (error["details"]["image"], error["details"]["filename"]) == (0, "notes.txt")
    assert [(item["image"], item["filename"], item["status"], item["code"]) for item in error["details"][
        "also_refused"]] == [(2, "empty.jpg", 400, "invalid_image"), (3, "scan.tiff", 415, "unsupported_image_format")]
    assert error["details"]["also_refused"][0]["message"] == "image 2 (empty.jpg): the image is empty (0 bytes)"
    many = [(io.BytesIO(b"nope"), f"n{i}.txt") for i in range(8)]
    error = error_of(client.post("/predict", data={"image": many}), 400, "invalid_image")
    assert error["message"].endswith("also refused: image 1 (n1.txt), image 2 (n2.txt), image 3 (n3.txt), "
                                     "image 4 (n4.txt), image 5 (n5.txt) and 2 more (details' also_refused)")
    assert [item["image"] for item in error["details"]["also_refused"]] == list(range(1, 8))
    alone = error_of(client.post("/predict", data={"image": [(io.BytesIO(b"not an image"), "notes.txt"),
                                                             (io.BytesIO(image_bytes(RED)), "cat.jpg")]}),
                     400, "invalid_image")
    assert "also_refused" not in alone["details"] and "also refused" not in alone["message"]
    app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_a_long_file_name_is_shortened_in_the_error_not_echoed_whole_twice(client: FlaskClient) -> None:
    # Before: 3,000 "é" in a text file's name gave a 36,200-byte 400, the name whole in the message and the details.
    name = "é" * 3000 + ".txt"
    error = error_of(client.post("/predict", data={"image": (io.BytesIO(b"not an image"), name)}), 400,
                     "invalid_image")
    assert error["message"] == f"image 0 ({'é' * 79}…{'é' * 16}.txt): the data is not an image in a format we can read"
    assert error["details"]["filename"] == name[:255] and error["details"]["image"] == 0
    short = error_of(client.post("/predict", data={"image": (io.BytesIO(b"not an image"), "notes.txt")}), 400,
                     "invalid_image")
    assert short["message"].startswith("image 0 (notes.txt): ") and short["details"]["filename"] == "notes.txt"


def test_a_wrong_multipart_field_says_which_fields_were_sent(client: FlaskClient) -> None:
    response = client.post("/predict", data={"file": (io.BytesIO(image_bytes()), "x.jpg")})
    assert "fields sent: 'file'" in error_of(response, 400, "invalid_request")["message"]
    both = {"image": (io.BytesIO(image_bytes()), "x.jpg"), "file": (io.BytesIO(image_bytes()), "y.jpg")}
    assert "'file'" in error_of(client.post("/predict", data=both), 400, "invalid_request")["message"]
    # Before: `curl -F image=cat.jpg` (no @: the name sent as text) was told "unknown form field 'image'"
    text = error_of(client.post("/predict", data={"image": "cat.jpg"}, content_type="multipart/form-data"), 400,
                    "invalid_request")["message"]
    assert text.startswith("the 'image' field came as text, not a file") and "-F image=@cat.jpg" in text
    # Before: `curl -F image=@x.jpg -F top_k=@n.txt` was told to send each image in the 'image' field, which it did
    sent = {"image": (io.BytesIO(image_bytes()), "x.jpg"), "top_k": (io.BytesIO(b"3"), "n.txt")}
    text = error_of(client.post("/predict", data=sent), 400, "invalid_request")["message"]
    assert text == "the form field 'top_k' came as a file, not as text: send it as text (curl -F top_k=<value>, without the @)"


@pytest.mark.parametrize("url, form", [("/predict?topk=1", None), ("/predict?top_k=1&format=json", None),
                                       ("/predict", {"topk": "1"})])
def test_unknown_parameters_are_refused_naming_the_known_ones(client: FlaskClient, url: str,
                                                              form: dict[str, str] | None) -> None:
    # Before: ignored silently, so a misspelt top_k quietly gave the default.
    if form is None:
        response = client.post(url, data=image_bytes(), content_type="image/jpeg")
    else:
        response = client.post(url, data={**form, "image": (io.BytesIO(image_bytes()), "x.jpg")})
    message = error_of(response, 400, "invalid_request")["message"]
    assert "unknown" in message and "known: " in message and "top_k" in message.split("known: ")[1]
    if form is not None:  # Before: "known: outputs, top_k", the image's own field left out
        assert message.endswith("; known: image (a file), outputs, top_k"), message


def test_a_deadline_shorter_than_one_forward_pass_is_400_without_retry_after(client: FlaskClient) -> None:
    # Before: 429 deadline_unreachable on an idle server, inviting a retry that could never succeed.
    assert labels_of(client.post("/predict", data=image_bytes(RED), content_type="image/jpeg")) == ["red"]
    response = client.post("/predict", data=image_bytes(RED), content_type="image/jpeg",
                           headers={"X-Request-Timeout": "1"})
    error_of(response, 400, "deadline_too_short")
    assert "Retry-After" not in response.headers


@pytest.fixture
def floorless(settings: Settings, predictor: Predictor) -> Any:
    """An app taking any deadline (MIN_REQUEST_TIMEOUT_MS 0), so microseconds reach the batcher's judgement: its
    client and service."""
    app = create_app(settings.model_copy(update={"min_request_timeout_ms": 0}), predictor)
    yield app.test_client(), app.extensions[EXTENSION_KEY]
    app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_a_deadline_of_microseconds_is_400_too_short_not_the_version_s_504(floorless: Any) -> None:
    # Before: one that passed before it was judged (X-Request-Timeout 0.001 ms, a V2 timeout of 1 us) was 504, and
    # counted as the version's failure (a client could push a new default toward its automatic rollback).
    client, _ = floorless
    assert labels_of(client.post("/predict", data=image_bytes(RED), content_type="image/jpeg")) == ["red"]
    failed = _version_requests("failed")
    response = client.post("/predict", data=image_bytes(RED), content_type="image/jpeg",
                           headers={"X-Request-Timeout": "0.001"})
    assert error_of(response, 400, "deadline_too_short")["message"].startswith("the 0.001 ms deadline is shorter")
    red = np.zeros((1, 3, 8, 8), np.float32)
    red[:, 0] = 1.0
    body = {"inputs": [{"name": "pixels", "shape": list(red.shape), "datatype": "FP32", "data": red.ravel().tolist()}],
            "parameters": {"timeout": 1}}
    answer = client.post("/v2/models/colour/infer", json=body)
    assert answer.status_code == 400 and "deadline is shorter" in answer.get_json()["error"], answer.get_json()
    assert _version_requests("failed") == failed


def test_a_deadline_under_the_floor_is_400_as_it_is_read_whatever_the_request_holds(client: FlaskClient) -> None:
    # Before: under gunicorn a deadline under about a millisecond passed before the route ran: 504, for a malformed
    # request too (?top_k=0), and for the same deadline as a V2 timeout parameter 400 or 504 by the engine layout (a
    # schema fuzz of the API)
    gunicorn = {"gunicorn.socket": _Received(0.002)}  # had whole 2 ms ago: past a 0.5 ms deadline
    for path in ("/predict?top_k=0", "/predict", "/explain"):
        answer = client.post(path, data=image_bytes(RED), content_type="image/jpeg",
                             headers={"X-Request-Timeout": "0.5"}, environ_overrides=gunicorn)
        assert error_of(answer, 400, "deadline_too_short")["message"] == (
            "X-Request-Timeout 0.5 asks for a deadline under 1 ms, the shortest this server takes "
            "(MIN_REQUEST_TIMEOUT_MS): it would pass before the request is read"), path
    answer = client.post("/v2/models/nosuch/infer", json={"inputs": []}, headers={"X-Request-Timeout": "5e-324"},
                         environ_overrides=gunicorn)  # (V2's errors: {"error": message})
    assert answer.status_code == 400 and answer.get_json()["error"].startswith(
        "X-Request-Timeout 5e-324 asks for a deadline under 1 ms"), answer.get_json()
    body = {"inputs": [{"name": "pixels", "shape": [1, 3, 8, 8], "datatype": "FP32", "data": [0.0] * 192}],
            "parameters": {"timeout": 500}}
    answer = client.post("/v2/models/colour/infer", json=body)
    assert answer.status_code == 400 and answer.get_json()["error"].startswith(
        "parameters.timeout 500 (microseconds) asks for a deadline under 1 ms"), answer.get_json()
    for said in ("1_000", "+500", "inf", "nan", "1e400", "-5", "0"):  # (float() took 1_000, +500, inf and 1e400)
        answer = client.post("/predict", data=image_bytes(RED), content_type="image/jpeg",
                             headers={"X-Request-Timeout": said})
        assert error_of(answer, 400, "invalid_request")["message"] == (
            f"X-Request-Timeout must be a positive number of milliseconds, got {said!r}"), said
    body["parameters"]["timeout"] = 1000  # the floor itself is taken (then judged by the version's own time)
    answer = client.post("/v2/models/colour/infer", json=body)
    assert answer.status_code == 200 or "MIN_REQUEST_TIMEOUT_MS" not in answer.get_json()["error"], answer.get_json()
    error_of(client.post("/predict", data=image_bytes(RED), content_type="image/jpeg",
                         headers={"X-Request-Timeout": "1000"}, environ_overrides={"gunicorn.socket": _Received(2.0)}),
             504, "deadline_exceeded")  # a deadline past the floor that passed in the worker is still its 504


class _Received:
    """The socket gunicorn hands a request over with, as far as its deadline goes (app/web/services.py)."""

    def __init__(self, seconds_ago: float) -> None:
        self.body_held, self.received_at = True, time.monotonic() - seconds_ago  # read whole by the worker's loop


def test_a_deadline_counts_from_when_the_worker_had_the_request_whole(client: FlaskClient) -> None:
    # Before: from when a request thread began on it: under a burst beyond the worker's threads, a 500 ms deadline's
    # requests were answered 200 after 4 s, and without one after more than REQUEST_TIMEOUT_S.
    def sent(seconds_ago: float) -> TestResponse:
        return client.post("/predict", data=image_bytes(RED), content_type="image/jpeg",
                           headers={"X-Request-Timeout": "1000"},
                           environ_overrides={"gunicorn.socket": _Received(seconds_ago)})

    from prometheus_client import REGISTRY

    def request_seconds() -> float:
        return REGISTRY.get_sample_value("visionserve_request_duration_seconds_sum", {"endpoint": "/predict"}) or 0

    before = request_seconds()
    answered = sent(0.2)
    assert labels_of(answered) == ["red"]
    # its wait in the worker counts in its time: Server-Timing's wait, the request histogram (before: neither saw it,
    # a load tester's clients saw 200s at p50 4.4 s where the histogram put 97% of them within 1 s)
    assert float(re.search(r"wait;dur=([\d.]+)", answered.headers["Server-Timing"]).group(1)) >= 200
    assert request_seconds() - before >= 0.2
    failed = _version_requests("failed")
    late = error_of(sent(2.0), 504, "deadline_exceeded")
    assert re.fullmatch(r"no inference result within the request's 1s deadline: it passed while the request waited "
                        r"2(\.\d+)?s for this worker", late["message"]), late
    assert _version_requests("failed") == failed  # the server's capacity, not the version's failure
    pixels = {"inputs": [{"name": "pixels", "shape": [1, 3, 8, 8], "datatype": "FP32", "data": [0.0] * 192}]}
    answer = client.post("/v2/models/colour/infer", json=pixels, headers={"X-Request-Timeout": "1000"},
                         environ_overrides={"gunicorn.socket": _Received(2.0)})
    assert answer.status_code == 504 and "1s deadline" in answer.get_json()["error"], answer.get_json()


def test_a_deadline_of_microseconds_before_the_version_s_first_batch_is_400_by_its_warm_up(
        floorless: Any) -> None:
    # Before: until a version's first batch (a new default, a candidate) its batcher had no time an image to judge
    # by, and a deadline that passed before it was judged was 504, counted as the version's failure.
    client, service = floorless
    assert service.loaded_version().batcher.batches_run == 0
    failed = _version_requests("failed")
    body = {"inputs": [{"name": "pixels", "shape": [1, 3, 8, 8], "datatype": "FP32", "data": [0.0] * 192}],
            "parameters": {"timeout": 1}}
    answer = client.post("/v2/models/colour/infer", json=body)
    assert answer.status_code == 400 and "deadline is shorter" in answer.get_json()["error"], answer.get_json()
    assert _version_requests("failed") == failed
    assert service.loaded_version().batcher.batches_run == 0


def test_pixels_the_model_overflows_on_are_400_not_the_version_s_500(client: FlaskClient) -> None:
    # Before: finite but huge pixels (3e38) made the model answer infinity: 500 "the model is at fault, not the
    # image", counted as the version's failure.
    failed = _version_requests("failed")
    huge = np.full((1, 3, 8, 8), 3e38, np.float32)
    body = {"inputs": [{"name": "pixels", "shape": list(huge.shape), "datatype": "FP32", "data": huge.ravel().tolist()}]}
    answer = client.post("/v2/models/colour/infer", json=body)
    assert answer.status_code == 400, answer.get_json()
    assert answer.get_json()["error"].startswith("image 0: the model's output is not finite (NaN or infinity) for "
                                                 "these pixels, of values from 3e+38 to 3e+38")
    assert _version_requests("failed") == failed


def test_a_deadline_that_its_decode_on_a_busy_server_left_short_is_429_not_400(
        client: FlaskClient, service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: 400 deadline_too_short ("the 16 ms deadline is shorter than this image's own inference", of a 40 ms
    # X-Request-Timeout), saying a retry cannot succeed where the same request alone on an idle server succeeds.
    loaded = service.loaded_version()
    loaded.predictor.module.delay_s = 0.05  # each image's own inference: about 50 ms
    assert labels_of(client.post("/predict", data=image_bytes(RED), content_type="image/jpeg")) == ["red"]
    short = client.post("/predict", data=image_bytes(RED), content_type="image/jpeg",
                        headers={"X-Request-Timeout": "20"})  # shorter than its own inference whatever the load
    assert re.fullmatch(r"the 20 ms deadline is shorter than this image's own inference \(about \d+ ms\)",
                        error_of(short, 400, "deadline_too_short")["message"])
    assert labels_of(client.post("/predict", data=image_bytes(RED), content_type="image/jpeg")) == ["red"]
    prepare = loaded.decoder.prepare

    def slow_prepare(data: bytes) -> object:
        time.sleep(0.15)  # the decode of a busy server: most of the deadline gone before the image queues
        return prepare(data)

    monkeypatch.setattr(loaded.decoder, "prepare", slow_prepare)
    response = client.post("/predict", data=image_bytes(RED), content_type="image/jpeg",
                           headers={"X-Request-Timeout": "200"})
    message = error_of(response, 429, "deadline_unreachable")["message"]
    assert re.fullmatch(r"\d+ ms was left of the request's 200 ms deadline when its images queued, less "
                        r"than their own inference \(about \d+ ms\): the server is busy", message), message
    assert int(response.headers["Retry-After"]) >= 1


def test_a_request_for_another_model_or_version_is_404_naming_the_served_one(client: FlaskClient,
                                                                             service: Service) -> None:
    manifest = service.loaded_version().predictor.manifest
    ok = client.post(f"/predict?model={manifest.name}&version={manifest.version}", data=image_bytes(),
                     content_type="image/jpeg")
    assert ok.status_code == 200
    for query in ("model=nope", f"model={manifest.name}&version=999"):
        error = error_of(client.post(f"/predict?{query}", data=image_bytes(), content_type="image/jpeg"),
                       404, "not_found")
        assert f"serves {manifest.name!r} version {manifest.version!r}" in error["message"]
        assert error["details"]["models"] == [{"name": manifest.name, "versions": [manifest.version],
                                               "default": manifest.version}]
    # A promotion or a rollback of a model not loaded names the same (before: the names alone)
    served = [{"name": manifest.name, "versions": [manifest.version], "default": manifest.version}]
    for path in ("/v1/models/nope/promote", "/v1/models/nope/rollback"):
        assert error_of(client.post(path), 404, "not_found")["details"] == {"models": served}


def test_base64_wrapped_over_lines_is_refused_saying_so(client: FlaskClient) -> None:
    # Before: "images[0] is not valid base64" alone, for GNU base64's default output (76 characters a line)
    import base64

    wrapped = base64.encodebytes(image_bytes()).decode()
    error = error_of(client.post("/predict", json={"images": [wrapped]}), 400, "invalid_base64")
    assert error["message"] == ("images[0] is not valid base64 (it holds line breaks: send it on one line, e.g. "
                                "base64 -w0)")
    assert client.post("/predict", json={"images": ["".join(wrapped.split())]}).status_code == 200


def test_base64_wrapped_over_lines_in_a_body_written_by_hand_is_refused_saying_so(client: FlaskClient) -> None:
    # Before: the documented pipeline without -w0 (printf '{"images": ["'; base64 cat.jpg; printf '"]}') put raw line
    # breaks in the JSON string, and the answer was the parser's "control character (\u0000-\u001F) found while
    # parsing a string at line 2 column 0" alone
    import base64

    wrapped = base64.encodebytes(image_bytes()).decode()
    body = b'{"images": ["' + wrapped.encode() + b'"], "top_k": 1}'
    error = error_of(client.post("/predict", data=body, content_type="application/json"), 400, "invalid_json")
    assert error["message"].startswith("the body is not valid JSON: control character")
    assert "base64 wrapped in lines is one: send it on one line, e.g. base64 -w0" in error["message"]


def test_base64_of_another_kind_is_refused_saying_which(client: FlaskClient) -> None:
    # Before: "images[0] is not valid base64" alone (a new user's trial: URL-safe and unpadded base64)
    import base64

    photo = image_bytes()
    unsafe = base64.urlsafe_b64encode(b"\xfb\xff" + photo).decode()  # (its first bytes give - and _)
    unpadded = base64.b64encode(photo + b"\0" * (1 + len(photo) % 3)).decode().rstrip("=")  # (a length 3 n + 1)
    for sent, why in [(unsafe, "the URL-safe alphabet"), (unpadded, "the = padding is missing")]:
        error = error_of(client.post("/predict", json={"images": [sent]}), 400, "invalid_base64")["message"]
        assert why in error, error
    v2 = {"inputs": [{"name": "images", "datatype": "BYTES", "shape": [1],  # (/predict takes a data URL as it is)
                      "data": ["data:image/jpeg;base64," + base64.b64encode(photo).decode()]}]}
    assert "a data URL" in client.post("/v2/models/colour/infer", json=v2).get_json()["error"]


def test_an_explanation_s_base64_error_names_its_field(client: FlaskClient) -> None:
    # Before: "images[0] is not valid base64" for /explain's {"image": ...}, a field /explain does not take (a new
    # user's trial)
    error = error_of(client.post("/explain", json={"image": "!!!"}), 400, "invalid_base64")["message"]
    assert error.startswith("image is not valid base64"), error
    error = error_of(client.post("/predict", json={"images": ["aGk=", "!!!"]}), 400, "invalid_base64")["message"]
    assert "images[1] is not valid base64" in error, error


def test_a_parameter_given_twice_in_one_place_is_400(client: FlaskClient) -> None:
    # Before: its first value won, silently (?top_k=3&top_k=1: three classes), where one in the body and the query
    # is a 400
    photo = image_bytes()
    error = error_of(client.post("/predict?top_k=3&top_k=1", data=photo, content_type="image/jpeg"), 400,
                     "invalid_request")
    assert error["message"] == "query parameter top_k is given 2 times ('3', '1'): send it once"
    error = error_of(client.post("/predict", data={"image": (io.BytesIO(photo), "a.jpg"), "top_k": ["1", "2"]}), 400,
                     "invalid_request")
    assert error["message"] == "form field top_k is given 2 times ('1', '2'): send it once"
    error_of(client.post("/predict?model=colour&model=nope", data=photo, content_type="image/jpeg"), 400,
             "invalid_request")
    error_of(client.post("/explain?label=red&label=blue", data=photo, content_type="image/jpeg"), 400,
             "invalid_request")
    assert client.post("/predict?top_k=2", data=photo, content_type="image/jpeg").status_code == 200
    # what `requests` sends for params={"outputs": ["labels", "embedding"]}: the refusal says how to ask for both
    error = error_of(client.post("/predict?outputs=labels&outputs=embedding", data=photo, content_type="image/jpeg"),
                     400, "invalid_request")
    assert error["message"] == ("query parameter outputs is given 2 times ('labels', 'embedding'): send it once "
                                "(several as one, comma-separated: outputs=labels,embedding)")
    error = error_of(client.post("/predict", data={"image": (io.BytesIO(photo), "a.jpg"), "outputs": ["labels",
                                                                                                     "embedding"]}),
                     400, "invalid_request")
    assert error["message"].endswith("send it once (several as one, comma-separated: outputs=labels,embedding)")


def test_an_explanation_s_class_given_in_the_query_and_the_body_is_400(client: FlaskClient) -> None:
    # Before: the body's or the form's value won over the query's, silently, where /predict refuses the two
    import base64

    photo = image_bytes()
    error = error_of(client.post("/explain?label=red", json={"image": base64.b64encode(photo).decode(),
                                                             "label": "blue"}), 400, "invalid_request")
    assert error["message"] == "label is given twice, 'blue' in the body and 'red' in the query: send it once"
    error = error_of(client.post("/explain?class_index=0", data={"image": (io.BytesIO(photo), "a.jpg"),
                                                                 "class_index": "1"}), 400, "invalid_request")
    assert error["message"] == "class_index is given twice, '1' in the form and '0' in the query: send it once"
    error = error_of(client.post("/explain?format=png", data={"image": (io.BytesIO(photo), "a.jpg"),
                                                              "format": "json"}), 400, "invalid_request")
    assert error["message"] == "format is given twice, 'json' in the form and 'png' in the query: send it once"


def test_a_content_type_that_does_not_parse_is_named_as_it_came(client: FlaskClient) -> None:
    # Before: "content type '(none)' is not supported", for a header that was sent
    error = error_of(client.post("/predict", data=image_bytes(), headers={"Content-Type": ";;;=="}), 415,
                     "unsupported_media_type")
    assert error["message"].startswith("content type ';;;==' is not supported; send multipart/form-data")


def _documented_errors() -> set[tuple[int, str]]:
    """(status, code) of every row of docs/api.md's error table."""
    from tests.conftest import ROOT

    rows = set()
    for line in (ROOT / "docs" / "api.md").read_text(encoding="utf-8").splitlines():
        if match := re.match(r"^\| (\d{3}) \| (.+?) \|", line):
            rows.update((int(match.group(1)), code) for code in re.findall(r"`(\w+)`", match.group(2)))
    return rows


def test_every_error_the_server_can_answer_is_in_the_api_page_s_table(client: FlaskClient) -> None:
    import inspect

    from app import errors

    raised = {(c.status, c.code) for _, c in inspect.getmembers(errors, inspect.isclass)
              if issubclass(c, errors.ServiceError)}
    answered = {(r.status_code, r.get_json()["error"]["code"]) for r in (
        client.get("/predict"), client.get("/nowhere"),
        client.post("/predict", data=b"--x\r\nbroken", content_type="multipart/form-data; boundary=x"))}
    assert (405, "method_not_allowed") in answered and (404, "not_found") in answered
    missing = (raised | answered) - _documented_errors()
    assert not missing, f"docs/api.md's error table lacks {sorted(missing)}"


@pytest.mark.parametrize("query, said", [("labels=all", "labels must be one of 1, true, yes, 0, false, no, got 'all'"),
                                         ("label=1", "unknown query parameter 'label'; known: labels"),
                                         ("labels=true&labels=maybe", "query parameter labels is given 2 times "
                                          "('true', 'maybe'): send it once")])  # (before: its first value)
def test_the_model_listing_refuses_what_it_would_ignore(client: FlaskClient, query: str, said: str) -> None:
    # Before: answered 200 without the labels, the mistake unsaid.
    for path in ("/v1/models", "/v1/models/colour"):
        assert error_of(client.get(f"{path}?{query}"), 400, "invalid_request")["message"] == said
    paths = client.get("/openapi.json").get_json()["paths"]
    assert all("400" in paths[path]["get"]["responses"] for path in ("/v1/models", "/v1/models/{name}"))
    assert "labels" in client.get("/v1/models?labels=TRUE").get_json()["models"][0]
    assert "labels" not in client.get("/v1/models?labels=no").get_json()["models"][0]
