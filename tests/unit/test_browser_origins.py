"""The CORS headers the app's hook and the worker loop's own answers say alike (app/hosting/browser_origins.py)."""
from __future__ import annotations

import pytest

from app.hosting.browser_origins import EXPOSED, BrowserOrigins, parse_origins

HEAD = b"POST /predict HTTP/1.1\r\nHost: x\r\n%s\r\nContent-Length: 9\r\n\r\n"


@pytest.mark.parametrize("listed, origin_lines, expected", [
    ("https://app.example", b"Origin: https://app.example", {"Access-Control-Allow-Origin": "https://app.example",
                                                             "Access-Control-Expose-Headers": EXPOSED,
                                                             "Vary": "origin"}),
    ("*", b"origin:  https://any.example ", {"Access-Control-Allow-Origin": "*",
                                             "Access-Control-Expose-Headers": EXPOSED, "Vary": "origin"}),
    ("https://app.example", b"Origin: https://evil.example", {"Vary": "origin"}),  # not listed: no allowance
    ("https://app.example", b"X-Origin: https://app.example", {"Vary": "origin"}),  # no Origin field
    ("https://app.example", b"Origin: https://app.example\r\nOrigin: https://app.example", {"Vary": "origin"}),  # two
    ("", b"Origin: https://app.example", {}),  # CORS off: nothing at all
])
def test_the_loop_s_answer_says_what_the_app_s_would_for_the_origin_its_head_names(
        listed: str, origin_lines: bytes, expected: dict[str, str]) -> None:
    lines = BrowserOrigins(parse_origins(listed)).header_lines(HEAD % origin_lines)
    said = dict(line.split(": ", 1) for line in lines.decode().split("\r\n") if line)
    assert {name: value.lower() if name == "Vary" else value for name, value in said.items()} == expected


def test_an_origin_line_not_ended_yet_is_not_read() -> None:
    origins = BrowserOrigins(parse_origins("https://app.example"))
    assert origins.header_lines(b"POST /predict HTTP/1.1\r\nOrigin: https://app.exa") == b"Vary: Origin\r\n"
    assert b"Allow-Origin" in origins.header_lines(b"POST /predict HTTP/1.1\r\nOrigin: https://app.example\r\n")
