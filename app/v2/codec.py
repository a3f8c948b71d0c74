"""The Open Inference Protocol (KServe V2) REST wire format: JSON tensors and Triton's binary tensor extension.

A request body is a JSON header, optionally followed by raw tensor bytes; ``Inference-Header-Content-Length`` says
where the JSON ends, and each binary input says its size in ``parameters.binary_data_size``. BYTES elements in
binary form are each prefixed by their length as a 4-byte little-endian integer. Knows nothing of Flask or models.
"""
from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from app.errors import BadRequest, InvalidJSON, UnsupportedMediaType
from app.web.inputs import decode_base64, parse_json

_NUMPY_TYPES = {"FP32": np.float32, "FP64": np.float64, "FP16": np.float16, "INT64": np.int64, "INT32": np.int32,
                "INT16": np.int16, "INT8": np.int8, "UINT8": np.uint8, "BOOL": np.bool_}
# The binary extension's values are little-endian; the dtypes made once, not per request.
_WIRE_TYPES = {name: np.dtype(kind).newbyteorder("<") for name, kind in _NUMPY_TYPES.items()}
_JSON_NUMBERS, _JSON_BOOLEANS = frozenset({int, float}), frozenset({bool})  # what JSON parses to: bool is no int
_INTEGERS = frozenset({int})
_LENGTH = struct.Struct("<I")
_LENGTH_DIGITS = re.compile(r"[0-9]{1,18}")  # ASCII digits only (str.isdigit takes "²"), few enough for int()
# A shape's bounds: JSON takes integers of any size, and the product of a thousand of 4,000 digits held the
# interpreter for tens of seconds, then was too long to print. Half numpy's 64 dimensions, each an int32: more than
# any image takes.
MAX_DIMENSIONS, MAX_DIMENSION = 32, 2 ** 31 - 1
# The fields of a request, an input and a requested output (the Open Inference Protocol's): another one is a
# misspelling or a misplaced field ("output", a flag outside "parameters") that would otherwise be ignored
# (model_name and model_version: KServe's Python client writes the URL's model into its body too; read from the URL)
SHARED_MEMORY = "shared_memory_"  # the shared memory extension's parameters: region, byte size, offset
REQUEST_FIELDS = ("id", "parameters", "inputs", "outputs", "model_name", "model_version")
INPUT_FIELDS = ("name", "shape", "datatype", "parameters", "data")
OUTPUT_FIELDS = ("name", "parameters")
_IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG", b"GIF8", b"RIFF", b"BM")  # a photo sent as the whole body
# What a caller checks of an input (its index, name, datatype and shape) once they are read, before its data is.
InputCheck = Callable[[int, str, str, list[int]], None]


@dataclass
class Tensor:
    """One named tensor of a request or a response."""

    name: str
    datatype: str
    shape: list[int]
    data: np.ndarray  # numeric dtypes, or an object array of bytes for BYTES
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class InferRequest:
    """A parsed inference request."""

    id: str | None
    inputs: list[Tensor]
    outputs: list[dict[str, Any]] | None  # as requested: name and parameters (binary_data, classification)
    parameters: dict[str, Any]


def _header(body: bytes, header_length: str | None) -> tuple[dict[str, Any], bytes]:
    if header_length is None:
        size = len(body)
    elif not (header_length.isascii() and header_length.isdigit()):  # (str.isdigit alone takes "²")
        raise BadRequest(f"Inference-Header-Content-Length must be a whole number of bytes, got {header_length!r}")
    elif not _LENGTH_DIGITS.fullmatch(header_length) or int(header_length) > len(body):
        raise BadRequest(f"Inference-Header-Content-Length {header_length!r} does not fit a {len(body)} byte body")
    else:
        size = int(header_length)
    if header_length is None and body.startswith(_IMAGE_MAGIC):
        raise UnsupportedMediaType("the body is an image file, not an inference request: send it as a BYTES input "
                                   "(base64 in JSON, or binary_tensor_data), or POST the file to /predict")
    what = ("the inference request" if header_length is None
            else f"the inference request's JSON header (its first {size} bytes: Inference-Header-Content-Length)")
    try:
        header = parse_json(body[:size], what)
    except InvalidJSON as exc:
        if header_length is None and "trailing characters" in exc.message:  # binary data after it, its length unsaid
            raise InvalidJSON(f"{exc.message} (the body goes on after its JSON: a request with binary tensor data "
                              "names its JSON header's length in bytes in the Inference-Header-Content-Length "
                              "header)") from None
        if header_length is not None and body[:1] == b"{":  # a JSON header there, cut or run on: its length wrong
            raise InvalidJSON(f"{exc.message} (Inference-Header-Content-Length must be the JSON header's exact "
                              "length in bytes, the binary tensor data after it)") from None
        raise
    if isinstance(header, dict):  # a field it does not take named first: a misspelt one may be why "inputs" is not
        check_fields(header, REQUEST_FIELDS, "the request")
    if not isinstance(header, dict) or not isinstance(header.get("inputs"), list) or not header["inputs"]:
        raise BadRequest("the inference request must be a JSON object with a non-empty 'inputs' list")
    return header, body[size:]


