"""The Open Inference Protocol (V2) routes through the app factory with the fake colour model: shapes and errors."""
from __future__ import annotations

import base64
import json
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from flask.testing import FlaskClient

from app.engine.service import Service
from tests.support.fakes import ColourModel, wait_until
from tests.support.imaging import BLUE, GREEN, RED, image_bytes

INFER = "/v2/models/colour/infer"


def _bytes_input(*images: bytes) -> dict[str, Any]:
    return {"name": "images", "datatype": "BYTES", "shape": [len(images)],
            "data": [base64.b64encode(i).decode() for i in images]}


def _binary_body(header: dict[str, Any], blob: bytes) -> tuple[bytes, dict[str, str]]:
    encoded = json.dumps(header).encode()
    return encoded + blob, {"Inference-Header-Content-Length": str(len(encoded)),
                            "Content-Type": "application/octet-stream"}


def _v2_error(response, status: int) -> str:  # noqa: ANN001
    assert response.status_code == status, response.get_data(as_text=True)
    body = response.get_json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
    return body["error"]


def test_metadata_health_and_versions(client: FlaskClient) -> None:
    assert client.get("/v2").get_json()["extensions"] == ["classification", "binary_tensor_data", "model_repository"]
    assert client.get("/v2/health/live").status_code == 200
    assert client.get("/v2/health/ready").status_code == 200
    assert client.get("/v2/models/colour/ready").status_code == 200
    meta = client.get("/v2/models/colour/versions/test").get_json()
    assert meta["inputs"][1] == {"name": "pixels", "datatype": "FP32", "shape": [-1, 3, 8, 8]}
    assert meta["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 4]}]
    assert "no model 'colour' version '2' is loaded; this server serves 'colour' version 'test'" in _v2_error(
        client.get("/v2/models/colour/versions/2"), 404)
    _v2_error(client.get("/v2/models/other"), 404)


def test_json_bytes_input_gives_probabilities_and_classification(client: FlaskClient) -> None:
    body = {"id": "r1", "inputs": [_bytes_input(image_bytes(RED), image_bytes(BLUE))],
            "outputs": [{"name": "probabilities"}, {"name": "probabilities", "parameters": {"classification": 2}}]}
    answer = client.post(INFER, json=body)
    assert answer.status_code == 200, answer.get_data(as_text=True)
    out = answer.get_json()
    assert out["id"] == "r1" and out["model_name"] == "colour" and out["model_version"] == "test"
    probabilities, top = out["outputs"]
    assert probabilities["shape"] == [2, 4]
    assert np.argmax(np.reshape(probabilities["data"], (2, 4)), 1).tolist() == [0, 2]
    assert top["datatype"] == "BYTES" and top["shape"] == [2, 2]
    assert top["data"][0].split(":")[1:] == ["0", "red"] and top["data"][2].split(":")[1:] == ["2", "blue"]
    assert "Server-Timing" in answer.headers


def test_binary_pixels_in_and_binary_classification_out(client: FlaskClient) -> None:
    pixels = np.zeros((1, 3, 8, 8), dtype=np.float32)
    pixels[0, 1] = 1.0  # green after normalisation
    header = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 3, 8, 8],
                          "parameters": {"binary_data_size": pixels.nbytes}}],
              "outputs": [{"name": "probabilities", "parameters": {"classification": 1, "binary_data": True}}]}
    body, headers = _binary_body(header, pixels.tobytes())
    answer = client.post(INFER, data=body, headers=headers)
    assert answer.status_code == 200, answer.get_data(as_text=True)
    size = int(answer.headers["Inference-Header-Content-Length"])
    meta, blob = json.loads(answer.data[:size]), answer.data[size:]
    assert meta["outputs"][0]["parameters"]["binary_data_size"] == len(blob)
    (length,) = struct.unpack_from("<I", blob)
    assert blob[4:4 + length].decode().endswith(":1:green")


