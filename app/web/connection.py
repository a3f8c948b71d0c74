"""An answer that says ``Connection: close`` really closes its connection, under gunicorn too; and an answer that
leaves a streamed body unread says it.

gunicorn drops the hop-by-hop headers an application sets and decides keep-alive itself, so an app's
``Connection: close`` (after a body it did not read: too large, or too slow) would be silently ignored, and the
unread rest of the body would stay on a kept-alive connection. Its ``start_response`` is a bound method of its
response object, whose ``force_close()`` makes it send ``Connection: close`` and close the socket afterwards.
Other servers (werkzeug's, the test client) pass the header on as it is.

An answer after which the connection stays open says for how long an idle connection is kept
(``Keep-Alive: timeout=KEEPALIVE_S``, which gunicorn never sends): a client that reuses a connection the server is
closing at that moment sees a reset (ECONNRESET, "connection aborted") on a request that never reached the app;
told the timeout, Node's agent and other clients that read the hint stop reusing a connection before the server
ends it.

A body the worker's event loop held whole is skipped in memory whatever the app left of it
(app/hosting/request_framing.py).
One that arrives streamed (chunked, or sent after gunicorn's ``100 Continue``) is still on the socket: gunicorn
skips at most 64 KiB of it before the next request and otherwise closes the connection after an answer that said
keep-alive, so the client's next request on it was reset. An answer that starts before such a body was read to its
end (a refusal: 503 while the engine restarts, 404, 401) says ``Connection: close`` instead. So does every answer of
a worker that drains (app/hosting/drain.py): it still answers, and its clients reconnect to one that stays.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from app.hosting.starting import StartResponse, WSGIApp, force_close


def _asks_to_close(headers: list[tuple[str, str]]) -> bool:
    return any(name.lower() == "connection" and value.strip().lower() == "close" for name, value in headers)


def _streamed(environ: dict[str, Any]) -> bool:
    """The body arrives after the headers were handed over: chunked, or once gunicorn said ``100 Continue``."""
    return ("chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower()
            or environ.get("HTTP_EXPECT", "").strip().lower() == "100-continue")


def say_kept_alive(start_response: StartResponse) -> None:
    """Add ``Keep-Alive: timeout=N`` to an answer gunicorn keeps its connection open after (its ``keepalive``
    setting, KEEPALIVE_S; it drops the app's own hop-by-hop headers, so the header goes on its response's list
    after ``start_response``). Other servers, and answers that close: nothing."""
    response = getattr(start_response, "__self__", None)
    seconds = getattr(getattr(response, "cfg", None), "keepalive", 0)
    if not isinstance(seconds, int) or seconds <= 0 or response.should_close():  # type: ignore[union-attr]
        return
    said = response.headers  # type: ignore[union-attr]
    if not any(name == "Keep-Alive" for name, _ in said):  # (a second start_response, with exc_info, adds to it)
        said.append(("Keep-Alive", f"timeout={seconds}"))


def left_unread(environ: dict[str, Any]) -> bool:
    """A streamed body that gunicorn's reader has not handed out to its end (other servers' bodies: False)."""
    body = environ.get("wsgi.input")
    reader = getattr(body, "reader", None)
    if reader is None or not _streamed(environ):
        return False
    if hasattr(reader, "length"):  # a Content-Length body: what it has not read yet
        finished = reader.length == 0
    else:  # chunked: its parser ends with the last chunk
        finished = getattr(reader, "parser", True) is None
    return not finished or body.buf.tell() > 0


class CloseWhenAsked:
    """WSGI middleware around the Flask app (see the module docstring); ``draining``: whether the worker drains, when
    every answer closes its connection (the client's next request goes to a worker that stays)."""

    def __init__(self, app: WSGIApp, draining: Callable[[], bool] = lambda: False) -> None:
        self.app, self.draining = app, draining

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        """Run the app; force the server to close when its answer asks for it, leaves a streamed body unread, or
        the worker drains; else say how long the connection stays open idle."""
        def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            close = _asks_to_close(headers)
            if not close and (left_unread(environ) or self.draining()):
                headers, close = [*headers, ("Connection", "close")], True
            if close:
                force_close(start_response)
            write = start_response(status, headers, exc_info)
            if not close:
                say_kept_alive(start_response)
            return write

        return self.app(environ, start)
