"""What app/web/hooks.py and app/web/auth.py do on every request, refusals included: the request id, the API key as
the bytes a client sent, and the access log's fields."""
from __future__ import annotations

import logging
import os
import re
import select
from typing import Any, Iterator

import pytest
from flask import Flask

from app import EXTENSION_KEY
from app.config import Settings
from app.engine.loaded.predictor import Predictor
from app.factory import create_app
from app.hosting.request_framing import new_request_id
from tests.support.imaging import image_bytes


def _app(settings: Settings, predictor: Predictor, **changes: Any) -> Flask:
    return create_app(Settings.model_validate({**settings.model_dump(), **changes}), predictor)


@pytest.fixture
def keyed(settings: Settings, predictor: Predictor) -> Iterator[Flask]:
    """The service with a key that is not ASCII."""
    app = _app(settings, predictor, api_key="clé-secrète")
    yield app
    app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def _sent(raw: bytes) -> str:
    """A header value as a WSGI server hands it over (PEP 3333; gunicorn too): the bytes sent, read as latin-1."""
    return raw.decode("latin-1")


@pytest.mark.parametrize("raw", ["clé-secrète".encode(), "clé-secrète".encode("latin-1")])
@pytest.mark.parametrize("header", ["HTTP_X_API_KEY", "HTTP_AUTHORIZATION"])
def test_a_key_that_is_not_ascii_matches_in_utf8_and_in_latin1(keyed: Flask, raw: bytes, header: str) -> None:
    # Before: the header's text (the bytes read as latin-1) was encoded as UTF-8 to compare, so a client sending the
    # key in UTF-8 (curl, the demo page) never matched.
    value = _sent(raw) if header == "HTTP_X_API_KEY" else "Bearer " + _sent(raw)
    answer = keyed.test_client().get("/v1/models", environ_overrides={header: value})
    assert answer.status_code == 200, answer.get_json()


@pytest.mark.parametrize("value", ["clé-secrèt", "cl\udcffé", "密钥", "clé-secrète\u00a0", "x" * 10_000, ""])
def test_any_other_key_is_401_never_500(keyed: Flask, value: str) -> None:
    # A header value no server hands over (a character past U+00FF) is a wrong key too, not an encoding error.
    answer = keyed.test_client().get("/v1/models", environ_overrides={"HTTP_X_API_KEY": value})
    assert answer.status_code == 401 and answer.get_json()["error"]["code"] == "unauthorized"


def test_a_key_ending_in_a_byte_python_calls_whitespace_still_matches(settings: Settings,
                                                                      predictor: Predictor) -> None:
    # "à" is C3 A0 in UTF-8: read as latin-1 its last character is U+00A0, which str.strip() would cut off.
    app = _app(settings, predictor, api_key="voilà")
    try:
        value = "Bearer " + _sent("voilà".encode())
        answer = app.test_client().get("/v1/models", environ_overrides={"HTTP_AUTHORIZATION": value})
        assert answer.status_code == 200
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


@pytest.mark.parametrize("sent", ["abc\n", "abc\r\n", "a\x01b", "a" * 129, "a b", ""])
def test_a_request_id_that_is_not_sane_is_replaced(client: Any, sent: str) -> None:
    # Before: "abc\n" passed the pattern (its $ matches before a final newline), and setting it as the answer's
    # header raised: 500.
    answer = client.get("/healthz", environ_overrides={"HTTP_X_REQUEST_ID": sent})
    assert answer.status_code == 200
    assert answer.headers["X-Request-ID"] != sent and len(answer.headers["X-Request-ID"]) == 32


def test_made_request_ids_are_128_random_bits_that_differ_by_request_and_in_each_forked_worker(client: Any) -> None:
    made = [client.get("/healthz").headers["X-Request-ID"] for _ in range(64)]
    assert len(set(made)) == len(made) and all(re.fullmatch(r"[0-9a-f]{32}", made_id) for made_id in made)
    # gunicorn forks its workers: each draws from a generator of its own (random reseeds a forked child), not the
    # same ids as its siblings
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # (the id alone: no app in a forked test process)
        os.write(write_end, new_request_id().encode())
        os._exit(0)
    os.close(write_end)
    try:
        assert select.select([read_end], [], [], 10)[0], "the forked child wrote nothing"
        childs = os.read(read_end, 64).decode()
    finally:
        os.close(read_end)
        os.waitpid(child, 0)
    assert childs != new_request_id() and re.fullmatch(r"[0-9a-f]{32}", childs)


def test_refused_requests_log_the_trusted_forwarded_for(settings: Settings, predictor: Predictor,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    # Before: the forwarded address was recorded by a hook that ran after the one refusing (401, 413): null.
    app = _app(settings, predictor, api_key="s3cret", trust_forwarded_for=True)
    try:
        client, forwarded = app.test_client(), {"X-Forwarded-For": "203.0.113.7"}
        with caplog.at_level(logging.INFO, logger="visionserve.access"):
            client.post("/predict", data=image_bytes(), content_type="image/jpeg", headers=forwarded)
            client.post("/predict", data=b"\0" * (settings.max_body_bytes + 1), content_type="image/jpeg",
                        headers={**forwarded, "X-API-Key": "s3cret"})
            client.post("/predict", data=image_bytes(), content_type="image/jpeg",
                        headers={**forwarded, "X-API-Key": "s3cret"})
        lines = [(r.status, getattr(r, "forwarded_for", None)) for r in caplog.records if r.msg == "request"]
        assert lines == [(401, "203.0.113.7"), (413, "203.0.113.7"), (200, "203.0.113.7")]
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)
