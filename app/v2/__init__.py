"""The Open Inference Protocol (KServe V2) over REST, with Triton's binary tensor and classification extensions."""
from __future__ import annotations

from typing import Any

from app.errors import ServiceError
from app.v2 import openapi, repository  # noqa: F401 - repository adds its routes to bp
from app.v2.routes import bp
from app.web.protocol import Protocol


def error_body(error: ServiceError, request_id: str | None) -> dict[str, Any]:
    """The protocol fixes its error body, {"error": "<message>"}, which Triton's clients read."""
    return {"error": error.message}


PROTOCOL = Protocol(blueprint=bp, openapi_paths=openapi.paths, openapi_models=openapi.MODELS, error_body=error_body)
