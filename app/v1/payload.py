"""Reads a /predict request in any of its shapes into image bytes, a top_k and the outputs asked for; and an
/explain request into its one image, the class to explain and the answer's format.

It takes the werkzeug request as an argument rather than using Flask's global, so it stays a plain function.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, TypeVar

import pydantic
from werkzeug import Request

from app.errors import BadRequest, SchemaViolation, UnknownOutput, UnsupportedMediaType, check_image_count
from app.v1.schemas import ExplainJSONRequest, PredictJSONRequest
from app.web.inputs import decode_base64, each_once, given_more_than_once, parse_json, read_sent_body
from app.web.multipart import FormData, parse_form_data

Schema = TypeVar("Schema", bound=pydantic.BaseModel)
Given = TypeVar("Given")
RAW_TYPES = ("application/octet-stream",)
IMAGE_FIELD = "image"
TOP_K = "top_k"
OUTPUTS = "outputs"  # what to answer per image, comma-separated: labels (the top k, the default), embedding
LISTED = {OUTPUTS: "outputs=labels,embedding"}  # parameters of several values, comma-separated
LABELS_OUTPUT, EMBEDDING_OUTPUT = "labels", "embedding"
# The model and version a request asks for (optional; 404 naming the served one when they are not it).
MODEL, VERSION = "model", "version"


@dataclass(frozen=True)
class PredictInput:
    """What a /predict request asks for."""

    images: list[bytes]
    top_k: int
    names: list[str | None] | None = None  # multipart file names, to say which image an error is about
    labels: bool = True  # answer each image's top k
    embedding: bool = False  # answer each image's embedding


def _parse_outputs(raw: str | list[str] | None, where: str) -> tuple[bool, bool]:
    """(labels, embedding) from ``outputs`` ("labels", "embedding" or both, comma-separated; a list in JSON);
    UnknownOutput naming what is not one of them."""
    if raw is None:
        return True, False
    names = [name.strip() for name in (raw.split(",") if isinstance(raw, str) else raw) if name.strip()]
    unknown = [name for name in names if name not in (LABELS_OUTPUT, EMBEDDING_OUTPUT)]
    if unknown or not names:
        raise UnknownOutput(f"{OUTPUTS} ({where}) names {', '.join(map(repr, unknown)) or 'nothing'}; each must be "
                            f"{LABELS_OUTPUT!r} or {EMBEDDING_OUTPUT!r} (e.g. {OUTPUTS}={LABELS_OUTPUT},"
                            f"{EMBEDDING_OUTPUT})")
    return LABELS_OUTPUT in names, EMBEDDING_OUTPUT in names


def _filled(name: str, raw: Any) -> Any:
    """``raw`` unless it is empty (``?top_k=``): BadRequest, as an empty ``model``, ``version`` or ``outputs`` is
    (it took the default, where those refuse)."""
    if raw == "":
        raise BadRequest(f"{name} is empty: give it a value, or leave it out")
    return raw


_DIGITS = re.compile(r"-?[0-9]+")


def _integer(raw: str | int) -> int:
    """``int(raw)`` of a number written in ASCII digits, perhaps after a minus (``int`` takes every script's
    digits, underscores, a plus and spaces around: "３" was top_k 3, "1_0" 10); ValueError else."""
    if isinstance(raw, str) and not _DIGITS.fullmatch(raw):
        raise ValueError(raw)
    return int(raw)


def _parse_top_k(raw: str | int | None, default: int, num_classes: int, where: str) -> int:
    if _filled(TOP_K, raw) is None:
        return min(default, num_classes)
    try:
        value = _integer(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise BadRequest(f"top_k ({where}) must be an integer from 1 to {num_classes}, got {raw!r}") from None
    if not 1 <= value <= num_classes:
        raise BadRequest(f"top_k ({where}) must be from 1 to {num_classes}, got {value}")
    return value


def _image_from_base64(text: str, field: str) -> bytes:
    """``text``, the JSON field ``field`` (its name in errors), decoded: base64, or a data URL as browsers make."""
    if text.startswith("data:") and "," in text:
        text = text.split(",", 1)[1]
    return decode_base64(text, field)


SCHEMA_ERRORS_SHOWN = 20  # the most a 422 lists of what does not match: a list of millions would list millions
LIST_ITEMS = 64  # the most items a JSON list field but ``images`` may hold (``outputs`` names a few)


def _json_body(request: Request, schema: type[Schema], max_images: int | None = None) -> Schema:
    """The JSON body read as ``schema``; SchemaViolation (422) listing the fields that do not match (the first
    SCHEMA_ERRORS_SHOWN), or TooManyImages (413) for an ``images`` list over ``max_images``. Both judged before
    pydantic sees the body where its size would count: its errors for a list of millions of wrong items (an
    18 MB body of zeros) took a worker to 10 GB."""
    raw = parse_json(read_sent_body(request), "the body")
    if isinstance(raw, dict):
        _check_shape(raw, schema, max_images)
    try:
        return schema.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise SchemaViolation("the JSON body does not match the request schema", details=schema_details(exc)) from None


def schema_details(exc: pydantic.ValidationError, said: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """A 422's details: pydantic's first SCHEMA_ERRORS_SHOWN errors as ``loc``, ``msg`` and ``type``, a ``msg`` of
    an error type in ``said`` put in its words."""
    errors = exc.errors(include_url=False, include_input=False)[:SCHEMA_ERRORS_SHOWN]
    return [{"loc": list(e["loc"]), "msg": (said or {}).get(e["type"], e["msg"]), "type": e["type"]} for e in errors]


def _check_shape(raw: dict[str, Any], schema: type[Schema], max_images: int | None) -> None:
    """What ``_json_body`` judges before pydantic: fields ``schema`` does not have (named, with a hint where one is
    another request form's: ``MISPLACED``), ``images`` over ``max_images``, another list over LIST_ITEMS."""
    unknown = [name for name in raw if name not in schema.model_fields]
    if unknown:
        misplaced: dict[str, str] = getattr(schema, "MISPLACED", {})
        hints = "".join(f"; {misplaced[name]}" for name in unknown if name in misplaced)
        details = [{"loc": [name[:100]], "msg": "Extra inputs are not permitted", "type": "extra_forbidden"}
                   for name in unknown[:SCHEMA_ERRORS_SHOWN]]
        raise SchemaViolation(f"the JSON body does not match the request schema{hints}", details=details)
    for name, value in raw.items():
        if not isinstance(value, list):
            continue
        if name == "images" and max_images is not None:
            check_image_count(len(value), max_images)
        elif name != "images" and len(value) > LIST_ITEMS:
            raise SchemaViolation(f"the JSON body's {name!r} lists {len(value)} items; at most {LIST_ITEMS}",
                                  details=[{"loc": [name], "msg": f"at most {LIST_ITEMS} items", "type": "too_long"}])


def _said_once(name: str, given: Given | None, query: str | None, where: str) -> Given | str | None:
    """The value of parameter ``name`` given in the request's body or form (``where``) or in its query; BadRequest
    when both give it (neither silently wins over the other)."""
    if given is not None and query is not None:
        raise BadRequest(f"{name} is given twice, {given!r} in the {where} and {query!r} in the query: send it once")
    return query if given is None else given


def _joined(query: dict[str, str], given: dict[str, Given | None], where: str) -> dict[str, Given | str]:
    """The query's parameters and those the body or form (``where``) gives; BadRequest for one given in both."""
    joined: dict[str, Given | str] = dict(query)
    for name, value in given.items():
        if (said := _said_once(name, value, query.get(name), where)) is not None:
            joined[name] = said
    return joined


def _from_json(request: Request, query: dict[str, str], default_top_k: int, num_classes: int,
               max_images: int) -> PredictInput:
    parsed = _json_body(request, PredictJSONRequest, max_images)  # its image count before the decode, and before
    # pydantic's look at each item
    raw_top_k = _said_once(TOP_K, parsed.top_k, query.get(TOP_K), "body")
    top_k = _parse_top_k(raw_top_k, default_top_k, num_classes, "body" if parsed.top_k is not None else "query")
    raw_outputs = _said_once(OUTPUTS, parsed.outputs, query.get(OUTPUTS), "body")
    labels, embedding = _parse_outputs(raw_outputs, "body" if parsed.outputs is not None else "query")
    return PredictInput([_image_from_base64(s, f"images[{i}]") for i, s in enumerate(parsed.images)], top_k, None,
                        labels, embedding)


def _from_multipart(request: Request, fields: set[str], max_images: int) -> tuple[FormData, list[bytes],
                                                                                 list[str | None]]:
    """The form, its images (the ``image`` files) and their file names; BadRequest naming what was sent instead."""
    form = parse_form_data(read_sent_body(request), request.mimetype_params.get("boundary", ""), max_images)
    if IMAGE_FIELD in form.fields:  # curl -F image=cat.jpg (no @) sends the name as text
        raise BadRequest(f"the {IMAGE_FIELD!r} field came as text, not a file: send the image as a file (curl -F "
                         f"{IMAGE_FIELD}=@cat.jpg, with the @)")
    check_known(form.fields, fields, "form field", files=(IMAGE_FIELD,))
    for name, values in form.fields.items():  # (-F top_k=1 -F top_k=3 was its first value, silently)
        if len(values) > 1:
            raise given_more_than_once("form field", name, values, LISTED)
    files = form.files.get(IMAGE_FIELD, [])
    as_files = sorted(set(form.files) & fields)  # curl -F top_k=@file, or a client that sends every field as a file
    if files and as_files:
        raise BadRequest(f"the form field {as_files[0]!r} came as a file, not as text: send it as text (curl -F "
                         f"{as_files[0]}=<value>, without the @)")
    if not files or set(form.files) - {IMAGE_FIELD}:
        sent = ", ".join(repr(name) for name in form.names()) or "none"
        raise BadRequest(f"send each image as a file in the {IMAGE_FIELD!r} field (e.g. curl -F "
                         f"{IMAGE_FIELD}=@cat.jpg); fields sent: {sent}")
    return form, [f.data for f in files], [f.filename for f in files]


def _unsupported(request: Request) -> UnsupportedMediaType:
    """The 415 of a body of no form /predict and /explain read, naming its type as sent (one that does not parse,
    ``;;;==``, as it came, not as none)."""
    said = request.mimetype or request.headers.get("Content-Type") or "(none)"
    return UnsupportedMediaType(f"content type {said!r} is not supported; send multipart/form-data with an "
                                f"{IMAGE_FIELD!r} field, a raw image body (image/* or application/octet-stream), or "
                                "JSON")


def check_known(names: Iterable[str], known: set[str], what: str, files: Iterable[str] = ()) -> None:
    """Refuse a parameter the endpoint does not know (a misspelt ``topk`` would otherwise be ignored), naming those
    it knows: ``known``, and ``files``, the form's fields that are files."""
    unknown = sorted(set(names) - known)
    if unknown:
        listed = sorted([*known, *(f"{name} (a file)" for name in files)])
        raise BadRequest(f"unknown {what} {', '.join(map(repr, unknown))}; known: {', '.join(listed)}")


CLASS_INDEX, LABEL, FORMAT = "class_index", "label", "format"
FORMATS = ("json", "png")


@dataclass(frozen=True)
class ExplainInput:
    """What an /explain request asks for: one image, the class to explain (None: the top one), JSON or a PNG."""

    image: bytes
    index: int | None
    png: bool


def _class_index(raw_index: str | int | None, label: str | None, labels: list[str]) -> int | None:
    raw_index, label = _filled(CLASS_INDEX, raw_index), _filled(LABEL, label)
    if raw_index is not None and label is not None:
        raise BadRequest(f"name the class by {CLASS_INDEX} or by {LABEL}, not both")
    if label is not None:
        if label not in labels:
            raise BadRequest(f"{LABEL} {label!r} is not one of the model's {len(labels)} classes (GET /v1/models"
                             f"?labels=1 lists them)")
        return labels.index(label)
    if raw_index is None:
        return None
    try:
        index = _integer(raw_index)
    except (TypeError, ValueError):
        raise BadRequest(f"{CLASS_INDEX} must be an integer from 0 to {len(labels) - 1}, got {raw_index!r}") from None
    if not 0 <= index < len(labels) or isinstance(raw_index, bool):
        raise BadRequest(f"{CLASS_INDEX} must be from 0 to {len(labels) - 1}, got {raw_index!r}")
    return index


def parse_explain(request: Request, labels: list[str], max_images: int) -> ExplainInput:
    """The image (multipart ``image``, a raw body, or JSON ``{"image": base64}``), the class (``class_index`` or
    ``label``, as query parameters, form or JSON fields; left out: the top one) and ``format`` (json or png)."""
    check_known(request.args.keys(), {CLASS_INDEX, LABEL, FORMAT, MODEL, VERSION}, "query parameter")
    fields = each_once(request.args, "query parameter")
    mimetype = request.mimetype
    if mimetype == "application/json":
        parsed = _json_body(request, ExplainJSONRequest)
        image = _image_from_base64(parsed.image, "image")
        fields = _joined(fields, {CLASS_INDEX: parsed.class_index, LABEL: parsed.label, FORMAT: parsed.format},
                         "body")
    elif mimetype == "multipart/form-data":
        form, images, _ = _from_multipart(request, {CLASS_INDEX, LABEL, FORMAT}, max_images)
        if len(images) != 1:
            raise BadRequest(f"an explanation is of one image; {len(images)} were sent")
        image, fields = images[0], _joined(fields, {name: values[0] for name, values in form.fields.items()}, "form")
    elif mimetype.startswith("image/") or mimetype in RAW_TYPES:
        image = read_sent_body(request)
    else:
        raise _unsupported(request)
    answer_format = _filled(FORMAT, fields.get(FORMAT)) or "json"
    if answer_format not in FORMATS:
        raise BadRequest(f"{FORMAT} must be json or png, got {answer_format!r}")
    return ExplainInput(image, _class_index(fields.get(CLASS_INDEX), fields.get(LABEL), labels),
                        answer_format == "png")


def parse_predict(request: Request, query: dict[str, str], *, default_top_k: int, num_classes: int,
                  max_images: int) -> PredictInput:
    """Images, top_k and outputs from a multipart, raw-bytes or JSON request and its ``query`` (its parameters, each
    given once: ``inputs.each_once``, read once by the route); raises a ServiceError on bad input."""
    check_known(query, {TOP_K, OUTPUTS, MODEL, VERSION}, "query parameter")
    mimetype = request.mimetype
    names: list[str | None] | None = None
    if mimetype == "application/json":
        return _from_json(request, query, default_top_k, num_classes, max_images)
    if mimetype == "multipart/form-data":
        form, images, names = _from_multipart(request, {TOP_K, OUTPUTS}, max_images)
        form_top_k, form_outputs = form.field(TOP_K), form.field(OUTPUTS)
        raw_top_k = _said_once(TOP_K, form_top_k, query.get(TOP_K), "form")
        raw_outputs = _said_once(OUTPUTS, form_outputs, query.get(OUTPUTS), "form")
    elif mimetype.startswith("image/") or mimetype in RAW_TYPES:
        images = [read_sent_body(request)]
        raw_top_k = query.get(TOP_K)
        raw_outputs = query.get(OUTPUTS)
    else:
        raise _unsupported(request)
    return PredictInput(images, _parse_top_k(raw_top_k, default_top_k, num_classes, "parameter"), names,
                        *_parse_outputs(raw_outputs, "parameter"))
