"""The worker's first app (app/hosting/starting.py): what it answers while the real app is imported, that it answers as the
loading app does, and the handover. No server: werkzeug's test client calls it."""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

import pytest
from werkzeug.test import Client

from app import EXTENSION_KEY

from app.factory import create_app
from app.config import Settings
from app.engine.lifecycle import NOT_READY_RETRY_S
from app.engine.versions.sources import DirectorySource
from app.hosting.starting import RETRY_AFTER_S, StartingApp

PATHS = [("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/v2/health/live"), ("GET", "/v2/health/ready"),
         ("POST", "/predict"), ("GET", "/v1/models"), ("POST", "/v2/models/mine/infer"), ("GET", "/v2/models/mine"),
         ("GET", "/v2/models/mine/ready"), ("GET", "/v2/models/mine/versions/1/ready"),  # before: the error shape
         ("GET", "/v2")]  # before: 503, where the loading app gives the server's metadata (tritonclient's first call)


class Gate:
    """A ``load`` for StartingApp that returns ``built``'s builder once opened (or raises ``fails``)."""

    def __init__(self, built: Any = None, fails: BaseException | None = None) -> None:
        self.opened, self.built, self.fails, self.builds = threading.Event(), built, fails, 0

    def __call__(self) -> Callable[[], Any]:
        self.opened.wait(30)
        if self.fails is not None:
            raise self.fails

        def build() -> Any:
            self.builds += 1
            return self.built
        return build


def real(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"the real app"]


real.extensions = {EXTENSION_KEY: "the service"}  # type: ignore[attr-defined]


@pytest.fixture
def gate() -> Iterator[Gate]:
    gate = Gate(built=real)
    yield gate
    gate.opened.set()


def test_before_the_app_exists_every_request_gets_its_answer_at_once(gate: Gate) -> None:
    starting = StartingApp(gate, on_error=pytest.fail, max_body_bytes=1000).start()
    client = Client(starting)
    health, ready = client.get("/healthz"), client.get("/readyz")
    assert (health.status_code, health.json) == (200, {"status": "alive", "checks": {"batcher_thread": True}})
    assert ready.status_code == 503 and ready.json["status"] == "not_ready" and "Retry-After" not in ready.headers
    predict = client.post("/predict", data=b"x" * 10, headers={"Content-Type": "image/jpeg"})
    assert predict.status_code == 503 and predict.headers["Retry-After"] == "5"
    assert predict.headers["Content-Type"] == "application/json" and "Connection" not in predict.headers
    request_id = predict.headers["X-Request-ID"]
    assert predict.json == {"error": {"code": "not_ready", "message": "the model is still loading",
                                      "request_id": request_id}}
    v2 = client.post("/v2/models/mine/infer", json={"inputs": []}, headers={"X-Request-ID": "mine-1"})
    assert (v2.status_code, v2.json, v2.headers["X-Request-ID"]) == (503, {"error": "the model is still loading"},
                                                                     "mine-1")
    assert client.get("/metrics").json["error"]["code"] == "not_ready"  # everything else too
    assert starting.extensions == {}  # gunicorn.conf.py finds no service: a SIGTERM now just stops the worker


@pytest.mark.parametrize("headers", [{"Transfer-Encoding": "chunked"}, {"Content-Length": "1001"}])
def test_a_body_it_cannot_have_read_closes_the_connection(gate: Gate, headers: dict[str, str]) -> None:
    starting = StartingApp(gate, on_error=pytest.fail, max_body_bytes=1000).start()
    environ = {"REQUEST_METHOD": "POST", "PATH_INFO": "/predict",
               **{f"HTTP_{k.upper().replace('-', '_')}": v for k, v in headers.items()}}
    if "Content-Length" in headers:
        environ["CONTENT_LENGTH"] = headers["Content-Length"]
    closed: list[bool] = []

    class Response:  # gunicorn's start_response is a bound method of its response
        def force_close(self) -> None:
            closed.append(True)

        def start_response(self, status: str, headers: list[tuple[str, str]]) -> None:
            self.status, self.headers = status, dict(headers)

    response = Response()
    starting(environ, response.start_response)
    assert closed == [True] and response.headers["Connection"] == "close" and response.status.startswith("503")


