"""The Open Inference Protocol (V2) routes through the app factory with the fake colour model: shapes and errors."""
from __future__ import annotations

import base64
import io
import json
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from unittest import mock

import numpy as np
import pytest
from flask.testing import FlaskClient

from app.config import Settings
from app.engine.service import Service
from app.errors import BadRequest
from app.v2 import codec
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
    assert meta["platform"] == "pytorch"  # an eager module
    assert meta["inputs"][1] == {"name": "pixels", "datatype": "FP32", "shape": [-1, 3, 8, 8]}
    assert meta["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 4]}]
    assert "no model 'colour' version '2' is loaded; this server serves 'colour' version 'test'" in _v2_error(
        client.get("/v2/models/colour/versions/2"), 404)
    _v2_error(client.get("/v2/models/other"), 404)


def test_a_model_s_configuration_reads_as_triton_s(client: FlaskClient, settings: Settings) -> None:
    # Before: 404 with Flask's page text, where tritonclient's get_model_config, perf_analyzer and model_analyzer
    # read the batch limit, the inputs' dims and layout from it.
    for path in ("/v2/models/colour/config", "/v2/models/colour/versions/test/config"):
        config = client.get(path).get_json()
        assert config["name"] == "colour" and config["platform"] == "pytorch" and config["backend"] == "pytorch"
        assert config["max_batch_size"] == settings.max_images  # the images one request carries
        assert config["input"] == [
            {"name": "images", "data_type": "TYPE_STRING", "dims": [1], "format": "FORMAT_NONE",
             "reshape": {"shape": []}},
            {"name": "pixels", "data_type": "TYPE_FP32", "dims": [3, 8, 8], "format": "FORMAT_NCHW"}]
        assert [(o["name"], o["dims"]) for o in config["output"]] == [("probabilities", [4])]
        # the metadata's shapes are the configuration's after the batch's -1; the images' as the model takes them
        # (its reshape []: this server's metadata says [-1], where Triton's would give the dims, [-1, 1]; both sent
        # shapes are taken: test_v2_triton)
        metadata = client.get(path.removesuffix("/config")).get_json()
        assert [tensor["shape"] for tensor in metadata["inputs"] + metadata["outputs"]] == [
            [-1, *tensor.get("reshape", {}).get("shape", tensor["dims"])] for tensor in config["input"] + config["output"]]
        assert config["dynamic_batching"] == {"max_queue_delay_microseconds": round(settings.max_wait_ms * 1000),
                                              "preferred_batch_size": [settings.max_batch_size]}
        assert config["instance_group"] == [{"kind": "KIND_CPU", "count": 1}]
        # the preprocessing pixels need, as /v1/models says it (V2's metadata has no place for it: a Triton
        # client's trial found it nowhere on V2), in Triton's free-form parameters
        listed = client.get("/v1/models/colour").get_json()["models"][0]["preprocess"]
        assert json.loads(config["parameters"]["preprocess"]["string_value"]) == listed
    assert "no model 'other' is loaded" in _v2_error(client.get("/v2/models/other/config"), 404)
    assert "version '2'" in _v2_error(client.get("/v2/models/colour/versions/2/config"), 404)


@pytest.mark.parametrize("path, extension", [
    ("/v2/models/stats", "statistics"),  # before: "no model 'stats' is loaded"
    ("/v2/models/colour/stats", "statistics"),  # before: Flask's "The requested URL was not found" text
    ("/v2/models/colour/versions/test/stats", "statistics"),
    ("/v2/trace/setting", "trace"), ("/v2/models/colour/trace/setting", "trace"), ("/v2/logging", "logging"),
    ("/v2/systemsharedmemory/status", "shared memory"), ("/v2/cudasharedmemory/region/x/status", "shared memory"),
])
def test_triton_s_extensions_not_served_are_404_saying_so(client: FlaskClient, path: str, extension: str) -> None:
    message = _v2_error(client.get(path), 404)
    assert message.startswith(f"Triton's {extension} extension is not served here"), message
    assert "not served" not in _v2_error(client.get("/v2/models/colour/nope"), 404)  # any other path as before


def test_a_model_named_like_an_extension_is_still_told_of(client: FlaskClient) -> None:
    # Before: a model named "stats", not loaded, read as the statistics extension alone
    message = _v2_error(client.get("/v2/models/stats"), 404)
    assert "statistics extension" in message and "no model 'stats' is loaded" in message, message


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
    # a client that writes its unset fields as null (some do, every field): binary data beside "data": null, taken
    header["inputs"][0]["data"] = None
    body, headers = _binary_body(header, pixels.tobytes())
    assert client.post(INFER, data=body, headers=headers).status_code == 200  # before: 400 "both 'data' and ..."


_PIXELS = {"name": "pixels", "datatype": "FP32", "shape": [1, 3, 8, 8], "data": [0.0] * 192}


@pytest.mark.parametrize("body, message", [
    ({"inputs": []}, "non-empty 'inputs'"),
    ({"inputs": [{"name": "images", "datatype": "BYTES", "shape": [2], "data": ["aGk="]}]}, "needs 2 values"),
    ({"inputs": [{"name": "images", "datatype": "BYTES", "shape": [1], "data": ["%%%"]}]}, "not valid base64"),
    ({"inputs": [{"name": "images", "datatype": "BYTES", "shape": [1], "data": ["aGk="]}]}, "not an image"),
    ({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 3, 4, 4], "data": [0.0] * 48}]}, "shape"),
    ({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 3, 8, 8], "data": [float("nan")] * 192}]},
     "NaN"),
    ({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 3, 8, 8], "data": ["x"] * 192}]}, "not FP32"),
    # before: "holds NaN or infinite values" for a finite number past FP32's range (and numpy's overflow warning)
    ({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 3, 8, 8], "data": [1e39] + [0.0] * 191}]},
     "input 'pixels': 'data' holds 1e+39, beyond FP32's range (at most 3.40282e+38 either side)"),
    ({"inputs": [{"name": "tensor", "datatype": "INT8", "shape": [1], "data": [1]}]}, "unknown input"),
    ({"inputs": [{"name": "images", "datatype": "STRING", "shape": [1], "data": [1]}]}, "not supported"),
    ({"inputs": [{"name": "images", "datatype": "BYTES", "shape": [-1], "data": []}]}, "non-negative"),
    ({"inputs": [{"name": "images", "datatype": "BYTES", "shape": [1]}]}, "neither 'data'"),
    ({"inputs": [_bytes_input(image_bytes(RED))], "outputs": [{"name": "logits"}]}, "unknown output"),
    ({"inputs": [_bytes_input(image_bytes(RED))],
      "outputs": [{"name": "probabilities", "parameters": {"classification": "3"}}]}, "classification"),
    # the request's own classification (before: ignored, probabilities answered; a new user's trial sent it so)
    ({"inputs": [_bytes_input(image_bytes(RED))], "parameters": {"classification": 3}},
     'an output\'s, not the request\'s: {"outputs": [{"name": "probabilities", "parameters": {"classification": 3}}]}'),
])
def test_bad_requests_get_400_in_the_protocol_error_shape(client: FlaskClient, body: dict, message: str) -> None:
    assert message in _v2_error(client.post(INFER, json=body), 400)


