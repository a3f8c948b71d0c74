"""Embeddings served (#52): asked for by name on /predict and V2, from the same forward pass as the probabilities,
refused with a JSON 400 naming the problem, carried across the engine link; nothing more when not asked for."""
from __future__ import annotations

import base64
import json
from typing import Iterator

import numpy as np
import pytest
from flask import Flask
from flask.testing import FlaskClient

from app import EXTENSION_KEY
from app.config import Settings
from app.engine.loaded.predictor import Predictor
from app.factory import create_app
from tests.support.fakes import ColourModel, tiny_manifest
from tests.support.imaging import BLUE, RED, image_bytes


@pytest.fixture
def embedding_app(settings: Settings) -> Iterator[Flask]:
    model = ColourModel(embedding=True)
    app = create_app(settings, Predictor(model, tiny_manifest(embedding=True), device="cpu"))
    app.config["model"] = model
    yield app
    app.extensions[EXTENSION_KEY].shutdown(timeout=5)


@pytest.fixture
def embedding_client(embedding_app: Flask) -> FlaskClient:
    return embedding_app.test_client()


def _expected(colour: tuple[int, int, int]) -> np.ndarray:
    """ColourModel's embedding of a flat colour: its channel means on -1..1 shifted by 1, L2-normalised."""
    means = (np.array(colour, dtype=np.float64) / 255 - 0.5) / 0.5 + 1
    return means / np.linalg.norm(means)


def test_predict_answers_the_embedding_beside_the_labels_in_every_request_form(embedding_client: FlaskClient) -> None:
    red, blue = image_bytes(RED), image_bytes(BLUE)
    raw = embedding_client.post("/predict?outputs=labels,embedding", data=red, content_type="image/jpeg")
    form = embedding_client.post("/predict", data={"image": [(_file(red), "r.jpg"), (_file(blue), "b.jpg")],
                                                   "outputs": "embedding"}, content_type="multipart/form-data")
    as_json = embedding_client.post("/predict", json={"images": [base64.b64encode(blue).decode()],
                                                      "outputs": ["embedding", "labels"]})
    assert raw.status_code == form.status_code == as_json.status_code == 200, (raw.json, form.json, as_json.json)
    assert raw.json["predictions"][0]["label"] == "red" and len(raw.json["embeddings"]) == 1
    assert "predictions" not in form.json and len(form.json["embeddings"]) == 2  # embedding alone: no labels
    assert as_json.json["predictions"][0]["label"] == "blue"
    for got, colour in ((raw.json["embeddings"][0], RED), (form.json["embeddings"][0], RED),
                        (form.json["embeddings"][1], BLUE), (as_json.json["embeddings"][0], BLUE)):
        assert np.linalg.norm(got) == pytest.approx(1, abs=1e-5)
        assert np.allclose(got, _expected(colour), atol=0.03)  # JPEG moves a flat colour by a few levels


def test_under_bfloat16_the_embeddings_are_still_of_unit_length(settings: Settings) -> None:
    # Before: normalised in bfloat16 by the model, then only widened to float32: lengths off by up to about 1%, so
    # their dot products were no cosine similarities.
    import torch

    predictor = Predictor(ColourModel(embedding=True), tiny_manifest(embedding=True), device="cpu",
                          dtype=torch.bfloat16)
    app = create_app(settings.model_copy(update={"dtype": "bfloat16"}), predictor)
    try:
        for colour in (RED, BLUE, (90, 200, 40), (250, 250, 250)):
            answer = app.test_client().post("/predict?outputs=embedding", data=image_bytes(colour),
                                            content_type="image/jpeg")
            assert answer.status_code == 200, answer.json
            (got,) = answer.json["embeddings"]
            assert np.linalg.norm(got) == pytest.approx(1, abs=1e-5), colour
            assert np.allclose(got, _expected(colour), atol=0.03)
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_a_request_that_does_not_ask_gets_no_embedding_and_the_same_probabilities(embedding_client: FlaskClient,
                                                                                   client: FlaskClient) -> None:
    red = image_bytes(RED)
    plain = embedding_client.post("/predict?top_k=4", data=red, content_type="image/jpeg").json
    without_embedding_model = client.post("/predict?top_k=4", data=red, content_type="image/jpeg").json
    assert "embeddings" not in plain
    assert plain["predictions"] == without_embedding_model["predictions"]


def test_one_forward_pass_answers_both(embedding_app: Flask, embedding_client: FlaskClient) -> None:
    model = embedding_app.config["model"]
    before = len(model.batch_sizes)
    assert embedding_client.post("/predict?outputs=labels,embedding", data=image_bytes(RED),
                                 content_type="image/jpeg").status_code == 200
    assert len(model.batch_sizes) == before + 1


