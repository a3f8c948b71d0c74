"""Answers compressed on request (app/web/compression.py) through the app factory with the fake colour model."""
from __future__ import annotations

import base64
import gzip
import json
import zlib
from typing import Iterator

import pytest
from flask import Flask, Response
from flask.testing import FlaskClient

from app import EXTENSION_KEY
from app.config import Settings
from app.engine.loaded.predictor import Predictor
from app.factory import create_app
from app.web.compression import compressible
from tests.support.imaging import BLUE, RED, image_bytes

INFER = "/v2/models/colour/infer"


def _infer_body(binary_output: bool) -> dict:
    images = [base64.b64encode(image_bytes(colour)).decode() for colour in (RED, BLUE, RED, BLUE)]
    return {"inputs": [{"name": "images", "datatype": "BYTES", "shape": [4], "data": images}],
            "outputs": [{"name": "probabilities", "parameters": {"binary_data": binary_output}}]}


@pytest.mark.parametrize(("accept", "coding"), [
    ("gzip, deflate", "gzip"), ("deflate, gzip", "gzip"), ("gzip;q=0, deflate", "deflate"),
    ("deflate;q=0.5, gzip;q=0.4", "deflate"), ("*", "gzip"), ("GZIP", "gzip"),
    (None, None), ("identity", None), ("br", None), ("*;q=0", None)])
def test_a_large_json_answer_goes_out_in_the_coding_the_request_takes(client: FlaskClient, accept: str | None,
                                                                       coding: str | None) -> None:
    plain = client.get("/openapi.json")
    assert plain.status_code == 200 and "Content-Encoding" not in plain.headers
    answer = client.get("/openapi.json", headers={"Accept-Encoding": accept} if accept else {})
    assert answer.status_code == 200 and "Accept-Encoding" in answer.vary
    assert answer.headers.get("Content-Encoding") == coding
    sent = answer.get_data()
    assert int(answer.headers["Content-Length"]) == len(sent)
    if coding is None:
        assert sent == plain.get_data()
        return
    assert len(sent) < len(plain.get_data()) / 3
    assert (gzip.decompress(sent) if coding == "gzip" else zlib.decompress(sent)) == plain.get_data()


def test_small_answers_and_errors_go_out_as_they_are(client: FlaskClient) -> None:
    headers = {"Accept-Encoding": "gzip", "Content-Type": "image/png"}
    answer = client.post("/predict", data=image_bytes(RED), headers=headers)
    refused = client.post("/predict", data=b"not an image", headers=headers)
    assert (answer.status_code, refused.status_code) == (200, 400)
    for small in (answer, refused):
        assert "Content-Encoding" not in small.headers and "Accept-Encoding" not in small.vary
        assert small.get_json()


@pytest.fixture
def compressing_app(settings: Settings, predictor: Predictor) -> Iterator[Flask]:
    app = create_app(settings.model_copy(update={"answer_compression_min_bytes": 64}), predictor)
    yield app
    app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_v2_json_answers_compressed_binary_tensors_not(compressing_app: Flask) -> None:
    client = compressing_app.test_client()
    plain = client.post(INFER, json=_infer_body(False))
    compressed = client.post(INFER, json=_infer_body(False), headers={"Accept-Encoding": "gzip"})
    assert compressed.headers["Content-Encoding"] == "gzip"
    assert json.loads(gzip.decompress(compressed.get_data())) == plain.get_json()
    binary = client.post(INFER, json=_infer_body(True), headers={"Accept-Encoding": "gzip"})
    assert binary.status_code == 200 and binary.mimetype == "application/octet-stream"
    assert "Content-Encoding" not in binary.headers  # float32 tensors hardly shrink
    header = json.loads(binary.get_data()[:int(binary.headers["Inference-Header-Content-Length"])])
    assert header["outputs"][0]["parameters"]["binary_data_size"] == 4 * 4 * 4


def test_zero_turns_compression_off(settings: Settings, predictor: Predictor) -> None:
    app = create_app(settings.model_copy(update={"answer_compression_min_bytes": 0}), predictor)
    try:
        answer = app.test_client().get("/openapi.json", headers={"Accept-Encoding": "gzip"})
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)
    assert "Content-Encoding" not in answer.headers and "Accept-Encoding" not in answer.vary


@pytest.mark.parametrize(("response", "expected"), [
    (Response(b"x" * 100, mimetype="application/json"), True),
    (Response(b"x" * 100, mimetype="text/plain"), True),
    (Response(b"x" * 100, mimetype="application/problem+json"), True),
    (Response(b"x" * 99, mimetype="application/json"), False),  # under the limit
    (Response(b"x" * 100, mimetype="image/png"), False),  # compressed already
    (Response(b"x" * 100, mimetype="application/octet-stream"), False),
    (Response(b"x" * 100, mimetype="application/json", headers={"Content-Encoding": "gzip"}), False),
    (Response(b"x" * 100, mimetype="application/json", headers={"Cache-Control": "no-transform"}), False),
    (Response(iter([b"x" * 100]), mimetype="application/json"), False),  # streamed
    (Response(status=204), False),
])
def test_what_may_be_compressed(response: Response, expected: bool) -> None:
    assert compressible(response, 100) is expected