@pytest.mark.parametrize("body, message", [  # before: each answered 200, the field ignored (a new user's trial)
    ({"inputs": [_PIXELS], "output": [{"name": "embedding"}]}, "the request has an unknown field 'output'"),
    ({"inputs": [_PIXELS], "outputs": [{"name": "probabilities", "class_count": 3}]},
     "output 'probabilities' has an unknown field 'class_count'"),
    ({"inputs": [_PIXELS], "outputs": [{"name": "probabilities", "binary_data": True}]},
     "flags such as binary_data go in 'parameters'"),
    ({"inputs": [{**_PIXELS, "dtype": "FP32"}]}, "input 'pixels' has an unknown field 'dtype'"),
    # named before the inputs are looked at (a soak: "a non-empty 'inputs' list" alone, the misspelt field unsaid)
    ({"input": [_PIXELS]}, "the request has an unknown field 'input'"),
    ({"inputs": [], "bogus": 1}, "the request has an unknown field 'bogus'"),
])
def test_a_misspelled_or_misplaced_field_is_400_naming_it(client: FlaskClient, body: dict, message: str) -> None:
    assert message in _v2_error(client.post(INFER, json=body), 400)


def test_kserve_s_python_client_request_with_the_model_in_its_body_is_taken(client: FlaskClient) -> None:
    # KServe's InferRequest.to_rest() writes model_name (and model_version) into the body: refused as unknown fields
    # for a while (a review)
    body = {"id": "k1", "model_name": "colour", "model_version": None, "inputs": [_PIXELS], "parameters": None}
    answer = client.post(INFER, json=body)
    assert answer.status_code == 200 and answer.get_json()["id"] == "k1", answer.get_data(as_text=True)


