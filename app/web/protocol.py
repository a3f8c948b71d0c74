"""What a protocol package hands the web layer: its routes, its part of the OpenAPI document, its error shape."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from flask import Blueprint
from pydantic import BaseModel

from app.errors import ServiceError

# (error, request id) -> the JSON body of an error answer.
ErrorBody = Callable[[ServiceError, "str | None"], dict[str, Any]]


@dataclass(frozen=True)
class Protocol:
    """One API on top of the engine. ``error_body`` None: the default error shape (app/web/errors.py)."""

    blueprint: Blueprint
    openapi_paths: Callable[[], dict[str, Any]]
    openapi_models: Sequence[type[BaseModel]] = field(default_factory=tuple)
    error_body: ErrorBody | None = None
    # path -> why a 404 or 405 there is no typo: a part of the protocol (or of one it shares its paths with) this
    # server does not serve, and what to use instead; its answer is then a 404 saying so
    unserved: Callable[[str], "str | None"] | None = None

    def owns(self, path: str) -> bool:
        """Whether ``path`` is under this protocol's URL prefix (for requests no route matched)."""
        prefix = self.blueprint.url_prefix
        return bool(prefix) and (path == prefix or path.startswith(prefix.rstrip("/") + "/"))
