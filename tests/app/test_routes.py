"""Every request form and every error status, through the app factory with the fake colour model."""
from __future__ import annotations

import base64
import io
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from flask.testing import FlaskClient

from app import EXTENSION_KEY
from app.config import Settings
from app.engine.service import Service
from tests.support.fakes import ColourModel, wait_until
from tests.support.imaging import BLUE, GREEN, RED, image_bytes


def _labels(response) -> list[str]:  # noqa: ANN001
    assert response.status_code == 200, response.get_json()
    return [p["label"] for p in response.get_json()["predictions"]]


def _error(response, status: int, code: str) -> dict:  # noqa: ANN001
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.mimetype == "application/json"
    error = response.get_json()["error"]
    assert error["code"] == code and error["message"]
    assert error["request_id"] == response.headers["X-Request-ID"]
    return error


def test_multipart_images_come_back_in_order(client: FlaskClient) -> None:
    files = [(io.BytesIO(image_bytes(c)), f"{i}.jpg") for i, c in enumerate((RED, GREEN, BLUE))]
    assert _labels(client.post("/predict", data={"image": files})) == ["red", "green", "blue"]


def test_response_shape_and_scores(client: FlaskClient) -> None:
    body = client.post("/predict?top_k=3", data=image_bytes(GREEN), content_type="image/jpeg").get_json()
    assert body["model"] == {"name": "colour", "version": "test"}
    (prediction,) = body["predictions"]
    assert prediction["label"] == "green" and prediction["index"] == 1
    scores = [c["score"] for c in prediction["top_k"]]
    assert len(scores) == 3 and scores == sorted(scores, reverse=True)
    assert prediction["score"] == scores[0] and 0 < scores[0] <= 1


@pytest.mark.parametrize("content_type", ["image/png", "application/octet-stream"])
def test_raw_body(client: FlaskClient, content_type: str) -> None:
    response = client.post("/predict", data=image_bytes(BLUE, fmt="PNG"), content_type=content_type)
    assert _labels(response) == ["blue"]


def test_json_base64_and_data_url(client: FlaskClient) -> None:
    plain = base64.b64encode(image_bytes(RED)).decode()
    data_url = "data:image/png;base64," + base64.b64encode(image_bytes(GREEN, fmt="PNG")).decode()
    response = client.post("/predict", json={"images": [plain, data_url], "top_k": 4})
    assert _labels(response) == ["red", "green"]
    assert all(len(p["top_k"]) == 4 for p in response.get_json()["predictions"])


def test_top_k_default_query_and_form(client: FlaskClient) -> None:
    def top_k_len(response) -> int:  # noqa: ANN001
        return len(response.get_json()["predictions"][0]["top_k"])

    assert top_k_len(client.post("/predict", data=image_bytes(), content_type="image/jpeg")) == 2
    assert top_k_len(client.post("/predict?top_k=1", data=image_bytes(), content_type="image/jpeg")) == 1
    form = {"image": (io.BytesIO(image_bytes()), "a.jpg"), "top_k": "3"}
    assert top_k_len(client.post("/predict", data=form)) == 3


def test_server_timing_batch_size_and_request_id(client: FlaskClient) -> None:
    response = client.post("/predict", data=image_bytes(), content_type="image/jpeg",
                           headers={"X-Request-ID": "abc-123"})
    timing = response.headers["Server-Timing"]
    for metric in ("decode;dur=", "queue;dur=", "inference;dur=", 'batch;desc="1"'):
        assert metric in timing
    assert response.headers["X-Batch-Size"] == "1"
    assert response.headers["X-Request-ID"] == "abc-123"
    assert len(client.get("/healthz", headers={"X-Request-ID": "bad id <script>"}).headers["X-Request-ID"]) == 32


def test_concurrent_requests_share_batches(client: FlaskClient, model: ColourModel, service: Service) -> None:
    # Park the worker in a forward pass so the other requests queue up behind it, then let them run together.
    model.batch_sizes.clear()
    model.gate = threading.Event()

    def call(color: tuple[int, int, int]) -> str:
        return _labels(client.post("/predict", data=image_bytes(color), content_type="image/jpeg"))[0]

    colors = [RED, GREEN, BLUE, RED] * 2
    with ThreadPoolExecutor(8) as pool:
        first = pool.submit(call, colors[0])
        wait_until(lambda: len(model.batch_sizes) == 1)
        rest = [pool.submit(call, c) for c in colors[1:]]
        wait_until(lambda: service.batcher.depth == 7)
        model.gate.set()
        assert [first.result(timeout=10)] + [f.result(timeout=10) for f in rest] == ["red", "green", "blue", "red"] * 2
    assert model.batch_sizes == [1, 4, 3]


