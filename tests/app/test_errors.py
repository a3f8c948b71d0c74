"""Deadlines, auth, metrics and the full list of bad inputs, through the app factory with the fake model."""
from __future__ import annotations

import base64
import io
import re
import struct
import threading
import time
import zlib
from pathlib import Path

import pytest
from flask.testing import FlaskClient
from PIL import Image

from app import EXTENSION_KEY, create_app
from app.config import Settings
from app.engine.predictor import Predictor
from tests.support.fakes import ColourModel
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


# Every bad input of the hardening list: (request, status, error code). Good-but-unusual images answer 200.
BAD_INPUTS = {
    "empty body": (_raw(b""), 400, "invalid_image"),
    "wrong content type": (_raw(b"hello", "text/plain"), 415, "unsupported_media_type"),
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
    "images not a list": ({"json": {"images": 3}}, 422, "validation_error"),
    "image not a string": ({"json": {"images": [3]}}, 422, "validation_error"),
    "top_k 0": ({"json": {"images": [_b64(image_bytes())], "top_k": 0}}, 422, "validation_error"),
    "top_k -1": ({"json": {"images": [_b64(image_bytes())], "top_k": -1}}, 422, "validation_error"),
    "top_k 10^9": ({"json": {"images": [_b64(image_bytes())], "top_k": 10**9}}, 400, "invalid_request"),
    "top_k true": ({"json": {"images": [_b64(image_bytes())], "top_k": True}}, 422, "validation_error"),
    "top_k abc": ({"json": {"images": [_b64(image_bytes())], "top_k": "abc"}}, 422, "validation_error"),
    "too many images": ({"json": {"images": [_b64(image_bytes())] * 5}}, 413, "too_many_images"),
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
    response = client.post("/predict", **kwargs)
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.get_json()["error"]["code"] == code
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


def test_metrics_count_requests_batches_and_rejections(client: FlaskClient) -> None:
    client.post("/predict", **_raw(image_bytes()))
    client.post("/predict", **_raw(b"junk"))
    text = client.get("/metrics").get_data(as_text=True)
    assert 'visionserve_requests_total{endpoint="/predict",status="200"}' in text
    assert 'visionserve_requests_total{endpoint="/predict",status="400"}' in text
    for name in ("visionserve_batch_size_bucket", 'visionserve_stage_duration_seconds_count{stage="decode"}',
                 'stage="queue"', 'stage="inference"', "visionserve_queue_depth",
                 'visionserve_model_info{device="cpu",dtype="float32",name="colour",version="test"} 1.0'):
        assert name in text
    cpu = {m.group(1): float(m.group(2)) for m in
           re.finditer(r'^visionserve_stage_cpu_seconds_total\{stage="(\w+)"\} (\S+)$', text, re.M)}
    assert cpu["decode"] > 0 and cpu["inference"] > 0


def test_cuda_out_of_memory_splits_the_batch_and_lowers_the_cap(client: FlaskClient, model: ColourModel) -> None:
    model.batch_sizes.clear()
    model.oom_above = 1
    files = [(io.BytesIO(image_bytes(c)), f"{i}.jpg") for i, c in enumerate((RED, BLUE, RED, BLUE))]
    response = client.post("/predict", data={"image": files})
    assert response.status_code == 200
    assert [p["label"] for p in response.get_json()["predictions"]] == ["red", "blue", "red", "blue"]
    assert model.batch_sizes == [4, 2, 1, 1, 2, 1, 1]
    assert client.get("/v1/models").get_json()["models"][0]["batching"]["current_max_batch_size"] == 1
    assert 'visionserve_batcher_events_total{event="batch_split"}' in client.get("/metrics").get_data(as_text=True)


def test_cors_is_off_by_default_and_answers_preflights_for_allowed_origins(settings: Settings,
                                                                           predictor) -> None:  # noqa: ANN001
    from app import EXTENSION_KEY, create_app

    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, x-request-timeout"}
    off = create_app(settings, predictor)
    on = create_app(Settings.model_validate({**settings.model_dump(), "api_key": "k",
                                             "cors_origins": "https://app.example, https://other.example/"}),
                    predictor)
    try:
        answer = off.test_client().post("/predict", data=image_bytes(), content_type="image/jpeg",
                                        headers={"Origin": "https://app.example"})
        assert answer.status_code == 200 and "Access-Control-Allow-Origin" not in answer.headers
        client = on.test_client()
        answer = client.options("/predict", headers=preflight)  # no key: browsers send preflights without one
        assert answer.status_code == 204
        assert answer.headers["Access-Control-Allow-Origin"] == "https://app.example"
        assert "POST" in answer.headers["Access-Control-Allow-Methods"]
        assert "X-Request-Timeout" in answer.headers["Access-Control-Allow-Headers"]
        stranger = client.options("/predict", headers={**preflight, "Origin": "https://evil.example"})
        assert "Access-Control-Allow-Origin" not in stranger.headers
        answer = client.post("/predict", data=image_bytes(), content_type="image/jpeg",
                             headers={"Origin": "https://other.example", "Authorization": "Bearer k"})
        assert answer.status_code == 200 and answer.headers["Access-Control-Allow-Origin"] == "https://other.example"
        assert "Server-Timing" in answer.headers["Access-Control-Expose-Headers"]
        assert "Origin" in answer.headers["Vary"]
        refused = client.post("/predict", data=image_bytes(), content_type="image/jpeg",
                              headers={"Origin": "https://app.example"})  # CORS is no way around the key
        assert refused.status_code == 401 and refused.headers["Access-Control-Allow-Origin"] == "https://app.example"
    finally:
        for app in (off, on):
            app.extensions[EXTENSION_KEY].shutdown(timeout=5)
