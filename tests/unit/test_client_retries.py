"""The client's retries, time limits, headers and request planning against stub servers (http.server on a free
loopback port, in this process) and a stub session: what is retried and what never is, the call's time and its
deadline across attempts (on a fake clock: nothing here waits for real time), Retry-After in each of its forms, the
requests predict_each makes to fit the server's limits."""
from __future__ import annotations

import io
import json
import os
import re
import socket
import threading
import time
import tomllib
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import requests
import urllib3

import visionserve_client
from harness.servers import free_port
from visionserve_client import Client, Prediction, UsageError, VisionServeError
from visionserve_client.__main__ import main as cli

ROOT = Path(__file__).resolve().parents[2]


# -- a stub server ---------------------------------------------------------------------------------------------------

class Seen:
    """One request as the stub server got it."""

    def __init__(self, handler: BaseHTTPRequestHandler, body: bytes) -> None:
        self.method, self.path, self.body = handler.command, handler.path, body
        self.headers = {k: v.encode("latin-1") for k, v in handler.headers.items()}  # the bytes sent
        self.port = handler.client_address[1]
        self.images: list[tuple[str, bytes]] = []  # (file name, bytes) of each multipart part
        content_type = handler.headers.get("Content-Type", "")
        if content_type.startswith("multipart/form-data"):
            boundary = content_type.partition("boundary=")[2].strip('"').encode()
            for chunk in body.split(b"--" + boundary)[1:-1]:
                head, _, data = chunk.partition(b"\r\n\r\n")
                name = re.search(rb'filename="([^"]*)"', head)
                self.images.append((name[1].decode("utf-8") if name else "", data[:-2]))  # less its CRLF

    def header(self, name: str) -> str | None:
        value = self.headers.get(name)
        return None if value is None else value.decode("utf-8")


Answer = tuple[int, dict[str, str], bytes]


def ok(labels: list[str]) -> Answer:
    predictions = [{"label": label, "index": 0, "score": 1.0, "top_k": [{"label": label, "index": 0, "score": 1.0}]}
                   for label in labels]
    return 200, {}, json.dumps({"model": {"name": "m", "version": "1"}, "predictions": predictions}).encode()


def refused(status: int, code: str, message: str = "no", headers: dict[str, str] | None = None,
            details: object = None) -> Answer:
    error = {"code": code, "message": message, **({"details": details} if details is not None else {})}
    return status, headers or {}, json.dumps({"error": error}).encode()


def by_content(seen: Seen) -> Answer:
    """/predict answering each image's label as its bytes (b"bad..." refused as the server refuses an image: the
    first, the later ones in its details' ``also_refused``)."""
    bad = [{"image": index, "filename": name, "status": 400, "code": "invalid_image",
            "message": f"image {index} ({name}): not an image"}
           for index, (name, data) in enumerate(seen.images) if data.startswith(b"bad")]
    if bad:
        first = bad[0]
        return refused(400, "invalid_image", first["message"], details={
            "image": first["image"], "filename": first["filename"], **({"also_refused": bad[1:]} if bad[1:] else {})})
    return ok([data.decode() for _, data in seen.images])


class Stub:
    """Answers each request with ``answer(seen)`` (a scripted list first, when one is set) and records it."""

    def __init__(self, answer: Callable[[Seen], Answer]) -> None:
        self.answer, self.script, self.seen = answer, [], []  # type: ignore[var-annotated]
        self.events: list[str] = []  # shared with a test's own records: the order things happened in
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self._answer()

            def do_POST(self) -> None:  # noqa: N802
                self._answer()

            def _answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                seen = Seen(self, body)
                stub.seen.append(seen)
                stub.events.append(f"{seen.method} {seen.path.split('?')[0]} {len(seen.images)}")
                status, headers, payload = stub.script.pop(0)(seen) if stub.script else stub.answer(seen)
                self.send_response_only(status)  # no Date of its own: a test's Date is the one sent
                headers = {"Content-Type": "application/json", **headers}
                for name, value in {**headers, "Content-Length": str(len(payload))}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def posts(self) -> list[Seen]:
        return [seen for seen in self.seen if seen.method == "POST"]


@pytest.fixture
def stub() -> Iterator[Stub]:
    """A stub whose /v1/models says no limits (404) and whose /predict answers by content."""
    server = Stub(lambda seen: by_content(seen) if seen.path.startswith("/predict") else refused(404, "not_found"))
    threading.Thread(target=server.server.serve_forever, args=(0.02,), daemon=True).start()
    try:
        yield server
    finally:
        server.server.shutdown()
        server.server.server_close()


