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


@dataclass(frozen=True)
class Explanation:
    """Why the model chooses a class for one image (``/explain``: Grad-CAM): the class and its probability for the
    image (the ones ``predict`` answers), the map (``grid``: rows of 0, no evidence for the class, to 1, the most)
    over the region of the photo the model saw (``crop``: left, top, right, bottom in the photo's pixels), the layer
    and the weights it was taken of; the model and version that answered."""

    label: str
    index: int
    score: float
    grid: list[list[float]]
    crop: tuple[int, int, int, int]
    layer: str
    weights: str
    model: str | None = None
    version: str | None = None

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> "Explanation":
        """Build from /explain's JSON answer."""
        explained, crop, served = body["explained"], body["crop"], body.get("model") or {}
        return cls(label=explained["label"], index=explained["index"], score=explained["score"],
                   grid=body["grid"], crop=(crop["left"], crop["top"], crop["right"], crop["bottom"]),
                   layer=body["layer"], weights=body["weights"], model=served.get("name"),
                   version=served.get("version"))


@dataclass(frozen=True)
class Overlay:
    """An explanation drawn: the map over the region of the photo the model saw, a PNG (``png``, the file's bytes),
    with the class it explains and its probability, and the version that answered."""

    png: bytes = field(repr=False)
    label: str
    index: int
    score: float
    version: str | None = None
