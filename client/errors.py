"""The client's one exception type, carrying what the server said."""
from __future__ import annotations


class VisionServeError(Exception):
    """A request that failed: the HTTP status (None when no answer came), the server's error code and message,
    its request id (quote it when reporting a problem), and Retry-After when the server sent one."""

    def __init__(self, message: str, *, status: int | None = None, code: str = "error",
                 request_id: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.request_id = request_id
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        status = f"HTTP {self.status} " if self.status is not None else ""
        request = f" (request id {self.request_id})" if self.request_id else ""
        return f"{status}{self.code}: {self.message}{request}"
