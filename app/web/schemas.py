"""Bodies the web layer itself answers with: the default error shape and the health checks."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class ErrorDetail(BaseModel):
    """The body of every error."""

    code: str
    message: str
    request_id: str | None = None
    details: Any = None


class ErrorResponse(BaseModel):
    """Every non-2xx answer outside /v2 has this shape."""

    error: ErrorDetail


class HealthResponse(BaseModel):
    """Answer of /healthz and /readyz."""

    status: str
    checks: dict[str, bool] = Field(default_factory=dict)
    reason: str | None = Field(None, description="Why it fails, where a check cannot say: a batch that has run past "
                               "STALL_S (its model, version and how long); for /readyz also an engine that does not "
                               "answer or is loading, or another worker behind the port that does not serve yet.")