def check_fields(raw: dict[str, Any], known: Sequence[str], where: str) -> None:
    """BadRequest naming the first field of ``raw`` not in ``known`` (``where``: whose fields they are)."""
    if len(raw) > len(known) or not raw.keys() <= set(known):
        unknown = next(name for name in raw if name not in known)
        raise BadRequest(f"{where} has an unknown field {unknown!r}; its fields are {', '.join(known)} (flags such "
                         f"as binary_data go in 'parameters')")


def _shape(raw: Any, name: str) -> list[int]:
    # C loops (type, min, max), no generator: every request's shape passes here. type(), not isinstance: True is no
    # dimension.
    if not isinstance(raw, list) or not set(map(type, raw)) <= _INTEGERS or raw and min(raw) < 0:
        raise BadRequest(f"input {name!r}: 'shape' must be a list of non-negative integers")
    if len(raw) > MAX_DIMENSIONS:
        raise BadRequest(f"input {name!r}: 'shape' has {len(raw)} dimensions; at most {MAX_DIMENSIONS} are taken")
    if raw and max(raw) > MAX_DIMENSION:  # never printed: a dimension may have thousands of digits
        raise BadRequest(f"input {name!r}: each 'shape' dimension must be at most {MAX_DIMENSION}")
    return raw


def _split_bytes(blob: bytes, name: str, count: int) -> list[bytes]:
    """The length-prefixed elements of ``blob``; BadRequest at the first past ``count``, before the rest are cut."""
    items, offset = [], 0
    while offset < len(blob):
        if len(items) == count:
            raise BadRequest(f"input {name!r}: BYTES data holds more than the {count} values its shape says")
        if offset + 4 > len(blob):
            raise BadRequest(f"input {name!r}: BYTES data ends inside a length prefix")
        (length,) = _LENGTH.unpack_from(blob, offset)
        offset += 4
        if offset + length > len(blob):
            raise BadRequest(f"input {name!r}: a BYTES element claims {length} bytes past the end of the data (in "
                             "binary, each element is its length as 4 bytes, little-endian, then its bytes)")
        items.append(blob[offset:offset + length])
        offset += length
    return items


_NARROW_FLOATS = ("FP32", "FP16")  # JSON numbers past their range become inf when cast


def _check_float_range(values: list[Any], name: str, datatype: str) -> None:
    """BadRequest for finite JSON numbers beyond ``datatype``'s range (cast, they would be infinite: read as
    non-finite pixels, which they were not); NaN and infinities as written are the pixels' check's."""
    wide = np.abs(np.asarray(values, dtype=np.float64))
    finite = wide[np.isfinite(wide)]
    largest, held = float(np.finfo(_NUMPY_TYPES[datatype]).max), float(finite.max()) if finite.size else 0.0
    if held > largest:
        raise BadRequest(f"input {name!r}: 'data' holds {held:g}, beyond {datatype}'s range (at most {largest:g} "
                         "either side)")


def _json_bytes(values: list[Any], name: str) -> list[bytes]:
    # JSON cannot carry raw image bytes, so BYTES elements in JSON are base64 strings.
    if not all(isinstance(value, str) for value in values):
        raise BadRequest(f"input {name!r}: BYTES elements in JSON must be base64 strings")
    return [decode_base64(value, f"input {name!r} element {i}") for i, value in enumerate(values)]


