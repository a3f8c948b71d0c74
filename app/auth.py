"""Optional API key: ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``, compared in constant time."""
from __future__ import annotations

import hmac
from typing import Mapping

from app.errors import Unauthorized

# Probes and scrapers must reach these without a key (unless settings say otherwise).
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/v2/health/live", "/v2/health/ready"})


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a request carries, from either header."""
    authorization = headers.get("Authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("X-API-Key") or None


def check_api_key(headers: Mapping[str, str], expected: str) -> None:
    """Raise Unauthorized unless the request carries ``expected``."""
    key = presented_key(headers)
    # compare_digest takes the same time whatever the first differing byte, so timing leaks nothing.
    if key is None or not hmac.compare_digest(key.encode(), expected.encode()):
        raise Unauthorized("a valid API key is required (Authorization: Bearer <key> or X-API-Key)",
                           headers={"WWW-Authenticate": 'Bearer realm="visionserve"'})
