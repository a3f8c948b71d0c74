"""Optional API key: ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``, compared in constant time."""
from __future__ import annotations

import hmac
from typing import Mapping

from app.errors import Unauthorized

# Probes and scrapers must reach these without a key (unless settings say otherwise).
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/v2/health/live", "/v2/health/ready"})
# The API description and the demo page hold no data, and people need them before they have a key.
DOCS_PATH, OPENAPI_PATH = "/docs", "/openapi.json"
PAGE_PATH, PAGE_ASSETS, FAVICON_PATH = "/", "/demo/", "/favicon.ico"


def is_page(path: str) -> bool:
    """The API description, /docs and the demo page with their files and the site's icon: open, and counted apart
    from traffic."""
    return (path in (OPENAPI_PATH, DOCS_PATH, PAGE_PATH, FAVICON_PATH) or path.startswith(DOCS_PATH + "/")
            or path.startswith(PAGE_ASSETS))


def needs_key(path: str, health_open: bool) -> bool:
    """Whether a request to ``path`` must present the API key (when one is configured)."""
    if is_page(path):
        return False
    return not (health_open and path in OPEN_PATHS)


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
