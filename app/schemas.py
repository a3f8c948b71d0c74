"""Request and response bodies, validated with pydantic."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class PredictJSONRequest(BaseModel):
    """JSON form of POST /predict: base64-encoded image files."""

    model_config = ConfigDict(extra="forbid")

    images: list[str] = Field(min_length=1, description="base64 of each image file (JPEG, PNG, WebP, BMP, GIF)")
    top_k: int | None = Field(default=None, ge=1, description="classes to return per image")


class ClassScore(BaseModel):
    """One class and its softmax probability."""

    label: str
    index: int
    score: float


class Prediction(ClassScore):
    """The top class of one image, and the top-k list it heads."""

    top_k: list[ClassScore]


class ModelRef(BaseModel):
    """Which model answered."""

    model_config = ConfigDict(protected_namespaces=())

    name: str
    version: str


class PredictResponse(BaseModel):
    """Answer of POST /predict: one prediction per posted image, in order."""

    model: ModelRef
    predictions: list[Prediction]


class ErrorDetail(BaseModel):
    """The body of every error."""

    code: str
    message: str
    request_id: str | None = None
    details: Any = None


class ErrorResponse(BaseModel):
    """Every non-2xx answer has this shape."""

    error: ErrorDetail


class HealthResponse(BaseModel):
    """Answer of /healthz and /readyz."""

    status: str
    checks: dict[str, bool] = Field(default_factory=dict)
