"""/predict and /v1/models request and response bodies, validated with pydantic."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, WithJsonSchema, field_validator

from models.export.manifest import EmbeddingOutput, EvalPreset


class PredictJSONRequest(BaseModel):
    """JSON form of POST /predict: base64-encoded image files."""

    model_config = ConfigDict(extra="forbid")
    # a field another request form has, and what to send here instead (the 422 says it)
    MISPLACED: ClassVar[dict[str, str]] = {"image": "/predict takes a list: 'images'",
                                           "topk": "the field is 'top_k'", "model": "model is a query parameter",
                                           "version": "version is a query parameter"}

    images: list[str] = Field(min_length=1, description="base64 of each image file (JPEG, PNG, WebP, BMP, GIF)")
    top_k: StrictInt | None = Field(default=None, ge=1, description="classes to return per image (an integer, not "
                                    "a boolean, a string or 2.0, as the V2 protocol's numbers)")
    outputs: list[str] | str | None = Field(default=None, description="what to answer per image: labels (the top "
                                            "k, the default) and/or embedding, as a list or comma-separated")


class ExplainJSONRequest(BaseModel):
    """JSON form of POST /explain: one base64-encoded image file, and the class to explain."""

    model_config = ConfigDict(extra="forbid")
    MISPLACED: ClassVar[dict[str, str]] = {"images": "an explanation is of one image: 'image'",
                                           "model": "model is a query parameter",
                                           "version": "version is a query parameter"}

    image: str = Field(description="base64 of the image file (JPEG, PNG, WebP, BMP, GIF)")
    class_index: StrictInt | None = Field(default=None, ge=0, description="the class to explain (an integer, "
                                          "not a boolean or a string); left out (and no label): the top one")
    label: str | None = Field(default=None, description="the class to explain, by its label")
    format: str | None = Field(default=None, description="json (the default: the map and its class) or png (the "
                               "overlay); as in the query and the form")


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
    """Answer of POST /predict: one prediction per posted image, in order, and each image's embedding when asked
    for (``outputs=labels,embedding``; ``outputs=embedding`` answers the embeddings alone)."""

    model: ModelRef
    predictions: list[Prediction] | None = Field(default=None, description="each image's top k (left out when "
                                                 "outputs does not name labels)")
    embeddings: list[list[float]] | None = Field(default=None, description="each image's embedding: the model's "
                                                 "pooled features before its classifier, L2-normalised (the dot "
                                                 "product of two is their cosine similarity); only when outputs "
                                                 "names embedding")


class Crop(BaseModel):
    """The region of the photo (in its upright pixels) the model saw: what the grid covers."""

    left: int
    top: int
    right: int
    bottom: int


class ExplainResponse(BaseModel):
    """Answer of POST /explain: why the model chose (or would choose) a class for the image."""

    model: ModelRef
    explained: ClassScore = Field(description="the class explained, and its probability for this image")
    method: str = Field(description="grad-cam: the chosen class's gradient-weighted last feature map")
    layer: str = Field(description="the layer whose feature map it is")
    weights: str = Field(description="the weights the gradients were taken of: the version's state dict (the "
                         "served format when it has none: ONNX, AOTInductor, int8, TorchScript)")
    grid: list[list[float]] = Field(description="the map, row by row over the crop: 0 (no evidence for the class) "
                                    "to 1 (the most)")
    crop: Crop
    explain_ms: float = Field(description="decode, forward and backward pass and map, in the explanation lane")


class Batching(BaseModel):
    """The batcher's settings and its state now."""

    max_batch_size: int = Field(description="the ceiling: MAX_BATCH_SIZE, or its automatic value for the device")
    batch_cap: int = Field(description="the cap in force: measured at warm-up when auto_batch_size is on")
    max_wait_ms: float
    current_max_batch_size: int = Field(description="lower than batch_cap for a while after a GPU OOM")
    profile: dict[int, float] = Field(description="forward-pass images/s per batch size, measured at warm-up")
    queue_size: int
    queue_depth: int


