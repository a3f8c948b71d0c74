"""The HTTP worker without a server: its event loop's request reading (app/hosting/worker.py, request_framing.py),
when a request is whole, and its answers written without blocking (client_socket.py)."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import select
import selectors
import socket
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from gunicorn.config import Config
from gunicorn.http.parser import RequestParser

from app.config import Settings
from app.hosting.request_framing import HeldUnreader, Refusal, head_framing, timeout_response
from tests.support.loop import LoopWorker


POST_P = b"POST /p HTTP/1.1\r\nHost: x\r\n"  # a head's first lines, its other fields after them


@pytest.mark.parametrize("head, expected", [
    (b"GET /healthz HTTP/1.1\r\nHost: x", 0),  # no body
    (b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 1234", 1234),
    (b"POST /predict HTTP/1.1\r\nHost: x\r\ncontent-length:  7 ", 7),  # names are case-insensitive, values trimmed
    (b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2", None),  # the parser refuses these
    (b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: -1", None),
    (b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 1e3", None),
])
def test_a_head_without_transfer_encoding_or_expect_says_how_much_to_wait_for_by_its_length_alone(
        head: bytes, expected: int | None) -> None:
    assert head_framing(head) == expected


def test_a_content_length_of_more_digits_than_any_body_needs_is_refused_not_read() -> None:
    # Before: int() of its 4,301 digits (leading zeros will do) raised on the loop and ended the worker, every
    # connection it held with it (a security review)
    for head in (POST_P + b"Content-Length: " + b"0" * 4301, POST_P + b"Content-Length: " + b"9" * 19):
        framing = head_framing(head)
        assert isinstance(framing, Refusal) and (framing.status, framing.code) == (400, "bad_request")
        assert "digits, over 18: no body is that long" in framing.message
    assert head_framing(POST_P + b"Content-Length: " + b"9" * 18) == 10 ** 18 - 1  # read: the 413 is the app's


@pytest.mark.parametrize("head, refused", [
    (b"GET /healthz HTTP/1.1", True),  # RFC 9112 3.2: a server must answer 400
    (b"GET /healthz HTTP/1.1\r\nX-Host: x", True),
    (b"POST /p HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nhost: b", True),
    (b"GET /healthz HTTP/1.0\r\nHost: a\r\nHost: b", True),
    (b"GET /healthz HTTP/1.0", False),  # HTTP/1.0 needs none
    (b"GET /healthz HTTP/1.1\r\nhOsT :x", False),
    (b"GET /healthz HTTP/1.1\r\nHost:", False),  # empty: allowed (a target without an authority)
    (b"GET /healthz HTTP/1.1\r\nHost: [fe80::1%25eth0]:8000", False),  # an IP literal, its zone too
    (b"GET /healthz HTTP/1.1\r\nHost: a b/<x>@\xff", True),  # no host (before: served; a security review)
    (b"GET /healthz HTTP/1.0\r\nHost: user@evil.example", True),  # userinfo: no Host's
    (b"GET /healthz HTTP/1.1\r\nHost: example.com:http", True),
])
def test_an_http_1_1_head_carries_one_host(head: bytes, refused: bool) -> None:
    framing = head_framing(head)
    assert isinstance(framing, Refusal) is refused
    if refused:
        assert (framing.status, framing.code) == (400, "bad_request") and "Host" in framing.message


@pytest.mark.parametrize("head, expected", [
    (POST_P + b"Transfer-Encoding: chunked", (True, 0, False)),
    (POST_P + b"Transfer-Encoding: identity, Chunked\r\nExpect: 100-Continue", (True, 0, True)),
    (POST_P + b"Transfer-Encoding: identity\r\nTransfer-Encoding: chunked", (True, 0, False)),
    # codings gunicorn takes and passes on undone (the app would read compressed bytes as the body): 501 here
    (POST_P + b"Transfer-Encoding: gzip, Chunked\r\nExpect: 100-Continue", 501),
    (POST_P + b"Transfer-Encoding: deflate\r\nTransfer-Encoding: chunked", 501),
    (POST_P + b"Transfer-Encoding: compress, identity, chunked", 501),
    (POST_P + b"Content-Length: 9\r\nExpect: 100-continue", (False, 9, True)),
    # HTTP/1.0: ignored
    (b"POST /p HTTP/1.0\r\nHost: x\r\nContent-Length: 9\r\nExpect: 100-continue", (False, 9, False)),
    # the parser refuses these from the head: the loop reads no body for them
    (POST_P + b"Transfer-Encoding: chunked\r\nContent-Length: 9", None),  # both framings
    (b"POST /p HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked", None),
    (POST_P + b"Transfer-Encoding: chunked, gzip", None),  # not chunked last
    (POST_P + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked", None),
    (POST_P + b"Transfer-Encoding: br, chunked", None),  # a coding gunicorn does not take (501)
    (POST_P + b"Content-Length: 9\r\nExpect: 200-ok", None),  # 417
    (POST_P + b"Content-Length: 9\r\nContent-Length: 9\r\nExpect: 100-continue", None),
])
def test_the_loop_reads_a_chunked_or_expected_body_only_framed_as_the_parser_will_read_it(
        head: bytes, expected: tuple | int | None) -> None:
    framing = head_framing(head)
    if isinstance(framing, Refusal):
        assert (framing.status, framing.code) == (expected, "not_implemented")
        assert "Content-Encoding" in framing.message
        return
    assert (framing and (framing.chunked, framing.length, framing.expects_continue)) == expected


@pytest.mark.parametrize("head, came, expected", [  # expected: whole, body_end past the head, continue_owed, refusal
    (b"GET / HTTP/1.1\r\nHost: x", b"", (True, 0, False, None)),  # no body
    (POST_P + b"Content-Length: 5", b"abc", (False, 5, False, None)),
    (POST_P + b"Content-Length: 5", b"abcde", (True, 5, False, None)),
    # the parser reads these from the head as it is: the app refuses a body over the limit, the parser the others
    (POST_P + b"Content-Length: 101", b"", (True, None, False, None)),
    (POST_P + b"Content-Length: 5\r\nContent-Length: 5", b"", (True, None, False, None)),
    (POST_P + b"Content-Length: 1e3", b"", (True, None, False, None)),
    (POST_P + b"Transfer-Encoding: chunked\r\nContent-Length: 5", b"", (True, None, False, None)),
    (POST_P + b"Transfer-Encoding: br, chunked", b"", (True, None, False, None)),
    (POST_P + b"Content-Length: 5\r\nExpect: 200-ok", b"", (True, None, False, None)),
    (POST_P + b"Transfer-Encoding: chunked", b"", (False, 1, False, None)),  # a size line's first byte
    (POST_P + b"Content-Length: 5\r\nExpect: 100-continue", b"", (False, 5, True, None)),
    (POST_P + b"Transfer-Encoding: chunked\r\nExpect: 100-continue", b"", (False, 1, True, None)),
    (POST_P + b"Content-Length: 5\r\nExpect: 100-continue", b"ab", (False, 5, False, None)),  # sent anyway
    (POST_P + b"Content-Length: 0\r\nExpect: 100-continue", b"", (True, 0, False, None)),  # none to ask
    (b"POST /p HTTP/1.0\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue", b"",  # HTTP/1.0
     (False, 5, False, None)),
    (POST_P + b"Content-Length: 101\r\nExpect: 100-continue", b"", (True, None, False, 413)),
])
def test_the_loop_waits_for_the_body_a_head_frames_and_leaves_any_other_head_to_the_parser(
        head: bytes, came: bytes, expected: tuple) -> None:
    from app.hosting.request_framing import ReadLimits, Reading

    worker = _lingering()
    worker.limits = ReadLimits(max_body_bytes=100)
    reading = Reading(None, time.monotonic() + 10, time.monotonic())
    reading.take(head + b"\r\n\r\n" + came)
    whole = worker._whole(reading)
    body_end = None if reading.body_end is None else reading.body_end - len(head + b"\r\n\r\n")
    assert (whole, body_end, reading.continue_owed, reading.refusal and reading.refusal.status) == expected


@pytest.mark.parametrize("head", [POST_P + b"Content-Length: 101",  # over the limit: the app's 413
                                  POST_P + b"Content-Length: 5\r\nTransfer-Encoding: chunked"])  # parser's
def test_a_head_left_to_the_parser_is_judged_so_however_often_it_is_asked(head: bytes) -> None:
    # Before: asked again (a lingering request thread asks, then the loop), the head was looked for past where it
    # ended, and the body read on as a head: 400 "bare LF" or 431 for an upload over the limit on a kept-alive
    # connection, a wait without end for a head the parser refuses.
    from app.hosting.request_framing import ReadLimits, Reading

    worker = _lingering()
    worker.limits = ReadLimits(max_body_bytes=100)
    reading = Reading(None, time.monotonic() + 10, time.monotonic())
    reading.take(head + b"\r\n\r\nab\ncd")
    assert [worker._whole(reading) for _ in range(3)] == [True] * 3
    reading.take(b"\n" * 70_000)  # more of its body: still the parser's, never a head over its limit
    assert worker._whole(reading) and reading.refusal is None and reading.to_parser


@pytest.mark.parametrize("head, said", [
    (b"GET / HTTP/1.1\r\nHost: x\r\nx-request-id:  abc-1 \r\n\r\n", "abc-1"),  # any case, trimmed
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-Request-ID: abc-1\r\n", "abc-1"),  # a head not whole yet: its ended lines
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-Request-ID: abc-1", None),  # its line not ended: maybe not all of it
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-Request-ID: a\r\nX-Request-ID: b\r\n\r\n", None),  # two: neither
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\nX-Request-ID: in-the-body\r\n", None),  # past the head
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-Request-IDs: abc\r\n\r\n", None),
])
def test_the_caller_s_request_id_is_read_from_the_head_alone(head: bytes, said: str | None) -> None:
    from app.hosting.request_framing import caller_request_id

    assert caller_request_id(head) == said


def test_a_timeout_answer_is_408_json_in_the_service_error_shape() -> None:
    # with its request id, as every answer has (before: "request_id": null and no X-Request-ID)
    head, _, body = timeout_response("the request headers did not arrive within 10s", "a1b2").partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"Connection: close" in head and b"X-Request-ID: a1b2" in head
    assert f"Content-Length: {len(body)}".encode() in head
    assert json.loads(body) == {"error": {"code": "request_timeout", "request_id": "a1b2",
                                          "message": "the request headers did not arrive within 10s"}}


def _request(body: bytes, path: str = "/predict") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


@pytest.fixture
def sockets() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, client = socket.socketpair()
    yield ours, client
    ours.close()
    client.close()


def _parser(sock: socket.socket, held: bool) -> RequestParser:
    parser = RequestParser(Config(), sock, ("127.0.0.1", 1))
    if held:
        parser.unreader = HeldUnreader(sock)
    return parser


def _bodies(parser: RequestParser, count: int, piece: int) -> list[tuple[str, bytes]]:
    """``count`` requests out of the parser, each body read in ``piece``-byte reads (the app's way)."""
    found = []
    for _ in range(count):
        message = next(parser)
        pieces = []
        while data := message.body.read(piece):
            pieces.append(data)
        found.append((message.path, b"".join(pieces)))
    return found


@pytest.mark.parametrize("piece", [1, 1000, 65536, 1 << 22])
def test_the_held_unreader_gives_the_parser_what_gunicorns_gives_it(sockets, piece: int) -> None:
    # Two pipelined requests held, the second one's body partly still in the socket, then a third from the socket.
    ours, client = sockets
    bodies = [bytes(range(256)) * 600, b"", b"z" * 70_000]
    stream = _request(bodies[0], "/a") + _request(bodies[1], "/b") + _request(bodies[2], "/c")
    held, sent = stream[:len(stream) - 50_000], stream[len(stream) - 50_000:]
    answers = {}
    for kind in ("gunicorn's", "held", "held as a request"):
        client.sendall(sent)
        parser = _parser(ours, held=kind != "gunicorn's")
        getattr(parser.unreader, "unread_request" if kind == "held as a request" else "unread")(bytearray(held))
        answers[kind] = _bodies(parser, 3, piece)
    assert list(answers.values()) == [[("/a", bodies[0]), ("/b", b""), ("/c", bodies[2])]] * 3


def test_a_request_held_whole_gives_the_header_parser_its_head_alone(sockets) -> None:
    # Before: the parser was handed 64 KB of the photo behind the head, and copied it six times before it unread it
    ours, _ = sockets
    ours.settimeout(2)  # a read of the socket (nothing there) fails instead of waiting
    request = _request(b"x" * 100_000)
    head = request[:request.index(b"\r\n\r\n") + 4]
    unreader = HeldUnreader(ours)
    unreader.unread_request(bytearray(request))
    assert unreader.read() == head
    assert unreader.read(100_000) == b"x" * 100_000 and unreader._held == b""
    unreader.unread_request(bytearray(request))
    assert unreader.read(len(request)) == request  # a read of a size first: all of it held, none asked of the socket


def test_the_held_unreader_keeps_the_order_of_what_is_unread(sockets) -> None:
    ours, client = sockets
    unreader = HeldUnreader(ours)
    unreader.unread(b"0123456789")
    assert unreader.read(4) == b"0123"
    unreader.unread(b"23")  # the tail of the last slice: a step back
    assert unreader.read(3) == b"234"
    unreader.unread(b"ab")  # anything else goes before what is held
    client.sendall(b"socket")
    assert unreader.read(9) == b"ab56789so"
    assert unreader.read() == b"cket"
    unreader.unread(b"left")
    assert unreader.take_buffered() == b"left" and unreader.take_buffered() == b""


def test_a_kept_alive_connection_holds_nothing_once_its_request_was_read(sockets) -> None:
    ours, _ = sockets
    parser = _parser(ours, held=True)
    parser.unreader.unread(bytearray(_request(b"x" * 200_000)))
    assert _bodies(parser, 1, 65536)[0][1] == b"x" * 200_000
    assert parser.unreader._held == b""


def test_gunicorn_builds_no_access_line_where_the_app_writes_its_own(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from app.hosting.worker import NoAccessLog

    # The config is read in a process of its own: it sets up the environment it runs in (CONTROL_DIR, the metrics'
    # folder), which every server this test process starts later would inherit and share.
    read = ("import json, runpy; c = runpy.run_path('gunicorn.conf.py'); "
            "print(json.dumps({k: c[k] for k in ('logger_class', 'accesslog', 'logconfig_dict')}))")
    root = Path(__file__).resolve().parents[2]
    conf = json.loads(subprocess.run([sys.executable, "-c", read], cwd=root, check=True, capture_output=True,
                                     text=True, env={**os.environ, "VISIONSERVE_CONTROL_DIR": str(tmp_path),
                                                     "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
                                     ).stdout.splitlines()[-1])
    assert conf["logger_class"] == "app.hosting.worker.NoAccessLog" and conf["accesslog"] is None
    cfg = Config()
    cfg.set("logconfig_dict", conf["logconfig_dict"])  # what made gunicorn count access logging as on
    logger = NoAccessLog(cfg)
    assert logger.access_log_enabled  # gunicorn's own view ...

    def atoms(*_: object) -> dict:
        raise AssertionError("an access line was built")

    monkeypatch.setattr(logger, "atoms", atoms)
    logger.access(None, None, {}, 0.1)  # ... and still nothing is built


def test_each_server_has_its_own_gunicorn_control_socket_in_its_control_dir(tmp_path: Path) -> None:
    # Before: gunicorn's default, $HOME/.gunicorn/gunicorn.ctl, one for every server the user started
    import os
    import subprocess
    import sys

    read = "import runpy; print(runpy.run_path('gunicorn.conf.py')['control_socket'])"
    root = Path(__file__).resolve().parents[2]
    found = subprocess.run([sys.executable, "-c", read], cwd=root, check=True, capture_output=True, text=True,
                           env={**os.environ, "VISIONSERVE_CONTROL_DIR": str(tmp_path),
                                "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}).stdout.splitlines()[-1]
    assert found == str(tmp_path / "gunicorn.ctl")


@pytest.mark.parametrize("exiting, status", [("SystemExit(0)", 0), ("SystemExit(3)", 3), ("SystemExit(-1)", 255),
                                             ("SystemExit(None)", 0)])
def test_a_stopped_worker_exits_with_gunicorns_status_after_its_exit_functions_and_logs(
        tmp_path: Path, exiting: str, status: int) -> None:
    import subprocess
    import sys
    import textwrap

    ran = tmp_path / "ran"
    script = textwrap.dedent(f"""
        import atexit, logging, sys
        from app.hosting import drain
        logging.basicConfig(filename={str(tmp_path / 'log')!r}, level=logging.INFO)
        atexit.register(lambda: open({str(ran)!r}, "w").write("flushed"))  # a tracer's last spans, say
        exiting = {exiting}
        drain.exit_now(ValueError("not on its way out"))  # anything else: left alone
        try:
            raise exiting
        finally:  # as gunicorn's worker_exit hook runs
            logging.getLogger("worker").info("worker exiting")
            drain.exit_now(sys.exc_info()[1])
            print("not reached")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == status, done.stderr
    assert ran.read_text() == "flushed" and "worker exiting" in (tmp_path / "log").read_text()
    assert "not reached" not in done.stdout and "Traceback" not in done.stderr


class _Conn:
    """What a request thread's linger reads of a connection: its socket and its parser's unreader."""

    def __init__(self, sock: socket.socket, held: bytes = b"") -> None:
        self.sock, self.parser = sock, None
        if held:
            self.parser = _parser(sock, held=True)
            self.parser.unreader.unread(held)


def _lingering(linger_s: float = 0.05):  # noqa: ANN202 - the worker class without gunicorn's set-up
    from app.hosting.request_framing import ReadLimits
    from app.hosting.worker import BufferingWorker

    worker = BufferingWorker.__new__(BufferingWorker)
    worker.limits = ReadLimits(linger_s=linger_s)
    return worker


def test_a_lingering_thread_takes_the_next_request_that_arrives_whole_and_nothing_else(sockets) -> None:
    ours, client = sockets
    worker = _lingering()
    first, second = _request(b"a" * 10), _request(b"b" * 5)
    client.sendall(first + second[:7])  # the next request, and the start of one more
    reading = worker._next_request(_Conn(ours))
    assert worker._whole(reading) and bytes(reading.buffer[:reading.body_end]) == first
    client.sendall(second[7:])  # the rest: after the surplus the parser holds once the first is answered
    reading = worker._next_request(_Conn(ours, held=bytes(reading.buffer[reading.body_end:])))
    assert worker._whole(reading) and bytes(reading.buffer) == second


def test_a_request_held_behind_the_last_answer_is_taken_before_the_socket_is_read(sockets) -> None:
    # pipelined: the loop read two requests at once; the parser holds the second after answering the first
    ours, client = sockets
    worker = _lingering(linger_s=5.0)
    pipelined = _request(b"p" * 3)
    started = time.monotonic()
    reading = worker._next_request(_Conn(ours, held=pipelined))
    assert bytes(reading.buffer) == pipelined and worker._whole(reading) and time.monotonic() - started < 1.0
    client.sendall(b"x")
    assert ours.recv(1) == b"x"  # the socket was not read


def test_a_lingering_thread_gives_back_a_request_it_did_not_get_whole_and_a_connection_that_closed(sockets) -> None:
    ours, client = sockets
    worker = _lingering()
    assert worker._next_request(_Conn(ours)) is None  # nothing came: kept alive, back to the loop
    client.sendall(_request(b"z" * 100)[:-10])  # a request begun: the loop reads the rest, with its timeouts
    reading = worker._next_request(_Conn(ours))
    assert reading.body_end is not None and not worker._whole(reading)
    client.close()
    assert worker._next_request(_Conn(ours)) is False


class _Asked:
    """A socket that notes what each read asks for."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.asked = sock, []  # type: socket.socket, list[int]

    def recv(self, size: int, *flags: int) -> bytes:
        self.asked.append(size)
        return self.sock.recv(size, *flags)


def test_the_loop_reads_a_body_that_came_with_its_headers_in_one_wake_up_asking_for_what_is_left(sockets) -> None:
    from app.hosting.request_framing import FIRST_READ, Reading

    ours, client = sockets
    ours.setblocking(False)
    worker, dispatched = _lingering(), []
    worker._dispatch = dispatched.append
    for body, reads in ((os.urandom(120_000), 2), (b"s" * 10, 1)):  # a photo beyond the first read, a small one
        client.sendall(_request(body))  # all of it waits in the socket
        reading, asked = Reading(None, time.monotonic() + 10, time.monotonic()), _Asked(ours)
        worker._on_data(reading, asked)  # one wake-up
        assert dispatched.pop() is reading and bytes(reading.buffer) == _request(body)
        # the headers' read asks for 64 KB (not a MiB: Python allocates what is asked), then what the body still needs
        assert asked.asked[0] == FIRST_READ and len(asked.asked) == reads


class _Listening:
    """A worker's view of one listening socket with ``waiting`` connections in its backlog."""

    def __init__(self, waiting: int) -> None:
        self.waiting, self.closed = waiting, False

    def close(self) -> None:
        self.closed = True


class _DrainingWorker:
    """What app/hosting/drain.py's last step uses of a gthread worker."""

    def __init__(self, waiting: int, leaves: bool) -> None:
        self.sockets, self.nr_conns, self.leaves = [_Listening(waiting)], 0, leaves
        self.accepting = True

    def leaves_backlog(self) -> bool:
        return self.leaves

    def set_accept_enabled(self, enabled: bool) -> None:
        self.accepting = enabled

    def accept(self, listener: _Listening) -> None:
        if listener.waiting:
            listener.waiting, self.nr_conns = listener.waiting - 1, self.nr_conns + 1


@pytest.mark.parametrize("leaves", [False, True])
def test_a_drain_takes_the_backlog_unless_its_worker_leaves_it_to_one_that_serves(leaves: bool) -> None:
    # A worker drains to its last connection, then closes its listener: the backlog's connections are answered
    # (503 with Connection: close) rather than reset. One holding back for a worker that still serves (a
    # replacement still loading) leaves them to that worker instead of answering them 503.
    from app.hosting import drain

    worker = _DrainingWorker(waiting=3, leaves=leaves)
    drain._accept_queued_then_close(worker)
    assert not worker.accepting and worker.sockets[0].closed
    assert (worker.nr_conns, worker.sockets[0].waiting) == ((0, 3) if leaves else (3, 0))


class _CrowdedWorker(_DrainingWorker):
    """One whose backlog is one client's, over MAX_CONNECTIONS_PER_CLIENT: each answered 429 and closed at once."""

    accepts = 0

    def accept(self, listener: _Listening) -> None:
        if listener.waiting:
            listener.waiting, self.accepts = listener.waiting - 1, self.accepts + 1  # (no open connection added)


def test_a_drain_takes_a_backlog_of_connections_refused_at_once_whole() -> None:
    # Before: the drain counted what it took by open connections, so the first connection refused at accept ended
    # its taking, and closing the listener reset the rest.
    from app.hosting import drain

    worker = _CrowdedWorker(waiting=3, leaves=False)
    drain._accept_queued_then_close(worker)
    assert (worker.accepts, worker.sockets[0].waiting, worker.sockets[0].closed) == (3, 0, True)


def test_a_draining_worker_leaves_the_backlog_only_while_another_still_serves(tmp_path: Path) -> None:
    # Asked at its drain's end (its own mark gone): when the serving worker has begun its drain too (its mark gone),
    # the backlog is this one's to answer, or the last listener's close would reset it.
    from app.hosting import control
    from app.hosting.worker import BufferingWorker

    worker = BufferingWorker.__new__(BufferingWorker)  # its state alone: no gunicorn arbiter behind it
    worker.control_dir, worker.held_back = tmp_path, True
    serving = control.ready_mark(tmp_path, os.getppid())  # another live process's mark
    serving.touch()
    assert worker.leaves_backlog()
    serving.unlink()  # that worker began its drain
    assert not worker.leaves_backlog()
    serving.touch()
    worker.held_back = False  # Before: one that had served took its backlog (503s) while another still served
    assert worker.leaves_backlog()


def _listening_worker(control_dir: Path) -> tuple[Any, socket.socket]:
    """A BufferingWorker's accepting state (no gunicorn arbiter behind it) on a loopback listener."""
    from app.hosting.worker import BufferingWorker

    listener = socket.create_server(("127.0.0.1", 0))
    worker = BufferingWorker.__new__(BufferingWorker)
    worker.control_dir, worker.held_back, worker.draining = control_dir, False, False
    worker.sockets, worker.poller, worker._accepting = [listener], selectors.DefaultSelector(), False
    worker.nr_conns, worker.reading, worker.cfg = 0, set(), Config()
    worker.log = logging.getLogger("test.worker")
    return worker, listener


def _close_all(worker: Any, listener: socket.socket, clients: list[socket.socket]) -> None:
    """A ``_listening_worker``'s listener and poller closed, with its test's clients and what the worker took."""
    for client in clients:
        client.close()
    for reading in list(worker.reading):
        reading.conn.sock.close()
    listener.close()
    worker.poller.close()


def test_a_draining_worker_leaves_new_connections_to_a_worker_that_serves_and_takes_them_when_none_does(
        tmp_path: Path) -> None:
    # Before: a draining worker (a HUP's old one, one stopped alone) took every new connection it was offered and
    # answered it 503 for its whole SHUTDOWN_DRAIN_S while another worker served. A whole-server stop (no worker
    # serves) still takes them: answered 503, never reset.
    from app.hosting import control

    worker, listener = _listening_worker(tmp_path)
    mine, serving = control.ready_mark(tmp_path, os.getpid()), control.ready_mark(tmp_path, os.getppid())
    mine.touch()
    serving.touch()
    clients = []
    try:
        worker.set_accept_enabled(True)
        assert worker.poller.get_map() and not worker.held_back  # it serves: it takes new connections
        clients.append(socket.create_connection(listener.getsockname()))
        worker.accept(listener)
        assert worker.nr_conns == 1
        mine.unlink()  # its drain begins (app/hosting/drain.py): its mark goes, and it says so
        worker.draining = True
        clients.append(socket.create_connection(listener.getsockname()))
        worker.accept(listener)  # the poller found the listener readable
        assert worker.nr_conns == 1 and worker.held_back and not worker._accepting  # left in the backlog
        assert listener not in [key.fileobj for key in worker.poller.get_map().values()]
        worker.set_accept_enabled(True)  # gthread's loop asks again each turn
        assert not worker._accepting
        serving.unlink()  # the other worker drains too (the whole server stops)
        worker.set_accept_enabled(True)
        assert worker._accepting and not worker.held_back
        worker.accept(listener)
        assert worker.nr_conns == 2  # the connection that waited is taken, to be answered
    finally:
        _close_all(worker, listener, clients)


def test_a_worker_held_back_while_it_loads_then_told_to_stop_says_it_drains(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Before: held back while it loaded (another worker served), marked ready, then told to stop before its loop
    # asked again (a second apart at most): its log said once, at the start, that it held back until it served,
    # and never that it drained (a CI run's end-to-end test found the line missing).
    from app.hosting import control

    worker, listener = _listening_worker(tmp_path)
    control.ready_mark(tmp_path, os.getppid()).touch()  # another worker serves
    clients = [socket.create_connection(listener.getsockname())]
    try:
        with caplog.at_level(logging.INFO, logger="test.worker"):
            worker.accept(listener)  # loading: left in the backlog
            worker.draining = True  # its drain began before its loop asked again
            worker.accept(listener)
            worker.accept(listener)
        said = [record.getMessage() for record in caplog.records]
        assert said == [f"worker {os.getpid()} takes new connections once it serves (another worker serves them)",
                        f"worker {os.getpid()} drains: new connections go to the workers that serve "
                        f"({os.getppid()})"]
        assert worker.nr_conns == 0 and worker.held_back
    finally:
        _close_all(worker, listener, clients)


def test_a_draining_worker_names_the_serving_workers_of_the_master_beside_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Before: after USR2 the old master's draining worker left new connections to the new master's serving ones
    # (control.takes_connections) but its log said they went to "none now", naming only its own master's workers.
    from app.hosting import control

    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    (old / control.SUCCESSOR).write_text(str(new), encoding="utf-8")  # the new master told it (its CONTROL_DIR)
    control.ready_mark(new, os.getppid()).touch()  # the new master's worker serves
    worker, listener = _listening_worker(old)
    worker.draining = True
    clients = [socket.create_connection(listener.getsockname())]
    try:
        with caplog.at_level(logging.INFO, logger="test.worker"):
            worker.accept(listener)
        assert [record.getMessage() for record in caplog.records] == [
            f"worker {os.getpid()} drains: new connections go to the workers that serve ({os.getppid()})"]
        assert worker.nr_conns == 0 and worker.held_back
    finally:
        _close_all(worker, listener, clients)


def test_a_worker_taking_new_connections_leaves_them_to_one_that_serves_once_it_does_not_serve_itself(
        tmp_path: Path) -> None:
    # Before: gthread asks set_accept_enabled only when accepting should change for its own reasons, so a worker
    # that began taking new connections while none served (a server starting: every worker loading) went on taking
    # them once another served, answering them 503 until it served itself; and so did one whose engine ended (its
    # mark gone while the master restarts it) while the workers of the other engines served.
    from app.hosting import control

    worker, listener = _listening_worker(tmp_path)
    mine, serving = control.ready_mark(tmp_path, os.getpid()), control.ready_mark(tmp_path, os.getppid())
    clients = []

    def offered() -> None:  # a new connection, and the poller finding the listener readable
        clients.append(socket.create_connection(listener.getsockname()))
        worker.accept(listener)

    try:
        worker.set_accept_enabled(True)  # gthread's loop starts it accepting: no worker serves yet
        offered()
        assert worker.nr_conns == 1 and worker._accepting  # taken: it answers 503 while it loads
        serving.touch()  # another worker serves
        offered()
        assert worker.nr_conns == 1 and worker.held_back and not worker._accepting  # left in the backlog
        mine.touch()  # this one serves too
        worker.set_accept_enabled(True)  # gthread's loop asks again each turn
        assert worker._accepting and not worker.held_back
        worker.accept(listener)
        assert worker.nr_conns == 2  # the connection that waited
        mine.unlink()  # its engine ended (app/link/client.py): the master restarts it
        offered()
        assert worker.nr_conns == 2 and worker.held_back and not worker._accepting
        serving.unlink()  # the other's too (one engine for both): none serves, so it takes them, to answer 503
        worker.set_accept_enabled(True)
        assert worker._accepting and not worker.held_back
        worker.accept(listener)
        assert worker.nr_conns == 3
    finally:
        _close_all(worker, listener, clients)


def test_a_kept_control_dir_loses_what_an_earlier_server_left_at_the_next_start(tmp_path: Path) -> None:
    # A killed worker's ready mark from an earlier run could name a live process of this one (pids are reused):
    # the others would hold back new connections for a worker that does not serve.
    from app.hosting import control

    left = [control.ready_mark(tmp_path, 1234), control.socket_path(tmp_path, 0), control.engine_failure(tmp_path, 1),
            control.report(tmp_path, 1234)]
    kept = [tmp_path / control.DESIRED]
    for path in left + kept:
        path.touch()
    control.clear_stale(tmp_path)
    assert [path.exists() for path in left + kept] == [False, False, False, False, True]


def _reading(client: socket.socket, size: int) -> tuple[threading.Thread, bytearray]:
    """A thread started reading ``size`` bytes from ``client`` (or to its end) into the bytearray returned with it."""
    received = bytearray()

    def read_all() -> None:
        while len(received) < size and (chunk := client.recv(1 << 16)):
            received.extend(chunk)

    reader = threading.Thread(target=read_all)
    reader.start()
    return reader, received


def test_an_answer_is_written_as_the_client_reads_it_and_a_client_that_reads_none_is_left(sockets) -> None:
    from app.hosting.client_socket import ClientSocket

    ours, client = sockets
    answer = ClientSocket(ours.family, ours.type, ours.proto, fileno=ours.detach())
    answer.answer_timeout_s = 0.3
    body = os.urandom(4 << 20)  # beyond what the socket's buffers hold
    reader, received = _reading(client, len(body))
    answer.sendall(body)  # written while the client reads, never a blocking write
    reader.join(10)
    assert bytes(received) == body
    answer.settimeout(5.0)  # as app/web/hooks.py sets for a body still to read: not what bounds an answer's write
    started = time.monotonic()
    with pytest.raises(BrokenPipeError, match="took none of its answer for 0.3s"):
        answer.sendall(body)  # nobody reads now: gunicorn closes a broken pipe quietly
    assert 0.25 < time.monotonic() - started < 5
    client.setblocking(False)
    while client.recv(1 << 20):  # what was sent, then the end: the connection was shut down
        pass
    answer.close()


def test_a_client_socket_sets_only_a_mode_it_lacks_and_one_whose_request_runs_on_the_loop_stays_non_blocking(
        sockets, monkeypatch: pytest.MonkeyPatch) -> None:
    from app.hosting.client_socket import ClientSocket

    ours, _ = sockets
    sock = ClientSocket(ours.family, ours.type, ours.proto, fileno=ours.detach())
    set_in_kernel: list[float | None] = []  # each call that reaches socket's own settimeout (its ioctl)
    real_settimeout = socket.socket.settimeout
    monkeypatch.setattr(socket.socket, "settimeout",
                        lambda self, value: (set_in_kernel.append(value), real_settimeout(self, value))[1])

    def kernel_non_blocking() -> bool:
        return bool(fcntl.fcntl(sock.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK)

    sock.setblocking(False)  # as gthread keeps a connection between requests
    sock.setblocking(False)
    sock.settimeout(0.0)
    assert set_in_kernel == [0.0] and sock.gettimeout() == 0.0 and kernel_non_blocking()
    sock.stays_nonblocking = True  # a request held whole runs on the loop: gthread's handle, its parser ask for more
    for ask in (lambda: sock.setblocking(True), lambda: sock.settimeout(None), lambda: sock.settimeout(5.0)):
        ask()
        assert sock.gettimeout() == 0.0 and kernel_non_blocking()
    assert set_in_kernel == [0.0]
    with pytest.raises(BlockingIOError):
        sock.recv(1)  # a read there never holds up the loop
    sock.stays_nonblocking = False  # a request thread's: blocking, and a timeout, as asked
    sock.setblocking(True)
    assert sock.gettimeout() is None and not kernel_non_blocking()
    sock.settimeout(2.0)
    assert set_in_kernel == [0.0, None, 2.0] and sock.gettimeout() == 2.0
    sock.close()


@contextlib.contextmanager
def _waits_on_the_loop(loop: LoopWorker, count: int) -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    """``count`` socket pairs, and every wait of a loop request handed to ``loop``'s worker, for the block."""
    pairs = [socket.socketpair() for _ in range(count)]
    try:
        with loop.waits():
            yield pairs
    finally:
        for ours, theirs in pairs:
            ours.close()
            theirs.close()


def test_a_request_on_the_loop_hands_its_waits_to_the_loop_which_resumes_each_when_ready_or_at_its_deadline() -> None:
    from app.hosting import waiting

    loop = LoopWorker()
    with _waits_on_the_loop(loop, 3) as pairs:
        for name, (ours, _), limit in zip("abc", pairs, (5.0, 5.0, 0.2)):
            loop.start(name, lambda ours=ours, limit=limit: (waiting.wait_for(ours, select.POLLIN, limit),
                                                             ours.recv(8, socket.MSG_DONTWAIT) if limit > 1 else b""))
        assert loop.ended == [] and len(loop.worker.poller.get_map()) == 3  # all three wait on the one loop
        pairs[1][1].sendall(b"second")
        loop.worker.wait_for_and_dispatch_events(1.0)
        assert loop.ended == [("b", (True, b"second"))]
        started = time.monotonic()
        while len(loop.ended) < 2 and time.monotonic() - started < 3:
            loop.worker.wait_for_and_dispatch_events(1.0)  # wakes at c's deadline, not a second later
        assert loop.ended[1] == ("c", (False, b"")) and time.monotonic() - started < 0.9
        pairs[0][1].sendall(b"first")
        loop.worker.wait_for_and_dispatch_events(1.0)
        assert loop.ended[2] == ("a", (True, b"first"))
        assert not loop.worker.poller.get_map() and not [w for w in loop.worker.waits if not w[2].done]
        # a thread, or the loop's own greenlet, polls: the loop's wait declines
        assert loop.worker.loop_wait(pairs[0][0], select.POLLIN, 0.1) is None
        seen: list[object] = []
        thread = threading.Thread(target=lambda: seen.append(loop.worker.loop_wait(pairs[0][0], select.POLLIN, 0.1)))
        thread.start()
        thread.join(5)
        assert seen == [None]


def test_a_loop_request_s_end_reads_as_a_request_thread_s_future_would() -> None:
    # gthread's finish_request reads how a loop request ended as it reads a request thread's future: what it
    # returned, or what it raised (then re-raised by result()), never cancelled
    loop = LoopWorker()
    ended: dict[str, Any] = {}
    loop.worker.finish_request = ended.__setitem__
    failure = OSError("the client went")
    loop.start("returns", lambda: "keep-alive")
    loop.start("raises", lambda: (_ for _ in ()).throw(failure))
    for name, value, error in (("returns", "keep-alive", None), ("raises", None, failure)):
        done: Future = Future()
        done.set_result(value) if error is None else done.set_exception(error)
        outcome = ended[name]
        assert (outcome.cancelled(), outcome.exception()) == (done.cancelled(), done.exception())
        if error is None:
            assert outcome.result() == done.result() == value
        else:
            with pytest.raises(OSError) as raised:
                outcome.result()
            assert raised.value is failure


def test_a_failed_loop_request_s_outcome_is_not_held_by_its_error_once_read() -> None:
    # As a Future's: the error's traceback holds the frame that raised it, which must not hold the outcome (a cycle
    # that keeps the request's objects until the collector runs)
    from app.hosting.loop_requests import Outcome

    failure = OSError("the client went")
    outcome = Outcome(error=failure)
    with pytest.raises(OSError):
        outcome.result()
    frames, tb = [], failure.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    raised = [frame for frame in frames if frame.f_code is Outcome.result.__code__]  # (the test's own holds it)
    assert raised and not [value for value in raised[0].f_locals.values() if value is outcome]


def test_a_loop_request_waits_for_an_event_the_loop_sets_and_work_left_for_the_loop_runs_before_its_next_wait(
) -> None:
    loop = LoopWorker()
    events: dict[str, object] = {}
    order: list[str] = []

    def waits(name: str, timeout_s: float) -> bool:
        event = events[name] = loop.worker.event()
        return event.wait(timeout_s)

    def sets_another() -> str:
        events["a"].set()  # from another loop request: a resumes once this one waits or ends, not inside it
        order.append("b set a")
        return "b"

    with _waits_on_the_loop(loop, 1) as [(ours, theirs)]:
        loop.start("a", lambda: (waits("a", 5.0), order.append("a resumed"))[0])
        loop.start("late", lambda: waits("late", 0.1))
        assert loop.ended == []
        loop.start("b", sets_another)
        assert order == ["b set a"] and [name for name, _ in loop.ended] == ["b"]
        loop.worker.wait_for_and_dispatch_events(0.01)  # before its wait, the loop resumes a
        assert order == ["b set a", "a resumed"] and ("a", True) in loop.ended
        started = time.monotonic()
        loop.turn_until(lambda: len(loop.ended) == 3)
        assert ("late", False) in loop.ended and time.monotonic() - started < 1  # its time was up
        loop.start("early", lambda: (events.__setitem__("early", loop.worker.event()), events["early"].set(),
                                     events["early"].wait(5.0))[-1])
        assert ("early", True) in loop.ended  # set before its wait: no wait at all
        # a socket watched while it is open: its callback on the loop each time it is readable
        seen: list[bytes] = []
        loop.worker.watch(ours, lambda: seen.append(ours.recv(8)))
        theirs.sendall(b"one")
        loop.worker.wait_for_and_dispatch_events(1.0)
        theirs.sendall(b"two")
        loop.worker.wait_for_and_dispatch_events(1.0)
        loop.worker.unwatch(ours)
        theirs.sendall(b"three")
        loop.worker.wait_for_and_dispatch_events(0.05)
        assert seen == [b"one", b"two"] and not loop.worker.poller.get_map()


def test_at_most_threads_requests_run_on_the_loop_the_next_starting_as_one_ends() -> None:
    from app.hosting import waiting

    loop = LoopWorker(threads=2)
    with _waits_on_the_loop(loop, 3) as pairs:
        for name, (ours, _) in zip("abc", pairs):
            loop.start(name, lambda ours=ours: waiting.wait_for(ours, select.POLLIN, 5.0))
        assert len(loop.worker.poller.get_map()) == 2 and list(loop.worker.loop_queue) == ["c"]  # c waits its turn
        pairs[0][1].sendall(b"a")
        loop.worker.wait_for_and_dispatch_events(1.0)
        assert loop.ended == [("a", True)] and not loop.worker.loop_queue and len(loop.worker.poller.get_map()) == 2
        for _, theirs in pairs[1:]:
            theirs.sendall(b"x")
        until = time.monotonic() + 10
        while len(loop.ended) < 3 and time.monotonic() < until:
            loop.worker.wait_for_and_dispatch_events(1.0)
        assert sorted(loop.ended) == [("a", True), ("b", True), ("c", True)] and loop.worker.loop_running == 0


def test_requests_that_end_at_once_are_settled_one_after_another_not_one_inside_another() -> None:
    # pipelined requests: each one's end (gthread's finish_request) starts the next on the connection
    loop = LoopWorker()
    count = 3 * __import__("sys").getrecursionlimit()

    def ended(conn: str, outcome: Future) -> None:
        loop.ended.append((conn, outcome.result()))
        if len(loop.ended) < count:
            loop.start(f"r{len(loop.ended)}", lambda: "answered")

    loop.worker.finish_request = ended
    loop.start("r0", lambda: "answered")
    assert len(loop.ended) == count and {outcome for _, outcome in loop.ended} == {"answered"}


def test_a_loop_requests_greenlet_runs_the_next_request_once_settled_as_many_as_ran_at_once() -> None:
    # Before: a greenlet per request, whose first frame mapped a fresh frame stack and whose end unmapped it
    from greenlet import getcurrent

    from app.hosting import waiting

    loop = LoopWorker(threads=2)
    ran_on: dict[str, object] = {}

    def finished(conn: str, outcome: Future) -> None:
        loop.outcomes[conn] = outcome
        if outcome.exception() is None:
            loop.ended.append((conn, outcome.result()))

    loop.worker.finish_request = finished

    def answered(name: str) -> str:
        ran_on[name] = getcurrent()
        return name

    def failed() -> str:
        ran_on["failed"] = getcurrent()
        raise ValueError("its own")

    for name in ("a", "b"):
        loop.start(name, lambda name=name: answered(name))
    loop.start("failed", failed)
    loop.start("c", lambda: answered("c"))
    assert len(set(ran_on.values())) == 1  # one after another: one greenlet ran them all
    assert [name for name, _ in loop.ended] == ["a", "b", "c"]
    assert isinstance(loop.outcomes["failed"].exception(), ValueError) and loop.outcomes["c"].result() == "c"
    with _waits_on_the_loop(loop, 2) as pairs:  # two at once: two greenlets, each kept for a next request
        for name, (ours, _) in zip(("w1", "w2"), pairs):
            loop.start(name, lambda name=name, ours=ours: (answered(name), waiting.wait_for(ours, select.POLLIN, 5.0)))
        for _, theirs in pairs:
            theirs.sendall(b"x")
        loop.turn_until(lambda: len(loop.ended) == 5)
    assert ran_on["w1"] is ran_on["a"] and ran_on["w2"] is not ran_on["a"]
    loop.start("d", lambda: answered("d"))
    assert ran_on["d"] in (ran_on["w1"], ran_on["w2"]) and loop.worker.loop_running == 0
    assert len(loop.worker._idle) == 2


def test_a_loop_requests_greenlet_beyond_the_threads_kept_idle_is_freed_once_its_request_is_settled() -> None:
    # Before: an idle greenlet's frame held the greenlet itself, and a paused greenlet is never collected as part of
    # a cycle: each one beyond THREADS (requests waiting for their clients to read give up their slots) leaked
    import gc
    import weakref

    from greenlet import getcurrent

    from app.hosting import waiting

    loop = LoopWorker(threads=1)
    ran_on: list[weakref.ref] = []

    def waits_for_its_client(ours: socket.socket) -> bool:
        ran_on.append(weakref.ref(getcurrent()))
        return waiting.wait_for(ours, select.POLLIN, 5.0, for_client=True)

    with _waits_on_the_loop(loop, 3) as pairs:
        for name, (ours, _) in zip("abc", pairs):
            loop.start(name, lambda ours=ours: waits_for_its_client(ours))
        assert loop.worker.loop_running == 0 and len({ref() for ref in ran_on}) == 3  # three at once
        for _, theirs in pairs:
            theirs.sendall(b"x")
        loop.turn_until(lambda: len(loop.ended) == 3)
    gc.collect()
    assert [ref() for ref in ran_on if ref() is not None] == loop.worker._idle  # the one kept, the others freed
    assert len(loop.worker._idle) == 1


def test_a_request_waiting_to_write_its_answer_gives_its_slot_to_the_next() -> None:
    from app.hosting import waiting
    from app.hosting.client_socket import ClientSocket

    loop = LoopWorker(threads=1)
    with _waits_on_the_loop(loop, 2) as pairs:
        writer = ClientSocket(fileno=pairs[0][0].detach())
        writer.answer_timeout_s = 5.0
        loop.start("slow reader", lambda: writer.sendall(os.urandom(4 << 20)))  # its client reads none of it
        loop.start("next", lambda: waiting.wait_for(pairs[1][0], select.POLLIN, 5.0))
        assert not loop.worker.loop_queue and loop.worker.loop_running == 1  # "next" runs: the writer left its slot
        pairs[1][1].sendall(b"x")
        loop.worker.wait_for_and_dispatch_events(1.0)
        assert loop.ended == [("next", True)] and loop.worker.loop_running == 0
        writer.close()


GOOD_HEAD = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"


@pytest.mark.parametrize("sent, status", [
    (GOOD_HEAD, None),
    (b"GET / HTTP/1.1\nHost: x\n\n", 400),  # the request line ends in LF alone
    (b"GET / HTTP/1.1\r\nHost: x\nX: y\r\n\r\n", 400),  # a header line does
    (POST_P + b"Content-Length: 4\r\n\r\n\n\n\n\n", None),  # the body's LFs are the body's
    (b"GET /" + b"a" * 8185 + b" HTTP/1.1\r\n", 414),  # 8195 before its CRLF: over 8190
    (b"GET /" + b"a" * 8186, None),  # 8191 bytes, no CRLF yet: a line of 8190 may still end with one
    (b"GET /" + b"a" * 8187, 414),  # 8192 without one: too long already
    (b"GET /" + b"a" * 8180 + b" H\r\n\r\n", None),  # 8190 exactly
    (b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X: " + b"a" * (64 * 1024) + b"\r\n", 431),  # no end yet, over 64 KiB
    (b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X: " + b"a" * (64 * 1024) + b"\r\n\r\n", 431),  # whole, over 64 KiB
])
def test_the_loop_refuses_a_head_the_parser_would_wait_on_the_same_whichever_way_its_bytes_came(
        sent: bytes, status: int | None) -> None:
    from app.hosting.request_framing import Reading

    worker = _lingering()
    verdicts = []
    for step in (len(sent), 1000, 7, 1):  # at once, then in pieces: each byte looked at once, the same verdict
        reading = Reading(None, time.monotonic() + 10, time.monotonic())
        for at in range(0, len(sent), step):
            reading.take(sent[at:at + step])
            if worker._whole(reading):
                break
        verdicts.append(reading.refusal.status if reading.refusal else None)
    assert verdicts == [status] * 4


def test_the_head_limit_is_the_max_header_bytes_setting() -> None:
    from app.hosting.request_framing import head_refusal

    head = bytearray(b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X: " + b"a" * 20_000 + b"\r\n\r\n")
    end = head.find(b"\r\n\r\n")
    assert head_refusal(head, 0, end, 8190, Settings().max_header_bytes) is None  # 64 KiB by default
    refused = head_refusal(head, 0, end, 8190, 16 * 1024)
    assert refused is not None and refused.status == 431 and "16384 byte limit (MAX_HEADER_BYTES)" in refused.message


def test_a_refusal_is_json_in_the_service_error_shape_and_closes_the_connection() -> None:
    from app.hosting.request_framing import Refusal

    answer = Refusal(431, "Request Header Fields Too Large", "too long").response("r1")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n") and b"Connection: close" in head
    assert json.loads(body) == {"error": {"code": "request_header_fields_too_large", "message": "too long",
                                          "request_id": "r1"}}


def test_a_refusal_s_access_line_has_the_method_and_route_fields_the_app_s_lines_have(
        caplog: pytest.LogCaptureFixture) -> None:
    # Before: a line of the loop's own answers (413, 414, 431, a bare-LF 400) had neither, where the app's have both.
    from app.hosting.request_framing import Refusal

    sent: list[bytes] = []
    with caplog.at_level(logging.INFO, logger="visionserve.access"):
        Refusal(413, "Request Entity Too Large", "too big").tell(
            sent.append, "127.0.0.1", "/predict", b"POST /predict HTTP/1.1\r\nHost: x\r\nX-Request-ID: big-1\r\n")
        Refusal(431, "Request Header Fields Too Large", "too long").tell(sent.append, "127.0.0.1", None, b"GE")
    first, second = caplog.records
    assert (first.method, first.route, first.status, first.request_id) == ("POST", "unparsed", 413, "big-1")
    assert (second.method, second.route, second.status) == (None, "unparsed", 431)  # no request line came whole
    assert len(sent) == 2


def test_empty_lines_before_a_request_are_skipped_and_a_connection_that_sent_only_those_idles() -> None:
    from app.hosting.request_framing import Reading

    class Kept:
        timeout = time.monotonic() + 3  # gthread's keep-alive deadline for the connection

    worker = _lingering()
    worker.alive = True
    reading = Reading(Kept(), time.monotonic() + 60, time.monotonic())
    for piece in (b"\r\n", b"\r", b"\n\r\n"):  # one after a body, then two more, one split
        reading.take(piece)
        assert not worker._whole(reading)
    assert reading.buffer == b"" and reading.refusal is None
    # idle, not a request begun: it ends quietly with its keep-alive, not with a 408 at the header timeout
    assert not worker._expired(reading, Kept.timeout - 0.1) and worker._expired(reading, Kept.timeout + 0.1)
    worker.alive = False  # a stopping worker keeps it no longer than gthread keeps its own idle connections
    assert worker._expired(reading, reading.last_data + 2.1)
    reading.take(b"\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert worker._whole(reading) and reading.buffer == b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    assert not worker._expired(reading, Kept.timeout + 0.1)  # a request begun has its header time


def test_requests_answered_before_the_app_count_in_requests_total_as_unparsed(sockets) -> None:
    # The loop's refusals (a bare LF: 400), its timeouts (408) and the parser's refusals (a request line over its
    # limit: 414) never reached Flask's hooks, so no series counted them.
    import re
    import selectors
    from types import SimpleNamespace

    from gunicorn.http import errors as http_errors
    from prometheus_client import REGISTRY

    from app.hosting.request_framing import Reading

    def counted(status: int) -> float:
        return REGISTRY.get_sample_value("visionserve_requests_total",
                                         {"endpoint": "unparsed", "status": str(status)}) or 0.0

    ours, client = sockets
    worker = _lingering()
    worker.reading, worker.poller, worker.nr_conns = set(), selectors.DefaultSelector(), 2
    conn = SimpleNamespace(sock=ours, client=("127.0.0.1", 1), close=lambda graceful=False: None)
    before = {status: counted(status) for status in (400, 408, 414)}
    refused = Reading(conn, time.monotonic() + 10, time.monotonic())
    refused.take(b"GET /healthz HTTP/1.1\nHost: x\n\n")
    assert worker._whole(refused)
    worker._dispatch(refused)
    stalled = Reading(conn, time.monotonic(), time.monotonic())
    stalled.take(b"POST /predict HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
    worker._time_out(stalled, time.monotonic() + 1)
    worker.handle_error(None, ours, ("127.0.0.1", 1), http_errors.LimitRequestLine(9000, 8190))
    assert {status: counted(status) - count for status, count in before.items()} == {400: 1, 408: 1, 414: 1}
    client.settimeout(5)
    answers = b""
    while answers.count(b"HTTP/1.1 ") < 3:
        answers += client.recv(65536)
    assert re.findall(rb"HTTP/1.1 (\d+) ", answers) == [b"400", b"408", b"414"]  # each told, as before


def test_a_kept_metrics_dir_loses_an_earlier_run_s_files_at_the_master_s_start(tmp_path: Path) -> None:
    # /metrics sums every file in PROMETHEUS_MULTIPROC_DIR: a run that died uncleanly (its container killed) left its
    # processes' files, and the next run read ready 0 while serving, their counters and twice the queue capacity.
    folder, control_dir = tmp_path / "metrics", tmp_path / "control"
    folder.mkdir()
    control_dir.mkdir()
    left = [folder / name for name in ("counter_1234.db", "gauge_livemin_1234.db", "histogram_99.db")]
    kept = [folder / "README", folder / "db", folder / "counter_1234.db.bak"]  # only prometheus-client's files go
    for path in left + kept:
        path.write_bytes(b"x")
    env = {**os.environ, "VISIONSERVE_CONTROL_DIR": str(control_dir), "PROMETHEUS_MULTIPROC_DIR": str(folder),
           "VISIONSERVE_ENGINE": "inline", "VISIONSERVE_DEVICE": "cpu"}
    for master_pid, removed in ((4321, False), (0, True)):  # a USR2's new master: the old one's workers serve on
        _master_starting(env, master_pid)
        assert [path.exists() for path in left + kept] == [not removed] * len(left) + [True] * len(kept)


def _master_starting(env: dict[str, str], master_pid: int = 0) -> str:
    """gunicorn.conf.py's on_starting run in a process of its own with ``env``, as gunicorn's arbiter calls it (a
    master started by another's USR2 has a ``master_pid``); what it logged."""
    import subprocess
    import sys

    start = ("import logging, runpy; from types import SimpleNamespace; c = runpy.run_path('gunicorn.conf.py'); "
             "logging.basicConfig(level=logging.INFO, format='%(message)s'); "
             "c['on_starting'](SimpleNamespace(log=logging.getLogger('master'), reap_workers=lambda: None, "
             f"handle_ttou=lambda: None, stop=lambda graceful=True: None, maybe_promote_master=lambda: None, "
             f"master_pid={master_pid}, "
             "cfg=SimpleNamespace(bind=[], **{k: c[k] for k in ('workers', 'threads', 'worker_connections', "
             "'timeout', 'graceful_timeout', 'keepalive')})))")
    return subprocess.run([sys.executable, "-c", start], cwd=Path(__file__).resolve().parents[2], check=True,
                          capture_output=True, text=True, timeout=60, env=env).stderr


def test_the_master_says_which_of_the_servers_own_variables_were_given_by_hand(tmp_path: Path) -> None:
    # Before: VISIONSERVE_ENGINES=3 or VISIONSERVE_WORKER_SLOT=1 in the environment were overwritten in silence (a trial)
    env = {**os.environ, "VISIONSERVE_CONTROL_DIR": str(tmp_path), "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "m"),
           "VISIONSERVE_ENGINE": "inline", "VISIONSERVE_DEVICE": "cpu", "VISIONSERVE_ENGINES": "3",
           "VISIONSERVE_WORKER_SLOT": "1"}
    assert "visionserve: VISIONSERVE_ENGINES=3, VISIONSERVE_WORKER_SLOT=1: the server sets these itself" in \
        _master_starting(env)
    env["VISIONSERVE_ENGINES"] = "0"  # as a USR2's new master inherits it: the count it makes again, not said
    del env["VISIONSERVE_WORKER_SLOT"]
    assert "the server sets these itself" not in _master_starting(env)


@pytest.mark.parametrize("key", ["", " s3cret\n"])
def test_the_master_says_at_start_whether_requests_need_the_api_key_and_where_it_is_read(tmp_path: Path,
                                                                                         key: str) -> None:
    # Before: nothing in the start's log said whether auth was on (a trial)
    env = {**os.environ, "VISIONSERVE_CONTROL_DIR": str(tmp_path), "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "m"),
           "VISIONSERVE_ENGINE": "inline", "VISIONSERVE_DEVICE": "cpu"}
    env.pop("VISIONSERVE_API_KEY", None)
    if key:
        (tmp_path / "key").write_text(key, encoding="utf-8")
        env["VISIONSERVE_API_KEY_FILE"] = str(tmp_path / "key")
    said = _master_starting(env)
    if key:
        assert f"visionserve: requests need the API key (from the key file {tmp_path / 'key'}); health probes " \
               f"and /metrics are open (AUTH_HEALTH_OPEN)" in said
    else:
        assert "visionserve: no API key: requests are served without one (VISIONSERVE_API_KEY or " \
               "VISIONSERVE_API_KEY_FILE requires one)" in said


class _NoRoom:
    """A listener whose accept fails as one past the open-file limit does (EMFILE)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.tries = sock, 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def setblocking(self, flag: bool) -> None:
        pass

    def accept(self) -> tuple[socket.socket, Any]:
        self.tries += 1
        raise OSError(errno.EMFILE, "Too many open files")


def test_a_worker_out_of_file_descriptors_pauses_accepting_and_goes_on_serving(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Before: accept's EMFILE ended the worker (exit 255), resetting every connection it held, and the backlog did the
    # same to its replacement.
    worker, listener = _listening_worker(tmp_path)
    no_room = _NoRoom(listener)
    worker.sockets = [no_room]
    try:
        worker.set_accept_enabled(True)
        with caplog.at_level(logging.WARNING, logger="test.worker"):
            worker.accept(no_room)  # no exception: the worker lives on
            assert not worker._accepting and not worker.poller.get_map()  # its listener unwatched for a pause
            worker.set_accept_enabled(True)  # gthread's loop asks again at once: still paused
            assert not worker._accepting
            worker.accept_paused_until = time.monotonic()  # the pause is over
            worker.set_accept_enabled(True)
            assert worker._accepting
            worker.accept(no_room)  # out of files again: paused again, said once (a minute apart at most)
            assert not worker._accepting and no_room.tries == 2
        said = [r.getMessage() for r in caplog.records if "cannot accept a connection" in r.getMessage()]
        assert len(said) == 1 and "Too many open files" in said[0]
    finally:
        listener.close()
        worker.poller.close()


def test_a_file_limit_below_max_connections_is_raised_or_else_the_worker_takes_fewer_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Before: MAX_CONNECTIONS (1000 by default) was never checked against RLIMIT_NOFILE (systemd's default soft limit
    # is 1024): idle clients took the worker's last file descriptors, then accept failed with EMFILE.
    import subprocess
    import sys

    from app.hosting import worker as worker_module

    raised = subprocess.run([sys.executable, "-c", (
        "import resource\n"
        "from app.hosting.worker import raise_file_limit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))\n"
        "print(raise_file_limit(100) == (100 if hard == resource.RLIM_INFINITY else hard) >= 100)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 80))\n"
        "print(raise_file_limit(100) == 80, raise_file_limit(50) == 80)\n")], capture_output=True, text=True,
        timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert raised.stdout.split() == ["True", "True", "True"], raised.stderr

    worker, listener = _listening_worker(tmp_path)
    listener.close()
    worker.cfg.set("threads", 4)
    worker.worker_connections, worker.max_keepalived = 1000, 996
    monkeypatch.setattr(worker_module, "raise_file_limit", lambda needed: 200)  # a hard limit of 200
    with caplog.at_level(logging.WARNING, logger="test.worker"):
        worker._fit_connections_to_file_limit()
    own = 4 + worker_module.OWN_FILES
    assert (worker.worker_connections, worker.max_keepalived) == (200 - own, 200 - own - 4)
    assert "it takes 132 connections at once" in caplog.text


def _writing_worker(answer_timeout_s: float = 30.0) -> Any:
    """A BufferingWorker's loop state (no gunicorn arbiter behind it) for the answers it writes."""
    from collections import deque

    from app.hosting.request_framing import ReadLimits

    from app.hosting.worker import BufferingWorker

    worker = BufferingWorker.__new__(BufferingWorker)
    worker.poller, worker.cfg, worker.alive = selectors.DefaultSelector(), Config(), True
    worker.reading, worker.closing, worker.writing = set(), set(), set()
    worker.pending_conns, worker.keepalived_conns, worker.nr_conns = deque(), deque(), 1
    worker.limits = ReadLimits(answer_timeout_s=answer_timeout_s)
    return worker


def _turn(worker: Any, done: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """The worker's loop turned (its events, then its sweep) until ``done``."""
    until = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < until, "the loop did not get there in time"
        for key, _ in worker.poller.select(0.05):
            key.data(key.fileobj)
        worker.murder_pending()


def _client_connection(ours: socket.socket, answer_timeout_s: float) -> tuple[Any, list[socket.socket]]:
    """``ours`` as the worker's connection to a client (ClientConn over a ClientSocket the loop writes for); the
    sockets its graceful close was asked for."""
    from app.hosting.client_socket import ClientConn, ClientSocket

    sock = ClientSocket(ours.family, ours.type, ours.proto, fileno=ours.detach())
    sock.answer_timeout_s, sock.loop_writes = answer_timeout_s, True
    conn = ClientConn(Config(), sock, ("127.0.0.1", 1), ("127.0.0.1", 2))
    closed: list[socket.socket] = []
    conn.closer = lambda sock, _counted: closed.append(sock)
    return conn, closed


def test_a_request_thread_leaves_the_rest_of_an_answer_to_the_loop_which_writes_it_as_the_client_reads(
        sockets) -> None:
    # Before: the thread polled until the client had read it all (CLIENT_ANSWER_TIMEOUT_S at most): THREADS clients
    # that stopped reading held every request thread of an inline worker, and a /healthz waited behind them.
    ours, client = sockets
    worker = _writing_worker()
    conn, closed = _client_connection(ours, 30.0)
    body = os.urandom(4 << 20)  # beyond what the socket's buffers hold
    thread = threading.Thread(target=conn.sock.sendall, args=(body,))
    thread.start()
    thread.join(30)
    assert not thread.is_alive()  # the thread is free while the client has read nothing
    assert 0 < len(conn.sock.unsent) < len(body)
    done: Future = Future()
    done.set_result(False)  # the answer said Connection: close
    worker.finish_request(conn, done)  # on the loop, once the thread is done with the connection
    assert worker.writing and not closed
    reader, received = _reading(client, len(body))
    _turn(worker, lambda: bool(closed))  # written as it reads, then closed as the thread left it
    reader.join(30)
    assert bytes(received) == body and closed == [conn.sock] and worker.nr_conns == 0
    assert not worker.writing and conn.sock.unsent is None
    worker.poller.close()


def test_a_request_thread_holds_an_answer_s_pieces_up_to_a_limit_then_writes_what_it_held_as_the_client_reads(
        sockets, monkeypatch: pytest.MonkeyPatch) -> None:
    from app.hosting import client_socket

    monkeypatch.setattr(client_socket, "HELD_ANSWER_BYTES", 4 << 20)
    ours, client = sockets
    worker = _writing_worker()
    conn, closed = _client_connection(ours, 30.0)
    pieces = [os.urandom(2 << 20), os.urandom(1000), os.urandom(3 << 20)]  # an answer streamed in three pieces
    conn.sock.sendall(pieces[0])  # nobody reads: the socket takes some, the rest is held
    held = len(conn.sock.unsent)
    conn.sock.sendall(pieces[1])  # behind it, held too
    assert 0 < held < len(pieces[0]) and bytes(conn.sock.unsent[held:]) == pieces[1]
    reader, received = _reading(client, sum(map(len, pieces)))
    conn.sock.sendall(pieces[2])  # beyond the limit: what was held, written here as the client reads it, then this
    assert len(conn.sock.unsent or b"") <= len(pieces[2])  # at most this piece's rest is held for the loop
    done: Future = Future()
    done.set_result(False)  # the answer said Connection: close
    worker.finish_request(conn, done)
    _turn(worker, lambda: bool(closed))
    reader.join(30)
    assert bytes(received) == b"".join(pieces) and not worker.writing
    worker.poller.close()


def test_a_client_that_takes_none_of_the_rest_of_its_answer_loses_its_connection_on_the_loop(
        sockets, caplog: pytest.LogCaptureFixture) -> None:
    ours, client = sockets
    worker = _writing_worker()
    conn, closed = _client_connection(ours, 0.2)
    conn.sock.sendall(os.urandom(4 << 20))
    done: Future = Future()
    done.set_result(True)  # kept alive, as far as the thread knew
    with caplog.at_level(logging.INFO, logger="app.hosting.client_socket"):
        worker.finish_request(conn, done)
        _turn(worker, lambda: not worker.writing)
    assert worker.nr_conns == 0 and conn.sock.fileno() == -1 and not closed  # closed at once, not kept alive
    assert "the client took none of its answer for 0.2s" in caplog.text
    worker.poller.close()


def _answered_by_gunicorn(ours: socket.socket, app: Callable[..., Any]) -> tuple[Any, Any, list[bytes]]:
    """A worker whose request threads run gunicorn's own handling of ``app``, its connection on ``ours`` (a
    ClientSocket that notes each send) and that list of sends."""
    from types import SimpleNamespace

    from app.hosting.client_socket import ClientConn, ClientSocket

    sends: list[bytes] = []

    class Noting(ClientSocket):
        def send(self, data: Any, flags: int = 0) -> int:
            sent = super().send(data, flags)
            sends.append(bytes(memoryview(data)[:sent]))
            return sent

    sock = Noting(ours.family, ours.type, ours.proto, fileno=ours.detach())
    sock.loop_writes = True
    worker = _writing_worker()
    quiet = lambda *args, **kwargs: None  # noqa: E731 - gunicorn's logger's calls, unread here
    worker.log = SimpleNamespace(access=quiet, debug=quiet, info=quiet, warning=quiet, exception=quiet)
    worker.wsgi, worker.nr, worker.max_requests, worker.max_keepalived = app, 0, 1000, 100
    return worker, ClientConn(Config(), sock, ("127.0.0.1", 1), ("127.0.0.1", 2)), sends


def _answer_read(client: socket.socket, head_only: bool = False) -> bytes:
    """One HTTP answer as the client reads it: its head, then as many bytes as its Content-Length says (none after
    the head of an answer to HEAD)."""
    client.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        piece = client.recv(1 << 16)
        assert piece, f"the connection closed before the answer's head; read: {data!r}"
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0 if head_only else int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                                           if line.lower().startswith(b"content-length:")), b"0"))
    while len(body) < length:
        piece = client.recv(1 << 16)
        assert piece, "the connection closed before the answer's body"
        body += piece
    return head + b"\r\n\r\n" + body


@pytest.mark.parametrize("request_line, status, body", [
    (b"GET /small", "200 OK", b'{"ok": true}'),  # head and body: one send
    (b"HEAD /small", "200 OK", b'{"ok": true}'),  # a head alone (no body for HEAD): sent once the answer is written
    (b"GET /empty", "204 No Content", b""),
    (b"GET /large", "200 OK", os.urandom(200 * 1024)),  # beyond HEAD_JOINED_BYTES: the head apart, not copied
    (b"GET /broken", None, b""),  # the app fails before it answers: gunicorn's own 500, whole
])
def test_an_answer_s_head_goes_out_with_its_first_piece_of_body_in_one_send(
        sockets, request_line: bytes, status: str | None, body: bytes) -> None:
    from app.hosting.client_socket import HEAD_JOINED_BYTES

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        if status is None:
            raise RuntimeError("broken")
        start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    ours, client = sockets
    worker, conn, sends = _answered_by_gunicorn(ours, app)
    client.sendall(request_line + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    kept_alive = worker._handle_one(conn)
    answer = _answer_read(client, head_only=request_line.startswith(b"HEAD"))
    assert b"".join(sends) == answer  # every byte of it sent, nothing more
    if status is None:  # gunicorn's answer to an error, sent whole, then the connection closes
        assert answer.startswith(b"HTTP/1.1 500 Internal Server Error\r\n") and kept_alive is False
        return
    assert answer.startswith(f"HTTP/1.1 {status}\r\n".encode()) and kept_alive is True
    assert answer.endswith(b"" if request_line.startswith(b"HEAD") else body)
    if len(body) <= HEAD_JOINED_BYTES:
        assert len(sends) == 1  # before: the head in a send of its own, then the body
    else:
        assert sends[0].endswith(b"\r\n\r\n") and len(sends[0]) < 1024  # the head apart: the body is not copied


def test_a_held_head_goes_out_before_gunicorn_closes_a_connection_whose_app_failed_after_it(sockets) -> None:
    # An answer without a body is its head: gunicorn closes the connection when the app fails after writing it
    class ClosingFails(list):
        def close(self) -> None:
            raise RuntimeError("after the answer")

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        start_response("204 No Content", [])
        return ClosingFails()

    ours, client = sockets
    worker, conn, _ = _answered_by_gunicorn(ours, app)
    client.sendall(b"GET /empty HTTP/1.1\r\nHost: x\r\n\r\n")
    client.shutdown(socket.SHUT_WR)  # gunicorn's graceful close reads until the client's end: here at once
    assert worker._handle_one(conn) is False
    assert _answer_read(client).startswith(b"HTTP/1.1 204 No Content\r\n")


def test_an_interim_answer_goes_out_at_once_and_the_final_head_with_its_body(sockets) -> None:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        environ["wsgi.early_hints"]([("Link", "</a.css>; rel=preload; as=style")])
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    ours, client = sockets
    worker, conn, sends = _answered_by_gunicorn(ours, app)
    client.sendall(b"GET /page HTTP/1.1\r\nHost: x\r\n\r\n")
    assert worker._handle_one(conn) is True
    assert [send.split(b"\r\n")[0] for send in sends] == [b"HTTP/1.1 103 Early Hints", b"HTTP/1.1 200 OK"]
    assert sends[1].endswith(b"\r\n\r\nok")


class _Pool:
    """Request threads that only note each connection they are handed (``handed``), running none."""

    def __init__(self) -> None:
        self.handed: list[Any] = []
        self.ran: list[Callable[[Any], Any]] = []  # what each would have run

    def submit(self, handle: Callable[[Any], Any], conn: Any) -> Future:
        self.handed.append(conn)
        self.ran.append(handle)
        return Future()  # never done: nothing settles


def _serving_worker(loop_requests: bool = False, **limits: Any) -> Any:
    """A BufferingWorker's loop reading requests with ``limits`` (ReadLimits' fields), its request threads a
    ``_Pool`` (``worker.tpool.handed``) and, with ``loop_requests`` (ENGINE=process), its loop requests noted in
    ``worker.on_loop``."""
    from greenlet import getcurrent

    from app.hosting.request_framing import ReadLimits

    worker = _writing_worker()
    worker.limits, worker.tpool, worker.log = ReadLimits(**limits), _Pool(), logging.getLogger("test.worker")
    worker.loop_requests, worker.loop_greenlet, worker.on_loop = loop_requests, getcurrent(), []
    worker.run_on_loop = worker.on_loop.append
    return worker


def _read_by_the_loop(worker: Any, client: socket.socket, piece: bytes) -> None:
    """``piece`` sent, then the loop turned until it has read it (or handed the request on, or ended it)."""
    reading = next(iter(worker.reading))
    expected = len(reading.buffer) + len(piece)
    client.sendall(piece)
    _turn(worker, lambda: len(reading.buffer) >= expected or reading not in worker.reading)


@pytest.mark.parametrize("loop_requests", [False, True], ids=["inline", "process"])
def test_a_health_probe_runs_on_the_probes_thread_never_behind_the_requests(sockets, loop_requests: bool) -> None:
    # Before (a load tester's trial): behind 512 clients' requests, /readyz and /healthz took 3-5 s, past the 3 s
    # timeout of the Deployment's probes: a busy pod would be marked unready, and restarted.
    ours, client = sockets
    worker = _serving_worker(loop_requests)
    worker.probes = _Pool()
    conn, _ = _client_connection(ours, 30.0)
    worker._start_reading(conn)
    _read_by_the_loop(worker, client, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert worker.probes.handed == [conn] and not worker.tpool.handed and not worker.on_loop
    # the probe alone: a request that follows it on its connection goes back to the loop, not to the probes' thread
    assert worker.probes.ran == [worker._handle_one]
    for path in (b"/healthz", b"/v2/health/live", b"/v2/health/ready"):
        conn.prefetched = bytearray(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path)
        worker.enqueue_req(conn)
    conn.prefetched = bytearray(b"GET /readyz?verbose=1 HTTP/1.1\r\nHost: x\r\n\r\n")  # anything else: as any request
    worker.enqueue_req(conn)
    assert len(worker.probes.handed) == 4 and len(worker.on_loop if loop_requests else worker.tpool.handed) == 1


@pytest.mark.parametrize("chunked", [False, True], ids=["length", "chunked"])
def test_a_client_that_leaves_while_it_sends_its_body_is_logged_and_counted_as_499(
        sockets, chunked: bool, caplog: pytest.LogCaptureFixture) -> None:
    # Before: the loop that reads bodies closed such a connection saying nothing, where docs/api.md promised a 499
    # in the access log and in visionserve_requests_total (a thread reading the body had said it).
    from prometheus_client import REGISTRY

    def counted() -> float:
        return REGISTRY.get_sample_value("visionserve_requests_total", {"endpoint": "unparsed", "status": "499"}) or 0

    ours, client = sockets
    worker = _serving_worker()
    conn, _ = _client_connection(ours, 30.0)
    worker._start_reading(conn)
    before = counted()
    head = (CHUNKED_HEAD + b"5\r\nhel" if chunked
            else b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nhello")
    _read_by_the_loop(worker, client, head)
    with caplog.at_level(logging.INFO):
        client.close()
        _turn(worker, lambda: not worker.reading)
    assert counted() == before + 1
    (line,) = [r for r in caplog.records if getattr(r, "status", None) == 499]
    assert line.error == "client_closed_request" and "while it sent its body" in line.detail
    worker2, (ours2, client2) = _serving_worker(), socket.socketpair()  # a head cut short: no request began
    conn2, _ = _client_connection(ours2, 30.0)
    worker2._start_reading(conn2)
    _read_by_the_loop(worker2, client2, b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Le")
    client2.close()
    _turn(worker2, lambda: not worker2.reading)
    assert counted() == before + 1


CHUNKED_HEAD = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nTransfer-Encoding: chunked\r\n\r\n"
CHUNKS = [b"5;name=value\r\n", b"hel", b"lo\r\n", b"1", b"0\r\n", b"0123456789abcdef", b"\r\n0\r\nX-Sum: 7\r\n",
          b"\r\n"]  # a chunk extension, a size line split, a trailer
EXPECT_HEAD = (b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nContent-Length: 21\r\n"
               b"Expect: 100-continue\r\n\r\n")


@pytest.mark.parametrize("loop_requests", [False, True], ids=["inline", "process"])
@pytest.mark.parametrize("kind", ["chunked", "expect"])
def test_a_chunked_or_expected_body_arriving_slowly_is_read_by_the_loop_and_handed_on_only_whole(
        sockets, kind: str, loop_requests: bool) -> None:
    # Before: the loop handed a chunked body, or one after Expect: 100-continue, to a request thread as soon as its
    # head was in, and the thread read the body as it trickled in: 40 such clients at one byte a second held all 32
    # threads of an inline worker, and no other request was answered.
    from gunicorn.http import wsgi
    from gunicorn.http.message import Request

    ours, client = sockets
    client.settimeout(5)
    worker = _serving_worker(loop_requests)
    conn, _ = _client_connection(ours, 30.0)
    worker._start_reading(conn)
    pieces = CHUNKS if kind == "chunked" else [b"hel", b"lo", b"0123456789abcdef"]
    _read_by_the_loop(worker, client, CHUNKED_HEAD if kind == "chunked" else EXPECT_HEAD)
    if kind == "expect":
        assert client.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"  # from the loop, which reads the body next
    for piece in pieces[:-1]:
        _read_by_the_loop(worker, client, piece)
        assert not worker.tpool.handed and not worker.on_loop and worker.reading  # no thread while it arrives
    before = time.monotonic()
    _read_by_the_loop(worker, client, pieces[-1] + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # pipelined behind it
    assert (worker.on_loop if loop_requests else worker.tpool.handed) == [conn]  # whole: handed on, once
    assert not (worker.tpool.handed if loop_requests else worker.on_loop) and not worker.reading
    assert conn.body_held and conn.sock.body_held  # the app sets no socket timeout for it: no read will wait
    assert before <= conn.sock.received_at <= time.monotonic()  # its deadline counts from its last piece
    # The parser reads the request the client sent from what the loop held: the body decoded, the chunk extension
    # skipped, the trailer kept; gunicorn asks no 100 Continue again; the pipelined request follows.
    seen: list[tuple[Any, bytes]] = []

    def handle_request(req: Any, _conn: Any) -> bool:
        _, environ = wsgi.create(req, conn.sock, conn.client, conn.server, worker.cfg)
        seen.append((req, environ["wsgi.input"].read()))
        return True

    worker.handle_request = handle_request
    assert worker._handle_one(conn) is True
    (req, body), = seen
    assert (req.path, body) == ("/predict", b"hello0123456789abcdef")
    assert req.trailers == ([("X-SUM", "7")] if kind == "chunked" else [])
    client.setblocking(False)
    with pytest.raises(BlockingIOError):  # nothing was written to the client: no second 100 Continue
        client.recv(100)
    assert type(conn.parser).mesg_class is Request and "mesg_class" not in vars(conn.parser)  # the next: as any
    assert next(conn.parser).path == "/healthz"


@pytest.mark.parametrize("sent, status, says", [
    (b"65\r\n", 413, "the request body is over the 100 byte limit"),  # 101 announced: refused before they come
    (b"40\r\n" + b"a" * 64 + b"\r\n40\r\n", 413, "the request body is over the 100 byte limit"),  # 128 in all
    (b"1;e=" + b"x" * 120 + b"\r\n", 413, "the request body's chunked framing is over the 100 byte limit"),
    (b"zz\r\nhello\r\n", 400, "Invalid chunk size: b'zz'"),
    (b"5\r\nhelloXX", 400, "Invalid chunk terminator is not '\\r\\n': b'XX'"),
    (b"5;\x01\r\n", 400, "Invalid chunk extension"),
    (b"5;a\rb\r\n", 400, "bare CR not allowed"),
    (b"5\n", 400, "a line ends in a bare LF"),
    (b"0\r\nX: 1\nY: 2\r\n", 400, "a line ends in a bare LF"),  # in the trailer section
    (b"1" * 8192, 400, "Invalid chunk size: b'line over 8190 bytes'"),  # no end yet: over the limit already
    (b"0\r\nX: " + b"a" * (64 * 1024), 431, "trailer section is over the 65536 byte limit (MAX_HEADER_BYTES)"),
])
def test_chunked_framing_over_its_limits_or_malformed_is_refused_by_the_loop_at_once_whichever_way_it_came(
        sockets, sent: bytes, status: int, says: str) -> None:
    from app.hosting.request_framing import ReadLimits, Reading

    worker = _lingering()
    worker.limits = ReadLimits(max_body_bytes=100)
    verdicts = []
    for step in (len(sent), 7, 1):  # at once, then in pieces: the same verdict, once the bytes that decide it came
        reading = Reading(None, time.monotonic() + 10, time.monotonic())
        reading.take(CHUNKED_HEAD)
        assert not worker._whole(reading)
        for at in range(0, len(sent), step):
            reading.take(sent[at:at + step])
            if worker._whole(reading):
                break
        verdicts.append(reading.refusal and (reading.refusal.status, reading.refusal.message))
    assert len(set(verdicts)) == 1 and verdicts[0] is not None and verdicts[0][0] == status and says in verdicts[0][1]
    # served: the answer in the service's error shape, the connection closed, no thread taken
    ours, client = sockets
    client.settimeout(5)
    worker = _serving_worker(max_body_bytes=100)
    conn, closed = _client_connection(ours, 30.0)
    worker._start_reading(conn)
    client.sendall(CHUNKED_HEAD + sent)
    _turn(worker, lambda: bool(closed))
    head, _, body = client.recv(65536).partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()) and b"Connection: close" in head
    assert says in json.loads(body)["error"]["message"] and not worker.tpool.handed and not worker.reading


@pytest.mark.parametrize("kind", ["chunked", "expect"])
def test_a_chunked_or_expected_body_that_stalls_is_408_on_the_loop(sockets, kind: str) -> None:
    ours, client = sockets
    client.settimeout(5)
    worker = _serving_worker(body_timeout_s=0.2)
    conn, _ = _client_connection(ours, 30.0)
    worker._start_reading(conn)
    client.sendall(CHUNKED_HEAD + b"5\r\nhe" if kind == "chunked" else EXPECT_HEAD)  # then nothing
    _turn(worker, lambda: not worker.reading)  # the loop's turns: its sweep ends the request that stalled
    answers = b""
    while more := client.recv(65536):  # up to the connection's end
        answers += more
    head, _, body = answers.rpartition(b"HTTP/1.1 408 ")[2].partition(b"\r\n\r\n")
    assert json.loads(body)["error"]["message"] == "no byte of the body came for 0.2s (CLIENT_BODY_TIMEOUT_S)"
    assert answers.startswith(b"HTTP/1.1 100 Continue\r\n\r\n") == (kind == "expect")
    assert not worker.tpool.handed  # no thread taken


@pytest.mark.parametrize("kind", ["length", "chunked"])
def test_a_body_that_drips_below_the_least_rate_is_408_though_never_silent_for_long(sockets, kind: str) -> None:
    # Before (a security review): a byte within each silence's limit held the connection for ever; two thousand such
    # clients took every connection of the server.
    ours, client = sockets
    client.settimeout(5)
    worker = _serving_worker(body_timeout_s=0.3, body_min_rate=200)  # 0.3 s, then a second for each 200 bytes
    conn, _ = _client_connection(ours, 30.0)
    worker._start_reading(conn)
    head = CHUNKED_HEAD + b"1000\r\n" if kind == "chunked" else (
        b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nContent-Length: 4096\r\n\r\n")
    client.sendall(head)
    stop = threading.Event()

    def drip() -> None:  # a byte every 0.1 s: never silent for the 0.3 s limit
        with contextlib.suppress(OSError):
            while not stop.wait(0.1):
                client.send(b"x")

    dripping = threading.Thread(target=drip)
    dripping.start()
    try:
        _turn(worker, lambda: not worker.reading)  # ended by the sweep: about 0.3 + 1 s here
    finally:
        stop.set()
        dripping.join()
    answers = b""
    with contextlib.suppress(OSError):
        while more := client.recv(65536):
            answers += more
    body = answers.rpartition(b"HTTP/1.1 408 ")[2].partition(b"\r\n\r\n")[2]
    assert json.loads(body)["error"]["message"] == "the body came slower than 200 bytes a second (CLIENT_BODY_MIN_RATE)"
    assert not worker.tpool.handed


def test_a_body_announced_over_the_limit_after_expect_100_continue_is_413_with_no_100_first(sockets) -> None:
    # Before: gunicorn's parser said 100 Continue, inviting the whole body, and the app then answered 413.
    ours, client = sockets
    client.settimeout(5)
    worker = _serving_worker(max_body_bytes=100)
    conn, closed = _client_connection(ours, 30.0)
    worker._start_reading(conn)
    client.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nContent-Length: 101\r\n"
                   b"Expect: 100-continue\r\n\r\n")
    _turn(worker, lambda: bool(closed))
    head, _, body = client.recv(65536).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ") and b"Connection: close" in head and b"100 Continue" not in head
    assert json.loads(body)["error"]["message"] == "the request body is over the 100 byte limit"
    assert not worker.tpool.handed and not worker.reading


@pytest.mark.parametrize("address, key", [
    (("203.0.113.7", 51000), "203.0.113.7"),
    (("2001:db8:1:2:aaaa::1", 51000, 0, 0), "2001:db8:1:2:aaaa::1"),  # whole: a /64 is often a network's pods'
    (("fe80::9%eth0", 51000, 0, 2), "fe80::9"),
    (("::ffff:203.0.113.7", 51000, 0, 0), "203.0.113.7"),  # IPv4 on a dual-stack listener
    ("", None), ("/run/visionserve.sock", None),  # a Unix socket's (a local proxy): not counted
])
def test_a_connection_counts_against_its_client_s_ip_address(address: object, key: str | None) -> None:
    from app.hosting.client_socket import client_key

    assert client_key(address) == key


def test_client_counts_let_go_of_a_connection_once_whatever_closes_it() -> None:
    from app.hosting.client_socket import REFUSALS_AWAITED, ClientConn, ClientCounts, Joined

    counts, address = ClientCounts(2), ("198.51.100.1", 1)
    conns = [ClientConn(Config(), socket.socket(), address, ("127.0.0.1", 2)) for _ in range(3 + REFUSALS_AWAITED)]
    try:
        joined = [counts.join(conn, address) for conn in conns]
        assert joined == [Joined.COUNTED] * 2 + [Joined.REFUSED_ON_ITS_LINE] * REFUSALS_AWAITED + [
            Joined.REFUSED_AT_ONCE]
        assert counts.open == {"198.51.100.1": 2} and counts.refusing == {"198.51.100.1": REFUSALS_AWAITED}
        conns[0].close()
        conns[0].close()  # (closed twice: counted off once)
        conns[2].close()  # a refusal answered: another may wait for its line
        assert counts.open == {"198.51.100.1": 1} and counts.refusing == {"198.51.100.1": REFUSALS_AWAITED - 1}
        assert counts.join(conns[-1], address) is Joined.COUNTED and counts.open == {"198.51.100.1": 2}
        assert ClientCounts(0).join(conns[0], address) is Joined.COUNTED  # 0: no limit, nothing counted
    finally:
        for conn in conns:
            conn.sock.close()


def test_one_client_may_hold_at_most_half_of_a_worker_s_connections(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    # Before: MAX_CONNECTIONS_PER_CLIENT (500) protected nothing in a worker taking fewer (MAX_CONNECTIONS lowered,
    # or fitted to a low open-file limit: 60 under `ulimit -n 128`), silently.
    from app.hosting.request_framing import ReadLimits

    worker, listener = _listening_worker(tmp_path)
    try:
        worker.limits = ReadLimits(per_client=500)
        worker.worker_connections = 1000
        assert worker._per_client() == 500
        worker.worker_connections = 60
        with caplog.at_level(logging.WARNING, logger="test.worker"):
            assert worker._per_client() == 30
        assert "one client may hold 30 of them, not MAX_CONNECTIONS_PER_CLIENT=500" in caplog.text
        worker.limits = ReadLimits(per_client=0)
        assert worker._per_client() == 0  # no limit stays none
    finally:
        listener.close()
        worker.poller.close()


def test_the_loop_s_own_answer_carries_the_cors_headers_of_a_listed_origin(sockets) -> None:  # noqa: ANN001
    # Before: a 431, a 408 for a stalled upload, a 413 after Expect: 100-continue had no Access-Control-Allow-Origin:
    # a page on a listed origin saw "Failed to fetch", not the JSON error (a web developer's trial)
    from app.hosting.browser_origins import LOOP_ORIGINS

    ours, client = sockets
    client.settimeout(5)
    worker = _serving_worker(head_limit=8192)
    conn, closed = _client_connection(ours, 30.0)
    LOOP_ORIGINS.configure(frozenset({"https://app.example"}))
    try:
        worker._start_reading(conn)
        client.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nOrigin: https://app.example\r\nX: " + b"a" * 9000)
        _turn(worker, lambda: bool(closed))
    finally:
        LOOP_ORIGINS.configure(frozenset())
    head, _, body = client.recv(65536).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ") and b"\r\nAccess-Control-Allow-Origin: https://app.example\r\n" in head
    assert b"\r\nVary: Origin\r\n" in head and json.loads(body)["error"]["code"] == "request_header_fields_too_large"


@pytest.mark.parametrize("ends", ["client closes", "bodies drained"])
def test_a_lingering_close_counts_as_its_client_s_connection_and_the_worker_s_until_it_ends(
        sockets, ends: str) -> None:  # noqa: ANN001
    # Before: a graceful close left both counts at once, then lingered (up to CLOSE_LINGER_S) holding its file: one
    # client refused again and again held 3,000 files of a worker past MAX_CONNECTIONS_PER_CLIENT (500) and
    # MAX_CONNECTIONS (1000), and its health probes waited seconds (a security review)
    from app.hosting.client_socket import ClientConn, ClientCounts
    from app.hosting.worker import CLOSE_DRAIN_BODIES

    ours, client = sockets
    worker = _serving_worker(max_body_bytes=100)
    worker.poller, worker.closing, worker.nr_conns = selectors.DefaultSelector(), set(), 1
    counts, address = ClientCounts(2), ("198.51.100.1", 1)
    conn = ClientConn(Config(), ours, address, ("127.0.0.1", 2))
    counts.join(conn, address)
    conn.closer = worker.close_gracefully
    worker.nr_conns -= 1  # as the worker's close does, then the connection's own
    conn.close(graceful=True)
    assert worker.nr_conns == 1 and counts.open == {"198.51.100.1": 1} and len(worker.closing) == 1
    if ends == "client closes":
        client.sendall(b"the rest of a body")
        client.shutdown(socket.SHUT_WR)
    else:  # a client that goes on sending: closed once it sent the bodies it could have, not only after the time
        client.sendall(b"x" * (CLOSE_DRAIN_BODIES * 100 + 1))
    _turn(worker, lambda: not worker.closing, timeout_s=3)
    assert worker.nr_conns == 0 and counts.open == {} and ours.fileno() == -1