@pytest.mark.parametrize("body, message", [
    ({"inputs": []}, "non-empty 'inputs'"),
    ({"inputs": [{"name": "images", "datatype": "BYTES", "shape": [2], "data": ["aGk="]}]}, "needs 2 values"),
    ({"inputs": [{"name": "images", "datatype": "BYTES", "shape": [1], "data": ["%%%"]}]}, "not valid base64"),
    ({"inputs": [{"name": "images", "datatype": "BYTES", "shape": [1], "data": ["aGk="]}]}, "not an image"),
    ({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 3, 4, 4], "data": [0.0] * 48}]}, "shape"),
    ({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 3, 8, 8], "data": [float("nan")] * 192}]},
     "NaN"),
    ({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1], "data": ["x"]}]}, "not FP32"),
    ({"inputs": [{"name": "tensor", "datatype": "INT8", "shape": [1], "data": [1]}]}, "unknown input"),
    ({"inputs": [{"name": "images", "datatype": "STRING", "shape": [1], "data": [1]}]}, "not supported"),
    ({"inputs": [{"name": "images", "datatype": "BYTES", "shape": [-1], "data": []}]}, "non-negative"),
    ({"inputs": [{"name": "images", "datatype": "BYTES", "shape": [1]}]}, "neither 'data'"),
    ({"inputs": [_bytes_input(image_bytes(RED))], "outputs": [{"name": "logits"}]}, "unknown output"),
    ({"inputs": [_bytes_input(image_bytes(RED))],
      "outputs": [{"name": "probabilities", "parameters": {"classification": "3"}}]}, "classification"),
])
def test_bad_requests_get_400_in_the_protocol_error_shape(client: FlaskClient, body: dict, message: str) -> None:
    assert message in _v2_error(client.post(INFER, json=body), 400)


_PIXELS = {"name": "pixels", "datatype": "FP32", "shape": [1, 3, 8, 8], "data": [0.0] * 192}


@pytest.mark.parametrize("body, headers, message", [
    ({"inputs": [{**_PIXELS, "datatype": ["FP32"]}]}, {}, "not supported"),  # unhashable: a TypeError before
    ({"inputs": [{**_PIXELS, "parameters": [1]}]}, {}, "input 'pixels': 'parameters' must be an object"),
    ({"inputs": [{"name": "images", "datatype": "UINT8", "shape": [1], "data": [-1]}]}, {}, "not UINT8"),
    ({"inputs": [{"name": "images", "datatype": "INT64", "shape": [1], "data": [2 ** 70]}]}, {}, "not INT64"),
    ({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [0, 2 ** 62, 2 ** 62], "data": []}]}, {},
     "cannot be made"),
    ({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [0] * 65, "data": []}]}, {}, "cannot be made"),
    ({"inputs": [_PIXELS], "outputs": [{"name": "probabilities", "parameters": [1]}]}, {},
     "output 'probabilities': 'parameters' must be an object"),
    ({"inputs": [_PIXELS], "parameters": "x"}, {}, "the request: 'parameters' must be an object"),
    ({"inputs": [_PIXELS]}, {"Inference-Header-Content-Length": "\u00b2"}, "does not fit"),  # a digit to isdigit()
    ({"inputs": [_PIXELS]}, {"Inference-Header-Content-Length": "9" * 5000}, "does not fit"),  # past int()'s limit
])
def test_malformed_tensors_are_400_and_no_failure_of_the_version(client: FlaskClient, service: Service,
                                                                 body: dict, headers: dict, message: str) -> None:
    # Each was a 500 (a TypeError, AttributeError, OverflowError or ValueError in the parse), and a 500 counts as a
    # failure of the version serving it: one bad request rolled a watched default back or held a canary.
    (route,) = [row for row in service.catalog.index() if row.state == "READY"]
    traffic = service.controller.evidence.traffic(route.name, route.version)
    assert message in _v2_error(client.post(INFER, data=json.dumps(body), content_type="application/json",
                                            headers=headers), 400)
    answered = client.post(INFER, json={"inputs": [_PIXELS], "parameters": {"timeout": 10 ** 400}})
    assert answered.status_code == 200  # a timeout past a float's range: the announced deadline
    assert traffic.failures == 0 and traffic.requests == 1


def test_bad_binary_framing_and_limits(client: FlaskClient, settings: Any) -> None:
    def framed(size: int, blob: bytes) -> tuple[bytes, dict[str, str]]:
        return _binary_body({"inputs": [{"name": "images", "datatype": "BYTES", "shape": [1],
                                         "parameters": {"binary_data_size": size}}]}, blob)

    body, headers = framed(99, b"\x05\x00\x00\x00abcde")
    assert "runs past the end of the body" in _v2_error(client.post(INFER, data=body, headers=headers), 400)
    body, headers = framed(7, b"\x05\x00\x00\x00abc")
    assert "past the end of the data" in _v2_error(client.post(INFER, data=body, headers=headers), 400)
    body, headers = framed(9, b"\x05\x00\x00\x00abcdef")
    assert "no input claims" in _v2_error(client.post(INFER, data=body, headers=headers), 400)
    headers["Inference-Header-Content-Length"] = "100000"
    assert "does not fit" in _v2_error(client.post(INFER, data=body, headers=headers), 400)
    assert "not valid JSON" in _v2_error(client.post(INFER, data=b"{", content_type="application/json"), 400)
    deep = b'{"inputs": ' + b"[" * 50000 + b"]" * 50000 + b"}"
    assert "nested too deeply" in _v2_error(client.post(INFER, data=deep, content_type="application/json"), 400)
    many = {"inputs": [_bytes_input(*[image_bytes(RED)] * (settings.max_images + 1))]}
    assert "limit" in _v2_error(client.post(INFER, json=many), 413)