def test_a_photo_sent_as_the_whole_body_is_415_saying_how_to_send_it(client: FlaskClient) -> None:
    # before: 400 "the inference request header is not valid JSON"
    message = _v2_error(client.post(INFER, data=image_bytes(RED), content_type="image/jpeg"), 415)
    assert "send it as a BYTES input" in message and "/predict" in message
    assert "upper case" in _v2_error(client.post(INFER, json={"inputs": [{**_PIXELS, "datatype": "fp32"}]}), 400)



@pytest.mark.parametrize("body, headers, message", [
    ({"inputs": [{**_PIXELS, "datatype": ["FP32"]}]}, {}, "not supported"),  # unhashable: a TypeError before
    ({"inputs": [{**_PIXELS, "parameters": [1]}]}, {}, "input 'pixels': 'parameters' must be an object"),
    # refused by name before their data is read (test_the_codec_alone_refuses_values_not_of_their_type)
    ({"inputs": [{"name": "images", "datatype": "UINT8", "shape": [1], "data": [-1]}]}, {},
     "input 'images' must have datatype BYTES, got UINT8"),  # before: "unknown input", of a known one
    ({"inputs": [{"name": "images", "datatype": "INT64", "shape": [1], "data": [2 ** 70]}]}, {},
     "input 'images' must have datatype BYTES, got INT64"),
    ({"inputs": [{"name": "pixels", "shape": [1, 3, 8, 8], "data": [0] * 192}]}, {},
     "input 'pixels' has no datatype"),  # before: "datatype None is not supported"
    ({"inputs": [{"name": "images", "datatype": "BYTES", "shape": [1], "data": "aGk="}]}, {},
     "input 'images': 'data' must be an array of its values, flat or nested, got a string: send [value] for one"),
    # before: taken as [value], where the protocol and the served schema say an array (a schema fuzz of the API)
    # before: "shape [3, 3, 8, 8]", and the model unnamed (several models of other sizes may serve: a trial)
    ({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [3, 8, 8], "data": [0] * 192}]}, {},
     "colour version test's input 'pixels' must have shape [N, 3, 8, 8] (N images first), got [3, 8, 8]"),
    ({"inputs": [{"name": "images", "datatype": "BYTES", "shape": [], "data": ["aGk="]}]}, {},
     "input 'images' has shape [] (a scalar): its first dimension counts its images, [1] for one"),
    # before: "input 'images' holds no images", of a request holding one (a Triton client's trial)
    ({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [0, 2 ** 62, 2 ** 62], "data": []}]}, {},
     "each 'shape' dimension must be at most 2147483647"),
    ({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [0] * 65, "data": []}]}, {},
     "'shape' has 65 dimensions; at most 32 are taken"),
    ({"inputs": [_PIXELS], "outputs": [{"name": "probabilities", "parameters": [1]}]}, {},
     "output 'probabilities': 'parameters' must be an object"),
    ({"inputs": [_PIXELS], "parameters": "x"}, {}, "the request: 'parameters' must be an object"),
    ({"inputs": [_PIXELS]}, {"Inference-Header-Content-Length": "\u00b2"}, "must be a whole number"),  # isdigit()'s
    ({"inputs": [_PIXELS]}, {"Inference-Header-Content-Length": "abc"}, "must be a whole number of bytes, got 'abc'"),
    ({"inputs": [{**_PIXELS, "parameters": {"binary_data_size": "12"}}]}, {},
     "binary_data_size must be a whole number of bytes, 0 or more, got '12'"),  # before: "runs past the end"
    ({"inputs": [{**_PIXELS, "parameters": {"binary_data_size": -1}}]}, {}, "0 or more, got -1"),
    ({"inputs": [{**_PIXELS, "parameters": {"binary_data_size": 4}}]}, {}, "both 'data' and binary_data_size"),
    ({"inputs": [_PIXELS], "outputs": [{}]}, {}, "each output needs its 'name' ('probabilities'), got None"),
    ({"inputs": [_PIXELS]}, {"Inference-Header-Content-Length": "9" * 5000}, "does not fit"),  # past int()'s limit
    # a deadline the caller meant, dropped before (the request ran with the announced one)
    *(({"inputs": [_PIXELS], "parameters": {"timeout": bad}}, {}, "parameters.timeout must be a number of "
       "microseconds") for bad in (-5, "abc", True, float("nan"))),
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
    assert client.post(INFER, json={"inputs": [_PIXELS], "parameters": {"timeout": 0}}).status_code == 200  # none
    assert traffic.failures == 0 and traffic.requests == 2


