"""An answer that says ``Connection: close`` really closes its connection, under gunicorn too.

gunicorn drops the hop-by-hop headers an application sets and decides keep-alive itself, so an app's
``Connection: close`` (after a body it did not read: too large, or too slow) would be silently ignored, and the
unread rest of the body would stay on a kept-alive connection. Its ``start_response`` is a bound method of its
response object, whose ``force_close()`` makes it send ``Connection: close`` and close the socket afterwards.
Other servers (werkzeug's, the test client) pass the header on as it is.
"""
from __future__ import annotations

from typing import Any, Iterable

from app.hosting.starting import StartResponse, WSGIApp, force_close


def _asks_to_close(headers: list[tuple[str, str]]) -> bool:
    return any(name.lower() == "connection" and value.strip().lower() == "close" for name, value in headers)


class CloseWhenAsked:
    """WSGI middleware around the Flask app (see the module docstring)."""

    def __init__(self, app: WSGIApp) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        """Run the app; force the server to close when its answer asks for it."""
        def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            if _asks_to_close(headers):
                force_close(start_response)
            return start_response(status, headers, exc_info)

        return self.app(environ, start)
