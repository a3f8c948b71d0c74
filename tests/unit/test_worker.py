"""The event loop's request reading (app/worker.py), without a server: when a request is whole."""
from __future__ import annotations

import json

import pytest

from app.worker import body_length, timeout_response


@pytest.mark.parametrize("head, expected", [
    (b"GET /healthz HTTP/1.1\r\nHost: x", 0),  # no body
    (b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 1234", 1234),
    (b"POST /predict HTTP/1.1\r\ncontent-length:  7 ", 7),  # names are case-insensitive, values trimmed
    (b"POST /predict HTTP/1.1\r\nTransfer-Encoding: chunked", None),  # the thread's parser reads chunks
    (b"POST /predict HTTP/1.1\r\nContent-Length: 9\r\nExpect: 100-continue", None),  # the client waits for 100
    (b"POST /predict HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2", None),  # the parser refuses these
    (b"POST /predict HTTP/1.1\r\nContent-Length: -1", None),
    (b"POST /predict HTTP/1.1\r\nContent-Length: 1e3", None),
])
def test_body_length_says_how_much_to_wait_for(head: bytes, expected: int | None) -> None:
    assert body_length(head) == expected


def test_a_timeout_answer_is_408_json_in_the_service_error_shape() -> None:
    head, _, body = timeout_response("the request headers did not arrive within 10s").partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"Connection: close" in head
    assert f"Content-Length: {len(body)}".encode() in head
    assert json.loads(body) == {"error": {"code": "request_timeout", "request_id": None,
                                          "message": "the request headers did not arrive within 10s"}}