@pytest.mark.parametrize("datatype, value", [("UINT8", -1), ("INT64", 2 ** 70), ("BOOL", 1)])
def test_the_codec_alone_refuses_values_not_of_their_type(datatype: str, value: int) -> None:
    # The route refuses these inputs by name before their data is read; the codec, asked with no check, still
    # answers 400 (an OverflowError once, a 500; a BOOL of 1 once True).
    body = json.dumps({"inputs": [{"name": "x", "datatype": datatype, "shape": [1], "data": [value]}]}).encode()
    with pytest.raises(BadRequest, match=f"'data' holds values that are not {datatype}"):
        codec.parse_request(body, None)


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


def test_a_binary_body_without_its_header_length_says_which_header_names_it(client: FlaskClient) -> None:
    # Before: 400 "the inference request header is not valid JSON: trailing characters at line 1 column 188" alone
    body, headers = _binary_body({"inputs": [{"name": "images", "datatype": "BYTES", "shape": [1],
                                              "parameters": {"binary_data_size": 9}}]}, b"\x05\x00\x00\x00abcde")
    del headers["Inference-Header-Content-Length"]
    message = _v2_error(client.post(INFER, data=body, headers=headers), 400)
    assert message.startswith("the inference request is not valid JSON: trailing characters")
    assert message.endswith("names its JSON header's length in bytes in the Inference-Header-Content-Length header)")


@pytest.mark.parametrize("off_by", [5, -5])
def test_a_header_length_that_cuts_or_runs_past_the_json_says_it_must_be_the_json_s_exact_length(
        client: FlaskClient, off_by: int) -> None:
    # Before: the JSON parser's words alone ("trailing characters ...", "EOF while parsing ...") about "the inference
    # request header" (a raw V2 client's trial: the commoner mistake is a length given and wrong)
    body, headers = _binary_body({"inputs": [{"name": "images", "datatype": "BYTES", "shape": [1],
                                              "parameters": {"binary_data_size": 9}}]}, b"\x05\x00\x00\x00abcde")
    length = int(headers["Inference-Header-Content-Length"]) + off_by
    headers["Inference-Header-Content-Length"] = str(length)
    message = _v2_error(client.post(INFER, data=body, headers=headers), 400)
    assert message.startswith(f"the inference request's JSON header (its first {length} bytes: "
                              "Inference-Header-Content-Length) is not valid JSON: "), message
    assert message.endswith("(Inference-Header-Content-Length must be the JSON header's exact length in bytes, the "
                            "binary tensor data after it)")
    # a JSON body without the header: no header named
    assert _v2_error(client.post(INFER, data=b'{"inputs": [', content_type="application/json"), 400).startswith(
        "the inference request is not valid JSON: ")