class Limits(BaseModel):
    """The request limits in force."""

    max_body_bytes: int
    max_pixels: int
    max_images: int
    max_aspect_ratio: float
    default_top_k: int
    request_timeout_s: float


class ClassCount(BaseModel):
    """A class the monitoring window's predictions name, how often, and its share of the window."""

    model_config = ConfigDict(from_attributes=True)  # built from the engine's snapshot (dataclasses)

    label: str
    index: int
    count: int
    share: float


class MonitoringReference(BaseModel):
    """What the drift figure compares the window with."""

    model_config = ConfigDict(from_attributes=True)  # built from the engine's snapshot (dataclasses)

    source: str = Field(description="validation: the validation split's predictions, measured at export (the "
                        "manifest's reference); first_predictions: this worker's first MONITOR_WINDOW predictions "
                        "after the load (the manifest has none: the packaged Lite0, older exports; or one of fewer "
                        "than MONITOR_MIN_PREDICTIONS predictions)")
    predictions: int = Field(description="predictions it holds (first_predictions, while collecting: so far)")
    complete: bool
    low_confidence_threshold: float
    low_confidence_share: float | None = Field(default=None, description="its share below the threshold")


class Monitoring(BaseModel):
    """This worker's monitor of the version's predictions for requests (warm-up and the canary excluded)."""

    model_config = ConfigDict(from_attributes=True)  # built from the engine's snapshot (dataclasses)

    window_size: int = Field(description="the most predictions the window holds (MONITOR_WINDOW)")
    predictions: int = Field(description="predictions in the window now")
    predictions_total: int = Field(description="predictions for requests since the load")
    psi: float | None = Field(default=None, description="population stability index of the window's top-1 class "
                              "mix against the reference: < 0.1 stable, 0.1-0.2 watch, > 0.2 drifted; absent until "
                              "the reference is complete and the window holds MONITOR_MIN_PREDICTIONS")
    psi_bins: int = Field(description="bins of the class mix (one per class, or the reference's most frequent "
                          "classes and one for the rest)")
    low_confidence_threshold: float
    low_confidence_ratio: float | None = Field(default=None, description="the window's share of predictions below "
                                               "the threshold; absent below MONITOR_MIN_PREDICTIONS")
    top_classes: list[ClassCount] = Field(description="the window's most predicted classes")
    reference: MonitoringReference


class ModelInfo(BaseModel):
    """The served model: identity, input, device, metrics from training, batching and limits."""

    model_config = ConfigDict(protected_namespaces=())

    name: str
    version: str
    arch: str
    num_classes: int
    input_shape: list[int] = Field(description="(C, H, W) of one preprocessed image")
    preprocess: EvalPreset
    format: str = Field(description="torchscript, state_dict, aoti (an AOTInductor package) or int8 (an int8 one)")
    device: str
    dtype: str
    memory_format: Literal["contiguous", "channels_last"] = Field(
        description="the layout of its weights and batches in the forward pass (MEMORY_FORMAT, where its weights "
        "took it)")
    files: dict[str, str] = Field(description="sha256 of each weights file: by format, `onnx`, and each compiled "
                                  "package by its file name")
    metrics: dict[str, float]
    source: str
    embedding: EmbeddingOutput | None = Field(default=None, description="what its embedding output is (outputs="
                                              "embedding); null: exported without one")
    warmed_batch_sizes: list[int]
    labels: list[str] | None = Field(default=None, description="only with ?labels=1")
    batching: Batching
    limits: Limits
    ready: bool
    default: bool = Field(description="requests naming no version get this one")
    state: str = Field(description="READY while it takes traffic")
    role: str | None = Field(default=None, description="its part in its model's rollout: live (the default), canary "
                             "or shadow (the candidate), previous (kept loaded for a rollback); null: none")
    memory_bytes: int = Field(description="its weights in the served dtype")
    device_memory_bytes: int | None = Field(default=None, description="CUDA memory its load and warm-up took")
    monitoring: Monitoring = Field(description="its predictions' class mix, drift and confidence (this worker's)")


