"""The visionserve API: POST /predict (multipart, raw body, JSON with base64) and GET /v1/models."""
from __future__ import annotations

import re

from app.v1 import openapi
from app.v1.routes import bp
from app.web.protocol import Protocol

# KServe's V1 protocol shares this prefix: its verbs follow a model's name after a colon
KSERVE_V1 = re.compile(r"/v1/models/([^/]+):(?:predict|explain)")


def unserved(path: str) -> str | None:
    """Why ``path`` is not served: KServe's V1 protocol (``/v1/models/<name>:predict``), with what to call instead;
    None for any other path."""
    kserve = KSERVE_V1.fullmatch(path)
    if kserve is None:
        return None
    return (f"KServe's V1 protocol is not served here: POST /v2/models/{kserve.group(1)}/infer (the Open Inference "
            "Protocol, KServe V2) or POST /predict (docs/api.md)")


PROTOCOL = Protocol(blueprint=bp, openapi_paths=openapi.paths, openapi_models=openapi.MODELS, unserved=unserved)