# -- errors --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, status, code", [
    ({"data": b"hello", "content_type": "text/plain"}, 415, "unsupported_media_type"),
    ({"data": b""}, 415, "unsupported_media_type"),
    ({"data": b"", "content_type": "image/jpeg"}, 400, "invalid_image"),
    ({"data": b"not an image", "content_type": "image/jpeg"}, 400, "invalid_image"),
    ({"data": image_bytes(fmt="TIFF"), "content_type": "image/tiff"}, 415, "unsupported_image_format"),
    ({"data": {"file": (io.BytesIO(image_bytes()), "a.jpg")}}, 400, "invalid_request"),
    ({"data": b"{not json", "content_type": "application/json"}, 400, "invalid_json"),
    ({"json": {"images": ["%%%not base64%%%"]}}, 400, "invalid_base64"),
    ({"json": {"images": "abc"}}, 422, "validation_error"),
    ({"json": {"images": []}}, 422, "validation_error"),
    ({"json": {"images": ["AAAA"], "extra": 1}}, 422, "validation_error"),
    ({"json": {"images": ["AAAA"], "top_k": 0}}, 422, "validation_error"),
    ({"json": {"images": ["AAAA"], "top_k": "abc"}}, 422, "validation_error"),
    ({"json": [1, 2]}, 422, "validation_error"),
])
def test_bad_requests(client: FlaskClient, kwargs: dict, status: int, code: str) -> None:
    _error(client.post("/predict", **kwargs), status, code)
    assert _labels(client.post("/predict", data=image_bytes(RED), content_type="image/jpeg")) == ["red"]


@pytest.mark.parametrize("top_k", ["0", "-1", "1000000000", "abc", "5"])
def test_bad_top_k_parameter(client: FlaskClient, top_k: str) -> None:
    response = client.post(f"/predict?top_k={top_k}", data=image_bytes(), content_type="image/jpeg")
    assert "top_k" in _error(response, 400, "invalid_request")["message"]


def test_schema_violation_lists_the_fields(client: FlaskClient) -> None:
    details = _error(client.post("/predict", json={"images": 5}), 422, "validation_error")["details"]
    assert details[0]["loc"] == ["images"]


def test_body_over_the_limit_is_413(client: FlaskClient) -> None:
    response = client.post("/predict", data=b"\xff" * (300 * 1024), content_type="image/jpeg")
    _error(response, 413, "request_entity_too_large")


def test_too_many_images_is_413(client: FlaskClient) -> None:
    files = [(io.BytesIO(image_bytes()), f"{i}.jpg") for i in range(5)]
    _error(client.post("/predict", data={"image": files}), 413, "too_many_images")


def test_too_many_pixels_is_413(client: FlaskClient) -> None:
    data = image_bytes(fmt="PNG", size=(1000, 1000), mode="L", color=0)
    _error(client.post("/predict", data=data, content_type="image/png"), 413, "image_too_large")


def test_unknown_route_and_method_are_json(client: FlaskClient) -> None:
    _error(client.get("/nope"), 404, "not_found")
    _error(client.get("/predict"), 405, "method_not_allowed")


def test_failing_forward_is_500_json_and_the_server_goes_on(client: FlaskClient, model: ColourModel) -> None:
    model.fail_when = 0.5  # red images make the forward pass raise
    _error(client.post("/predict", data=image_bytes(RED), content_type="image/jpeg"), 500, "inference_failed")
    assert client.get("/healthz").status_code == 200
    assert _labels(client.post("/predict", data=image_bytes(BLUE), content_type="image/jpeg")) == ["blue"]


