"""The visionserve API: POST /predict (multipart, raw body, JSON with base64) and GET /v1/models."""
from __future__ import annotations

from app.v1 import openapi
from app.v1.routes import bp
from app.web.protocol import Protocol

PROTOCOL = Protocol(blueprint=bp, openapi_paths=openapi.paths, openapi_models=openapi.MODELS)