def test_not_ready_is_503_in_the_protocol_shape(client: FlaskClient, service: Service) -> None:
    service.begin_drain()
    assert client.get("/v2/health/ready").status_code == 503
    assert "shutting down" in _v2_error(client.post(INFER, json={"inputs": [_bytes_input(image_bytes(RED))]}), 503)


def test_v2_and_predict_requests_join_the_same_batches(client: FlaskClient, model: ColourModel,
                                                       service: Service) -> None:
    model.batch_sizes.clear()
    model.gate = threading.Event()  # park the worker inside a forward pass, then queue one of each kind
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(client.post, "/predict", data=image_bytes(GREEN), content_type="image/jpeg")
        wait_until(lambda: len(model.batch_sizes) == 1)
        v2 = pool.submit(client.post, INFER, json={"inputs": [_bytes_input(image_bytes(RED))]})
        rest = pool.submit(client.post, "/predict", data=image_bytes(BLUE), content_type="image/jpeg")
        wait_until(lambda: service.loaded_version().batcher.depth == 2)
        model.gate.set()
        answers = [f.result(timeout=10) for f in (first, v2, rest)]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert model.batch_sizes == [1, 2]
    assert answers[1].headers["X-Batch-Size"] == answers[2].headers["X-Batch-Size"] == "2"


def _binary_answer(answer) -> tuple[dict[str, Any], bytes]:  # noqa: ANN001
    assert answer.status_code == 200, answer.get_data(as_text=True)
    size = int(answer.headers["Inference-Header-Content-Length"])
    return json.loads(answer.data[:size]), answer.data[size:]


def test_one_output_asked_twice_comes_back_as_each_entry_asked(client: FlaskClient) -> None:
    # Before: binary was decided per output name, so the entry that asked for JSON came back binary too.
    body = {"inputs": [_bytes_input(image_bytes(RED))],
            "outputs": [{"name": "probabilities"},
                        {"name": "probabilities", "parameters": {"classification": 1, "binary_data": True}}]}
    meta, blob = _binary_answer(client.post(INFER, json=body))
    as_json, as_binary = meta["outputs"]
    assert as_json["datatype"] == "FP32" and "parameters" not in as_json
    assert np.argmax(as_json["data"]) == 0 and len(as_json["data"]) == 4  # red, in the JSON
    assert as_binary["datatype"] == "BYTES" and "data" not in as_binary
    assert as_binary["parameters"]["binary_data_size"] == len(blob)
    (length,) = struct.unpack_from("<I", blob)
    assert blob[4:4 + length].decode().endswith(":0:red")
    # and the other way round: the request asks for binary, one entry for JSON
    body["parameters"] = {"binary_data_output": True}
    body["outputs"] = [{"name": "probabilities", "parameters": {"binary_data": False}}, {"name": "probabilities"}]
    meta, blob = _binary_answer(client.post(INFER, json=body))
    first, second = meta["outputs"]
    assert len(first["data"]) == 4 and second["parameters"]["binary_data_size"] == len(blob) == 16


@pytest.mark.parametrize("where, value", [
    ("output", "false"), ("output", "true"), ("output", 0), ("output", 1), ("output", [True]),
    ("request", "false"), ("request", 1),
])
def test_binary_flags_must_be_json_booleans(client: FlaskClient, where: str, value: Any) -> None:
    # Before: bool(params.get("binary_data")) read the string "false" as true, and the client that asked for JSON
    # got binary it could not read.
    if where == "output":
        body = {"inputs": [_PIXELS], "outputs": [{"name": "probabilities", "parameters": {"binary_data": value}}]}
        expected = f"output 'probabilities': parameters.binary_data must be true or false, got {value!r}"
    else:
        body = {"inputs": [_PIXELS], "parameters": {"binary_data_output": value}}
        expected = f"the request: parameters.binary_data_output must be true or false, got {value!r}"
    assert _v2_error(client.post(INFER, json=body), 400) == expected