def limits(max_images: int, max_body_bytes: int) -> Callable[[Seen], Answer]:
    """/v1/models saying these limits, /predict holding to them (413 as the server's) and answering by content."""
    def answer(seen: Seen) -> Answer:
        if seen.path.startswith("/v1/models"):
            model = {"name": "m", "limits": {"max_images": max_images, "max_body_bytes": max_body_bytes}}
            return 200, {}, json.dumps({"default_model": "m", "models": [model]}).encode()
        if len(seen.body) > max_body_bytes:
            return refused(413, "request_entity_too_large", f"the request body is over the {max_body_bytes} byte "
                           "limit", {"Connection": "close"})
        if len(seen.images) > max_images:
            return refused(413, "too_many_images", f"{len(seen.images)} images; the limit is {max_images}")
        return by_content(seen)
    return answer


class Clock:
    """Monotonic seconds that pass only when the client sleeps; the sleeps recorded."""

    def __init__(self) -> None:
        self.now, self.sleeps = 1000.0, []  # type: ignore[var-annotated]

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def client(url: str, clock: Clock | None = None, **options: Any) -> Client:
    clock = clock or Clock()
    return Client(url, sleep=clock.sleep, clock=clock, **options)


def always(answer: Answer) -> Callable[[Seen], Answer]:
    return lambda seen: answer


# -- predict_each: requests that fit the server's limits -------------------------------------------------------------

def test_predict_each_sends_as_many_requests_as_the_servers_limits_need(stub: Stub, tmp_path: Path) -> None:
    # Before: every file in one request, so 17 files (or a body over MAX_BODY_BYTES) was one 413 for them all.
    stub.answer = limits(max_images=3, max_body_bytes=2000)
    images: list[bytes | str] = [f"img{i}".encode() for i in range(7)]
    big = tmp_path / "big.jpg"
    big.write_bytes(b"x" * 2500)  # alone over the body limit: its own error, never sent
    images.insert(4, str(big))
    images += [b"y" * 700, b"z" * 700, b"w" * 700]  # bytes, not the count, close these requests
    with client(stub.url) as c:
        results = c.predict_each(images)
    assert [r.label for r in results if isinstance(r, Prediction)] == [
        data.decode() for data in images if isinstance(data, bytes)]
    error = results[4]
    assert isinstance(error, VisionServeError) and error.code == "request_entity_too_large"
    assert error.image_index == 4 and error.status is None and "big.jpg" in str(error) and "2000" in str(error)
    posts = stub.posts()
    assert [len(p.images) for p in posts] == [3, 3, 2, 2]
    assert all(len(p.body) <= 2000 for p in posts) and not any(b"x" * 100 in p.body for p in posts)
    assert [s.method for s in stub.seen].count("GET") == 1  # the limits read once