@pytest.mark.parametrize("form", ["multipart", "urlencoded"])
def test_a_form_posted_to_infer_is_415_pointing_at_predict(client: FlaskClient, form: str) -> None:
    # Before: 400 "the inference request header is not valid JSON: invalid number at line 1 column 2" for the
    # multipart form /predict takes (curl -F image=@cat.jpg), as for a urlencoded one
    data = {"image": (io.BytesIO(image_bytes(RED)), "red.png")} if form == "multipart" else {"a": "b"}
    message = _v2_error(client.post(INFER, data=data), 415)
    assert message.startswith("the body is a form (multipart/form-data" if form == "multipart"
                              else "the body is a form (application/x-www-form-urlencoded)"), message
    assert message.endswith("or POST the form to /predict")


@pytest.mark.parametrize("where", ["input", "output", "request"])
def test_shared_memory_parameters_are_refused_naming_the_extension(client: FlaskClient, where: str) -> None:
    # Before: an output's region was ignored (the data answered in the body while a Triton client read its region),
    # an input's read as an empty body's ("needs 150528 values, more than a 160 byte body holds")
    region = {"shared_memory_region": "o0", "shared_memory_byte_size": 4000}
    body: dict[str, Any] = {"inputs": [_PIXELS]}
    if where == "input":
        body["inputs"] = [{**{k: v for k, v in _PIXELS.items() if k != "data"}, "parameters": region}]
    elif where == "output":
        body["outputs"] = [{"name": "probabilities", "parameters": region}]
    else:
        body["parameters"] = region
    message = _v2_error(client.post(INFER, json=body), 400)
    assert ("parameters.shared_memory_region: Triton's shared memory extension is not served here; send tensors in "
            "the request body (binary_tensor_data) and read them in the answer's") in message, message


def test_a_second_input_or_one_twice_or_one_without_a_name_is_named(client: FlaskClient) -> None:
    # Before: "send exactly one input ..." for an extra input and for the same one twice alike, and "unknown input ''"
    # for one without a name
    image = _bytes_input(image_bytes(RED))
    twice = _v2_error(client.post(INFER, json={"inputs": [image, image]}), 400)
    assert twice == "input 'images' twice: send exactly one input, 'images' (BYTES) or 'pixels' (FP32)"
    extra = {"name": "mask", "datatype": "BYTES", "shape": [1], "data": ["aGVsbG8="]}
    assert _v2_error(client.post(INFER, json={"inputs": [image, extra]}), 400).startswith("a second input, 'mask': ")
    unnamed = {k: v for k, v in image.items() if k != "name"}
    assert _v2_error(client.post(INFER, json={"inputs": [unnamed]}), 400) == (
        "input 1 needs its 'name', a string, got null")


def test_not_ready_is_503_in_the_protocol_shape(client: FlaskClient, service: Service) -> None:
    service.begin_drain()
    assert client.get("/v2/health/ready").status_code == 503
    service.stop_serving()
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
    # got binary it could not read. The value as JSON writes it (before: Python's, 'false' and True).
    if where == "output":
        body = {"inputs": [_PIXELS], "outputs": [{"name": "probabilities", "parameters": {"binary_data": value}}]}
        expected = f"output 'probabilities': parameters.binary_data must be true or false, got {json.dumps(value)}"
    else:
        body = {"inputs": [_PIXELS], "parameters": {"binary_data_output": value}}
        expected = f"the request: parameters.binary_data_output must be true or false, got {json.dumps(value)}"
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


@pytest.mark.parametrize("depth", [4, 150])
def test_nested_tensor_data_is_flattened_in_one_pass_in_order(client: FlaskClient, depth: int) -> None:
    # Before: _flatten called itself on every list and value, copying each value once per level: a 10 MB body
    # nested 190 deep took 8.8 s of CPU against 0.65 flat. One call now, whatever the depth.
    green = [[[0.0] * 8] * 8, [[1.0] * 8] * 8, [[0.0] * 8] * 8]  # channel 1 set: green once normalised
    data: Any = [green]  # [1, 3, 8, 8], as the shape
    for _ in range(depth - 4):
        data = [data]
    mixed = [[0.0] * 64, [[1.0] * 8] * 8, 0.0, [[[0.0]] * 63]]  # lists and values side by side, same order
    outputs = [{"name": "probabilities", "parameters": {"classification": 1}}]
    for values in (data, mixed):
        with mock.patch.object(codec, "_flatten", wraps=codec._flatten) as flatten:
            answer = client.post(INFER, json={"inputs": [{**_PIXELS, "data": values}], "outputs": outputs})
        assert answer.status_code == 200, answer.get_data(as_text=True)
        assert answer.get_json()["outputs"][0]["data"][0].endswith(":1:green")
        assert flatten.call_count == 1


