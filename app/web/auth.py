"""Optional API key: ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``, compared in constant time.

A key need not be ASCII: it matches when the bytes a client sent are the key in UTF-8 (curl, the demo page) or, for
a key of characters up to U+00FF, in latin-1 (what Python's http.client and a browser's fetch send for such text).
A WSGI server hands a header over as its bytes read as latin-1 (PEP 3333; gunicorn too), so those bytes are the
header's text encoded as latin-1 again.
"""
from __future__ import annotations

import functools
import hmac
import ipaddress
import re
import socket
from typing import Callable, Mapping, TypeVar

from flask import request

from app.errors import Forbidden, Unauthorized
from app.web.services import current_service

# Probes and scrapers must reach these without a key (unless settings say otherwise): the V2 health API's
# model readiness too (the Open Inference Protocol's health endpoints; tritonclient's is_model_ready said False,
# not unauthorized, without a key)
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/v2/health/live", "/v2/health/ready"})
_MODEL_READY = re.compile(r"/v2/models/[^/]+(?:/versions/[^/]+)?/ready")


def is_health(path: str) -> bool:
    """A health probe or a scrape: open when AUTH_HEALTH_OPEN (OPEN_PATHS, and a model's or version's V2
    readiness; a route's template as well as a request's path)."""
    return path in OPEN_PATHS or _MODEL_READY.fullmatch(path) is not None

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
    return not (health_open and is_health(path))


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a request carries, from either header (as the server hands it over: its bytes read as latin-1)."""
    authorization = headers.get("Authorization", "")
    scheme, _, token = authorization.partition(" ")
    token = token.strip(" \t")  # HTTP's whitespace only: str.strip() would also cut U+0085 and U+00A0, bytes of UTF-8
    if scheme.lower() == "bearer" and token:
        return token
    return headers.get("X-API-Key") or None


def key_forms(expected: str) -> tuple[bytes, bytes]:
    """The bytes a client may send for ``expected``: its UTF-8 and its latin-1 (the UTF-8 again where it has
    characters past U+00FF)."""
    utf8 = expected.encode()
    try:
        return utf8, expected.encode("latin-1")
    except UnicodeEncodeError:
        return utf8, utf8


def _sent_bytes(key: str) -> bytes | None:
    """The bytes the client sent; None for text no server hands over (a character past U+00FF)."""
    try:
        return key.encode("latin-1")
    except UnicodeEncodeError:
        return None


def carries_key(headers: Mapping[str, str], forms: tuple[bytes, bytes]) -> bool:
    """Whether the request carries the key, in one of its ``forms`` (``key_forms``)."""
    key = presented_key(headers)
    sent = _sent_bytes(key) if key is not None else None
    # compare_digest takes the same time whatever the first differing byte, so timing leaks nothing; both forms are
    # compared, always.
    return sent is not None and (hmac.compare_digest(sent, forms[0]) | hmac.compare_digest(sent, forms[1]))


def check_api_key(headers: Mapping[str, str], forms: tuple[bytes, bytes]) -> None:
    """Raise Unauthorized unless the request carries the key, in one of its ``forms`` (``key_forms``)."""
    if not carries_key(headers, forms):
        raise Unauthorized("a valid API key is required (Authorization: Bearer <key> or X-API-Key)",
                           headers={"WWW-Authenticate": 'Bearer realm="visionserve"'})


# What a proxy adds to a request it forwards: one that carries any is no local client's, whatever its peer address
PROXY_HEADERS = ("X-Forwarded-For", "X-Real-IP", "Forwarded")
# What a browser adds to a request a page makes (a page of any site, or one reached by DNS rebinding, may POST to a
# loopback address without a CORS preflight): one that carries any is a page's, not the machine's operator's
BROWSER_HEADERS = ("Origin", "Sec-Fetch-Site")
_CONTROL_OFF = ("model changes by call are off on this server (VISIONSERVE_CONTROL_API=off): models change as the "
                "repository does")
_CONTROL_LOCAL = ("the control API answers clients on this machine alone, not a web page's requests "
                  "(VISIONSERVE_CONTROL_API=local, the default){why}: call it there (a container's: docker compose "
                  "exec api curl ..., api-cpu under the cpu profile; kubectl exec or port-forward), or set "
                  "VISIONSERVE_CONTROL_API=open with VISIONSERVE_API_KEY, so that the key guards it")


def is_local(peer: str | None, unix_socket: bool = False) -> bool:
    """Whether a connection's peer address is this machine's: a loopback address (IPv4, IPv6, or IPv4 mapped into
    IPv6), or none on a Unix socket (a peer without an address elsewhere, as a PROXY protocol header of type LOCAL
    leaves it, is not)."""
    if not peer:
        return unix_socket
    try:
        address = ipaddress.ip_address(peer.partition("%")[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def control_refusal(mode: str, peer: str | None, headers: Mapping[str, str],
                    unix_socket: bool = False) -> Forbidden | None:
    """Why a control call (load, unload, promote, rollback) from ``peer`` (on a Unix socket: ``unix_socket``) with
    ``headers`` is refused under CONTROL_API ``mode``, or None when it may be made."""
    if mode == "open":
        return None
    if mode == "off":
        return Forbidden(_CONTROL_OFF)
    forwarded = next((name for name in PROXY_HEADERS if name in headers), None)
    if forwarded is not None:
        return Forbidden(_CONTROL_LOCAL.format(why=f", and this one came through a proxy (it carries {forwarded})"))
    page = next((name for name in BROWSER_HEADERS if name in headers), None)
    if page is not None:
        return Forbidden(_CONTROL_LOCAL.format(why=f", and this one came from a browser (it carries {page})"))
    if not is_local(peer, unix_socket):
        return Forbidden(_CONTROL_LOCAL.format(why=f", and this one came from {peer or 'no address'}"))
    return None


View = TypeVar("View", bound=Callable[..., object])


def control_call(view: View) -> View:
    """A route that changes what is served: CONTROL_API says who may call it (after the API key, when one is set)."""
    @functools.wraps(view)
    def checked(*args: object, **kwargs: object) -> object:
        sock = request.environ.get("gunicorn.socket")
        refusal = control_refusal(current_service().settings.control_api, request.remote_addr, request.headers,
                                  getattr(sock, "family", None) == socket.AF_UNIX)
        if refusal is not None:
            raise refusal
        return view(*args, **kwargs)

    return checked  # type: ignore[return-value]