def test_full_queue_is_429_with_retry_after(client: FlaskClient, model: ColourModel, service: Service) -> None:
    model.batch_sizes.clear()
    model.gate = threading.Event()  # park the worker inside a forward pass
    blocked = ThreadPoolExecutor(1).submit(
        client.post, "/predict", data=image_bytes(), content_type="image/jpeg")
    wait_until(lambda: bool(model.batch_sizes) and service.batcher.depth == 0)
    filler = [service.preprocess(image_bytes())] * service.settings.queue_size
    queued = service.batcher.submit_many(filler)
    response = client.post("/predict", data=image_bytes(), content_type="image/jpeg")
    _error(response, 429, "overloaded")
    assert int(response.headers["Retry-After"]) >= 1
    model.gate.set()
    assert blocked.result(timeout=10).status_code == 200
    assert all(f.result(timeout=10).batch_size >= 1 for f in queued)


def test_health_endpoints_and_draining(client: FlaskClient, service: Service) -> None:
    assert client.get("/healthz").get_json()["status"] == "alive"
    ready = client.get("/readyz")
    assert ready.status_code == 200 and all(ready.get_json()["checks"].values())
    service.begin_drain()
    assert client.get("/readyz").status_code == 503
    assert client.get("/healthz").status_code == 200  # liveness does not follow readiness
    response = client.post("/predict", data=image_bytes(), content_type="image/jpeg")
    _error(response, 503, "not_ready")
    assert response.headers["Retry-After"]


def test_dead_batcher_fails_liveness(client: FlaskClient, service: Service) -> None:
    service.batcher.stop(timeout=5)
    assert client.get("/healthz").status_code == 503
    assert client.get("/readyz").status_code == 503


def test_models_endpoint(client: FlaskClient) -> None:
    (info,) = client.get("/v1/models").get_json()["models"]
    assert info["name"] == "colour" and info["num_classes"] == 4 and info["device"] == "cpu"
    assert info["batching"]["max_batch_size"] == 4 and info["limits"]["max_images"] == 4
    assert info["warmed_batch_sizes"] == [1, 2, 3, 4] and info["ready"] is True
    assert "labels" not in info
    assert client.get("/v1/models?labels=1").get_json()["models"][0]["labels"] == ["red", "green", "blue", "other"]


def test_request_larger_than_max_batch_size_is_split(settings, predictor, model: ColourModel) -> None:  # noqa: ANN001
    from app import create_app

    app = create_app(settings.model_copy(update={"max_images": 6}), predictor)
    try:
        model.batch_sizes.clear()
        colors = [RED, GREEN, BLUE, RED, GREEN, BLUE]
        files = [(io.BytesIO(image_bytes(c)), f"{i}.jpg") for i, c in enumerate(colors)]
        response = app.test_client().post("/predict", data={"image": files})
        assert _labels(response) == ["red", "green", "blue", "red", "green", "blue"]
        assert model.batch_sizes == [4, 2]
        assert response.headers["X-Batch-Size"] == "4,4,4,4,2,2"
        assert 'batch;desc="4+2"' in response.headers["Server-Timing"]
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


@pytest.mark.parametrize("inline", [True, False])
def test_a_lone_request_runs_its_batch_inline_unless_turned_off(settings, predictor,  # noqa: ANN001
                                                                 inline: bool) -> None:
    from app import create_app

    app = create_app(settings.model_copy(update={"inline_when_idle": inline}), predictor)
    try:
        service: Service = app.extensions[EXTENSION_KEY]
        before = service.batcher.batches_run
        response = app.test_client().post("/predict", data=image_bytes(GREEN), content_type="image/jpeg")
        assert _labels(response) == ["green"] and response.headers["X-Batch-Size"] == "1"
        assert service.batcher.batches_run == before + 1
        assert service.batcher.batches_inline == (1 if inline else 0)
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


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


def test_a_bad_image_among_several_is_named_by_index_and_file_name(client: FlaskClient) -> None:
    # Before: one 400 that did not say which of the images was bad.
    files = [(io.BytesIO(image_bytes(RED)), "cat.jpg"), (io.BytesIO(b"not an image"), "notes.txt")]
    error = _error(client.post("/predict", data={"image": files}), 400, "invalid_image")
    assert error["message"].startswith("image 1 (notes.txt): ")
    assert error["details"]["image"] == 1 and error["details"]["filename"] == "notes.txt"
    body = {"images": [base64.b64encode(image_bytes(RED)).decode(), base64.b64encode(b"nope").decode()]}
    error = _error(client.post("/predict", json=body), 400, "invalid_image")
    assert error["message"].startswith("image 1: ") and error["details"]["image"] == 1