def test_binary_flags_as_booleans_and_null_are_honoured(client: FlaskClient) -> None:
    off = {"inputs": [_PIXELS], "outputs": [{"name": "probabilities", "parameters": {"binary_data": False}}]}
    answer = client.post(INFER, json=off)
    assert answer.status_code == 200 and answer.mimetype == "application/json"
    assert "Inference-Header-Content-Length" not in answer.headers
    on = {"inputs": [_PIXELS], "parameters": {"binary_data_output": True},
          "outputs": [{"name": "probabilities", "parameters": {"binary_data": None}}]}  # null: the request's
    meta, blob = _binary_answer(client.post(INFER, json=on))
    assert meta["outputs"][0]["parameters"]["binary_data_size"] == len(blob) == 16


@pytest.mark.parametrize("request_id", [{"a": 1}, True, 7, 1.5, ["r1"]])
def test_a_request_id_that_is_not_a_string_is_400(client: FlaskClient, request_id: Any) -> None:
    # Before: it was echoed as Python's text of it: "{'a': 1}", "True".
    message = _v2_error(client.post(INFER, json={"id": request_id, "inputs": [_PIXELS]}), 400)
    assert message.startswith("the request's 'id' must be a string, got ")
    for given in ({"id": "r-7", "inputs": [_PIXELS]}, {"id": None, "inputs": [_PIXELS]}):
        answer = client.post(INFER, json=given)
        assert answer.status_code == 200 and answer.get_json().get("id") == given["id"]


@pytest.mark.parametrize("data, datatype", [
    ([True] * 192, "FP32"), (["0.5"] * 192, "FP32"), ([0.0] * 191 + ["1"], "FP32"), ([0.0] * 191 + [None], "FP32"),
    ([1] * 192, "BOOL"),
])
def test_tensor_data_of_another_json_kind_is_400(client: FlaskClient, data: list, datatype: str) -> None:
    # Before: numpy took true as 1.0 and "0.5" as 0.5, and answered 200 on pixels the client never sent.
    body = {"inputs": [{**_PIXELS, "datatype": datatype, "data": data}]}
    kind = "JSON booleans" if datatype == "BOOL" else "JSON numbers"
    assert (f"input 'pixels': 'data' holds values that are not {datatype} ({kind})"
            in _v2_error(client.post(INFER, json=body), 400))


def test_nested_tensor_data_is_flattened_as_triton_does(client: FlaskClient) -> None:
    nested = {"inputs": [{**_PIXELS, "data": [[[[0.0] * 8] * 8] * 3]}]}  # [1, 3, 8, 8] as nested lists
    assert client.post(INFER, json=nested).status_code == 200
    ints = {"inputs": [{**_PIXELS, "data": [0] * 192}]}  # JSON integers are numbers too
    assert client.post(INFER, json=ints).status_code == 200


@pytest.mark.parametrize("params", [[], 0, "", False])
@pytest.mark.parametrize("where", ["request", "input", "output"])
def test_falsy_parameters_that_are_not_an_object_are_400(client: FlaskClient, where: str, params: Any) -> None:
    # Before: `raw.get("parameters") or {}` took [], 0 and "" as no parameters.
    body: dict[str, Any] = {"inputs": [dict(_PIXELS)], "outputs": [{"name": "probabilities"}]}
    {"request": body, "input": body["inputs"][0], "output": body["outputs"][0]}[where]["parameters"] = params
    named = {"request": "the request", "input": "input 'pixels'", "output": "output 'probabilities'"}[where]
    assert _v2_error(client.post(INFER, json=body), 400) == f"{named}: 'parameters' must be an object"
    for target in (body, body["inputs"][0], body["outputs"][0]):
        target["parameters"] = None  # null, as absent: none
    assert client.post(INFER, json=body).status_code == 200


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
def test_a_compressed_body_is_400_saying_compression_is_not_supported(client: FlaskClient, encoding: str) -> None:
    import gzip
    import zlib

    raw = json.dumps({"inputs": [_PIXELS]}).encode()
    packed = {"gzip": gzip.compress, "deflate": zlib.compress}.get(encoding, lambda data: data)(raw)
    answer = client.post(INFER, data=packed, content_type="application/json",
                         headers={"Content-Encoding": encoding})
    message = _v2_error(answer, 400)
    assert message.startswith(f"Content-Encoding {encoding!r} is not supported: this server does not take "
                              "compressed request bodies")
    plain = client.post(INFER, data=raw, content_type="application/json", headers={"Content-Encoding": "identity"})
    assert plain.status_code == 200, plain.get_data(as_text=True)  # identity: no encoding at all
