"""What the client returns: plain dataclasses, so callers get attributes and type hints, not dicts."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ClassScore:
    """One class and its probability."""

    label: str
    index: int
    score: float


@dataclass(frozen=True)
class Prediction:
    """The top class of one image, and the top-k list it heads (best first); the model and version that
    answered (None when the server did not say)."""

    label: str
    index: int
    score: float
    top_k: list[ClassScore]
    model: str | None = None
    version: str | None = None

    @classmethod
    def from_json(cls, body: dict[str, Any], model: str | None = None,
                  version: str | None = None) -> "Prediction":
        """Build from one entry of /predict's ``predictions`` and the answer's ``model`` name and version."""
        return cls(label=body["label"], index=body["index"], score=body["score"],
                   top_k=[ClassScore(**entry) for entry in body["top_k"]], model=model, version=version)


@dataclass(frozen=True)
class Embedding:
    """One image's embedding (the model's pooled features before its classifier, L2-normalised: the dot product of
    two is their cosine similarity), and the model and version that answered."""

    vector: list[float]
    model: str | None = None
    version: str | None = None


@dataclass(frozen=True)
class ModelInfo:
    """The served model, as /v1/models describes it; ``raw`` keeps every field the server sent."""

    name: str
    version: str
    arch: str
    num_classes: int
    input_shape: list[int]
    device: str
    dtype: str
    ready: bool
    labels: list[str] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> "ModelInfo":
        """Build from one entry of /v1/models's ``models``."""
        names = ("name", "version", "arch", "num_classes", "input_shape", "device", "dtype", "ready")
        return cls(**{name: body[name] for name in names}, labels=body.get("labels"), raw=body)
