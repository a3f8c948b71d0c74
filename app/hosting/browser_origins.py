"""Which browser origins may read the answers (``CORS_ORIGINS``), and the CORS headers an answer to one of them
carries: said alike by the app's hook (app/web/cors.py) and by the answers the worker's loop gives itself before the
app (request_framing.py's Refusal: a 408 for a stalled upload, a 431, a 413 after ``Expect: 100-continue``), so a
page on a listed origin reads those errors as it reads the app's, not as a failed fetch (standard library only).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# What a browser's script may read of an answer: the timings, the request id, the retry hint, an explanation's class
# (the PNG's headers), the version that answered it, and a binary V2 answer's framing.
EXPOSED = ("Server-Timing, X-Request-ID, X-Batch-Size, Retry-After, X-Explained-Class, X-Explained-Index, "
           "X-Explained-Score, X-Model-Version, Inference-Header-Content-Length")
_ORIGIN_FIELD = re.compile(rb"\r\nOrigin:[ \t]*([^\r\n]*?)[ \t]*(?=\r\n)", re.IGNORECASE)


def parse_origins(setting: str) -> frozenset[str]:
    """``https://a.example, https://b.example`` or ``*``; empty means off."""
    return frozenset(origin.strip().rstrip("/") for origin in setting.split(",") if origin.strip())


@dataclass
class BrowserOrigins:
    """The origins ``CORS_ORIGINS`` lists (``*``: every one); none: CORS off, no CORS header at all."""
    origins: frozenset[str] = frozenset()

    def configure(self, origins: frozenset[str]) -> None:
        self.origins = origins

    def allows(self, origin: str | None) -> bool:
        return origin is not None and ("*" in self.origins or origin in self.origins)

    def headers(self, origin: str | None) -> dict[str, str]:
        """The headers an answer to a request from ``origin`` carries: its allowance and what the page may read
        where the origin is listed, ``Vary: Origin`` whenever CORS is on (the answer depends on it); none when off."""
        if not self.origins:
            return {}
        if not self.allows(origin):
            return {"Vary": "Origin"}
        return {"Access-Control-Allow-Origin": "*" if "*" in self.origins else str(origin),
                "Access-Control-Expose-Headers": EXPOSED, "Vary": "Origin"}

    def header_lines(self, head: bytes | bytearray) -> bytes:
        """``headers`` for the request whose head (or as much of it as came: a field whose line has not ended is not
        read) is ``head``, as lines of an answer's head; one Origin field only (two: none)."""
        if not self.origins:
            return b""
        end = head.find(b"\r\n\r\n")
        found = _ORIGIN_FIELD.findall(head, 0, len(head) if end < 0 else end + 4)
        origin = found[0].decode("latin-1") if len(found) == 1 else None
        return b"".join(f"{name}: {value}\r\n".encode("latin-1") for name, value in self.headers(origin).items())


# This worker's, configured by the app it serves (app/web/cors.py's register_cors, from its settings); what the loop's
# own answers say. Off until then (the starting app's answers).
LOOP_ORIGINS = BrowserOrigins()
