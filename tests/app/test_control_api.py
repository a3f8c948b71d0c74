"""Who may change what is served (CONTROL_API): a repository load or unload, a promotion or a rollback. Before it,
any client that could reach the port could unload every model (the default bind is 0.0.0.0, no key by default):
a new user's trial."""
from __future__ import annotations

from typing import Iterator

import pytest
from flask.testing import FlaskClient

from app import EXTENSION_KEY
from app.config import Settings
from app.factory import create_app
from tests.support.answers import error_of
from tests.support.fakes import FakeRepository
from tests.support.imaging import RED, image_bytes

CALLS = ("/v1/models/colour/promote", "/v1/models/colour/rollback", "/v2/repository/models/colour/load",
         "/v2/repository/models/colour/unload")
AWAY = {"REMOTE_ADDR": "10.1.2.3"}


def _client(settings: Settings, **changed: object) -> Iterator[FlaskClient]:
    repository = FakeRepository()
    repository.add("colour", "1")
    repository.add("colour", "2")
    app = create_app(Settings(**{**settings.model_dump(), **changed}), source=repository)  # type: ignore[arg-type]
    try:
        yield app.test_client()
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


@pytest.fixture
def local(settings: Settings) -> Iterator[FlaskClient]:
    yield from _client(settings)


def _refusal(response) -> str:  # noqa: ANN001 - a Flask test response
    """The 403's message, in its path's error shape (V2's: {"error": message})."""
    assert response.status_code == 403, response.get_data(as_text=True)
    body = response.get_json()["error"]
    return body if isinstance(body, str) else error_of(response, 403, "forbidden")["message"]


def test_by_default_only_this_machine_changes_what_is_served(local: FlaskClient) -> None:
    default = local.get("/v1/models/colour").get_json()["workers"][0]["models"]["colour"]["default"]
    for path in CALLS:
        message = _refusal(local.post(path, environ_base=AWAY))
        assert "answers clients on this machine alone, not a web page's requests (VISIONSERVE_CONTROL_API=local, " \
               "the default), and this one came from 10.1.2.3" in message and "CONTROL_API=open" in message, message
    assert local.get("/v1/models/colour").get_json()["workers"][0]["models"]["colour"]["default"] == default
    for path in ("/v1/models", "/v2/repository/index"):  # what is served may still be read from anywhere
        assert (local.post if path.startswith("/v2") else local.get)(path, environ_base=AWAY).status_code == 200
    assert local.post("/predict", data=image_bytes(RED), content_type="image/jpeg",
                      environ_base=AWAY).status_code == 200
    # A proxy's request is no local client's, though its peer is this machine
    for header in ("X-Forwarded-For", "X-Real-IP", "Forwarded"):
        message = _refusal(local.post(CALLS[2], headers={header: "203.0.113.9"}))
        assert f"this one came through a proxy (it carries {header})" in message
    # A web page's request, though its peer is this machine (a page of any site may POST to a loopback address
    # without a preflight; DNS rebinding makes it same-origin): a review found an unload by one
    for header, value in (("Origin", "https://evil.example"), ("Sec-Fetch-Site", "cross-site"),
                          ("Origin", "http://rebind.evil.example:8000")):
        message = _refusal(local.post(CALLS[3], headers={header: value}, data="{}", content_type="text/plain"))
        assert f"this one came from a browser (it carries {header})" in message
    # Loopback peers, IPv4, IPv6 and IPv4 mapped into IPv6, change it
    for peer in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
        assert local.post(CALLS[2], environ_base={"REMOTE_ADDR": peer}).status_code == 200, peer
    assert local.post(CALLS[0], json={"version": "1"}).get_json()["default"] == "1"


def test_open_takes_every_client_and_off_none(settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    for client in _client(settings, control_api="open"):
        assert client.post(CALLS[0], json={"version": "1"}, environ_base=AWAY).get_json()["default"] == "1"
    assert "CONTROL_API=open and no API key: any client that reaches this server may load, unload" in caplog.text
    for client in _client(settings, control_api="off"):
        for path in CALLS:
            assert "model changes by call are off on this server (VISIONSERVE_CONTROL_API=off)" in _refusal(
                client.post(path))


def test_the_api_key_is_asked_first_then_the_control_rule(settings: Settings,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    key = {"X-API-Key": "k3y"}
    for client in _client(settings, api_key="k3y"):
        error_of(client.post(CALLS[0], environ_base=AWAY), 401, "unauthorized")
        assert "came from 10.1.2.3" in _refusal(client.post(CALLS[0], headers=key, environ_base=AWAY))
        assert client.post(CALLS[0], json={"version": "1"}, headers=key).status_code == 200
    caplog.clear()
    for client in _client(settings, api_key="k3y", control_api="open"):
        error_of(client.post(CALLS[0], environ_base=AWAY), 401, "unauthorized")
        assert client.post(CALLS[0], json={"version": "1"}, headers=key, environ_base=AWAY).status_code == 200
    assert "CONTROL_API=open" not in caplog.text  # with a key, nothing to warn of


def test_a_peer_without_an_address_is_local_on_a_unix_socket_alone() -> None:
    # gunicorn leaves REMOTE_ADDR empty on a Unix socket, and None behind a PROXY protocol header of type LOCAL: only
    # the first is this machine for sure (a review's finding: both were local)
    from app.web.auth import control_refusal, is_local

    assert is_local("", unix_socket=True) and not is_local("") and not is_local(None)
    assert is_local("::1%lo") and is_local("127.0.0.2") and not is_local("::127.0.0.1") and not is_local("0.0.0.0")
    assert control_refusal("local", "", {}, unix_socket=True) is None
    assert "came from no address" in control_refusal("local", None, {}).message
