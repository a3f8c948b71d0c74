"""Requests judged by their framing, against the real server: heads the worker's loop refuses at once (a bare LF,
a request line or a head over its limit), empty lines between requests, a body that stalls after ``100 Continue``,
malformed chunked framing, slow chunked and ``Expect: 100-continue`` bodies (read by the loop, not a thread), and the
starting app's answer to an upload it never reads. Each gets a JSON error with
its 4xx status (or, for the empty lines, nothing at all), never a 500 or a connection left waiting; those answered
before the app count in /metrics all the same.

The server's header timeout is long (60 s) and every read here waits at most 30 s: an answer that came is the
refusal itself, not a timeout."""
from __future__ import annotations

import gzip
import json
import re
import socket
import textwrap
import threading
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Iterator

import pytest

from app.config import Settings
from app.hosting.client_socket import REFUSALS_AWAITED

from harness import faults
from harness.servers import Running, free_port, gunicorn_command
from tests.support.imaging import RED, image_bytes
from tests.support.servers import serve

WAIT_S = 30.0  # the most a read waits for the server; the server's own timeouts are longer, or not involved
HEALTH = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def server(small_weights: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    server = serve(small_weights, tmp_path_factory.mktemp("framing"), client_header_timeout_s="60",
                   client_body_timeout_s="1", keepalive_s="1").wait_ready()
    yield server
    server.stop()


class Raw:
    """One connection: bytes sent as they are, answers read whole (a 1xx head alone, others by Content-Length)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        self.data = b""

    def __enter__(self) -> "Raw":
        return self

    def __exit__(self, *_: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):  # the server answered and closed before taking it all
            pass

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        """The next answer: status, headers (names lower-cased), body."""
        while b"\r\n\r\n" not in self.data:
            self._more()
        head, self.data = self.data.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
        status = int(status_line.split()[1])
        length = 0 if status < 200 else int(headers.get("content-length", "0"))
        while len(self.data) < length:
            self._more()
        body, self.data = self.data[:length], self.data[length:]
        return status, headers, body

    def error(self, status: int, code: str) -> dict:
        """The next answer, which must be ``status`` with the service's JSON error ``code``, closing the
        connection; its error object."""
        got, headers, body = self.answer()
        assert (got, headers.get("content-type"), headers.get("connection")) == (
            status, "application/json", "close"), (got, headers, body)
        error = json.loads(body)["error"]
        assert error["code"] == code and error["request_id"] == headers["x-request-id"], error
        return error

    def closed(self) -> bool:
        """Whether the server closes the connection with nothing more said (waits up to WAIT_S)."""
        try:
            more = self.sock.recv(65536)
        except ConnectionResetError:
            return not self.data
        except TimeoutError:
            return False
        assert not self.data and not more, self.data + more  # an unsolicited answer (an idle 408, say)
        return True

    def _more(self) -> None:
        chunk = self.sock.recv(65536)
        assert chunk, f"closed by the server; held {self.data[:200]!r}"
        self.data += chunk


def _photo(extra: bytes = b"") -> bytes:
    return (b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
            + f"Content-Length: {len(faults.IMAGE)}\r\n".encode() + extra + b"\r\n" + faults.IMAGE)


def test_a_head_over_64_kib_is_refused_431_at_once_whole_or_stalled(server: Running) -> None:
    # Before: a stalled head over 64 KiB went to a request thread whose parser waited on a blocking socket for the
    # rest (gunicorn refuses only near 800 KiB): no answer ever, the thread held, a stop waited graceful_timeout.
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 8000) for i in range(9))
    for sent in (head, head + b"\r\n"):  # stalled before its end; whole (was served or not as the reads fell)
        with Raw(server.port) as raw:
            raw.send(sent)
            error = raw.error(431, "request_header_fields_too_large")
            assert "65536 byte limit" in error["message"] and raw.closed()
    with Raw(server.port) as raw:  # the worker serves on
        raw.send(HEALTH)
        assert raw.answer()[0] == 200


def test_one_header_may_take_the_head_s_whole_limit(server: Running) -> None:
    # Before: gunicorn's own bound on one header line (8190 bytes) refused a 20 KB cookie with 431 "limit request
    # headers fields size", within the documented 64 KiB head
    with Raw(server.port) as raw:
        raw.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\nCookie: " + b"a" * 20_000 + b"\r\n\r\n")
        assert raw.answer()[0] == 200


def test_a_bare_lf_head_is_400_and_an_endless_request_line_414_at_once(server: Running) -> None:
    # Before: both waited for a CRLF CRLF that never came, then got 408 after the header timeout.
    for sent in (b"GET /healthz HTTP/1.1\nHost: x\n\n", b"GET /healthz HTTP/1.1\r\nHost: x\n\n",
                 b"\nGET /healthz HTTP/1.1\r\n\r\n"):
        with Raw(server.port) as raw:
            raw.send(sent)
            assert "bare LF" in raw.error(400, "bad_request")["message"] and raw.closed()
    with Raw(server.port) as raw:
        raw.send(b"GET /" + b"a" * 9000)  # no end of line yet, past gunicorn's 8190
        assert "8190 byte limit" in raw.error(414, "uri_too_long")["message"] and raw.closed()


def test_an_answer_before_the_app_takes_the_error_shape_of_its_path(server: Running) -> None:
    # Before: an upload over MAX_BODY_BYTES after Expect: 100-continue (curl sends it for bodies over 1 MB) to a V2
    # route was refused in the service's shape, where the OpenAPI document says /v2 errors are {"error": "<message>"}.
    over = Settings().max_body_bytes + 1
    for path, v2 in (("/v2/models/small/infer", True), ("/predict", False)):
        with Raw(server.port) as raw:
            raw.send(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                     f"Content-Length: {over}\r\nExpect: 100-continue\r\n\r\n".encode())
            status, headers, body = raw.answer()
            assert (status, headers["connection"]) == (413, "close"), (status, headers, body)
            error = json.loads(body)["error"]
            if v2:
                assert isinstance(error, str) and "byte limit" in error
            else:
                assert error["code"] == "request_entity_too_large" and "byte limit" in error["message"]
    with Raw(server.port) as raw:  # a bare LF in a V2 route's head
        raw.send(b"GET /v2/health/ready HTTP/1.1\nHost: x\n\n")
        status, _, body = raw.answer()
        assert status == 400 and "bare LF" in json.loads(body)["error"]


@pytest.mark.parametrize("sent, status, code", [
    (b"GARBAGE\r\n\r\n", 400, "bad_request"),  # no method, path and version
    (b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n", 400, "bad_request"),
    (b"GET /healthz HTTP/1.1\r\nHost x\r\n\r\n", 400, "bad_request"),  # a header without its colon
    (b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", 400,
     "bad_request"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: a\r\n" % i for i in range(101)) + b"\r\n", 431,
     "request_header_fields_too_large"),  # over limit_request_fields
])
def test_a_head_gunicorn_s_parser_refuses_is_answered_in_the_error_shape(server: Running, sent: bytes, status: int,
                                                                         code: str) -> None:
    # Before: gunicorn's own HTML page, with the right status.
    with Raw(server.port) as raw:
        raw.send(sent)
        raw.error(status, code)


@pytest.mark.parametrize("sent, status", [
    (b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: a\r\n" % i for i in range(101))
     + b"Content-Length: 2\r\n\r\n{}", 431),  # over limit_request_fields
    (b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n",
     400),
])
def test_a_v2_head_gunicorn_s_parser_refuses_is_answered_in_the_protocol_s_error_shape(server: Running, sent: bytes,
                                                                                     status: int) -> None:
    # Before: the service's {"error": {"code", ...}} under /v2, where the loop's own refusals (a head over 64 KiB)
    # said the protocol's {"error": "..."} (an API contract trial).
    with Raw(server.port) as raw:
        raw.send(sent)
        got, headers, body = raw.answer()
        assert (got, headers["connection"]) == (status, "close") and isinstance(json.loads(body)["error"], str), body


def test_a_content_length_of_thousands_of_digits_is_400_and_the_worker_lives_on(server: Running) -> None:
    # Before: int() of 4,301 digits raised on the worker's loop: the worker died, every connection it held with it,
    # from one unauthenticated request (a security review)
    workers = set(server.http_worker_pids())
    with Raw(server.port) as raw:
        raw.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"0" * 4301 + b"\r\n\r\n")
        assert "no body is that long" in raw.error(400, "bad_request")["message"] and raw.closed()
    with Raw(server.port) as raw:
        raw.send(HEALTH)
        assert raw.answer()[0] == 200
    assert set(server.http_worker_pids()) == workers


def test_an_http_1_1_request_without_one_host_is_400_in_the_error_shape(server: Running) -> None:
    # Before: served (RFC 9112 3.2: a server must answer 400 to an HTTP/1.1 request without a Host, or with two)
    for sent, v2 in ((b"GET /healthz HTTP/1.1\r\n\r\n", False), (b"GET /v2/health/ready HTTP/1.1\r\n\r\n", True),
                     (b"GET /healthz HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", False)):
        with Raw(server.port) as raw:
            raw.send(sent)
            status, _, body = raw.answer()
            error = json.loads(body)["error"]
            assert status == 400 and "Host" in (error if v2 else error["message"]) and raw.closed()
    with Raw(server.port) as raw:  # HTTP/1.0 needs none
        raw.send(b"GET /healthz HTTP/1.0\r\n\r\n")
        assert raw.answer()[0] == 200


@pytest.mark.parametrize("head, rest, status, code", [
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\n", b"Expect: foo\r\n\r\n", 417, "expectation_failed"),  # the parser's
    (b"POST /predict HTTP/1.1\r\nHost: x\r\n", b"Content-Length: 5\r\nContent-Length: 5\r\n\r\nhello", 400,
     "bad_request"),
    (b"POST /predict HTTP/1.1\r\nHost: x\r\n", b"Transfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n", 400,
     "bad_request"),  # the loop's, from the chunked framing
    (b"POST /predict HTTP/1.1\r\nHost: x\r\n", b"Content-Length: 30000000\r\nExpect: 100-continue\r\n\r\n", 413,
     "request_entity_too_large"),  # the loop's, before the body is asked for
    (b"GET /healthz HTTP/1.1\r\n", b"Host: x\n\n", 400, "bad_request"),  # a bare LF after it
    (b"POST /predict HTTP/1.1\r\nHost: x\r\n", b"Transfer-Encoding: gzip, chunked\r\n\r\n", 501,
     "not_implemented"),  # the loop's, from a transfer coding gunicorn would pass on undone
    (b"POST /predict HTTP/1.1\r\nHost: x\r\n", b"Content-Length: 10\r\n\r\nabc", 408, "request_timeout"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\n", b"Content-Length: 10\r\n\r\nabc", 408, "request_timeout"),  # a GET's
])
def test_an_answer_before_the_app_says_the_caller_s_request_id_as_the_app_s_do(
        server: Running, head: bytes, rest: bytes, status: int, code: str) -> None:
    # Before: each of these, the head read and the caller's X-Request-ID in it, was answered under a new id (the
    # same 413 without Expect, refused by the app, said the caller's: a client's own id found or not in the logs as
    # it sent Expect or not; an application developer's trial)
    for sent, kept in ((b"mine-1", True), (b"not a sane id <>", False)):
        with Raw(server.port) as raw:
            raw.send(head + b"X-Request-ID: " + sent + b"\r\n" + rest)
            error = raw.error(status, code)
            assert (error["request_id"] == sent.decode()) is kept, error
            assert kept or re.fullmatch(r"[0-9a-f]{32}", error["request_id"]), error


def test_an_answer_that_keeps_its_connection_says_for_how_long_and_the_server_keeps_it_that_long(
        server: Running) -> None:
    # Before: no Keep-Alive header; the server closed an idle connection after KEEPALIVE_S unsaid, and a client
    # that reused one at that moment (Node's agent, urllib3's pool) had its request reset unanswered (a web
    # developer's trial). KEEPALIVE_S=1 here.
    with Raw(server.port) as raw:
        raw.send(_photo())
        status, headers, _ = raw.answer()
        assert (status, headers.get("connection"), headers.get("keep-alive")) == (200, "keep-alive", "timeout=1")
        raw.send(HEALTH)
        status, headers, _ = raw.answer()
        assert (status, headers.get("keep-alive")) == (200, "timeout=1"), headers
        started = time.monotonic()
        assert raw.closed() and time.monotonic() - started < WAIT_S  # idle: closed after its timeout, nothing said
    with Raw(server.port) as raw:  # an answer that closes its connection says no timeout
        raw.send(HEALTH.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
        status, headers, _ = raw.answer()
        assert (status, headers.get("connection"), "keep-alive" in headers) == (200, "close", False), headers
        raw.send(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
        assert raw.closed()


def test_empty_lines_between_requests_are_skipped_and_leave_the_connection_idle(server: Running) -> None:
    # RFC 9112 2.2: a client may send a CRLF after a body. Before: it counted as a request begun, so the idle
    # connection got an unsolicited 408 at the header timeout (and held a stopping worker until then).
    with Raw(server.port) as raw:
        raw.send(_photo() + b"\r\n")
        assert raw.answer()[0] == 200
        raw.send(HEALTH + b"\r\n")  # the next request after the empty line: served on the same connection
        assert raw.answer()[0] == 200
        assert raw.closed()  # then idle: closed quietly when its keep-alive (1 s) ends, nothing said
    with Raw(server.port) as raw:  # the empty line arriving on its own, once the answer went out
        raw.send(_photo())
        assert raw.answer()[0] == 200
        raw.send(b"\r\n")
        assert raw.closed()
    with Raw(server.port) as raw:  # any number of them, before a connection's first request too
        raw.send(b"\r\n\r\n" + HEALTH)
        assert raw.answer()[0] == 200


def test_a_client_that_sends_a_body_over_the_limit_whole_reads_its_413_without_a_reset(server: Running) -> None:
    # Before: refused from its head, the connection was closed once 64 KiB more of the body had come; the kernel then
    # reset it under a client still sending (Node's fetch failed with EPIPE half the time, never reading the 413)
    size = 3 * Settings().max_body_bytes
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as sock:
        sock.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
                     b"Content-Length: %d\r\n\r\n" % size)
        answer = bytearray()

        def read() -> None:
            while data := sock.recv(65536):
                answer.extend(data)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        piece = bytes(1 << 20)
        for _ in range(size >> 20):
            sock.sendall(piece)  # every byte of it taken: no EPIPE, no reset
        reader.join(WAIT_S)
    assert answer.startswith(b"HTTP/1.1 413") and b"request_entity_too_large" in answer


def test_a_body_over_the_limit_on_a_kept_alive_connection_is_413(server: Running) -> None:
    # Before: a request thread lingering for the connection's next request judged its head twice, the second time
    # finding no head; the loop then read the body as if it were the head: 400 "a line of the request head ends in a
    # bare LF" (a photo's bytes), or 431 (a body of zeros), where a new connection's same request was 413.
    over = Settings().max_body_bytes + 1
    for body in (b"ab\ncd" * 20_000, bytes(120_000)):
        with Raw(server.port) as raw:
            raw.send(_photo())
            assert raw.answer()[0] == 200
            raw.send(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
                     + f"Content-Length: {over}\r\n\r\n".encode() + body)  # at once: the thread still lingers
            assert "byte limit" in raw.error(413, "request_entity_too_large")["message"]
    with Raw(server.port) as raw:  # a head only the parser refuses, there: it waited for a head that had come
        raw.send(_photo())
        assert raw.answer()[0] == 200
        raw.send(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n")
        raw.error(400, "bad_request")


def test_a_body_that_stalls_after_100_continue_is_408(server: Running) -> None:
    # Before: the app's one read of a Content-Length body raised the socket's timeout to the 500 handler.
    with Raw(server.port) as raw:
        head, body = _photo(b"Expect: 100-continue\r\n").split(b"\r\n\r\n", 1)
        raw.send(head + b"\r\n\r\n")
        assert raw.answer()[0] == 100
        raw.send(body[:50])  # then nothing: the body timeout is 1 s
        said = raw.error(408, "request_timeout")["message"]
        assert "no byte of the body came for 1s (CLIENT_BODY_TIMEOUT_S)" in said  # a silence's limit, not the body's


@pytest.mark.parametrize("chunks, what", [
    (b"zz\r\nhello\r\n0\r\n\r\n", "chunk size"),
    (b"5\r\nhelloXX0\r\n\r\n", "chunk terminator"),
    (b"5;\x01\r\nhello\r\n0\r\n\r\n", "chunk extension"),
    (b"5\r\nhello\r\n0\r\nBad Trailer\r\n\r\n", "Invalid HTTP Header"),
])
def test_malformed_chunked_framing_is_400_in_the_error_shape(server: Running, chunks: bytes, what: str) -> None:
    # Before: gunicorn's parse errors, raised as the app read the body, were a 500 and a logged traceback.
    with Raw(server.port) as raw:
        raw.send(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nTransfer-Encoding: chunked\r\n\r\n"
                 + chunks + HEALTH)
        error = raw.error(400, "bad_request")
        assert "framing is malformed" in error["message"] and what in error["message"]
        assert raw.closed()  # where the next request would start is unknown
    assert "unhandled error" not in server.output()


@pytest.mark.parametrize("head, status, said", [
    (b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", 400, "the Content-Length header is invalid: not a "
     "whole number, given twice, or beside Transfer-Encoding"),
    (b"Content-Length: abc\r\n", 400, "the Content-Length header is invalid"),
    (b"".join(b"X-Field-%d: x\r\n" % index for index in range(120)), 431, "the request has more header fields than "
     "the server takes"),
])
def test_a_head_gunicorn_refuses_is_told_in_words_a_client_can_act_on(server: Running, head: bytes, status: int,
                                                                      said: str) -> None:
    # Before: gunicorn's own words: "Invalid HTTP Header: 'CONTENT-LENGTH'", "limit request headers fields" (a new
    # user's trial)
    with Raw(server.port) as raw:
        raw.send(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n" + head + b"\r\nhello")
        code = "bad_request" if status == 400 else "request_header_fields_too_large"
        assert raw.error(status, code)["message"].startswith(said)


@pytest.mark.parametrize("coding", [b"gzip", b"deflate"])
def test_a_body_compressed_as_a_transfer_coding_is_501_not_its_compressed_bytes_read_as_the_body(
        server: Running, coding: bytes) -> None:
    # Before: gunicorn took "gzip, chunked" and passed the gzip bytes on undone: a V2 request's answer was 400 "not
    # valid JSON", a photo's 400 invalid_image (a Triton client's trial); a body compressed with Content-Encoding is
    # what the service decompresses.
    photo = gzip.compress(image_bytes(RED)) if coding == b"gzip" else zlib.compress(image_bytes(RED))
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(photo), photo)
    for path, content_type in ((b"/predict", b"image/jpeg"), (b"/v2/models/m/infer", b"application/json")):
        with Raw(server.port) as raw:
            raw.send(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: %s\r\nTransfer-Encoding: %s, chunked\r\n\r\n"
                     % (path, content_type, coding) + chunked)
            status, _, body = raw.answer()
            said = json.loads(body)["error"]
            message = said if path.startswith(b"/v2") else said["message"]
            assert status == 501 and "transfer coding " + coding.decode() + " is not implemented" in message, body
            assert "Content-Encoding" in message and raw.closed()


CHUNKED_PHOTO = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.slow  # a server of its own: two request threads, long body timeouts
def test_slow_chunked_and_expect_100_bodies_hold_connections_not_the_threads_of_an_inline_worker(
        small_weights: Path, tmp_path: Path) -> None:
    # Before: the loop handed a chunked body, or one after Expect: 100-continue, to a request thread as soon as its
    # head was in, and the thread read the body as it came: as many slow clients as threads and no other request was
    # answered (the fault review: 40 such clients at one byte a second, 32 threads, 0 of 8 other requests answered).
    server = serve(small_weights, tmp_path, engine="inline", threads="2", client_header_timeout_s="60",
                   client_body_timeout_s="120").wait_ready()
    slow: list[tuple[Raw, bytes]] = []
    try:
        for kind in ("expect", "expect", "chunked", "chunked"):  # twice as many as the threads
            raw = Raw(server.port)
            if kind == "expect":
                head, rest = _photo(b"Expect: 100-continue\r\n").split(b"\r\n\r\n", 1)
                raw.send(head + b"\r\n\r\n")
                assert raw.answer()[0] == 100
            else:
                raw.send(CHUNKED_PHOTO)
                rest = f"{len(faults.IMAGE):x}\r\n".encode() + faults.IMAGE + b"\r\n0\r\n\r\n"
            raw.send(rest[:100])  # then nothing, for now
            slow.append((raw, rest[100:]))
        for _ in range(3):  # each answered while the slow bodies are still on their way
            with Raw(server.port) as raw:
                raw.send(_photo())
                assert raw.answer()[0] == 200
        for raw, rest in slow:  # the slow bodies end: each request is served whole
            raw.send(rest)
            status, _, body = raw.answer()
            assert status == 200 and json.loads(body)["predictions"], body
        assert "Traceback" not in server.output()
    finally:
        for raw, _ in slow:
            raw.sock.close()
        server.stop()


STARTING_ONLY = """
import threading, time
from app.hosting.starting import StartingApp

def load():  # imports that never end while the worker runs: every request is the starting app's
    while threading.main_thread().is_alive():
        time.sleep(0.05)
    return lambda: None

app = StartingApp(load, print, 20 * 1024 * 1024).start()
"""


@pytest.mark.slow  # a gunicorn master started from the command line, as the server is
def test_a_starting_worker_closes_the_connection_after_an_upload_it_did_not_read(tmp_path: Path) -> None:
    # Before: the 503 to an Expect: 100-continue upload said keep-alive; gunicorn skipped 64 KiB of the body it had
    # asked for, then dropped the connection, so the client's next request on it failed.
    (tmp_path / "starting_only.py").write_text(textwrap.dedent(STARTING_ONLY))
    port = free_port()
    env = {"PYTHONPATH": str(tmp_path), "VISIONSERVE_BIND": f"127.0.0.1:{port}", "VISIONSERVE_WORKERS": "1",
           "VISIONSERVE_DEVICE": "cpu", "VISIONSERVE_LOG_LEVEL": "info", "VISIONSERVE_SHUTDOWN_DRAIN_S": "0.5"}
    server = Running("starting-only", gunicorn_command("starting_only:app"), env, port, "/healthz", tmp_path)
    try:
        server.wait_ready(120)
        body = b"\xff" * 300_000
        with Raw(port) as raw:
            raw.send(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nExpect: 100-continue\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode())
            assert raw.answer()[0] == 100  # the worker's loop asks for the body before the app runs
            raw.send(body)
            assert raw.error(503, "not_ready")["message"] == "the model is still loading"
            assert raw.closed()
    finally:
        server.stop()


PLAIN = """
BIG = b"x" * (2 << 20)


def app(environ, start_response):  # every path answered at once (/big with 2 MiB): a worker with no model to load
    body = BIG if environ["PATH_INFO"] == "/big" else b"ok"
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
"""


def _plain(tmp_path: Path, limit: str = "", **settings: str) -> Running:
    """PLAIN under gunicorn.conf.py, one worker (``settings``: more VISIONSERVE_ variables; ``limit``: a shell
    command run before it, ``ulimit -n 128``)."""
    (tmp_path / "plain.py").write_text(textwrap.dedent(PLAIN))
    port = free_port()
    env = {"PYTHONPATH": str(tmp_path), "VISIONSERVE_BIND": f"127.0.0.1:{port}", "VISIONSERVE_WORKERS": "1",
           "VISIONSERVE_DEVICE": "cpu", "VISIONSERVE_LOG_LEVEL": "info", "VISIONSERVE_SHUTDOWN_DRAIN_S": "0.5",
           **{f"VISIONSERVE_{name.upper()}": value for name, value in settings.items()}}
    command = ["bash", "-c", f'{limit or "true"} && exec "$@"', "plain", *gunicorn_command("plain:app")]
    return Running("plain", command, env, port, "/healthz", tmp_path)


@pytest.mark.slow  # a gunicorn master started from the command line, as the server is
def test_a_worker_under_a_low_file_limit_holds_the_connections_it_can_and_leaves_the_rest_waiting(
        tmp_path: Path) -> None:
    # Before: MAX_CONNECTIONS (1000) was not fitted to the open-file limit: idle clients took the worker's last file
    # descriptors, accept failed with EMFILE, and the worker died with every connection it held reset (its
    # replacement alike). Here the limit is 128 (soft and hard: nothing to raise it to) and 150 clients connect.
    server = _plain(tmp_path, "ulimit -n 128", threads="4", client_header_timeout_s="60",
                    max_connections_per_client="0")  # (all of them one client's: half would be answered 429)
    port, held = server.port, []
    try:
        server.wait_ready(120)
        (worker,) = server.worker_pids()
        held = [Raw(port) for _ in range(150)]  # idle: the worker holds what it can, the rest wait in the backlog
        deadline = time.monotonic() + 60
        while _backlog(port) != 150 - 60:  # it took 60 (128 less THREADS and its own files)
            assert time.monotonic() < deadline and server.worker_pids() == [worker], server.output()[-3000:]
            time.sleep(0.01)
        first = held[0]
        first.send(HEALTH)  # the first one in was taken: answered, the loop turning meanwhile
        assert first.answer()[0] == 200
        assert _backlog(port) == 150 - 60 and server.worker_pids() == [worker]  # nothing more taken
        for raw in held:
            raw.sock.close()
        held = []
        with Raw(port) as raw:  # the rest were taken as the held ones closed; a new one is answered too
            raw.send(HEALTH)
            assert raw.answer()[0] == 200
        assert server.worker_pids() == [worker], server.output()[-3000:]  # the same worker throughout
        assert "may open 128 files (ulimit -n)" in server.output() and "it takes 60 connections at once" in \
            server.output()
    finally:
        for raw in held:
            raw.sock.close()
        server.stop()


@pytest.mark.slow  # a gunicorn master started from the command line, as the server is
def test_clients_that_stop_reading_their_answers_hold_connections_not_the_request_threads(tmp_path: Path) -> None:
    # Before: a request thread polled until its client had read the whole answer (CLIENT_ANSWER_TIMEOUT_S at most):
    # THREADS clients that stopped reading held every thread of the worker (ENGINE=inline's, or any request a thread
    # runs), and a /healthz waited behind them. Now the thread leaves the rest to the loop and goes on.
    server = _plain(tmp_path, threads="2", client_answer_timeout_s="300")
    stalled: list[socket.socket] = []
    try:
        server.wait_ready(120)
        for _ in range(2):  # as many as the threads, each asking for answers it never reads
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", server.port))
            sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n" * 20)
            stalled.append(sock)
        for _ in range(3):  # a thread is free each time: answered long before a stalled answer's time is up
            with Raw(server.port) as raw:
                raw.send(HEALTH)
                assert raw.answer()[0] == 200
        stalled[0].settimeout(WAIT_S)  # a stalled client that reads again gets all its answers
        received = 0
        while received < 20 * (2 << 20):
            chunk = stalled[0].recv(1 << 20)
            assert chunk, "closed by the server"
            received += len(chunk)
        assert "Traceback" not in server.output()
    finally:
        for sock in stalled:
            sock.close()
        server.stop()


def _backlog(port: int) -> int:
    """The connections waiting in the listen backlog of the server on 127.0.0.1:``port`` (/proc/net/tcp: a listening
    socket's rx_queue)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == f"0100007F:{port:04X}" and fields[3] == "0A":  # LISTEN
            return int(fields[4].split(":")[1], 16)
    raise AssertionError(f"nothing listens on port {port}")


def _unparsed(server: Running) -> Counter[str]:
    """visionserve_requests_total of the requests answered before the app, by status."""
    with Raw(server.port) as raw:
        raw.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = raw.answer()
    assert status == 200
    return Counter({status.decode(): float(value) for status, value in re.findall(
        rb'^visionserve_requests_total\{endpoint="unparsed",status="(\d+)"\} (\S+)$', body, re.M)})


def test_requests_answered_before_the_app_count_in_requests_total_as_unparsed(server: Running) -> None:
    # Before: the loop's refusals and timeouts and the parser's refusals reached no hook, so no series had them.
    before = _unparsed(server)
    for sent, status, code in ((b"GET /healthz HTTP/1.1\nHost: x\n\n", 400, "bad_request"),  # the loop's
                               (b"GET /" + b"a" * 9000, 414, "uri_too_long"),
                               (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: " + b"a" * (64 * 1024) + b"\r\n", 431,
                                "request_header_fields_too_large"),
                               (b"GARBAGE\r\n\r\n", 400, "bad_request"),  # the parser's
                               (_photo()[:-100], 408, "request_timeout")):  # the body stalls: the loop's 1 s
        with Raw(server.port) as raw:
            raw.send(sent)
            raw.error(status, code)
    after = _unparsed(server)
    after.subtract(before)
    assert +after == Counter({"400": 2, "414": 1, "431": 1, "408": 1})


def _held_open(port: int, count: int) -> list[Raw]:
    """``count`` connections, each answered once (so the worker took it), then held open. A connection its client
    closed counts until the worker reads its end (the readiness checks' on a busy machine): while one is over the
    limit, they are closed and opened again."""
    deadline = time.monotonic() + WAIT_S
    while True:
        held = [Raw(port) for _ in range(count)]
        for raw in held:
            raw.send(HEALTH)
        if all(raw.answer()[0] == 200 for raw in held):
            return held
        for raw in held:
            raw.sock.close()
        assert time.monotonic() < deadline, "the worker never took the connections"
        time.sleep(0.1)


@pytest.mark.slow  # a gunicorn master started from the command line, as the server is
def test_one_client_holds_at_most_max_connections_per_client_of_a_worker(tmp_path: Path) -> None:
    # Before: connections were not limited per client: one client's slow connections (a slowloris of 2,000 in a
    # security review) took every connection of the server for a header timeout at a time. Now one more than
    # MAX_CONNECTIONS_PER_CLIENT is answered 429 with Retry-After, in its path's error shape, and closed.
    server = _plain(tmp_path, max_connections_per_client="3", client_header_timeout_s="60",
                    keepalive_s="60")  # (the held ones stay open however slow a busy machine makes the test)
    held: list[Raw] = []
    try:
        server.wait_ready(120)
        held = _held_open(server.port, 3)  # then idle: held open, as a slow client's are
        with Raw(server.port) as over:
            over.send(b"GET /v2/hea")  # (its path's error shape once its request line is in)
            time.sleep(0.2)
            over.send(b"lth/ready HTTP/1.1\r\nHost: x\r\n\r\n")
            status, headers, body = over.answer()
            assert (status, headers["retry-after"], headers["connection"]) == (429, "1", "close"), (headers, body)
            assert "VISIONSERVE_MAX_CONNECTIONS_PER_CLIENT" in json.loads(body)["error"]  # V2's error shape
            assert over.closed()
        with Raw(server.port) as silent:  # one that says nothing is told all the same, a second on
            assert "127.0.0.1 has 3 connections open" in silent.error(429, "too_many_requests")["message"]
        waiting = [Raw(server.port) for _ in range(REFUSALS_AWAITED)]  # silent too: answered a second on
        try:
            with Raw(server.port) as flood:  # one more at once, so a flood holds none of the worker's room
                flood.sock.settimeout(0.5)
                assert flood.error(429, "too_many_requests")
            for raw in waiting:
                raw.sock.settimeout(WAIT_S)
                assert raw.error(429, "too_many_requests")
        finally:
            for raw in waiting:
                raw.sock.close()
        for raw in held[1:]:  # the held ones still serve
            raw.send(HEALTH)
            assert raw.answer()[0] == 200
        held.pop().sock.close()  # one closes: a new one takes its place
        deadline = time.monotonic() + WAIT_S
        while True:
            with Raw(server.port) as again:
                again.send(HEALTH)
                if again.answer()[0] == 200:
                    break
            assert time.monotonic() < deadline, "the closed connection was never let go of"
            time.sleep(0.05)
    finally:
        for raw in held:
            raw.sock.close()
        server.stop()


REFUSING = """
import json
import time

from app.errors import Backlog
from app.hosting.recent_refusals import RECENT

RECENT.configure(30.0, 30.0, 16, None)  # as the app's init_app: REFUSAL_MEMORY_MS, REQUEST_TIMEOUT_S, MAX_IMAGES
CALLS = [0]


def app(environ, start_response):  # /predict refused as the engine's backlog refuses it, for the next 30 s
    if environ["REQUEST_METHOD"] == "GET":  # /calls, /healthz: how many requests reached the app
        body = str(CALLS[0]).encode()
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
        return [body]
    CALLS[0] += 1
    environ["wsgi.input"].read()
    RECENT.remember(environ["RAW_URI"], Backlog(time.monotonic() + 30.0, 0.01, 0.002), "7")
    body = json.dumps({"error": {"code": "deadline_unreachable", "message": "the app's", "request_id": "a"}}).encode()
    start_response("429 Too Many Requests", [("Content-Type", "application/json"), ("Retry-After", "7"),
                                             ("Content-Length", str(len(body)))])
    return [body]
"""


def _refusing(tmp_path: Path, **settings: str) -> Running:
    """REFUSING under gunicorn.conf.py, one worker (``settings``: more VISIONSERVE_ variables)."""
    (tmp_path / "refusing.py").write_text(textwrap.dedent(REFUSING))
    port = free_port()
    env = {"PYTHONPATH": str(tmp_path), "VISIONSERVE_BIND": f"127.0.0.1:{port}", "VISIONSERVE_WORKERS": "1",
           "VISIONSERVE_DEVICE": "cpu", "VISIONSERVE_LOG_LEVEL": "info", "VISIONSERVE_SHUTDOWN_DRAIN_S": "0.5",
           **{f"VISIONSERVE_{name.upper()}": value for name, value in settings.items()}}
    return Running("refusing", gunicorn_command("refusing:app"), env, port, "/healthz", tmp_path)


@pytest.mark.slow  # a gunicorn master started from the command line, as the server is
@pytest.mark.parametrize("engine", ["inline", "process"])  # a request thread's, or a loop request's (a greenlet)
def test_requests_the_engine_would_refuse_for_its_backlog_are_refused_before_the_app_on_a_kept_alive_connection(
        tmp_path: Path, engine: str, request: pytest.FixtureRequest) -> None:
    # A storm's refusals went through the whole app and the engine, each costing about what an answer costs the
    # HTTP side; after the engine refused one for its backlog, its route's requests whose deadline ends before
    # that backlog clears are refused before the app (app/hosting/recent_refusals.py). Under ENGINE=process the
    # master starts an engine (of small weights) that the plain app never asks: its requests run on the loop.
    weights = {} if engine == "inline" else {"weights_dir": str(request.getfixturevalue("small_weights"))}
    server, port = _refusing(tmp_path, engine=engine, **weights), 0
    calls = b"GET /calls HTTP/1.1\r\nHost: x\r\n\r\n"
    short = _photo(b"X-Request-Timeout: 500\r\n")
    try:
        port = server.wait_ready(120).port
        with Raw(port) as raw:
            raw.send(short)
            assert raw.answer()[2] == b'{"error": {"code": "deadline_unreachable", "message": "the app\'s", ' \
                                      b'"request_id": "a"}}'  # the app's: the first is the engine's refusal
            raw.send(short)
            status, headers, body = raw.answer()
            error = json.loads(body)["error"]
            assert (status, headers["retry-after"], headers.get("connection"), error["code"]) == (
                429, "7", None, "deadline_unreachable"), (headers, body)
            assert re.fullmatch(r"the queue ahead may need up to \d+\.\d{3}s, more than the 0\.\d{3}s deadline",
                                error["message"]) and error["request_id"]
            raw.send(short + short + calls)  # pipelined: each answered in turn, the connection kept
            assert [raw.answer()[0] for _ in range(3)] == [429, 429, 200]
            raw.send(calls)
            assert raw.answer()[2] == b"1"  # the app saw none of them
            raw.send(_photo(b"X-Request-Timeout: 60000\r\n"))  # its deadline outlasts the backlog: the app's to judge
            assert json.loads(raw.answer()[2])["error"]["message"] == "the app's"
            raw.send(b"POST /predict HTTP/1.0\r\nX-Request-Timeout: 500\r\nContent-Length: 2\r\n\r\nab")
            assert raw.answer()[1]["connection"] == "close" and raw.closed()
        assert "Traceback" not in server.output()
    finally:
        server.stop()


@pytest.mark.slow  # a gunicorn master started from the command line, as the server is
def test_a_request_refused_before_the_app_closes_its_connection_where_the_app_s_answer_would(tmp_path: Path) -> None:
    # KEEPALIVE_S=0: gunicorn closes every connection after its answer; the refusal's said keep-alive, and the
    # connection was then closed without a word, the client's next request on it unanswered (a review)
    server = _refusing(tmp_path, keepalive_s="0")
    short = _photo(b"X-Request-Timeout: 500\r\n")
    try:
        port = server.wait_ready(120).port
        for said in ("the app's", None):  # the engine's refusal, remembered; then the worker's own
            with Raw(port) as raw:
                raw.send(short)
                status, headers, body = raw.answer()
                assert (status, headers.get("connection")) == (429, "close") and raw.closed()
                assert (json.loads(body)["error"]["message"] == "the app's") == (said is not None)
    finally:
        server.stop()


def test_a_post_whose_head_gives_no_length_is_told_so_once_and_closed(server: Running) -> None:
    # Before: its body read as empty ("image 0: the image is empty (0 bytes)"), then the photo's bytes parsed as a
    # next request (a second 400, for a bare LF): two answers, neither saying what was wrong.
    with Raw(server.port) as raw:
        raw.send(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n\r\n" + faults.IMAGE)
        said = raw.error(400, "bad_request")["message"]
        assert "neither Content-Length nor Transfer-Encoding" in said
        assert raw.closed()