def test_files_are_read_as_their_request_is_made(stub: Stub, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: every file read into memory before the first request.
    stub.answer = limits(max_images=2, max_body_bytes=10_000)
    paths = []
    for i in range(6):
        paths.append(tmp_path / f"{i}.jpg")
        paths[-1].write_bytes(f"img{i}".encode())
    read_bytes = Path.read_bytes

    def recorded(path: Path) -> bytes:
        stub.events.append(f"read {path.name}")
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", recorded)
    with client(stub.url) as c:
        assert [r.label for r in c.predict_each(paths)] == [f"img{i}" for i in range(6)]  # type: ignore[union-attr]
    first_post = stub.events.index("POST /predict 2")
    assert stub.events[first_post - 1] in ("read 1.jpg", "read 2.jpg")  # at most one file ahead of the requests
    assert "read 5.jpg" not in stub.events[:first_post]


def test_a_413_for_the_whole_request_is_answered_in_halves(stub: Stub) -> None:
    # A server whose limits /v1/models does not say (404 here), lower than the defaults: halves until they fit.
    def answer(seen: Seen) -> Answer:
        if not seen.path.startswith("/predict"):
            return refused(404, "not_found")
        if len(seen.images) > 3:
            return refused(413, "too_many_images", f"{len(seen.images)} images; the limit is 3")
        if len(seen.body) > 1500:
            return refused(413, "request_entity_too_large", "over the 1500 byte limit", {"Connection": "close"})
        return by_content(seen)

    stub.answer = answer
    images = [f"img{i}".encode() for i in range(10)] + [b"q" * 1400]
    with client(stub.url) as c:
        results = c.predict_each(images)
    assert [r.label for r in results[:10]] == [f"img{i}" for i in range(10)]  # type: ignore[union-attr]
    alone = results[10]
    assert isinstance(alone, VisionServeError) and alone.status == 413 and alone.image_index == 10
    assert alone.code == "request_entity_too_large"


@pytest.mark.parametrize("max_images", [3, 16])  # in several requests, in one
def test_a_refused_image_is_named_by_its_own_position(stub: Stub, max_images: int) -> None:
    # Before: the server's index in the request it was sent in ("image 1") for the caller's image 3.
    stub.answer = limits(max_images=max_images, max_body_bytes=10_000)
    images = [b"img0", b"bad1", b"img2", b"bad3", b"img4", b"bad5", b"bad6"]
    with client(stub.url) as c:
        results = c.predict_each(images)
    for position in (1, 3, 5, 6):
        error = results[position]
        assert isinstance(error, VisionServeError) and error.image_index == position, error
        assert error.message.startswith(f"image {position} (image{position}): ")
        assert error.details["filename"] == f"image{position}"  # type: ignore[index]
    assert [r.label for r in results if isinstance(r, Prediction)] == ["img0", "img2", "img4"]


def test_the_images_a_refusal_lists_are_taken_out_together_and_the_rest_sent_once(stub: Stub) -> None:
    # Before: one image taken out a request, the rest sent again: five requests for four bad images in seven.
    stub.answer = limits(max_images=16, max_body_bytes=10_000)
    images = [b"img0", b"bad1", b"img2", b"bad3", b"img4", b"bad5", b"bad6"]
    with client(stub.url) as c:
        results = c.predict_each(images)
    assert [len(seen.images) for seen in stub.posts()] == [7, 3]
    for position in (1, 3, 5, 6):
        error = results[position]
        assert isinstance(error, VisionServeError) and (error.image_index, error.status, error.code) == (
            position, 400, "invalid_image"), error
        assert error.message == f"image {position} (image{position}): not an image"
    assert [r.label for r in results if isinstance(r, Prediction)] == ["img0", "img2", "img4"]
    stub.answer = lambda seen: refused(400, "invalid_image", "image 0 (a): no", details={"image": 0, "also_refused": [
        {"image": 9}, {"image": True}, "x", {"image": 1, "status": "?", "code": None}]})
    with client(stub.url) as c:
        odd = c.predict_each([b"bad0", b"bad1", b"img2"])
    assert [(e.image_index, e.status, e.code) for e in odd] == [  # type: ignore[union-attr]
        (0, 400, "invalid_image"), (1, 400, "invalid_image"), (2, 400, "invalid_image")]  # (img2 sent again)
    assert [len(seen.images) for seen in stub.posts()][-2:] == [3, 1]  # the malformed entries' images not taken out


def test_a_request_refused_as_a_whole_is_each_images_error_and_the_rest_are_not_sent(stub: Stub) -> None:
    stub.answer = limits(max_images=2, max_body_bytes=10_000)
    stub.script = [lambda seen: refused(401, "unauthorized", "a valid API key is required")] * 3
    with client(stub.url, retries=0) as c:
        results = c.predict_each([b"a", b"b", b"c", b"d", b"e"])
    assert all(isinstance(r, VisionServeError) and r.code == "unauthorized" for r in results)
    assert len(stub.posts()) == 1


# -- what is retried, and for how long -------------------------------------------------------------------------------

class Session:
    """A stand-in for requests.Session.request: raises or answers what it is given, one per call, recording each
    call's keyword arguments."""

    def __init__(self, outcomes: list[BaseException | Answer]) -> None:
        self.outcomes, self.calls = outcomes, []  # type: ignore[var-annotated]

    def __call__(self, method: str, url: str, **kwargs: Any) -> requests.Response:
        self.calls.append(kwargs)
        outcome = self.outcomes.pop(0) if self.outcomes else ok(["a"])
        if isinstance(outcome, BaseException):
            raise outcome
        response = requests.Response()
        response.status_code, payload = outcome[0], outcome[2]
        response.headers.update({"Content-Type": "application/json", **outcome[1]})
        response.raw = io.BytesIO(payload)
        return response


def _refused_connection() -> requests.ConnectionError:
    reason = urllib3.exceptions.NewConnectionError(None, "Connection refused")  # type: ignore[arg-type]
    return requests.ConnectionError(urllib3.exceptions.MaxRetryError(None, "/predict", reason))  # type: ignore


@pytest.mark.parametrize("failure, retried, code", [
    (requests.ReadTimeout("read timed out"), False, "timeout"),  # the server may still be working on it
    (requests.ConnectTimeout("connect timed out"), True, "connection_error"),  # nothing was sent
    (_refused_connection(), True, "connection_error"),
    (requests.ConnectionError("Connection aborted: RemoteDisconnected"), True, "connection_error"),  # a dead worker
    (requests.exceptions.SSLError("certificate verify failed"), False, "tls_error"),  # a server answered there
])
def test_which_failures_are_retried(failure: Exception, retried: bool, code: str) -> None:
    # Before: a POST was sent again after a read timeout, each attempt with the whole timeout.
    session = Session([failure] * 4)
    with client("http://127.0.0.1:9", retries=3) as c:  # no request reaches the URL: the session is a stub
        c.session.request = session  # type: ignore[method-assign]
        with pytest.raises(VisionServeError) as caught:
            c.predict(b"x")
    assert caught.value.code == code and caught.value.status is None
    assert len(session.calls) == (4 if retried else 1)


def test_a_real_read_timeout_is_not_retried(stub: Stub) -> None:
    release = threading.Event()
    stub.answer = lambda seen: (release.wait(10), ok(["late"]))[1]
    try:
        with Client(stub.url, timeout=0.3, retries=3, sleep=lambda s: None) as c, \
                pytest.raises(VisionServeError) as caught:
            c.predict(b"x")
    finally:
        release.set()
    assert caught.value.code == "timeout" and len(stub.posts()) == 1


def test_each_attempt_connects_within_a_short_timeout_and_reads_within_what_is_left() -> None:
    clock = Clock()
    session = Session([refused(503, "not_ready", headers={"Retry-After": "4"}), ok(["a"])])
    with client("http://127.0.0.1:9", clock, timeout=30, connect_timeout=5) as c:
        c.session.request = session  # type: ignore[method-assign]
        assert c.predict(b"x").label == "a"
    (wait,) = clock.sleeps
    assert [call["timeout"] for call in session.calls] == [(5, 30), (5, pytest.approx(30 - wait))]


def test_timeout_bounds_the_whole_call(stub: Stub) -> None:
    # Before: timeout limited each attempt, so 5 retries of a 429 with Retry-After 10 took a minute, not 25 s.
    clock = Clock()
    stub.answer = always(refused(429, "overloaded", headers={"Retry-After": "10"}))
    with client(stub.url, clock, timeout=25, retries=5) as c, pytest.raises(VisionServeError) as caught:
        c.predict(b"x")
    assert caught.value.code == "overloaded" and caught.value.retry_after_s == 10
    assert len(stub.posts()) == 3 and len(clock.sleeps) == 2 and sum(clock.sleeps) < 25


def test_the_deadline_left_goes_with_each_attempt_and_ends_the_retries(stub: Stub) -> None:
    # Before: every attempt sent the whole deadline_ms, and the retries went on after it had passed.
    clock = Clock()
    busy = refused(429, "overloaded", headers={"Retry-After": "1"})
    stub.script = [always(busy), always(busy)]
    with client(stub.url, clock, retries=5) as c:
        assert c.predict(b"img", deadline_ms=2500).label == "img"
    sent = [int(seen.header("X-Request-Timeout") or 0) for seen in stub.posts()]
    first, second = clock.sleeps
    assert sent[0] == 2500 and 1300 <= sent[1] <= 1500 and 100 <= sent[2] <= 500
    assert sent[1] == pytest.approx(2500 - first * 1000, abs=1)
    assert sent[2] == pytest.approx(2500 - (first + second) * 1000, abs=1)

    stub.seen.clear()
    stub.answer = always(busy)
    clock = Clock()
    with client(stub.url, clock, retries=5) as c, pytest.raises(VisionServeError) as caught:
        c.predict(b"x", deadline_ms=2000)
    assert caught.value.code == "overloaded" and len(stub.posts()) == 2 and len(clock.sleeps) == 1


@pytest.mark.parametrize("deadline_ms", [0, -1, float("nan"), float("inf")])
def test_a_deadline_that_is_no_time_is_refused_before_any_request(deadline_ms: float) -> None:
    with Client("http://127.0.0.1:9") as c, pytest.raises(ValueError, match="deadline_ms"):
        c.predict(b"x", deadline_ms=deadline_ms)


def test_a_proxys_502_is_retried_the_services_own_504_is_not(stub: Stub) -> None:
    page = (502, {"Content-Type": "text/html"}, b"<html><h1>502 Bad Gateway</h1>nginx</html>")
    stub.script = [always(page), always((504, {"Content-Type": "text/html"}, b"gateway timeout"))]
    with client(stub.url, retries=3) as c:
        assert c.predict(b"img").label == "img"
    assert len(stub.posts()) == 3
    stub.seen.clear()
    stub.answer = always(refused(504, "deadline_exceeded", "the deadline passed"))
    with client(stub.url, retries=3) as c, pytest.raises(VisionServeError) as caught:
        c.predict(b"img")
    assert caught.value.code == "deadline_exceeded" and len(stub.posts()) == 1


# -- Retry-After ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("retry_after, low, high", [
    ("nan", 0.25, 0.75), ("-1", 0.25, 0.75), ("inf", 0.25, 0.75), ("soon", 0.25, 0.75),  # the backoff (0.5 s)
    ("0", 0.0, 0.0), (" 3 ", 3.0, 3.6), ("1.5", 1.5, 1.8),
])
def test_retry_after_in_seconds_or_else_the_backoff(stub: Stub, retry_after: str, low: float, high: float) -> None:
    # Before: nan slept nan (time.sleep raises), -1 slept -1 (raises), "inf" slept max_backoff_s.
    clock = Clock()
    stub.script = [always(refused(429, "overloaded", headers={"Retry-After": retry_after}))]
    with client(stub.url, clock, retries=1, backoff_s=0.5) as c:
        assert c.predict(b"img").label == "img"
    (wait,) = clock.sleeps
    assert low <= wait <= high


