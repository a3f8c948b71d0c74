"""What the app's answers hold, checked the same way everywhere: the labels of a 200, the error body of a 4xx/5xx."""
from __future__ import annotations


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
