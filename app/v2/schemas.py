"""Pydantic models of the Open Inference Protocol (V2) REST messages: what /v2 answers and what /openapi.json says."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

Datatype = Literal["BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES"]


class ServerMetadata(BaseModel):
    """GET /v2."""

    name: str
    version: str
    extensions: list[str]


class Live(BaseModel):
    """GET /v2/health/live (200 live, 503 not)."""

    live: bool


class Ready(BaseModel):
    """GET /v2/health/ready (200 ready, 503 not)."""

    ready: bool


class ModelReady(BaseModel):
    """GET /v2/models/{name}[/versions/{version}]/ready."""

    name: str
    ready: bool


class TensorMetadata(BaseModel):
    """A model input or output: -1 marks the batch dimension."""

    name: str
    datatype: Datatype
    shape: list[int]


class ModelMetadata(BaseModel):
    """GET /v2/models/{name}[/versions/{version}]."""

    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class Reshape(BaseModel):
    """The shape the model takes an input in, where it differs from ``dims`` (Triton's ``reshape``)."""

    shape: list[int]


class ConfigTensor(BaseModel):
    """One input or output of GET .../config, as Triton's model configuration names it: ``dims`` without the batch
    dimension (the configuration's ``max_batch_size`` holds it)."""

    name: str
    data_type: str  # TYPE_STRING (BYTES), TYPE_FP32
    dims: list[int]
    format: str | None = None  # an image input's layout: FORMAT_NCHW, or FORMAT_NONE for encoded files
    # the encoded files: dims [1] with reshape [], as Triton declares an input of one item per batch row (the
    # inference API's shape [N, 1], the model's [N]); this server takes [N, 1] and [N], its metadata says [-1]
    reshape: Reshape | None = None


class DynamicBatching(BaseModel):
    """How requests are batched: up to ``max_queue_delay_microseconds`` (MAX_WAIT_MS) for more."""

    max_queue_delay_microseconds: int
    preferred_batch_size: list[int]


class InstanceGroup(BaseModel):
    """Where the version runs: KIND_GPU or KIND_CPU."""

    kind: str
    count: int


class ConfigParameter(BaseModel):
    """One of a configuration's free-form parameters, as Triton writes them."""

    string_value: str


class ModelConfig(BaseModel):
    """GET /v2/models/{name}[/versions/{version}]/config: the version's configuration in Triton's JSON form (what
    tritonclient's get_model_config, perf_analyzer and model_analyzer read)."""

    name: str
    platform: str
    backend: str
    max_batch_size: int  # images one request may carry (MAX_IMAGES)
    input: list[ConfigTensor]
    output: list[ConfigTensor]
    dynamic_batching: DynamicBatching
    instance_group: list[InstanceGroup]
    default_model_filename: str | None = None  # the file the version runs, where it is one file of the export
    parameters: dict[str, ConfigParameter] = Field(
        default_factory=dict, description="`preprocess`: how a picture becomes the `pixels` input, as JSON "
        "(resize_size, crop_size, interpolation, and mean and std on 0..1 pixels), as GET /v1/models/{name} says it")


class InferInput(BaseModel):
    """One input tensor: JSON ``data`` (flat or nested; BYTES as base64 strings) or binary (``binary_data_size``)."""

    model_config = ConfigDict(extra="forbid")  # as the server: a field it does not take is refused (400)

    name: str
    datatype: Datatype
    shape: list[int]
    parameters: dict[str, Any] | None = Field(default=None, description="binary_data_size: bytes after the header")
    data: list[Any] | None = None


class RequestedOutput(BaseModel):
    """An output to return: ``binary_data`` (bool) and ``classification`` (top k as "score:index:label")."""

    model_config = ConfigDict(extra="forbid")

    name: str
    parameters: dict[str, Any] | None = None


class InferRequest(BaseModel):
    """POST /v2/models/{name}[/versions/{version}]/infer (the JSON header when binary tensors follow)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    id: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="binary_data_output, timeout (µs)")
    inputs: list[InferInput] = Field(min_length=1)
    outputs: list[RequestedOutput] | None = None
    model_name: str | None = Field(default=None, description="taken and not read: the path names the model")
    model_version: str | None = Field(default=None, description="taken and not read: the path names the version")


class InferOutput(BaseModel):
    """One output tensor, in JSON (``data``) or binary (``parameters.binary_data_size``)."""

    name: str
    datatype: Datatype
    shape: list[int]
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class InferResponse(BaseModel):
    """The inference answer (the JSON header when binary tensors follow)."""

    model_config = ConfigDict(protected_namespaces=())

    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[InferOutput]


class Error(BaseModel):
    """Every /v2 error, as the protocol defines it."""

    error: str


class RepositoryIndexRequest(BaseModel):
    """POST /v2/repository/index (the body may be empty)."""

    model_config = ConfigDict(extra="forbid")  # a misspelt "ready" refused, not read as every version's readiness

    # strict: a JSON true or false ("yes" read as true before: no error, every version's readiness filtered)
    ready: bool = Field(False, strict=True, description="only the versions ready to serve")


class RepositoryModel(BaseModel):
    """One version in the repository index, with this worker's state of it."""

    name: str
    version: str
    state: Literal["READY", "LOADING", "UNLOADING", "UNAVAILABLE"]
    reason: str = ""
    default: bool = Field(False, description="whether this is its model's default version, the one a request "
                          "naming the model and no version gets (as `default` in /v1/models)")
    role: str | None = None  # its part in its model's rollout: live, canary, shadow, previous (GET /v1/models)
    comparison: dict[str, Any] | None = None  # a candidate's: its shadow figures against the live version


class RepositoryIndex(RootModel[list[RepositoryModel]]):
    """The index: a JSON array, one item per version."""


class LoadRequest(BaseModel):
    """POST /v2/repository/models/{name}/load (the body may be empty)."""

    model_config = ConfigDict(extra="forbid")

    parameters: dict[str, Any] = Field(default_factory=dict, description='"config": a JSON object (or its text) '
                                       'with "version_policy" (Triton\'s spelling), "default_version" and "rollout" '
                                       '(a canary or shadow and its rules, as a policy.json\'s: docs/models.md)')


class UnloadRequest(BaseModel):
    """POST /v2/repository/models/{name}/unload (the body may be empty)."""

    model_config = ConfigDict(extra="forbid")

    parameters: dict[str, Any] = Field(default_factory=dict, description='"unload_dependents" is accepted and '
                                       "has nothing to do: no model here depends on another")


class Loaded(BaseModel):
    """What a load or unload call leaves this server serving of the model."""

    name: str
    versions: list[str]
    default: str | None