class WorkerModels(BaseModel):
    """What one worker of the server serves: while a load spreads over the workers, they may differ."""

    pid: int
    generation: int = Field(description="the last repository load or unload this worker applied")
    models: dict[str, dict[str, Any]] = Field(description="name -> versions and default")
    error: str | None = Field(default=None, description="why it could not apply the last one")
    device: str | None = Field(default=None, description="where it serves: cpu, or its GPU (cuda:N)")


class Rollout(BaseModel):
    """A model's rollout and its evidence over every worker (docs/models.md, "Rolling out a version")."""

    model: str
    live: str = Field(description="the default version")
    candidate: str | None = Field(description="the version being rolled out; null: none now")
    canary_percent: float = Field(description="share of the unversioned requests the candidate answers")
    shadow_percent: float = Field(description="share of the live answers the candidate also runs, off the response "
                                  "path")
    previous: str | None = Field(description="the default before the last promotion, kept loaded for a rollback")
    rolled_back: list[str] = Field(description="versions rolled back: no candidate until a promotion names them")
    candidate_refused: dict[str, str] | None = Field(None, description="the candidate the rollout goes on without "
                                                     "because it cannot load (version, reason): the live version "
                                                     "serves without a candidate until it loads")
    watch: dict[str, Any] | None = Field(description="a new default watched by the rollback rule: version, "
                                         "previous, the previous default's p99 (baseline_p99_ms)")
    promote: dict[str, Any] | None = Field(description="the automatic promotion rule; null: by call only")
    rollback: dict[str, Any] | None = Field(description="the automatic rollback rule; null: by call only")
    promotion: str | None = Field(description="what the automatic promotion waits for, or why it holds")
    comparison: dict[str, Any] | None = Field(description="the shadow's figures: compared, top1_agreement, "
                                              "top5_overlap (null below 6 classes, where it is 1.0 by "
                                              "construction), mean/max_probability_difference, disagreements "
                                              "(live -> candidate, counts), live/candidate_forward_ms (p50, p99 per "
                                              "image), errors, dropped (by reason)")
    traffic: dict[str, Any] = Field(description="per version since its role last changed: requests, failures "
                                    "(500, 504), error_ratio, p50, p99 (ms in the engine)")


NAME_OR_NUMBER = {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}  # a version as a body names it


class VersionChoice(BaseModel):
    """Body of a promote or rollback call (optional): the version to serve."""

    model_config = ConfigDict(extra="forbid")

    version: Annotated[str | None, WithJsonSchema(NAME_OR_NUMBER)] = Field(
        None, description="promote: default the rollout's candidate; rollback: default the previous default (a number "
        "names the version of that number: 3 is \"3\")")

    @field_validator("version", mode="before")
    @classmethod
    def _numbers_are_names(cls, value: Any) -> Any:
        if value == "":  # (an unset shell variable: it would act on the default target, promote or roll back)
            raise ValueError("an empty version names none: leave version out for the default target")
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


class RolloutChanged(BaseModel):
    """Answer of a promote or rollback call: the model's versions and default in every worker now (``name``, as the
    V2 load call's answer names it)."""

    name: str
    default: str
    versions: list[str]
    previous: str | None = None
    rolled_back: list[str] = Field(default_factory=list)


class ModelsResponse(BaseModel):
    """Answer of GET /v1/models."""

    default_model: str | None = Field(None, description="The model requests naming none get (DEFAULT_MODEL, the "
                                      "repository's repository.json, or the only one); null: name one")
    models: list[ModelInfo]
    workers: list[WorkerModels]
    rollouts: list[Rollout] = Field(default_factory=list, description="models with a rollout, a candidate or a "
                                    "watched new default")