def _json_numbers(values: list[Any], name: str, datatype: str) -> np.ndarray:
    """JSON numbers as ``datatype`` (BOOL: JSON booleans). numpy alone takes true as 1 and "0.5" as 0.5, which the
    protocol's JSON tensors do not: each element must be of the JSON kind its datatype is written as."""
    kinds = set(map(type, values))  # a C loop: a JSON image's 150,528 values in about 2 ms
    if kinds <= (_JSON_BOOLEANS if datatype == "BOOL" else _JSON_NUMBERS):
        try:
            with np.errstate(over="ignore"):  # a float beyond FP32's range cast to inf: said below, not warned
                array = np.asarray(values, dtype=_NUMPY_TYPES[datatype])
        except (TypeError, ValueError, OverflowError):  # OverflowError: out of the type's range (UINT8 -1)
            pass
        else:
            if datatype in _NARROW_FLOATS and not np.isfinite(array).all():
                _check_float_range(values, name, datatype)
            return array
    kind = "JSON booleans" if datatype == "BOOL" else "JSON numbers"
    raise BadRequest(f"input {name!r}: 'data' holds values that are not {datatype} ({kind})")


def _json_kind(value: Any) -> str:
    """What a JSON value is, as a message names it."""
    return {str: "a string", bool: "a boolean", int: "a number", float: "a number", dict: "an object",
            type(None): "null"}.get(type(value), type(value).__name__)


def _flatten(data: Any) -> list[Any]:
    """The list ``data``'s values in order, its nested lists flattened as Triton does, in one pass: each value is
    copied once, however deep (a flatten per level copied a value once a level). Flat data, the usual, is not
    copied."""
    if list not in set(map(type, data)):  # a C loop
        return data
    flat: list[Any] = []
    stack = [data]
    while stack:
        part = stack.pop()
        if not isinstance(part, list):
            flat.append(part)
        elif list in set(map(type, part)):
            stack.extend(reversed(part))  # popped in order
        else:
            flat.extend(part)
    return flat


def _json_values(data: Any, name: str, datatype: str, shape: list[int], count: int) -> np.ndarray:
    """An input's JSON ``data``, ``count`` values of ``datatype`` (its ``shape``'s), flat: BadRequest for data
    that is no array (the protocol's, the served schema's) or holds another count or other kinds of values."""
    if not isinstance(data, list):
        raise BadRequest(f"input {name!r}: 'data' must be an array of its values, flat or nested, got "
                         f"{_json_kind(data)}: send [value] for one")
    flat = _flatten(data)
    if len(flat) != count:  # before any value is decoded
        raise BadRequest(f"input {name!r}: shape {shape} needs {count} value{'s' * (count != 1)}, got {len(flat)}")
    if datatype == "BYTES":
        return np.array(_json_bytes(flat, name), dtype=object)
    return _json_numbers(flat, name, datatype)


def _tensor(raw: dict[str, Any], binary: bytes, offset: int, most: int, index: int,
            check: InputCheck | None) -> tuple[Tensor, int]:
    name, datatype = raw.get("name"), raw.get("datatype")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"input {index + 1} needs its 'name', a string, got {json.dumps(name)}")
    if datatype is None:
        raise BadRequest(f"input {name!r} has no datatype: BYTES, or one of {', '.join(_NUMPY_TYPES)}")
    if not isinstance(datatype, str) or datatype != "BYTES" and datatype not in _NUMPY_TYPES:
        raise BadRequest(f"input {name!r}: datatype {datatype!r} is not supported: BYTES, or one of "
                         f"{', '.join(_NUMPY_TYPES)} (upper case)")
    shape, params = _shape(raw.get("shape"), name), parameters(raw, f"input {name!r}")
    count = math.prod(shape)  # small: a shape's bounds keep it under 2 ** 992
    if check is not None:  # before the data: what it refuses (a shape, too many images) costs no decode
        check(index, name, datatype, shape)
    if count > most:  # every value takes a byte of the body at least, in JSON or binary
        raise BadRequest(f"input {name!r}: shape {shape} needs {count} values, more than a {most} byte body holds")
    size = params.get("binary_data_size")
    if size is not None:
        if type(size) is not int or size < 0:  # type(): True is no size
            raise BadRequest(f"input {name!r}: binary_data_size must be a whole number of bytes, 0 or more, got "
                             f"{size!r}")
        if raw.get("data") is not None:  # (null: a client's unset field, as some write every field)
            raise BadRequest(f"input {name!r}: both 'data' and binary_data_size; send its values one way")
        if offset + size > len(binary):
            raise BadRequest(f"input {name!r}: binary_data_size {size!r} runs past the end of the body")
        blob, offset = binary[offset:offset + size], offset + size
        if datatype == "BYTES":
            values: Any = np.array(_split_bytes(blob, name, count) or [], dtype=object)
        else:
            wire = _WIRE_TYPES[datatype]
            if size % wire.itemsize:
                raise BadRequest(f"input {name!r}: {size} bytes is not a whole number of {datatype} values")
            values = np.frombuffer(blob, dtype=wire)
    elif raw.get("data") is not None:  # (null: a client's unset field, as with binary_data_size)
        values = _json_values(raw["data"], name, datatype, shape, count)
    else:
        raise BadRequest(f"input {name!r} has neither 'data' nor parameters.binary_data_size")
    if values.size != count:
        raise BadRequest(f"input {name!r}: shape {shape} needs {count} values, got {values.size}")
    if datatype != "BYTES":
        try:
            values = values.reshape(shape)
        except ValueError:  # no values, but more dimensions than numpy's 64 or a dimension past its sizes
            raise BadRequest(f"input {name!r}: shape {shape} cannot be made") from None
    return Tensor(name, datatype, shape, values, params), offset