def test_retry_after_as_an_http_date_is_counted_from_the_answers_date(stub: Stub) -> None:
    # Before: an HTTP-date was ignored (the backoff instead).
    now = datetime(2031, 5, 6, 7, 8, 9, tzinfo=timezone.utc)
    said = {"Retry-After": format_datetime(now + timedelta(seconds=8), usegmt=True),
            "Date": format_datetime(now, usegmt=True)}
    past = {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}  # long gone, and no Date: this machine's clock
    clock = Clock()
    stub.script = [always(refused(503, "not_ready", headers=said)), always(refused(503, "not_ready", headers=past))]
    with client(stub.url, clock, retries=2) as c:
        assert c.predict(b"img").label == "img"
    assert 8 <= clock.sleeps[0] <= 8 * 1.2 and clock.sleeps[1] == 0


def test_retry_after_longer_than_the_deadline_left_ends_the_retries(stub: Stub) -> None:
    clock = Clock()
    stub.answer = always(refused(429, "overloaded", headers={"Retry-After": "20"}))
    with client(stub.url, clock, retries=3) as c, pytest.raises(VisionServeError) as caught:
        c.predict(b"x", deadline_ms=5000)
    assert caught.value.retry_after_s == 20 and clock.sleeps == [] and len(stub.posts()) == 1