@pytest.mark.parametrize("shape, message", [
    ([9 * 10 ** 3999] * 40, "input 'pixels': 'shape' has 40 dimensions; at most 32 are taken"),
    ([9 * 10 ** 3999] * 20, "input 'pixels': each 'shape' dimension must be at most 2147483647"),
    ([0, 10 ** 30], "input 'pixels': each 'shape' dimension must be at most 2147483647"),
    ([4, 2 ** 31 - 1, 2 ** 31 - 1, 2 ** 31 - 1], "colour version test's input 'pixels' must have shape [4, 3, 8, 8], "
                                                 "got "),
])
def test_a_shape_of_huge_or_too_many_dimensions_is_400_with_a_short_message(client: FlaskClient, service: Service,
                                                                          shape: list[int], message: str) -> None:
    # Before: any integer was a dimension; the product of 1,000 of 4,000 digits held the interpreter for tens of
    # seconds (the worker's every request waiting), then printing it passed Python's int-to-str limit: a 500.
    body = json.dumps({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": shape, "data": []}]})
    (route,) = [row for row in service.catalog.index() if row.state == "READY"]
    traffic = service.controller.evidence.traffic(route.name, route.version)
    error = _v2_error(client.post(INFER, data=body, content_type="application/json"), 400)
    assert error.startswith(message) and len(error) < 200
    assert traffic.failures == 0
    assert client.post(INFER, json={"inputs": [_PIXELS]}).status_code == 200


def _too_many(settings: Any, how: str) -> tuple[bytes, dict[str, str]]:
    """A request of MAX_IMAGES + 1 images: BYTES in binary or in JSON, or pixels."""
    n = settings.max_images + 1
    if how == "binary":
        blob = b"".join(struct.pack("<I", 4) + b"\0" * 4 for _ in range(n))
        return _binary_body({"inputs": [{"name": "images", "datatype": "BYTES", "shape": [n],
                                         "parameters": {"binary_data_size": len(blob)}}]}, blob)
    if how == "json":
        body = {"inputs": [{"name": "images", "datatype": "BYTES", "shape": [n], "data": ["AAAA"] * n}]}
    else:
        body = {"inputs": [{**_PIXELS, "shape": [n, 3, 8, 8], "data": [0.0] * 192 * n}]}
    return json.dumps(body).encode(), {"Content-Type": "application/json"}


@pytest.mark.parametrize("how", ["binary", "json", "pixels"])
def test_too_many_images_is_413_before_any_element_is_cut_or_decoded(client: FlaskClient, settings: Any,
                                                                     how: str) -> None:
    # Before: every element was cut from the binary data (or base64-decoded, or read as a number) and only then
    # counted by Call.infer: 20 MiB of 4-byte elements took 2 s of CPU and 250 MiB before the same 413.
    body, headers = _too_many(settings, how)
    with mock.patch.object(codec, "_split_bytes", wraps=codec._split_bytes) as split, \
            mock.patch.object(codec, "decode_base64", wraps=codec.decode_base64) as decode, \
            mock.patch.object(codec, "_json_numbers", wraps=codec._json_numbers) as numbers:
        error = _v2_error(client.post(INFER, data=body, headers=headers), 413)
    n = settings.max_images + 1
    assert error == f"{n} images in one request; the limit is {settings.max_images}"
    assert split.call_count == decode.call_count == numbers.call_count == 0


def test_binary_bytes_past_the_shape_stop_being_cut_at_the_first_extra(client: FlaskClient) -> None:
    # Before: every element of the data was cut, then their count compared with the shape's.
    blob = b"".join(struct.pack("<I", 4) + b"\0" * 4 for _ in range(1000))
    body, headers = _binary_body({"inputs": [{"name": "images", "datatype": "BYTES", "shape": [1],
                                              "parameters": {"binary_data_size": len(blob)}}]}, blob)
    with mock.patch.object(codec, "_LENGTH", mock.Mock(wraps=codec._LENGTH)) as length:
        error = _v2_error(client.post(INFER, data=body, headers=headers), 400)
        cuts = length.unpack_from.call_count
    assert error == "input 'images': BYTES data holds more than the 1 values its shape says"
    assert cuts == 1


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


@pytest.mark.parametrize("encoding", ["gzip", "x-gzip", "deflate", "raw deflate", "identity"])
def test_a_body_compressed_with_gzip_or_deflate_is_answered_as_the_same_body_sent_plain(client: FlaskClient,
                                                                                        encoding: str) -> None:
    # Before: 400 "Content-Encoding ... is not supported" (Triton's HTTP endpoint takes gzip and deflate bodies).
    import gzip
    import zlib

    raw = json.dumps({"inputs": [_PIXELS]}).encode()
    raw_deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    packed = {"gzip": gzip.compress, "x-gzip": gzip.compress, "deflate": zlib.compress,
              "raw deflate": lambda data: raw_deflate.compress(data) + raw_deflate.flush(),
              "identity": lambda data: data}[encoding](raw)
    plain = client.post(INFER, data=raw, content_type="application/json")
    answer = client.post(INFER, data=packed, content_type="application/json",
                         headers={"Content-Encoding": encoding.removeprefix("raw ")})
    assert answer.status_code == 200, answer.get_data(as_text=True)
    assert answer.get_json()["outputs"] == plain.get_json()["outputs"]


def test_a_body_in_another_coding_is_415_naming_those_taken_and_one_not_what_it_says_400(
        client: FlaskClient, settings: Settings) -> None:
    import gzip

    raw = json.dumps({"inputs": [_PIXELS]}).encode()
    for said in ("br", "zstd", "gzip, gzip"):
        answer = client.post(INFER, data=raw, content_type="application/json", headers={"Content-Encoding": said})
        assert _v2_error(answer, 415).startswith(f"Content-Encoding {said!r} is not supported: send the body as it "
                                                 "is, or compressed once with gzip or deflate")
        assert answer.headers["Accept-Encoding"] == "gzip, deflate, identity"
    for body in (raw, gzip.compress(raw)[:-20]):  # plain bytes said to be gzip; a gzip body cut short
        answer = client.post(INFER, data=body, content_type="application/json", headers={"Content-Encoding": "gzip"})
        assert _v2_error(answer, 400).startswith("the body is not valid gzip data (its Content-Encoding)")
    # a small body that decompresses over MAX_BODY_BYTES is refused without decompressing it all
    bomb = gzip.compress(b" " * (settings.max_body_bytes + 1))
    assert len(bomb) < settings.max_body_bytes // 100
    answer = client.post(INFER, data=bomb, content_type="application/json", headers={"Content-Encoding": "gzip"})
    assert _v2_error(answer, 413) == f"the request body decompressed is over the {settings.max_body_bytes} byte limit"


def test_an_empty_outputs_list_answers_the_default_output_as_triton_does(client: FlaskClient) -> None:
    # Before: "outputs": [] ran the forward pass and answered 200 with no output at all; Triton reads an empty list
    # as none asked, and answers every output (a Triton user's trial)
    body = {"inputs": [_bytes_input(image_bytes(RED))], "outputs": []}
    answer = client.post(INFER, json=body)
    assert answer.status_code == 200, answer.get_data(as_text=True)
    (output,) = answer.get_json()["outputs"]
    assert output["name"] == "probabilities" and np.argmax(output["data"]) == 0


def test_later_refused_images_are_each_said_in_the_protocol_s_one_message(client: FlaskClient) -> None:
    # Before: "...; also refused: image 2, image 3 (details' also_refused)", details the protocol's error shape does
    # not have (a raw V2 client's trial): their reasons could not be read
    images = [image_bytes(RED), b"nope", b"", b"also not"]
    message = _v2_error(client.post(INFER, json={"inputs": [_bytes_input(*images)]}), 400)
    assert message == ("image 1: the data is not an image in a format we can read; image 2: the image is empty "
                       "(0 bytes); image 3: the data is not an image in a format we can read"), message