@pytest.mark.parametrize("outputs, fragment", [("embeding", "'embeding'"), ("labels,probabilities", "'probabilities'"),
                                               ("", "nothing")])
def test_an_unknown_output_is_a_400_naming_it(embedding_client: FlaskClient, outputs: str, fragment: str) -> None:
    answer = embedding_client.post(f"/predict?outputs={outputs}", data=image_bytes(RED), content_type="image/jpeg")
    assert answer.status_code == 400 and answer.json["error"]["code"] == "unknown_output"
    assert fragment in answer.json["error"]["message"] and "'embedding'" in answer.json["error"]["message"]


def test_an_embedding_asked_of_a_model_exported_without_one_is_a_400_saying_so(client: FlaskClient) -> None:
    answer = client.post("/predict?outputs=embedding", data=image_bytes(RED), content_type="image/jpeg")
    assert answer.status_code == 400 and answer.json["error"]["code"] == "no_embedding"
    assert "exported without an embedding" in answer.json["error"]["message"]
    v2 = client.post("/v2/models/colour/infer", json=_v2_request(image_bytes(RED), [{"name": "embedding"}]))
    assert v2.status_code == 400 and "exported without an embedding" in v2.json["error"]


def _file(data: bytes):  # noqa: ANN202 - a file object for the test client's multipart form
    import io

    return io.BytesIO(data)


def _v2_request(image: bytes, outputs: list[dict[str, object]]) -> dict[str, object]:
    return {"inputs": [{"name": "images", "datatype": "BYTES", "shape": [1], "data": [base64.b64encode(image).decode()]}],
            "parameters": {"binary_data_output": False}, "outputs": outputs}


def test_v2_lists_and_answers_the_embedding_output_in_json_and_binary(embedding_client: FlaskClient) -> None:
    metadata = embedding_client.get("/v2/models/colour").json
    assert {"name": "embedding", "datatype": "FP32", "shape": [-1, 3]} in metadata["outputs"]
    pixels = np.full((1, 3, 8, 8), 0.9, dtype=np.float32)  # preprocessed: every channel alike
    header = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 3, 8, 8],
                          "parameters": {"binary_data_size": pixels.nbytes}}],
              "outputs": [{"name": "probabilities", "parameters": {"classification": 2}},
                          {"name": "embedding", "parameters": {"binary_data": True}}]}
    head = json.dumps(header).encode()
    answer = embedding_client.post("/v2/models/colour/infer", data=head + pixels.tobytes(),
                                   headers={"Inference-Header-Content-Length": str(len(head))},
                                   content_type="application/octet-stream")
    assert answer.status_code == 200, answer.data[:300]
    length = int(answer.headers["Inference-Header-Content-Length"])
    outputs = {o["name"]: o for o in json.loads(answer.data[:length])["outputs"]}
    assert outputs["embedding"]["shape"] == [1, 3] and outputs["embedding"]["parameters"]["binary_data_size"] == 12
    vector = np.frombuffer(answer.data[length:length + 12], dtype=np.float32)
    assert np.allclose(vector, np.full(3, 3 ** -0.5), atol=1e-6)
    assert outputs["probabilities"]["datatype"] == "BYTES"  # the top 2, as JSON beside the binary embedding
    as_json = embedding_client.post("/v2/models/colour/infer", json=_v2_request(image_bytes(RED),
                                                                               [{"name": "embedding"}]))
    (only,) = as_json.json["outputs"]
    assert only["name"] == "embedding" and np.allclose(only["data"], _expected(RED), atol=0.03)


def test_v2_refuses_an_unknown_output_and_classification_of_the_embedding(embedding_client: FlaskClient) -> None:
    unknown = embedding_client.post("/v2/models/colour/infer", json=_v2_request(image_bytes(RED),
                                                                               [{"name": "features"}]))
    assert unknown.status_code == 400 and "'features'" in unknown.json["error"]
    assert "'probabilities', 'embedding'" in unknown.json["error"]
    classified = embedding_client.post("/v2/models/colour/infer", json=_v2_request(
        image_bytes(RED), [{"name": "embedding", "parameters": {"classification": 2}}]))
    assert classified.status_code == 400 and "classification" in classified.json["error"]


def test_v1_models_says_what_the_embedding_is(embedding_client: FlaskClient, client: FlaskClient) -> None:
    (info,) = embedding_client.get("/v1/models").json["models"]
    assert info["embedding"] == {"layer": "head", "dim": 3, "normalization": "l2"}
    assert client.get("/v1/models").json["models"][0]["embedding"] is None
