"""The client's exception types, carrying what the server said."""
from __future__ import annotations

from typing import Any


class VisionServeError(Exception):
    """A request that failed: the HTTP status (None when no answer came), the server's error code and message,
    its request id (quote it when reporting a problem), Retry-After when the server sent one, and the error's
    details (for a bad image among several: {"image": its index, "filename": ...})."""

    def __init__(self, message: str, *, status: int | None = None, code: str = "error",
                 request_id: str | None = None, retry_after_s: float | None = None,
                 details: object = None) -> None:
        super().__init__(message)
        self.details = details
        self.message = message
        self.status = status
        self.code = code
        self.request_id = request_id
        self.retry_after_s = retry_after_s

    def __repr__(self) -> str:
        """Its class and everything str() says (a printed list of ``predict_each``'s results shows each error's
        status, code and request id, not its message alone)."""
        return f"{type(self).__name__}({str(self)!r})"

    def __str__(self) -> str:
        status = f"HTTP {self.status} " if self.status is not None else ""
        request = f" (request id {self.request_id})" if self.request_id else ""
        return f"{status}{self.code}: {self.message}{request}"

    @property
    def image_index(self) -> int | None:
        """Which image of a multi-image request the server refused, when it said so."""
        index = self.details.get("image") if isinstance(self.details, dict) else None
        return index if isinstance(index, int) and not isinstance(index, bool) else None

    def to_json(self) -> dict[str, Any]:
        """What a program reading the CLI's --json needs: the status, code, message and request id."""
        return {"status": self.status, "code": self.code, "message": self.message, "request_id": self.request_id}


class UsageError(VisionServeError, ValueError):
    """A call that cannot be made as the client is set up: a URL without http:// or https:// or without a host, an
    API key or client id that cannot go in a header. Raised at once, never retried: no server was asked (so it is
    no "connection_error"), and asking again changes nothing. A ValueError too, for code that checks arguments."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="usage_error")
