"""The Open Inference Protocol (KServe V2) over REST, with Triton's binary tensor and classification extensions."""
from __future__ import annotations

import re
from typing import Any

from app.errors import ALSO_REFUSED, ServiceError
from app.v2 import openapi, repository  # noqa: F401 - repository adds its routes to bp
from app.v2.routes import bp
from app.web.protocol import Protocol


def error_body(error: ServiceError, request_id: str | None) -> dict[str, Any]:
    """The protocol fixes its error body, {"error": "<message>"}, which Triton's clients read: a refusal that names
    later images refused too (its details' ``also_refused``, which this shape has no room for) says each of them in
    its message."""
    later = error.details.get("also_refused") if isinstance(error.details, dict) else None
    if not later:
        return {"error": error.message}
    first = error.message.split(ALSO_REFUSED, 1)[0]
    return {"error": "; ".join([first, *(item["message"] for item in later)])}


# Triton's extensions this server does not serve, by their paths, and what it offers instead
UNSERVED = (
    (re.compile(r"/v2/models(?:/[^/]+(?:/versions/[^/]+)?)?/stats"), "statistics",
     "each version's requests, failures and latencies are Prometheus metrics at GET /metrics"),
    (re.compile(r"/v2(?:/models/[^/]+)?/trace/setting"), "trace", "requests are traced with OpenTelemetry: TRACING"),
    (re.compile(r"/v2/logging"), "logging", "the log level is the LOG_LEVEL setting"),
    (re.compile(r"/v2/(?:system|cuda)sharedmemory(?:/.*)?"), "shared memory",
     "send tensors in the request body (binary_tensor_data)"),
)


def unserved(path: str) -> str | None:
    """Why ``path`` is not found: one of Triton's extensions this server does not serve (GET /v2 lists those it
    does), and what it offers instead; None for any other path."""
    for pattern, extension, instead in UNSERVED:
        if pattern.fullmatch(path):
            return (f"Triton's {extension} extension is not served here (GET /v2 lists the extensions that are); "
                    f"{instead}")
    return None


PROTOCOL = Protocol(blueprint=bp, openapi_paths=openapi.paths, openapi_models=openapi.MODELS, error_body=error_body,
                    unserved=unserved)