def parse_request(body: bytes, header_length: str | None, check: InputCheck | None = None) -> InferRequest:
    """Parse a V2 inference request body; raises BadRequest (400) for anything malformed. ``check(index, name,
    datatype, shape)`` is called for each input once its shape is read, before its data is decoded; what it raises
    is raised."""
    header, binary = _header(body, header_length)
    inputs, offset = [], 0
    for index, raw in enumerate(header["inputs"]):
        if not isinstance(raw, dict):
            raise BadRequest("each input must be a JSON object")
        check_fields(raw, INPUT_FIELDS, f"input {str(raw.get('name', ''))!r}")
        tensor, offset = _tensor(raw, binary, offset, len(body), index, check)
        inputs.append(tensor)
    if offset != len(binary):
        raise BadRequest(f"the body has {len(binary) - offset} bytes that no input claims")
    outputs = header.get("outputs")
    if outputs is not None and not (isinstance(outputs, list) and all(isinstance(o, dict) for o in outputs)):
        raise BadRequest("'outputs' must be a list of objects")
    params = parameters(header, "the request")
    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):  # echoed: str() of an object is Python's text
        raise BadRequest(f"the request's 'id' must be a string, got {type(request_id).__name__} {request_id!r}")
    return InferRequest(request_id, inputs, outputs, params)


def parameters(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """``raw``'s ``parameters`` (the request's, an input's or an output's): an object, or none (absent or null:
    {}). Another falsy value ([], 0, "") is as wrong as a truthy one, not none."""
    params = raw.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise BadRequest(f"{where}: 'parameters' must be an object")
    shared = next((key for key in params if key.startswith(SHARED_MEMORY)), None)
    if shared is not None:  # (ignored, an output would be answered in the body while its client reads the region)
        raise BadRequest(f"{where}: parameters.{shared}: Triton's shared memory extension is not served here; send "
                         "tensors in the request body (binary_tensor_data) and read them in the answer's")
    return params


def flag(params: dict[str, Any], key: str, default: bool, where: str) -> bool:
    """A boolean parameter (``binary_data``, ``binary_data_output``): a JSON boolean, ``default`` when absent or
    null. A string or a number is refused: bool("false") is True, so reading one would answer binary to a client
    that asked for JSON."""
    value = params.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{where}: parameters.{key} must be true or false, got {json.dumps(value)}")
    return value


def _binary_payload(tensor: Tensor) -> bytes:
    if tensor.datatype == "BYTES":
        return b"".join(_LENGTH.pack(len(item)) + item for item in tensor.data.reshape(-1))
    return np.ascontiguousarray(tensor.data, dtype=tensor.data.dtype.newbyteorder("<")).tobytes()


def _json_data(tensor: Tensor) -> list[Any]:
    if tensor.datatype == "BYTES":
        return [item.decode("utf-8") for item in tensor.data.reshape(-1)]
    return tensor.data.reshape(-1).tolist()


def encode_response(*, model_name: str, model_version: str, request_id: str | None, outputs: list[Tensor],
                    binary: Sequence[bool]) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when binary tensors follow it (else None). ``binary``: one
    flag per output, in order (not per name: a request may ask for one output twice, once as JSON, once binary)."""
    entries, blobs = [], []
    for tensor, is_binary in zip(outputs, binary, strict=True):
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": tensor.shape}
        if is_binary:
            blob = _binary_payload(tensor)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = _json_data(tensor)
        entries.append(entry)
    header: dict[str, Any] = {"model_name": model_name, "model_version": model_version, "outputs": entries}
    if request_id is not None:
        header["id"] = request_id
    encoded = json.dumps(header, separators=(",", ":")).encode()
    if not blobs:
        return encoded, None
    return encoded + b"".join(blobs), len(encoded)