def test_retry_after_gets_jitter_on_top(stub: Stub, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: exactly what the server said, so every client it told the same came back at the same instant.
    clock = Clock()
    monkeypatch.setattr("visionserve_client.api.random.random", lambda: 0.999)
    busy = always(refused(429, "overloaded", headers={"Retry-After": "2"}))
    stub.script = [busy, always(refused(429, "overloaded", headers={"Retry-After": "100"}))]
    with client(stub.url, clock, retries=2, max_backoff_s=10) as c:
        c.predict(b"img")
    assert clock.sleeps == [pytest.approx(2 * 1.1998), pytest.approx(10 * 1.1998)]  # never less than asked


# -- what no retry changes --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("url", ["localhost:8000", "ftp://host", "http://", "http://[::1", "http://host:port"])
def test_a_url_no_request_can_go_to_is_a_usage_error_at_once(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: retried, then "connection_error ... no server answers at localhost:8000".
    with pytest.raises(UsageError) as caught:
        Client(url)
    assert isinstance(caught.value, ValueError) and caught.value.code == "usage_error"
    assert cli(["--url", url, "model"]) == 2
    error = capsys.readouterr().err
    assert "http://" in error and "no server answers" not in error


@pytest.mark.parametrize("url, root", [("http://localhost:8000/v2", "http://localhost:8000"),
                                       ("http://host/predict/?x=1", "http://host")])
def test_a_url_that_names_a_route_is_a_usage_error_naming_the_root(url: str, root: str) -> None:
    # Before: Client("http://localhost:8000/v2") sent every call to /v2/predict and the like, and read their 404 in
    # the Open Inference Protocol's shape as "invalid_response: not visionserve's answer" (a new user's trial).
    with pytest.raises(UsageError, match=f"give its root URL \\({re.escape(root)}\\)"):
        Client(url)
    for prefixed in ("http://host/serving", "https://gw.example.com/ml/v1"):  # a proxy's prefix: taken
        assert Client(prefixed).base_url == prefixed


@pytest.mark.parametrize("failure", [requests.exceptions.InvalidSchema("No connection adapters"),
                                     requests.exceptions.InvalidURL("Failed to parse"),
                                     requests.exceptions.InvalidHeader("value: 'Bearer s3cret\\n'")])
def test_setup_errors_from_requests_are_raised_at_once(failure: Exception) -> None:
    session = Session([failure] * 4)
    with client("http://127.0.0.1:9", retries=3) as c:
        c.session.request = session  # type: ignore[method-assign]
        with pytest.raises(UsageError) as caught:
            c.predict_each([b"x", b"y"])  # raised, not each image's error
    assert len(session.calls) == 1 and "s3cret" not in str(caught.value)


def test_an_api_key_goes_as_utf_8_and_one_with_a_line_break_is_refused(stub: Stub) -> None:
    # Before: a key past U+00FF raised UnicodeEncodeError ('latin-1' codec); one with a newline was retried as a
    # connection error whose message showed the key.
    with Client(stub.url, api_key="ключ-café", client_id="клиент") as c:
        c.predict(b"img")
    (seen,) = stub.posts()
    assert seen.headers["Authorization"] == "Bearer ключ-café".encode()
    assert seen.headers["X-Client-ID"] == "клиент".encode()
    with pytest.raises(UsageError) as caught:
        Client(stub.url, api_key="s3cret\nkey")
    assert "s3cret" not in str(caught.value)


def test_an_answer_that_is_not_the_services_json_is_a_visionserve_error(stub: Stub) -> None:
    # Before: a captive portal's 200 page raised JSONDecodeError, and a 200 without predictions KeyError.
    stub.script = [always((200, {"Content-Type": "text/html"}, b"<html>log in to the wifi</html>")),
                   always((200, {}, b'{"model": {}}')), always((200, {}, b"[1, 2]"))]
    with client(stub.url) as c:
        for _ in range(3):
            with pytest.raises(VisionServeError) as caught:
                c.predict(b"img")
            assert caught.value.code == "invalid_response" and caught.value.status == 200
        (result,) = c.predict_each([b"img"])  # and the next answer, the service's
        assert isinstance(result, Prediction)


def test_a_file_name_of_bytes_that_are_not_utf_8_is_sent(stub: Stub, tmp_path: Path) -> None:
    # Before: UnicodeEncodeError ('utf-8' codec can't encode character '\udce9') from the multipart encoder.
    name = os.fsdecode(b"caf\xe9 \xff.jpg")
    (tmp_path / name).write_bytes(b"img")
    with client(stub.url) as c:
        assert c.predict(tmp_path / name).label == "img"
        (result,) = c.predict_each([str(tmp_path / name)])
    assert isinstance(result, Prediction)
    assert stub.posts()[0].images[0][0] == "caf\ufffd \ufffd.jpg"


# -- the pool, the package ---------------------------------------------------------------------------------------------

def test_threads_past_the_pool_size_wait_for_a_pooled_connection(stub: Stub) -> None:
    # Before: a thread past pool_size opened a connection of its own and dropped it after ("Connection pool is
    # full, discarding connection"): a new connection per call under load.
    pair = threading.Barrier(2)
    stub.answer = lambda seen: (pair.wait(10), ok(["a"]))[1]  # two calls at a time, so the pool is in use
    with Client(stub.url, pool_size=2) as c:
        threads = [threading.Thread(target=c.predict, args=(b"x",)) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert len(stub.posts()) == 8 and len({seen.port for seen in stub.posts()}) <= 2


def test_the_package_says_it_is_typed() -> None:
    # Before: no py.typed, so mypy treated the client as untyped ("missing library stubs or py.typed marker").
    assert (Path(visionserve_client.__file__).parent / "py.typed").is_file()
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    assert "py.typed" in setup["package-data"]["visionserve_client"]


# -- the command line --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("option", [["--timeout", "0"], ["--timeout", "nan"], ["--timeout", "-3"],
                                    ["--timeout", "soon"], ["--retries", "-1"], ["--retries", "1.5"]])
def test_bad_options_are_usage_errors(option: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # Before: a ValueError traceback, exit 1.
    with pytest.raises(SystemExit) as done:
        cli([*option, "health"])
    assert done.value.code == 2 and f"argument {option[0]}:" in capsys.readouterr().err


@pytest.mark.parametrize("top_k", ["0", "-3", "two"])
def test_a_top_k_no_server_takes_is_a_usage_error_before_any_request(top_k: str, stub: Stub, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # Before: --top-k 0 went to the server and its 400 exited 1, as a refusal of the image would
    image = tmp_path / "a.jpg"
    image.write_bytes(b"img")
    with pytest.raises(SystemExit) as done:
        cli(["predict", str(image), "--top-k", top_k, "--url", stub.url])
    assert done.value.code == 2 and "argument --top-k:" in capsys.readouterr().err and stub.seen == []


def test_a_refused_key_is_said_with_the_option_that_sends_one(stub: Stub, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # Before: the server's words alone ("Authorization: Bearer <key> or X-API-Key"); health and ready printed "no"
    # and exited 1 on a 401, as for a server that is not ready
    refused = {"error": {"code": "unauthorized", "message": "a valid API key is required", "request_id": "r"}}
    stub.answer = always((401, {}, json.dumps(refused).encode()))
    image = tmp_path / "a.jpg"
    image.write_bytes(b"img")
    assert cli(["predict", str(image), "--url", stub.url, "--retries", "0"]) == 1
    assert "a valid API key is required (give the server's key with --api-key KEY or VISIONSERVE_API_KEY)" in \
        capsys.readouterr().err
    for command in ("health", "ready"):
        assert cli([command, "--url", stub.url]) == 2
        said = capsys.readouterr()
        assert said.out == "" and "the server refused the API key: give the server's key with --api-key" in said.err


def test_another_server_s_error_page_is_said_in_one_line(stub: Stub, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # Before: code http_error and the page's first 200 characters, markup and line breaks included
    page = b"<!DOCTYPE HTML>\n<html lang=\"en\">\n<head><title>Error response</title></head>\n<body>\n" \
           b"<h1>Error response</h1>\n<p>Error code: 501</p>\n</body>\n</html>\n"
    stub.answer = always((501, {"Content-Type": "text/html;charset=utf-8"}, page))
    with client(stub.url) as c:
        with pytest.raises(VisionServeError) as caught:
            c.predict(b"img")
    assert caught.value.code == "invalid_response" and caught.value.status == 501
    assert caught.value.message == ("not visionserve's answer (HTTP 501 Not Implemented, text/html;charset=utf-8): "
                                    "Error response Error response Error code: 501")


@pytest.mark.parametrize("answer", [
    (404, {"Content-Type": "text/html"}, b"<html><h1>File not found</h1></html>"),  # python -m http.server's
    (200, {"Content-Type": "text/html"}, b"<html>welcome</html>"),  # a page, 200 all the same
    (503, {"Content-Type": "application/json"}, b'["busy"]'),  # JSON, not a health answer
])
def test_health_and_ready_from_another_server_say_so_not_no(stub: Stub, answer: Answer,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # Before: "no", exit 1 (and False), as from this service when it is not ready: a wrong port looked like a
    # server that is down, where predict and model said "not visionserve's answer" (an application developer's trial)
    stub.answer = always(answer)
    for command in ("health", "ready"):
        assert cli([command, "--url", stub.url]) == 1
        said = capsys.readouterr()
        assert said.out == "" and f"error: HTTP {answer[0]} invalid_response: not visionserve's answer" in said.err
    with client(stub.url) as c:
        for probe in (c.health, c.ready):
            with pytest.raises(VisionServeError) as caught:
                probe()
            assert (caught.value.code, caught.value.status) == ("invalid_response", answer[0])
    stub.answer = always((503, {"Content-Type": "application/json"}, b'{"status": "not ready", "checks": {}}'))
    assert cli(["ready", "--url", stub.url]) == 1 and capsys.readouterr().out == "no\n"  # the service's no
    with client(stub.url) as c:
        assert c.ready() is False and c.says_yes("/readyz") is False


def test_a_model_the_server_does_not_serve_is_its_own_404(stub: Stub, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: the client read the whole listing and made up its own 404, without the server's request id or the
    # models it serves; model("nope") read "nope" as labels and answered the default model (a developer's trial)
    stub.answer = always(refused(404, "not_found", "no model 'a b/c' is loaded; GET /v1/models lists those that are",
                                 {"X-Request-ID": "r404"}, details={"models": ["lite0"]}))
    with client(stub.url) as c:
        with pytest.raises(VisionServeError) as caught:
            c.model(model="a b/c")
        with pytest.raises(TypeError, match="name the model with model="):
            c.model("nope")  # type: ignore[arg-type]
    error = caught.value
    assert (error.status, error.code, error.request_id, error.details) == (404, "not_found", "r404",
                                                                          {"models": ["lite0"]})
    assert [seen.path for seen in stub.seen] == ["/v1/models/a%20b%2Fc"]  # the model's own route, named whole
    assert cli(["model", "--model", "nope", "--url", stub.url]) == 1
    assert "error: HTTP 404 not_found: no model 'a b/c' is loaded" in capsys.readouterr().err


def test_json_on_a_refused_request_is_each_files_error(stub: Stub, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Before: "error: HTTP 401 ..." on stderr and nothing on stdout, so a program reading --json read nothing.
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"img")))
    stub.answer = always(refused(401, "unauthorized", "a valid API key is required", {"X-Request-ID": "r1"}))
    missing = str(tmp_path / "a.jpg")
    assert cli(["predict", missing, "-", "--json", "--url", stub.url, "--retries", "0"]) == 2
    printed = json.loads(capsys.readouterr().out)
    assert [entry["image"] for entry in printed] == [missing, "-"]
    assert printed[0]["error"] == {"status": None, "code": "unreadable_file", "request_id": None,
                                   "message": "cannot read it: No such file or directory"}
    assert printed[1]["error"] == {"status": 401, "code": "unauthorized", "request_id": "r1",
                                   "message": "a valid API key is required"}


def test_json_when_no_server_answers(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    photo = tmp_path / "a.jpg"
    photo.write_bytes(b"img")
    url = f"http://127.0.0.1:{free_port()}"
    assert cli(["predict", str(photo), str(photo), "--json", "--url", url, "--retries", "0"]) == 1
    said = capsys.readouterr()
    entries = json.loads(said.out)
    assert [set(entry["error"]) for entry in entries] == [{"status", "code", "message", "request_id"}] * 2
    assert all(entry["error"]["code"] == "connection_error" for entry in entries)
    # what went wrong first (before: urllib3's pool's repr led the message)
    assert all(entry["error"]["message"].startswith(f"could not connect to {url.removeprefix('http://')}: Connection "
                                                    "refused (") for entry in entries)
    assert said.err.count(f"no server answers at {url}") == 1


def test_a_dash_reads_the_image_from_stdin(stub: Stub, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"from-stdin")))
    assert cli(["predict", "-", "--url", stub.url]) == 0
    out = capsys.readouterr().out
    assert "-\n  1. from-stdin" in out and stub.posts()[0].images[0][1] == b"from-stdin"


def test_the_cli_says_a_refused_request_per_file(stub: Stub, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"img")))
    stub.answer = always(refused(401, "unauthorized", "a valid API key is required"))
    assert cli(["predict", "-", "-", "--url", stub.url, "--retries", "0"]) == 1
    assert capsys.readouterr().err.count("error: -: HTTP 401 unauthorized: a valid API key is required") == 2


def test_the_cli_prints_a_file_name_that_is_not_utf_8(stub: Stub, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # Before: UnicodeEncodeError from the multipart encoder (and printing the name would have raised too).
    photo = tmp_path / os.fsdecode(b"caf\xe9.jpg")
    photo.write_bytes(b"img")
    assert cli(["predict", str(photo), "--url", stub.url, "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["image"] == str(tmp_path / "caf\ufffd.jpg") and entry["label"] == "img"
    assert cli(["predict", str(photo), "--url", stub.url]) == 0
    assert f"{tmp_path}/caf\ufffd.jpg\n  1. img" in capsys.readouterr().out


def test_a_retry_refused_for_what_the_waits_left_of_the_deadline_raises_the_refusal_before_it(stub: Stub) -> None:
    # Before: a 429's retry sent the little left of the deadline, the server refused that as too short (400), and
    # the caller saw "deadline_too_short" (its own mistake, no retry) where the server had been busy.
    clock = Clock()
    stub.script = [always(refused(429, "overloaded", headers={"Retry-After": "1"})),
                   always(refused(400, "deadline_too_short", "under the shortest this server takes"))]
    with client(stub.url, clock, retries=5) as c, pytest.raises(VisionServeError) as caught:
        c.predict(b"x", deadline_ms=1500)
    assert caught.value.code == "overloaded" and caught.value.status == 429 and len(stub.posts()) == 2

    stub.seen.clear()  # the caller's own deadline refused on the first attempt: its 400, not retried
    stub.answer = always(refused(400, "deadline_too_short"))
    with client(stub.url, Clock(), retries=5) as c, pytest.raises(VisionServeError) as caught:
        c.predict(b"x", deadline_ms=1)
    assert caught.value.code == "deadline_too_short" and caught.value.status == 400 and len(stub.posts()) == 1


# -- the call's time, whatever the server does (a Python client user's trial) --------------------------------------

class SlowServer:
    """A raw HTTP server on loopback that reads each request's head, then answers as ``behaviour`` says: ``dribble``
    (a 200's head, then its JSON body a byte every 0.2 s), ``stall`` (the head and one byte of the body, then
    nothing) or ``hang`` (nothing at all)."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour, self.stop = behaviour, threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.listener.settimeout(0.1)
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        body = json.dumps({"model": {"name": "m", "version": "1"}, "predictions": []}).encode()
        with conn:
            conn.recv(65536)
            if self.behaviour != "hang":
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                             % len(body))
            for byte in (body[:1] if self.behaviour == "stall" else body if self.behaviour == "dribble" else b""):
                conn.sendall(bytes([byte]))
                if self.stop.wait(0.2):
                    return
            self.stop.wait(30)

    def close(self) -> None:
        self.stop.set()
        self.listener.close()


@pytest.fixture
def slow_server(request: pytest.FixtureRequest) -> Iterator[SlowServer]:
    server = SlowServer(request.param)
    yield server
    server.close()


@pytest.mark.parametrize("slow_server", ["dribble", "stall"], indirect=True)
def test_a_call_ends_at_its_timeout_however_slowly_its_answer_comes(slow_server: SlowServer) -> None:
    # Before: a body sent a byte every 0.5 s took 56 s of a 2 s call (requests' read timeout bounds each read), and a
    # body that stalled after its first byte said "connection_error" (the command line: start a server)
    started = time.monotonic()
    with Client(slow_server.url, timeout=1.0, retries=2) as c, pytest.raises(VisionServeError) as caught:
        c.predict(b"x")
    assert time.monotonic() - started < 3.0
    assert caught.value.code == "timeout" and "connection" not in str(caught.value)


@pytest.mark.parametrize("slow_server", ["hang"], indirect=True)
def test_a_call_waiting_for_a_pooled_connection_waits_within_its_own_timeout(slow_server: SlowServer) -> None:
    # Before: six threads of a pool of two against a server that never answers ended at 2, 2, 4, 4, 6 and 6 s of
    # their 2 s calls (the pool's wait for a free connection was counted in no call's time)
    ended: list[float] = []
    codes: list[str] = []
    started = time.monotonic()
    with Client(slow_server.url, timeout=0.6, retries=0, pool_size=1) as c:
        def call() -> None:
            try:
                c.predict(b"x")
            except VisionServeError as exc:
                codes.append(exc.code)
            ended.append(time.monotonic() - started)

        threads = [threading.Thread(target=call) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    assert codes == ["timeout"] * 3 and max(ended) < 1.5, ended


def test_an_error_s_repr_says_its_status_code_and_request_id() -> None:
    error = VisionServeError("no such model", status=404, code="not_found", request_id="r-1")
    assert repr(error) == "VisionServeError('HTTP 404 not_found: no such model (request id r-1)')"
    assert repr([error]) == "[VisionServeError('HTTP 404 not_found: no such model (request id r-1)')]"


@pytest.mark.parametrize("arguments", [{"retries": 1.5}, {"pool_size": 2.5}, {"retries": "3"}, {"pool_size": True}])
def test_counts_that_are_no_whole_numbers_are_refused_when_the_client_is_made(arguments: dict) -> None:
    # Before: Client(retries=1.5) was made, and its first call raised a TypeError of range()
    with pytest.raises(TypeError, match="retries and pool_size are whole numbers"):
        Client("http://127.0.0.1:9", **arguments)