def test_the_real_app_takes_over_in_place(gate: Gate) -> None:
    starting = StartingApp(gate, on_error=pytest.fail, max_body_bytes=1000).start()
    assert not starting.wait(0.05)
    gate.opened.set()
    assert starting.wait(10) and gate.builds == 1
    answer = Client(starting).get("/predict")
    assert (answer.status_code, answer.get_data()) == (200, b"the real app")
    assert starting.extensions[EXTENSION_KEY] == "the service"


def test_its_answers_are_counted_as_the_app_counts_its_own_once_the_app_exists(gate: Gate) -> None:
    # Before: none counted, so a reload's 503s from the new workers were missing from the 5xx ratio (1,709 of
    # 14,384 in a new user's trial).
    counted: list[tuple[bool, str, int, int]] = []
    starting = StartingApp(gate, on_error=pytest.fail, max_body_bytes=1000,
                           count=lambda *answer: counted.append(answer)).start()
    client = Client(starting)
    for _ in range(3):
        assert client.post("/predict", data=b"x").status_code == 503
    assert client.get("/readyz").status_code == 503
    assert counted == []  # held until the app exists: nothing imported for it meanwhile
    gate.opened.set()
    assert starting.wait(10)
    assert sorted(counted) == [(False, "", 503, 3), (True, "/readyz", 503, 1)]
    starting._note(False, "/predict", 503)  # one answered as the app took over: written at once
    assert counted[-1] == (False, "", 503, 1)


def test_its_counts_go_where_the_app_counts_its_own() -> None:
    from app.hosting.starting import count_answers
    from app.metrics import PROBES, REQUESTS, STARTING

    before = REQUESTS.labels(STARTING, "599")._value.get(), PROBES.labels("/healthz", "599")._value.get()
    count_answers(False, "", 599, 2)
    count_answers(True, "/healthz", 599, 1)
    assert (REQUESTS.labels(STARTING, "599")._value.get(), PROBES.labels("/healthz", "599")._value.get()) == (
        before[0] + 2, before[1] + 1)


def test_an_import_that_fails_goes_to_on_error() -> None:
    errors: list[BaseException] = []
    boom = ImportError("no torch")
    starting = StartingApp(Gate(fails=boom), on_error=errors.append, max_body_bytes=1000)
    starting._load.opened.set()  # type: ignore[attr-defined]
    assert not starting.start().wait(10)
    assert errors == [boom]


def test_a_worker_stopping_mid_import_builds_nothing(gate: Gate, monkeypatch: pytest.MonkeyPatch) -> None:
    starting = StartingApp(gate, on_error=pytest.fail, max_body_bytes=1000).start()
    monkeypatch.setattr("app.hosting.starting._stopping", lambda: True)  # as when the worker's main thread has ended
    gate.opened.set()
    assert not starting.wait(10) and gate.builds == 0


class Blocked(DirectorySource):
    """A repository that answers nothing until released: the real app stays loading."""

    released = threading.Event()

    def models(self) -> list[str]:
        self.released.wait(30)
        return []


@pytest.fixture
def loading_app(settings: Settings) -> Iterator[Any]:
    app = create_app(settings, source=Blocked(settings), on_load_error=lambda exc: None)
    yield app
    Blocked.released.set()
    app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_it_answers_as_the_loading_app_does(loading_app: Any, gate: Gate) -> None:
    assert RETRY_AFTER_S == NOT_READY_RETRY_S
    starting = Client(StartingApp(gate, on_error=pytest.fail, max_body_bytes=1000).start())
    loading = loading_app.test_client()
    for method, path in PATHS:
        ours = starting.open(path, method=method, headers={"X-Request-ID": "same"})
        theirs = loading.open(path, method=method, headers={"X-Request-ID": "same"})
        assert ours.status_code == theirs.status_code, path
        assert ours.json == theirs.json, path
        for header in ("Content-Type", "Retry-After", "X-Request-ID", "Connection"):
            assert ours.headers.get(header) == theirs.headers.get(header), (path, header)


def test_the_v2_extensions_said_while_starting_are_the_app_s() -> None:
    from app.hosting.starting import V2_EXTENSIONS
    from app.v2.routes import EXTENSIONS

    assert V2_EXTENSIONS == EXTENSIONS


def test_a_request_id_with_a_final_newline_is_not_kept() -> None:
    # `$` also matched before a final newline: "abc\n" was kept, and a header holding it cannot be sent.
    from app.hosting.request_framing import REQUEST_ID

    assert REQUEST_ID.match("abc-1") and not REQUEST_ID.match("abc-1\n")