def test_a_wrong_multipart_field_says_which_fields_were_sent(client: FlaskClient) -> None:
    response = client.post("/predict", data={"file": (io.BytesIO(image_bytes()), "x.jpg")})
    assert "fields sent: 'file'" in _error(response, 400, "invalid_request")["message"]
    both = {"image": (io.BytesIO(image_bytes()), "x.jpg"), "file": (io.BytesIO(image_bytes()), "y.jpg")}
    assert "'file'" in _error(client.post("/predict", data=both), 400, "invalid_request")["message"]


@pytest.mark.parametrize("url, form", [("/predict?topk=1", None), ("/predict?top_k=1&format=json", None),
                                       ("/predict", {"topk": "1"})])
def test_unknown_parameters_are_refused_naming_the_known_ones(client: FlaskClient, url: str,
                                                              form: dict[str, str] | None) -> None:
    # Before: ignored silently, so a misspelt top_k quietly gave the default.
    if form is None:
        response = client.post(url, data=image_bytes(), content_type="image/jpeg")
    else:
        response = client.post(url, data={**form, "image": (io.BytesIO(image_bytes()), "x.jpg")})
    message = _error(response, 400, "invalid_request")["message"]
    assert "unknown" in message and "known: " in message and "top_k" in message.split("known: ")[1]


def test_a_deadline_shorter_than_one_forward_pass_is_400_without_retry_after(client: FlaskClient) -> None:
    # Before: 429 deadline_unreachable on an idle server, inviting a retry that could never succeed.
    assert _labels(client.post("/predict", data=image_bytes(RED), content_type="image/jpeg")) == ["red"]
    response = client.post("/predict", data=image_bytes(RED), content_type="image/jpeg",
                           headers={"X-Request-Timeout": "1"})
    _error(response, 400, "deadline_too_short")
    assert "Retry-After" not in response.headers


def test_scores_are_rounded_to_the_configured_digits(settings: Settings, predictor) -> None:  # noqa: ANN001
    from app import create_app

    app = create_app(settings.model_copy(update={"score_digits": 3}), predictor)
    try:
        body = app.test_client().post("/predict", data=image_bytes(GREEN), content_type="image/jpeg").get_json()
        scores = [s["score"] for p in body["predictions"] for s in p["top_k"]]
        assert all(round(s, 3) == s for s in scores) and any(s != 0 for s in scores)
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_the_default_queue_holds_several_maximum_size_requests(predictor) -> None:  # noqa: ANN001
    # Before: a 64-image queue, so six concurrent 16-image requests on an idle server got two 429s.
    from app import create_app

    defaults = Settings(device="cpu", max_batch_size=4, auto_batch_size=False, max_wait_ms=5)
    assert defaults.resolved_queue_size() == 8 * defaults.max_images == 128
    app = create_app(defaults, predictor)
    model = predictor.model
    try:
        model.gate = threading.Event()
        client = app.test_client()
        files = lambda: {"image": [(io.BytesIO(image_bytes(RED)), f"{i}.jpg") for i in range(16)]}  # noqa: E731
        with ThreadPoolExecutor(6) as pool:
            calls = [pool.submit(client.post, "/predict", data=files()) for _ in range(6)]
            wait_until(lambda: app.extensions[EXTENSION_KEY].batcher.depth >= 80)
            model.gate.set()
            assert [c.result(timeout=30).status_code for c in calls] == [200] * 6
    finally:
        model.gate = None
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)



def test_a_request_for_another_model_or_version_is_404_naming_the_served_one(client: FlaskClient,
                                                                             service: Service) -> None:
    manifest = service.predictor.manifest
    ok = client.post(f"/predict?model={manifest.name}&version={manifest.version}", data=image_bytes(),
                     content_type="image/jpeg")
    assert ok.status_code == 200
    for query in ("model=nope", f"model={manifest.name}&version=999"):
        error = _error(client.post(f"/predict?{query}", data=image_bytes(), content_type="image/jpeg"),
                       404, "not_found")
        assert f"serves {manifest.name!r} version {manifest.version!r}" in error["message"]
        assert error["details"]["models"] == [{"name": manifest.name, "versions": [manifest.version],
                                               "default": manifest.version}]
