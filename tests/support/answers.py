"""What the app's answers hold, checked the same way everywhere: the labels of a 200, the error body of a 4xx/5xx;
and the one error line python -m models.predict ends with."""
from __future__ import annotations

import logging
from typing import Sequence

import pytest


def labels_of(response) -> list[str]:  # noqa: ANN001 - a Flask test response
    """The predicted labels of a 200 answer, in order."""
    assert response.status_code == 200, response.get_json()
    return [p["label"] for p in response.get_json()["predictions"]]


def error_of(response, status: int, code: str) -> dict:  # noqa: ANN001 - a Flask test response
    """The error body of an answer that must be ``status`` with ``code``: JSON, a message, the request's id."""
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.mimetype == "application/json"
    body = response.get_json()["error"]
    assert body["code"] == code and body["message"]
    assert body["request_id"] == response.headers["X-Request-ID"]
    return body


def predict_error(argv: Sequence[str], caplog: pytest.LogCaptureFixture) -> str:
    """The one error line ``python -m models.predict`` logs for ``argv``, which it refuses with exit code 2."""
    from models.predict.__main__ import main

    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="models.predict"):
        assert main(list(argv)) == 2
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    return line
