"""tritonclient.http, unmodified, against the real gunicorn server on the real model; answers equal /predict's."""
from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
import requests
import skimage.data
import tritonclient.http as triton
from PIL import Image
from tritonclient.utils import InferenceServerException

from harness.servers import Running
from models.export.manifest import read_manifest
from models.presets import eval_transform
from tests.support.imaging import encode

MODEL = "efficientnet_lite0"
PHOTOS = {"chelsea": "tiger cat", "coffee": "espresso"}


@pytest.fixture(scope="module")
def server(live_server: Running) -> Running:
    return live_server


@pytest.fixture(scope="module")
def client(server: Running) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(server.url.removeprefix("http://"))


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    return [encode(Image.fromarray(getattr(skimage.data, name)()), "JPEG") for name in PHOTOS]


@pytest.fixture(scope="module")
def predict_scores(server: Running, photos: list[bytes]) -> np.ndarray:
    """/predict's probabilities for every class of each photo."""
    rows = []
    for photo in photos:
        body = requests.post(f"{server.url}/predict?top_k=1000", data=photo, headers={"Content-Type": "image/jpeg"},
                             timeout=60).json()
        row = np.zeros(1000, dtype=np.float32)
        for entry in body["predictions"][0]["top_k"]:
            row[entry["index"]] = entry["score"]
        rows.append(row)
    return np.stack(rows)


def _images(photos: list[bytes], binary: bool) -> triton.InferInput:
    tensor = triton.InferInput("images", [len(photos)], "BYTES")
    # In JSON, BYTES elements are base64 strings (JSON cannot carry raw image bytes).
    values = photos if binary else [base64.b64encode(p).decode() for p in photos]
    tensor.set_data_from_numpy(np.array(values, dtype=object), binary_data=binary)
    return tensor


def test_health_and_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    meta = client.get_model_metadata(MODEL)
    assert meta["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 1000]},
                               {"name": "embedding", "datatype": "FP32", "shape": [-1, 1280]}]
    assert not client.is_model_ready(MODEL, model_version="999")
    config = client.get_model_config(MODEL)  # what perf_analyzer reads: the batch limit and the inputs' dims
    assert config["max_batch_size"] > 0 and config["input"][1]["dims"] == meta["inputs"][1]["shape"][1:]


@pytest.mark.parametrize("binary", [True, False])
def test_bytes_input_equals_predict(client: triton.InferenceServerClient, photos: list[bytes],
                                    predict_scores: np.ndarray, binary: bool) -> None:
    outputs = [triton.InferRequestedOutput("probabilities", binary_data=binary)]
    result = client.infer(MODEL, [_images(photos, binary)], outputs=outputs)
    assert np.allclose(result.as_numpy("probabilities"), predict_scores, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_answers_compressed_as_the_client_asks(client: triton.InferenceServerClient, server: Running,
                                               photos: list[bytes], predict_scores: np.ndarray, algorithm: str) -> None:
    # tritonclient asks with Accept-Encoding and decompresses by Content-Encoding: a JSON answer compressed, the
    # binary one sent as it is; both read the same as uncompressed
    for binary in (False, True):
        outputs = [triton.InferRequestedOutput("probabilities", binary_data=binary)]
        result = client.infer(MODEL, [_images(photos, True)], outputs=outputs,
                              response_compression_algorithm=algorithm)
        assert np.allclose(result.as_numpy("probabilities"), predict_scores, atol=1e-6)
        body = {"inputs": [{"name": "images", "datatype": "BYTES", "shape": [1],
                            "data": [base64.b64encode(photos[0]).decode()]}],
                "outputs": [{"name": "probabilities", "parameters": {"binary_data": binary}}]}
        answer = requests.post(f"{server.url}/v2/models/{MODEL}/infer", json=body, timeout=60,
                               headers={"Accept-Encoding": algorithm})
        assert answer.status_code == 200
        assert answer.headers.get("Content-Encoding") == (None if binary else algorithm)


@pytest.mark.parametrize("binary", [True, False])
def test_fp32_input_preprocessed_by_the_client(client: triton.InferenceServerClient, real_weights: Path,
                                               photos: list[bytes], predict_scores: np.ndarray, binary: bool) -> None:
    transform = eval_transform(read_manifest(real_weights).preprocess)
    pixels = np.stack([transform(Image.fromarray(getattr(skimage.data, n)())).numpy() for n in PHOTOS])
    tensor = triton.InferInput("pixels", list(pixels.shape), "FP32")
    tensor.set_data_from_numpy(pixels, binary_data=binary)
    result = client.infer(MODEL, [tensor])  # no outputs named: tritonclient asks for binary outputs
    # The server decoded a JPEG of the photo, the client used the raw pixels: close, not identical.
    got = result.as_numpy("probabilities")
    assert got.argmax(1).tolist() == predict_scores.argmax(1).tolist()
    assert np.abs(got - predict_scores).max() < 0.05


@pytest.mark.parametrize("binary", [True, False])
def test_the_embedding_output_equals_predict_s(client: triton.InferenceServerClient, server: Running,
                                               photos: list[bytes], binary: bool) -> None:
    outputs = [triton.InferRequestedOutput("embedding", binary_data=binary),
               triton.InferRequestedOutput("probabilities", class_count=1)]
    result = client.infer(MODEL, [_images(photos, True)], outputs=outputs)
    vectors = result.as_numpy("embedding")
    assert vectors.dtype == np.float32 and vectors.shape == (2, 1280)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    by_predict = [requests.post(f"{server.url}/predict?outputs=embedding", data=photo, timeout=60,
                                headers={"Content-Type": "image/jpeg"}).json()["embeddings"][0] for photo in photos]
    assert np.allclose(vectors, np.array(by_predict, dtype=np.float32), atol=1e-6)
    assert [row[0].decode().split(":", 2)[2] for row in result.as_numpy("probabilities")] == list(PHOTOS.values())


def test_classification_extension(client: triton.InferenceServerClient, photos: list[bytes]) -> None:
    outputs = [triton.InferRequestedOutput("probabilities", class_count=3)]
    top = client.infer(MODEL, [_images(photos, True)], outputs=outputs).as_numpy("probabilities")
    assert top.shape == (2, 3)
    assert [row[0].decode().split(":", 2)[2] for row in top] == list(PHOTOS.values())


def test_errors_reach_the_client_with_status_and_message(client: triton.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as caught:
        client.infer("no-such-model", [_images([b"x"], True)])
    assert caught.value.status() == "404" and "efficientnet_lite0" in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:
        client.infer(MODEL, [_images([b"not a picture"], True)])
    assert caught.value.status() == "400" and "not an image" in caught.value.message()
