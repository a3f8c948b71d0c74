"""The one settings object. Every limit is here, read from ``VISIONSERVE_*`` environment variables.

Each setting's text lives once, in its ``description``: ``docs/configuration.md`` is generated from this file
(``python -m app.configdoc``) and a test fails when the two differ. Imports nothing of the project, so the gunicorn
master can read it without torch.

The settings are declared in groups by what they govern (``GROUPS``, in the order of the page): model and repository,
rollouts, device and precision, batching, requests, decoding, the HTTP server, prediction monitoring, security.
``Settings`` combines them into one flat object: a setting is still ``settings.<name>``, read from
``VISIONSERVE_<NAME>``, whichever group declares it.
"""
from __future__ import annotations

import difflib
import ipaddress
import logging
import os
import re
from pathlib import Path
from typing import ClassVar, Literal, Mapping, get_args, get_origin

from pydantic import (BaseModel, ConfigDict, Field, SecretStr, ValidationError, ValidationInfo, field_validator,
                      model_validator)
from pydantic_settings import BaseSettings, SettingsConfigDict

DeviceName = str
Dtype = Literal["float32", "float16", "bfloat16"]
MemoryFormat = Literal["contiguous", "channels_last"]
WeightsFormatSetting = Literal["auto", "onnx", "aoti", "int8", "torchscript", "state_dict"]
ENV_PREFIX = "VISIONSERVE_"
CLIENT_VARIABLES = frozenset({"VISIONSERVE_URL"})  # read by the client (python -m visionserve_client), not by the server
AUTO_MAX_BATCH_SIZE = {"cpu": 8, "cuda": 32}  # MAX_BATCH_SIZE=0, by the model's device type
# the largest MAX_BATCH_SIZE: warm-up runs a batch of it (its activations grow with it: 100,000 took the 2-core VM's
# 23 GB; a trial), and no device measured gained past 64
MAX_BATCH_SIZE_CEILING = 1024
log = logging.getLogger(__name__)


def dtype_fits_device(dtype: str, device_type: str) -> str | None:
    """Why ``dtype`` cannot run on ``device_type`` (cpu, cuda), or None when it can: float16 is CUDA only."""
    if dtype == "float16" and device_type == "cpu":
        return "dtype float16 needs a CUDA device; use bfloat16 or float32 on cpu"
    return None


class SettingsGroup(BaseModel):
    """One group of settings: a mixin of ``Settings``, which reads its fields from the environment. ``heading``
    titles the group's table in docs/configuration.md."""

    model_config = ConfigDict(protected_namespaces=())
    heading: ClassVar[str]

    @field_validator("*", mode="before")
    @classmethod
    def _a_word_in_any_case(cls, value: object, info: ValidationInfo) -> object:
        """A setting whose value is one of a few words takes it in any case, spaces around it dropped
        (LOG_LEVEL=INFO, as Python's logging names its levels, was refused; ENGINE=Process too); a value that is
        none of the words is refused as it was given."""
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, str) and field is not None and get_origin(field.annotation) is Literal \
                and value.strip().lower() in get_args(field.annotation):
            return value.strip().lower()
        return value


class ModelSettings(SettingsGroup):
    """What to serve: the export or model repository, which models and versions, memory for loading them, the
    weights format."""

    heading = "Model and repository"

    weights_dir: Path = Field(Path("weights"), description="What to serve: a directory with `manifest.json` "
                              "(one export, as `python -m models.export` writes it), or a model repository "
                              "`<dir>/<model>/<version>/` (as `models.export --repository` writes it).")
    models: str = Field("", description="The repository's models to load at start, comma-separated; empty: every "
                        "model in it.")
    default_model: str = Field(
        "", description="The model that requests naming none get when the server serves several; empty: the one the "
        "repository names (`<repository>/repository.json`: `{\"default_model\": \"NAME\"}`), else the only model "
        "served (with several and none named, such requests get 400 listing the models). One that names a model "
        "not served stops the start.")
    version_policy: str = Field(
        "latest:1", description="Which versions of each model stay loaded: `latest:N` (the N highest numbers), `all`, or "
        "`specific:V[,V...]`. Requests that name no version get the newest loaded one. A model's own "
        "`<repository>/<model>/policy.json` (`{\"version_policy\": {\"latest\": {\"num_versions\": 2}}, "
        "\"default_version\": \"3\"}`, Triton's spelling) overrides it.")
    repository_poll_s: float = Field(
        0.0, ge=0, description="Look for new or removed versions in the repository every this many seconds and "
        "swap them in with no failed request (each worker polls on its own); 0 = off: versions change only "
        "through `POST /v2/repository/models/{name}/load`.")
    repository_sync_timeout_s: float = Field(
        120.0, gt=0, description="How long a repository change call (load, unload, promote, rollback) waits for "
        "another change under way in its worker (a call's, or a new version the poll loads) before answering 504 "
        "`load_timeout` with nothing changed, and then, once applied there, how long it waits for the server's other "
        "workers to apply it before answering 504 (they still apply it). Its own load is not bounded by it (under "
        "`ENGINE=process` the HTTP worker answers 504 once the engine has not answered within twice this plus 10 s; "
        "the change goes on).")
    model_memory_limit_mb: int = Field(
        0, ge=0, description="Most memory the loaded models' weights may take together, per worker; a load past "
        "it is refused (507). 0 = no limit but the device's free memory.")
    memory_reserve_mb: int = Field(
        512, ge=0, description="Memory a load must leave free on the model's device (the GPU's, or the host's "
        "and its container's) for traffic; a version that would not is refused (507) and the old one keeps "
        "serving.")
    control_dir: Path | None = Field(
        None, description="Where one server's workers keep the desired state (which versions of which models to "
        "serve, and what load and unload calls chose) and report what each serves. Unset: gunicorn.conf.py makes a "
        "fresh temporary directory at each start, so a restarted server begins from the repository and its "
        "policies; set it to a directory you keep for calls (a rollback, an unload) to survive a server restart (made "
        "if missing; one that cannot be written stops the start, naming it).")
    weights_format: WeightsFormatSetting = Field(
        "auto", description="`auto`: what `bench.serving.formats` measured fastest end to end on this device type "
        "among what the export holds: on the CPU the ONNX file under ONNX Runtime (about 2x TorchScript's forward "
        "pass) when its answers agreed with float32 at export; else the manifest's `default_format` (TorchScript), "
        "saying in the log why. `onnx`: the ONNX file (CPU, float32), or no start; `aoti`: the float AOTInductor "
        "package compiled for this device type, dtype and torch version, or no start; `int8`: the same for the "
        "int8 CPU package (`--packages cpu-int8`); `torchscript`; `state_dict`.")

    @field_validator("version_policy")
    @classmethod
    def _a_policy_that_keeps_a_version(cls, value: str) -> str:
        if not re.fullmatch(r"latest(:[0-9]+)?|all|specific:[^,]+(,[^,]+)*", value):
            raise ValueError(f"must be latest:N, all or specific:V[,V...], got {value!r}")
        if value.startswith("latest:") and int(value.removeprefix("latest:")) < 1:
            raise ValueError(f"latest:N keeps the N newest versions: N must be 1 or more, got {value!r}")
        return value

    def model_names(self) -> list[str]:
        """``models`` as a list (empty: every model of the repository)."""
        return [name.strip() for name in self.models.split(",") if name.strip()]

    def resolved_weights_dir(self) -> Path:
        """The weights directory as an absolute path (relative paths are taken from the working directory)."""
        return Path(os.path.abspath(self.weights_dir))


class RolloutSettings(SettingsGroup):
    """Rolling a new version out (docs/models.md): canary share, shadow comparisons, automatic promotion and
    rollback."""

    heading = "Rollouts"

    canary_percent: float = Field(
        0.0, ge=0, le=100, description="Rollouts (docs/models.md): the share of a model's requests that name no "
        "version which its candidate answers instead of the default (sticky per client: the `CLIENT_KEY_HEADER` "
        "header, else the API key; random without either). A model's policy.json or a load call's config "
        "(`{\"rollout\": {\"canary_percent\": 10}}`) overrides it. While any rollout setting is on, a new version "
        "arrives as the candidate and the default stays until a promotion.")
    shadow_percent: float = Field(
        0.0, ge=0, le=100, description="The share of the requests the default answers that the candidate also "
        "runs, off the response path, to compare its answers (`/v1/models` `rollouts`); shadow work waits behind "
        "live work and is dropped (counted) when the queue is busy.")
    promote_after: int = Field(
        0, ge=0, description="Promote a candidate by itself once this many shadow comparisons (or canary requests, "
        "without a shadow) across the workers agree within `PROMOTE_MIN_AGREEMENT`, its p99 within "
        "`PROMOTE_MAX_LATENCY_RATIO` of the default's, with no error; 0 = only by a call. Needs `CANARY_PERCENT` or "
        "`SHADOW_PERCENT` above 0 (here or in a model's policy.json): a candidate with no share of the traffic gathers "
        "no evidence, so its model is refused.")
    promote_min_agreement: float = Field(
        0.99, ge=0, le=1, description="The top-1 agreement with the default a candidate needs to be promoted by "
        "itself.")
    promote_max_latency_ratio: float = Field(
        1.5, gt=0, description="The candidate's p99 over the default's, at most, to be promoted by itself.")
    rollback_within: int = Field(
        0, ge=0, description="Watch a newly promoted default for this many requests and roll it back by itself if "
        "its error ratio passes `ROLLBACK_MAX_ERROR_RATIO` or its p99 `ROLLBACK_MAX_P99_RATIO` times the previous "
        "default's; 0 = only by a call.")
    rollback_max_error_ratio: float = Field(
        0.01, ge=0, le=1, description="The share of a new default's requests that may fail (500 or 504) before it "
        "is rolled back by itself.")
    rollback_max_p99_ratio: float = Field(
        2.0, gt=0, description="A new default's p99 over the previous default's, at most, before it is rolled back "
        "by itself.")
    client_key_header: str = Field(
        "X-Client-ID", pattern=r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$", description="The request header whose value keeps "
        "a client on one side of a canary (hashed, never stored); without it the API key does, else each request "
        "is drawn at random. A header's name (RFC 9110's token: letters, digits, `-` and a few marks; no space).")
    shadow_queue_size: int = Field(
        64, ge=1, description="Images waiting for their shadow comparison, per live version; new shadow work that "
        "would take the waiting ones past it is dropped (counted in `visionserve_shadow_dropped_total`), one "
        "request's alone taken whatever its size.")
    shadow_max_age_s: float = Field(
        5.0, gt=0, description="Shadow work not run within this many seconds of its live answer is dropped.")


class DeviceSettings(SettingsGroup):
    """Where and how the forward pass runs: device, GPU placement of workers, dtype, threads, warm-up, TorchScript
    optimisation."""

    heading = "Device and precision"

    device: DeviceName = Field("auto", description="`auto` (CUDA when available, else CPU), `cpu`, `cuda`, "
                               "`cuda:N`. With `auto` or `cuda` on a host with several GPUs, gunicorn's workers "
                               "spread over them (`WORKERS_PER_GPU`); `cuda:N` puts every worker on GPU N.")
    workers_per_gpu: int = Field(
        0, ge=0, description="How workers are placed on several GPUs: 0 = round robin (worker i on GPU i mod N, as "
        "Triton's instance groups and LitServe's devices do); k = k workers on each GPU in turn (0..k-1 on GPU 0, "
        "k..2k-1 on GPU 1, wrapping). `/v1/models` and `/metrics` (`visionserve_model_info`) name each worker's GPU.")
    engines: int = Field(
        0, ge=0, description="Set by gunicorn.conf.py, not by hand: under ENGINE=process, how many engine processes "
        "serve (ENGINES_PER_DEVICE per GPU, or on the CPU host); 0 under ENGINE=inline. Given by hand: not used, "
        "said at start.")
    worker_slot: int | None = Field(
        None, ge=0, description="Set by gunicorn.conf.py, not by hand: this worker's number among the live workers "
        "(0..WORKERS-1; a restarted worker takes the free one), which places it on a GPU. Given by hand: not used, "
        "said at start.")
    dtype: Dtype = Field("float32", description="Compute dtype: `float32`, `float16` (CUDA only) or `bfloat16`.")
    memory_format: MemoryFormat = Field(
        "contiguous", description="The layout of a version's weights and batches in its forward pass: `contiguous` "
        "(NCHW, as exported) or `channels_last` (NHWC), whose cuDNN kernels can run depthwise convolutions, and "
        "float16 and bfloat16 ones, faster on a GPU (`python -m bench.serving.forward_launch --memory-formats "
        "contiguous channels_last` measures both; the same answers within float rounding). Applies to a module "
        "that holds its weights as parameters (TorchScript, state dict; not a TorchScript frozen by `JIT_OPTIMIZE` "
        "on the CPU, ONNX Runtime or an AOTInductor package, which keep their own) and whose forward pass takes it "
        "(tried on one image at load; one that refuses keeps its own, with a warning): `/v1/models` says which "
        "each version runs with.")
    torch_threads: int = Field(
        0, ge=0, description="Intra-op threads for the forward pass. 0 = auto: on the CPU half of each worker's "
        "share of the usable cores (at least 1), because request threads decode images on the others (measured: +7 "
        "to +20% images/s on 2 cores); on CUDA torch's default.")
    warmup: bool = Field(True, description="Run every batch shape once before reporting ready (each size on the "
                         "CPU; powers of two and the cap on CUDA, where batches are padded to them).")
    warmup_timeout_s: float = Field(
        300.0, ge=0, description="A version's warm-up and canary (every batch shape's first forward pass, CUDA "
        "graph captures, cuDNN tuning) that have not ended after this long fail its load, saying so: a forward pass "
        "that never returns (a deadlocked custom op, a hung device) no longer holds the version `LOADING` and every "
        "later model change behind it for ever. At start the server stops with the reason (the orchestrator "
        "restarts it); a new version is refused as a failed load is, its files tried again once they change, and "
        "the versions serving go on. The stuck thread cannot be stopped: it keeps what it holds until its forward "
        "pass returns, then ends without serving. 0 = wait for ever.")
    warmup_timing_s: float = Field(
        20.0, ge=0, description="The warm-up's timed rounds (each batch shape's forward pass timed, up to 5 rounds, "
        "to choose the batch cap and a lone image's expected time) stop once the warm-up has run this long, every "
        "shape timed once at least: a model of seconds a forward pass is ready in minutes, not a quarter of an hour "
        "(its five rounds of sixteen sizes on the CPU). 0 = one timed round.")
    cuda_graphs: bool = Field(
        True, description="On CUDA, capture each warmed batch shape's forward pass as a CUDA graph and replay it: "
        "one launch instead of one per kernel, which at small batches is what bounds the engine (EfficientNet-Lite0, "
        "float32, H200: ~2.2 ms of the engine thread's CPU per batch of 1-8 eager, 7-9 us replayed; docs/"
        "performance.md). TorchScript and state-dict weights; needs `WARMUP` (graphs are captured then). A model "
        "that cannot be captured runs eagerly, and the log says why.")
    jit_optimize: bool = Field(
        True, description="On the CPU, `torch.jit.freeze` + `optimize_for_inference` the TorchScript model "
        "(BatchNorm folded into convolutions, MKLDNN kernels): about 1.5x images/s for EfficientNet-Lite0 on 2 "
        "cores (`python -m bench.serving.limit`).")

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        value = value.strip().lower()
        if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
            return value
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {value!r}")

    @model_validator(mode="after")
    def _dtype_fits_device(self) -> "DeviceSettings":
        problem = dtype_fits_device(self.dtype, self.device)  # device auto is checked once resolved, at load
        if problem:
            raise ValueError(problem)
        return self


class BatchingSettings(SettingsGroup):
    """How images are gathered into forward passes, and the queue in front of them."""

    heading = "Batching and queue"

    max_batch_size: int = Field(
        0, ge=0, le=MAX_BATCH_SIZE_CEILING,
        description="Most images in one forward pass. 0 = auto, by the model's device: 8 on a CPU (a batch "
        "costs about as much per image there at any size, and a larger one only waits longer); 32 on a GPU (an H200's "
        "forward pass of 32 images ran 10,000 img/s against 7,500 at 8 and 10,750 at 64: docs/performance.md). "
        "`auto_batch_size` may cap batches lower.")
    auto_batch_size: bool = Field(
        True, description="At warm-up, time the forward pass per batch size and cap batches at the largest size "
        "within 5% of the best images/s (less twice the warm-up's run-to-run noise: a curve measured beside a busy "
        "worker caps nothing a steady one would not), below any size where it slows (the curve is in `/v1/models`). "
        "A version's first start in a server measures its cap; a later start of it (an engine or a worker restarted "
        "under load, a reload) takes that cap (kept in CONTROL_DIR) instead of measuring beside busy work.")
    max_wait_ms: float = Field(
        2.0, ge=0, description="How long the worker waits for more images after the first one of a batch (not "
        "at all when no other request is on its way). Under ENGINE=process, where the engine's loop runs short "
        "batches itself (`ENGINE_LOOP_BATCH_MS`), the loop also waits up to this long for more requests after it "
        "reads some, while they come faster than one per this long and waiting has recently brought more: one "
        "wake-up then reads several and their images run as one batch (docs/performance.md).")
    inline_when_idle: bool = Field(
        True, description="A request that finds no batch running or waiting, and no other request on its way, "
        "runs its forward pass on its own thread instead of handing it to the worker thread on another core "
        "(about 2 ms less per lone request on a CPU; still one batch at a time). CPU only: on CUDA each request "
        "thread would tune its own cuDNN plans again (seconds, measured on an H100). Inline workers' request "
        "threads; the engine's loop under ENGINE=process follows `ENGINE_LOOP_BATCH_MS`.")
    queue_size: int = Field(
        0, ge=0, description="Images waiting for the inference worker, per process; a request that does not "
        "fit is refused at once with 429 and `Retry-After`. 0 = auto: room for every image the requests feeding "
        "this queue can hold (`THREADS` x `MAX_IMAGES` for each HTTP worker it serves: its own worker inline, "
        "every worker under `ENGINE=process`), so what refuses an overload is time: a request whose images the "
        "queue ahead cannot answer within its deadline (`REQUEST_TIMEOUT_S`, or less by `X-Request-Timeout`) is "
        "refused at once with 429 and `Retry-After` (measured: a count of 128 refused 16-image requests "
        "that would have been answered in time, and its refusals starved the engine, docs/performance.md). Set, at "
        "least `MAX_IMAGES`: a request of more images than the queue holds could never be queued.")
    oom_shrink_s: float = Field(
        60.0, ge=0, description="After a CUDA out-of-memory batch is split in halves and retried, how long the "
        "lower batch cap holds.")
    stall_s: float = Field(
        60.0, ge=0, description="A batch running this many seconds is stuck (a forward pass that hangs): `/healthz` "
        "and `/readyz` answer 503 naming the version and how long (the orchestrator restarts the server), and its "
        "version's requests get 503 `not_ready` at once. Under ENGINE=process the master also kills an engine "
        "process whose state answer says such a batch (the master asks every 5 s), or that has answered none of "
        "its state queries for this long (stopped, or its loop stuck), saying why in the log, and starts it again "
        "as one that died. Warm-up, with its CUDA graph captures and cuDNN tuning, runs before a version serves "
        "and does not count; no batch comes near it (a new shape's cuDNN tuning with `WARMUP` off takes about 3 s "
        "on an H100, a batch of the default cap a fraction of a second on a CPU). 0 = never.")


class RequestSettings(SettingsGroup):
    """What one request may hold, how long it may wait for its inference, and the shape of its answer."""

    heading = "Request limits and answers"

    max_body_bytes: int = Field(20 * 1024 * 1024, gt=0, description="Largest request body, in bytes (413); a body "
                                "sent compressed (Content-Encoding gzip or deflate) both as sent and decompressed.")
    max_header_bytes: int = Field(64 * 1024, ge=8192, description="Largest request head (the request line and "
                                  "headers; one header, a large cookie or token, may take all of it), in bytes: a "
                                  "longer one is refused by the worker's event loop as it arrives (431), before any "
                                  "thread waits on it.")
    max_pixels: int = Field(40_000_000, gt=0, description="Largest image, width x height, checked from its "
                            "header before any pixel is decoded (413).")
    max_aspect_ratio: float = Field(20.0, ge=1, description="Longest side / shortest side: a 1x10000 strip is "
                                    "refused (400).")
    max_jpeg_scans: int = Field(64, ge=0, description="Most scans a progressive JPEG may have, counted before any "
                                "pixel is decoded (400): each scan decodes the whole image again, so a small file of "
                                "thousands held a decoding thread for minutes. Encoders write about 10; 0 = no limit.")
    max_images: int = Field(16, gt=0, description="Images in one request (413).")
    score_digits: int = Field(6, ge=1, le=17, description="Decimal places of the scores in an answer.")
    answer_compression_min_bytes: int = Field(
        1024, ge=0, description="A JSON or text answer at least this long goes out compressed (`Content-Encoding: "
        "gzip` or `deflate`, zlib's fastest level) when the request's `Accept-Encoding` takes one, as Triton answers "
        "tritonclient's `response_compression_algorithm`: a V2 JSON answer of 16 x 1000 probabilities, 371 KB, "
        "sends 2.1x fewer bytes for 3.3 ms of CPU. Images, V2's binary tensors and the pages' files go out as they "
        "are. 0 = never compressed.")
    top_k: int = Field(5, gt=0, description="Classes per image when the request does not say (requests may ask "
                       "1..classes).")
    request_timeout_s: float = Field(
        30.0, gt=0, description="Longest a request waits for its inference (then 504); a client may ask for "
        "less with `X-Request-Timeout: <ms>`.")
    min_request_timeout_ms: float = Field(
        1.0, ge=0, description="The shortest deadline a request may ask for: a shorter one is 400 "
        "`deadline_too_short`, `X-Request-Timeout`'s first in its route (after the API key and the body limit, "
        "before the request is parsed), the V2 `timeout` parameter's once its body is (a deadline under about a "
        "millisecond passes before the request's route runs: it was a 504, a malformed request's too). 0: none.")
    refusal_memory_ms: float = Field(
        100.0, ge=0, description="After the engine refuses a request because the backlog ahead would outlast its "
        "deadline (429 `deadline_unreachable`), how long its HTTP worker refuses the same route's requests (the "
        "inference route, with the model and version it names) whose deadline ends before that backlog clears, by "
        "the engine's estimate, itself: from the request's head, with the same 429 and `Retry-After`, before "
        "the app parses it or the engine sees it (a refusal through the app cost about what "
        "an answered request costs the HTTP side). A request with an `Origin` header, or without the API key where "
        "one is set, goes to the app. 0 = every request reaches the app.")


class DecodingSettings(SettingsGroup):
    """How and where images are decoded and preprocessed."""

    heading = "Decoding"

    jpeg_draft_min_side: int = Field(
        1024, ge=0, description="JPEGs larger than this on their short side are decoded at 1/2, 1/4 or 1/8 "
        "scale (libjpeg's DCT scaling), never below it; 0 = off. Measured effect in docs/performance.md. The CPU "
        "decode paths' (`pil`, `tensor`): the `device` path, the default on CUDA, decodes the JPEGs it takes at full "
        "size (nvJPEG has no reduced scale; CMYK ones, and those it refuses, go to the CPU's decode at the reduced "
        "scale), so such a JPEG's answers differ a little between a GPU server and a CPU one "
        "(a 7000x4666 photo: 0.378 against 0.372, embeddings' cosine 0.998); 0 on the CPU servers makes theirs "
        "the GPU's (slower for large photos), as `DECODE_PATH=tensor` on the GPU makes its the CPU's.")
    decode_path: Literal["auto", "pil", "tensor", "device"] = Field(
        "auto", description="Where images are decoded and preprocessed. `pil`: in the request threads with PIL "
        "(reduced-scale JPEG decoding, PIL's resize). `tensor`: in the request threads, JPEGs with "
        "libjpeg-turbo straight into a tensor (PIL's pixels: its reduced scale and EXIF orientation; PIL for other "
        "formats) and the resize, crop and normalisation on tensors. `device`: the request threads check headers and limits only, and the batch worker "
        "decodes the whole batch on the model's device (nvJPEG on CUDA, PIL for what it refuses) and preprocesses "
        "it there. `auto`: `device` on CUDA, `tensor` on the CPU (1.2x PIL's images/s there at the same answers: "
        "docs/performance.md).")
    malloc_trim_threshold_mb: int = Field(
        64, ge=0, description="glibc only: each malloc arena keeps up to this many MiB of freed memory, so the "
        "next large image or request body reuses it instead of page-faulting fresh memory (server decode 15 -> 9.5 "
        "ms median here; an HTTP worker of ENGINE=process 24 -> 1 page faults a photo request). 0 = glibc's "
        "defaults. Costs up to this much resident memory per arena (MALLOC_ARENA_MAX).")
    malloc_arena_max: int = Field(
        4, ge=0, description="glibc only: each server process makes at most this many malloc arenas, its threads "
        "sharing them. Each arena keeps its own freed memory (MALLOC_TRIM_THRESHOLD_MB and the fragments between "
        "live blocks); with glibc's default of 8 per core an inline worker held up to 1.2-1.4 GB after 150 s of "
        "mixed photos on 2 cores, with 4 up to 0.93-1.04 GB, the rate within its run-to-run spread (a process's "
        "Python runs under one lock: few of its threads allocate at once; bench/results/"
        "2026-12-06-worker-memory-arenas-inline-cpu-2cpu-vm.md). 0 = glibc's default.")


class ServerSettings(SettingsGroup):
    """The HTTP server: gunicorn's settings (read by gunicorn.conf.py in the master, which must not touch torch),
    its workers' connection limits and timeouts, shutdown, logs."""

    heading = "HTTP server (gunicorn)"

    bind: str = Field("0.0.0.0:8000", description="gunicorn's listen address: `HOST:PORT`, `:PORT` (every address), "
                      "`[IPv6]:PORT`, `unix:PATH` or `fd://N`; one of them.")
    engine: Literal["auto", "process", "inline"] = Field(
        "auto", description="Where the model runs under gunicorn. `process`: engine processes (ENGINES_PER_DEVICE "
        "per GPU, or on a CPU host), started and restarted by the master, owns the models, batching, decoding and "
        "the forward pass; "
        "the HTTP workers never import torch and send it the images over a Unix socket (docs/architecture.md). "
        "`inline`: each worker loads its own copy and batches its own requests. `auto`: `process` when the model "
        "runs on a GPU (on an H200, Lite0, one image per request: one engine 1,619-2,062 img/s against inline's "
        "1,339-1,568 from C=64 to 1,024; docs/performance.md), `inline` on a CPU host, where two workers each running "
        "forward passes keep both cores busy; the start-up log says which it chose.")
    @field_validator("bind")
    @classmethod
    def _one_listen_address(cls, value: str) -> str:
        """What gunicorn's own reading of the address would refuse in a raw line naming no setting, or take and
        listen nowhere (an empty one: "Listening at:  ", then ready; a trial)."""
        address = value.strip()
        scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", address)
        if not address:
            problem = "it is empty"
        elif scheme and scheme.group(1) not in ("tcp", "fd"):
            problem = f"{scheme.group(0)} is a URL's scheme: the address alone, {address[scheme.end():]!r}"
        elif "," in address or any(character.isspace() for character in address):
            problem = "it holds several addresses: the server listens on one"
        else:
            return address
        raise ValueError(f"{problem}; give HOST:PORT (e.g. 0.0.0.0:8000 or 127.0.0.1:8001), got {value!r}")

    engines_per_device: int = Field(
        1, ge=1, le=8, description="Under ENGINE=process: engine processes per device (Triton's instance count), each "
        "with its own copy of the models and its own interpreter: a GPU whose preprocessing and launches saturate one "
        "engine's interpreter lock takes two. Engines 0..k-1 run on the first GPU, k..2k-1 on the next (on a CPU "
        "host, k engines share the cores); HTTP worker n talks to engine n mod the engine count, so WORKERS should "
        "be at least the engine count (the start-up log warns when an engine gets no worker). Versions, rollouts and "
        "readiness span every engine, as they span inline workers. Inline it changes nothing (the start-up log warns).")
    engine_decode_threads: int = Field(
        0, ge=0, le=256, description="Under ENGINE=process: threads each engine decodes images on the CPU with (the "
        "PIL and tensor paths; the device path decodes on the GPU). 0 = one per usable core (the process's affinity "
        "within its container's CPU quota); set it where the container has no CPU limit and so cannot tell its "
        "share of the node's cores (deploy/k8s sets the pod's CPU request).")
    engine_loop_batch_ms: float = Field(
        5.0, ge=0, description="Under ENGINE=process: what a loop turn queued runs on the engine's loop itself, in "
        "batches of the cap, when the version's recent batches say one takes at most this long: as many as fit in "
        "this long a turn, a backlog's rest in the next turns, with reads and answers between them; else the "
        "batcher's thread is woken once. Handing a short batch to that thread and its answers back costs two "
        "wake-ups and the interpreter lock's hand-overs, a good part of its CPU; a longer one holds the loop from "
        "reading the next requests (this bounds a batch's expected time from the version's recent ones; on CUDA "
        "the loop waits for the device to finish the batch). On a CPU; on CUDA for a version whose every batch "
        "replays a CUDA graph (`CUDA_GRAPHS`: an eager pass would tune cuDNN's plans again on the loop's thread), "
        "off the default stream. The first batch of a version never runs there; 0 = never (docs/performance.md).")
    link_arena_mb: int = Field(
        64, ge=0, le=4096, description="Under ENGINE=process: shared memory each HTTP worker's loop link to an "
        "engine places its requests' photos in (a memfd handed to the engine), held from a request's send until "
        "the engine let go of it: the engine decodes a photo where it lies, so it crosses as one copy on the "
        "worker's side instead of through the socket's buffers (the engine's time per 100 KB photo beyond decode "
        "and forward: docs/performance.md). A request whose photos the engine holds long (queued on a device "
        "behind long batches) holds the ring's later places too; a saturated server's queue holds many: 64 MB "
        "holds about 40 requests of 16 photos of 100 KB a worker (at 16 MB, most photos of 16-photo requests at C=64 "
        "on 2 workers went through the socket: the engine's time per photo beyond decode and forward 1.6x that at "
        "64 MB). Requests "
        "that find no room, smaller than 16 KB in all, or sent apart from the loop go through the socket; 0 = "
        "every image through the socket. Memory: up to this much per HTTP worker once its ring has gone round "
        "under load (its engine maps the same pages).")
    workers: int = Field(
        0, ge=0, description="gunicorn worker processes: under `ENGINE=inline` each loads its own model and "
        "batcher, under `ENGINE=process` they speak HTTP only. 0 = auto, said in the start-up log: on a CPU host "
        "one per usable core (affinity and container quota), at most 8 (2 processes x 1 forward thread beat 1 x 2 "
        "by 8-12% on 2 cores); with a GPU one per 4 cores, at least one per GPU and at most 4 per GPU (4 inline "
        "workers on a 16-core H100 host served 1.5x one; the H200's process-mode figures were taken with it). More "
        "inline workers than usable cores are warned of at start (each holds a copy of every model).")
    threads: int = Field(32, gt=0, le=1024,
                         description="gthread threads per worker: concurrent requests that share one "
                         "batcher. Under ENGINE=process with LOOP_REQUESTS only a request whose body arrives after "
                         "its headers takes one; the others run on the worker's event loop, at most this many at "
                         "once (so at most this many exchanges with the engine), the rest waiting their turn, read "
                         "and not parsed.")
    max_connections: int = Field(
        1000, gt=0, description="Open connections per worker, idle keep-alive and still-arriving requests included "
        "(gunicorn's `worker_connections`); at the limit the worker stops accepting until one closes.")
    max_connections_per_client: int = Field(
        500, ge=0, description="Open connections per worker from one client IP address, so that one client (slow "
        "ones holding their connections, a slowloris) cannot take all of a worker's `MAX_CONNECTIONS` (at most half "
        "of them: a higher value is lowered, said at the start). One more is answered 429 with Retry-After once its "
        "request line comes (within 1 s), and closed; a flood of them is answered and closed at once. 0: no limit. "
        "Behind a proxy every connection is the proxy's: 0, or more than it opens to one worker. Connections on a "
        "Unix socket are not limited.")
    client_header_timeout_s: float = Field(
        10.0, gt=0, description="Longest a client may take to send its request line and headers (then 408 and "
        "the connection closes). A request is read by the worker's event loop, headers and body (of known length, "
        "chunked, or after `Expect: 100-continue`), before it gets a thread, so slow clients hold connections, not "
        "threads.")
    client_body_timeout_s: float = Field(30.0, gt=0, description="Longest silence while a client sends its "
                                         "body (then 408).")
    client_body_min_rate: float = Field(
        500.0, ge=0, description="Bytes a second a body must average once `CLIENT_BODY_TIMEOUT_S` from its head has "
        "passed (then 408): a body gets that long plus a second for each this many bytes, as Apache's MinRate; "
        "a client sending a byte within each silence's limit otherwise holds its connection for ever. 0 = no "
        "limit (behind a proxy that buffers bodies).")
    client_answer_timeout_s: float = Field(
        30.0, gt=0, description="Longest a client may take none of its answer while the HTTP worker sends it (then the "
        "connection closes): a client that stops reading holds its connection, never a request thread or the "
        "worker's event loop (LOOP_REQUESTS).")
    timeout_s: int = Field(60, gt=0, description="gunicorn worker timeout (a stuck worker is restarted).")
    graceful_timeout_s: int = Field(
        35, gt=0, le=86_400,
        description="Time to finish accepted requests after SIGTERM: at least `REQUEST_TIMEOUT_S` (a "
        "shorter one stops the start), 5 s above it by default, so that a request accepted just before SIGTERM may "
        "wait out its whole deadline. A request is accepted once its body has arrived whole: within "
        "`SHUTDOWN_DRAIN_S` after SIGTERM new ones are still accepted and answered, their deadline cut to what is "
        "left of this timeout but 1 s (an answer, a 504 at worst, before the worker is stopped), after it "
        "`503 not_ready` (with `Retry-After`).")
    shutdown_drain_s: float = Field(
        5.0, ge=0, description="After SIGTERM (a stop, or a HUP's old worker) a worker keeps its listener open at "
        "least this long, not ready but answering new requests as before, each with `Connection: close` (so a load "
        "balancer that has not noticed yet, or a HUP's new worker still loading, loses nothing), and then until the "
        "requests it accepted are answered, within `GRACEFUL_TIMEOUT_S`, answering new ones `503 not_ready` with "
        "`Retry-After` and `Connection: close` (a clean answer, not a reset); only then does it stop accepting and "
        "close the listener.")
    keepalive_s: int = Field(5, ge=0, description=(
        "HTTP keep-alive, in seconds: an idle connection is closed after this long, and every answer after which "
        "its connection stays open says so (`Keep-Alive: timeout=N`), so that a client stops reusing it first. "
        "0 closes each connection after its answer."))
    loop_requests: bool = Field(
        True, description="Under ENGINE=process: a request whose body the HTTP worker's event loop read whole runs "
        "on that loop as a greenlet, and its wait for the engine's answer is handed back to the loop, which serves "
        "other requests meanwhile; no request thread is woken for it. Every request goes to a request thread when "
        "this is false and under ENGINE=inline (whose threads run the forward passes); a body over MAX_BODY_BYTES "
        "announced in its headers does too (the app refuses it at once). docs/performance.md says what it saves.")
    keepalive_linger_ms: float = Field(
        2.0, ge=0, description="After an answer on a kept-alive connection, how long its request thread waits for "
        "the client's next request and serves it itself, when no other request waits for a thread, instead of "
        "handing the connection back to the worker's event loop, which would read the request and hand it to a "
        "thread again: a client that sends its requests one after another on one connection costs the worker "
        "fewer wake-ups (docs/performance.md). A request begun and not whole by then is read on by the loop, "
        "with its timeouts. 0 = never.")
    trust_forwarded_for: bool = Field(
        False, description="Log the `X-Forwarded-For` header beside the peer address. Turn on only behind a proxy "
        "that sets it: clients can write anything there.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Logs are JSON lines on stderr, each with the `pid` of the process that wrote it, one "
        "per request with its id, status, images, batch sizes and durations (ACCESS_LOG says which requests; with "
        "TRACING, a sampled request's `trace_id` and `span_id`).")
    access_log: Literal["all", "errors", "off"] = Field(
        "all", description="Which requests get their line (at info; probes' at debug): `all`; `errors`: those "
        "answered 4xx or 5xx (499 when the client left); `off`: none. A line is about 350 bytes: at 60 requests a "
        "second, `all` writes about 1.8 GB a day, to be rotated outside the server. The metrics count every request "
        "whatever this says.")

    @model_validator(mode="after")
    def _drain_within_graceful_timeout(self) -> "ServerSettings":
        if self.shutdown_drain_s >= self.graceful_timeout_s:
            raise ValueError(f"shutdown_drain_s ({self.shutdown_drain_s:g}) must be shorter than graceful_timeout_s "
                             f"({self.graceful_timeout_s}): the drain happens inside gunicorn's graceful timeout")
        return self


class MonitoringSettings(SettingsGroup):
    """Prediction monitoring (docs/deployment.md, "Monitoring predictions"): drift and low-confidence gauges."""

    heading = "Prediction monitoring"

    monitor_window: int = Field(
        1000, ge=10, description="Each worker watches the last this many predictions of each model version (its "
        "window): their top-1 class mix against the version's reference gives `visionserve_prediction_drift_psi`, "
        "and their share below `MONITOR_LOW_CONFIDENCE` `visionserve_low_confidence_ratio`. A version whose manifest "
        "holds no reference (the packaged Lite0, exports before the field), or one of fewer than "
        "`MONITOR_MIN_PREDICTIONS` predictions (a small folder's few held-out images), takes its first this many "
        "predictions after the load as the reference, and the window starts again after them; the first one taken is "
        "kept in `CONTROL_DIR`, and later starts of the version (a worker restarted, a reload) judge by it.")
    monitor_min_predictions: int = Field(
        200, ge=1, description="The window must hold at least this many predictions (and the reference be "
        "complete) before the drift and low-confidence gauges report; fewer give figures that are mostly noise. "
        "At most `MONITOR_WINDOW`.")
    monitor_low_confidence: float = Field(
        0.5, gt=0, le=1, description="A prediction whose top-1 probability is below this is low-confidence "
        "(`visionserve_low_confidence_ratio`).")
    monitor_psi_bins: int = Field(
        20, ge=2, description="Bins of the drift figure's class mix: a model with at most this many classes gets one "
        "bin per class; with more, the reference's classes holding at least 1/(2 x bins) of it get a bin each and the "
        "others are dealt over the remaining bins by class index (one bin per class of 1,000 ImageNet classes in "
        "1,000 predictions would make the figure sampling noise). More bins: finer, and noisier.")
    metrics_flush_ms: float = Field(
        100.0, ge=0, le=5000, description="A batch's figures (batch size, stage times and CPU, predicted classes, "
        "confidence) and its predictions' place in the monitor's window are held and written together with the "
        "next batches', by the first batch that ends this long or more after the last write, or by the idle batcher "
        "this long after it: a busy engine writes them once for many batches. An engine process's request counts and "
        "durations likewise, by its loop this long after the first held. A scrape of /metrics has its worker's "
        "versions (and engine) write theirs first, and a version's monitoring read writes its own, so each counts "
        "every request answered before it; other engines' and workers' figures are at most this long and the batch "
        "running then behind. 0 = after every batch and loop turn.")

    @model_validator(mode="after")
    def _minimum_within_window(self) -> "MonitoringSettings":
        if self.monitor_min_predictions > self.monitor_window:
            raise ValueError(f"monitor_min_predictions ({self.monitor_min_predictions}) must be at most "
                             f"monitor_window ({self.monitor_window}): the window never holds more")
        return self


class ExplainSettings(SettingsGroup):
    """Explanations (`POST /explain`, docs/api.md): Grad-CAM maps in a lane of their own, beside the batches."""

    heading = "Explanations"

    explain_concurrency: int = Field(
        1, ge=1, description="Explanations computed at once per process (the models' process: each worker inline, "
        "each engine under ENGINE=process), each one forward and one backward pass on a copy of the version's "
        "weights with gradients, on threads of their own, never inside the batches `/predict` runs.")
    explain_queue_size: int = Field(
        4, ge=0, description="Explanations waiting for a free lane, per process; past it a new one is refused at "
        "once (429 with Retry-After).")
    explain_at_start: bool = Field(
        False, description="Each version's explanations made ready in its load, before it serves: its copy of the "
        "weights with gradients made (for an ONNX or TorchScript export, its state dict loaded into its "
        "architecture: about 2 s of CPU a start, most of it importing timm) and the canary photo explained once, so "
        "the first `/explain` costs what the next ones do; made on its first use instead (false), that takes 1-4 s "
        "of the first explanation in each process on the bundled model (a short deadline's 504), and nothing of a "
        "service that never explains. Set it where `/explain` serves users. It holds that copy in each process with "
        "models (each worker inline, each engine under ENGINE=process; on CUDA counted in the load's memory check, "
        "`MODEL_MEMORY_LIMIT_MB`).")
    explain_nice: int = Field(
        10, ge=0, le=19, description="The CPU priority the explanation threads lower themselves to (Linux nice, "
        "0-19): on busy cores predictions go first; 0 leaves them equal.")


_DEFAULT_PORTS = {"http": "80", "https": "443", "ws": "80", "wss": "443"}


def _as_browsers_send_it(origin: str) -> str:
    """A CORS origin as a browser writes it in its Origin header, which is compared as it is: the scheme and host in
    lower case, an IPv6 host in its shortest form, no default port, no trailing slash
    (``https://App.example.com:443/`` is ``https://app.example.com``); ``*`` and ``null`` (a file:// page's, a
    sandboxed frame's) as they are. ValueError for one that can never match: no scheme, a path, a host of other
    characters than a host name's (a wildcard ``*.example.com``, user@host, a query), a port outside 1-65535."""
    if origin in ("*", "null"):
        return origin
    found = re.fullmatch(r"([A-Za-z][A-Za-z0-9+.-]*)://([A-Za-z0-9._~-]+|\[[0-9A-Fa-f:.]+\])(?::(\d{1,5}))?/?", origin)
    host = found.group(2).lower() if found else ""
    if host.startswith("["):
        try:
            host = f"[{ipaddress.IPv6Address(host[1:-1]).compressed}]"
        except ValueError:
            found = None
    if found is None or (found.group(3) is not None and not 1 <= int(found.group(3)) <= 65535):
        raise ValueError(f"each origin is scheme://host[:port], as a browser sends it in its Origin header "
                         f"(https://app.example.com), or * or null; {origin!r} can never match one")
    scheme, port = found.group(1).lower(), found.group(3)
    return f"{scheme}://{host}" + ("" if port is None or _DEFAULT_PORTS.get(scheme) == port else f":{port}")


def _origins(value: str) -> str:
    """CORS_ORIGINS' origins as browsers send them (``_as_browsers_send_it``), comma-separated; ValueError for
    ``*`` beside others (it allows every origin: the others would say nothing)."""
    origins = [_as_browsers_send_it(part.strip()) for part in value.split(",") if part.strip()]
    if "*" in origins and len(origins) > 1:
        raise ValueError(f"* allows every origin: give it alone, or the origins alone ({value!r})")
    return ",".join(origins)


class SecuritySettings(SettingsGroup):
    """Who may call the API (API key, CORS), and tracing."""

    heading = "Security, CORS and tracing"

    api_key: SecretStr | None = Field(
        None, description="Require `Authorization: Bearer <key>` or `X-API-Key: <key>` (compared in constant "
        "time; the key stripped of surrounding whitespace). Unset: no key needed; so is an empty or whitespace-only "
        "key, here or in `API_KEY_FILE`, with a warning at start that auth is off. Empty beside `API_KEY_FILE`: the "
        "file's key (before, auth was off); both given keys: the start stops. The start's log says whether "
        "requests need a key, and from where it is read.")
    api_key_file: Path | None = Field(None, description="The same, read from a file at boot (a Docker or "
                                      "Kubernetes secret).")
    tracing: bool = Field(
        False, description="Export OpenTelemetry traces: a span per request (continuing an incoming `traceparent`) "
        "with decode, queue and inference children. Where to is set by the standard variables "
        "(`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_SERVICE_NAME`...); OTLP over "
        "HTTP. Off: no tracing code runs at all.")
    cors_origins: str = Field(
        "", description="Origins a browser front-end may call the API from, comma-separated, each "
        "scheme://host[:port] (`https://app.example.com`, `http://localhost:3000`, `chrome-extension://ID`; taken as "
        "a browser writes it: lower case, no default port, no trailing slash), `null` (file:// pages, sandboxed "
        "frames), or `*` alone (every origin); empty = CORS off (no CORS headers at all). Preflights are answered "
        "before the API key check.")
    control_api: Literal["local", "open", "off"] = Field(
        "local", description="Who may call the control API, the calls that change what is served (a repository "
        "`load` or `unload`, a `promote` or `rollback`): `local`, clients on this machine alone (a loopback peer "
        "address, or a Unix socket; no `X-Forwarded-For`, `X-Real-IP` or `Forwarded` header a proxy would add, no "
        "`Origin` or `Sec-Fetch-Site` a browser's page would; from a container's host: `docker compose exec`, "
        "`kubectl exec` or `kubectl port-forward`); `open`, every client the API answers (set `API_KEY` with it: "
        "the key then guards these calls as every other); `off`, none (models change only as the repository "
        "does). Refused: 403 `forbidden`, saying how. The API key, when set, is asked first. Behind a proxy on this "
        "machine or in its pod that adds none of those headers (nginx's plain `proxy_pass`, a service mesh's "
        "sidecar such as Istio's) every client is local: use `off`, or `open` with a key, there.")
    auth_health_open: bool = Field(True, description="Keep `/healthz`, `/readyz`, `/metrics` and the V2 health "
                                   "endpoints (`/v2/health/live`, `/v2/health/ready`, and a model's or version's "
                                   "`/ready`) open for probes and scrapers when an API key is set.")

    @field_validator("cors_origins")
    @classmethod
    def _origins_as_browsers_send_them(cls, value: str) -> str:
        return _origins(value)

    @model_validator(mode="after")
    def _key_file_exists(self) -> "SecuritySettings":
        if self.api_key_file is not None and not self.api_key_file.is_file():
            relative = not self.api_key_file.is_absolute()  # (bin/serve, as make serve, runs in the checkout's folder)
            where = " (a relative path is taken from the working directory: give an absolute one)" if relative else ""
            raise ValueError(f"api_key_file {os.path.abspath(self.api_key_file)} does not exist{where}")
        if self.api_key is not None and self.api_key.get_secret_value().strip() and self.api_key_file is not None:
            raise ValueError("api_key and api_key_file are both set: set one (which key would clients need?)")
        return self

    def resolved_api_key(self) -> str | None:
        """The API key from the setting or the key file (stripped), or None when auth is off."""
        return self.api_key_and_source()[0]

    def api_key_and_source(self) -> tuple[str | None, str | None]:
        """The API key (as ``resolved_api_key``) and where it was read: ``VISIONSERVE_API_KEY`` or ``the key file
        PATH`` (None without either).

        An empty or whitespace-only key, from either, is no key: auth off, said in a warning. Taken as a key, no
        request could present it (a header's value is stripped), so every protected path would be 401; an empty
        variable is how a template or a compose file says "none" (`API_KEY=${API_KEY:-}`), and the warning tells
        an operator who meant a key that none is required."""
        if self.api_key is not None and (self.api_key.get_secret_value().strip() or self.api_key_file is None):
            key, source = self.api_key.get_secret_value().strip(), f"{ENV_PREFIX}API_KEY"
        elif self.api_key_file is not None:  # (an empty API_KEY beside it, as a compose file's ${API_KEY:-}, is none)
            key, source = self.api_key_file.read_text(encoding="utf-8").strip(), f"the key file {self.api_key_file}"
        else:
            return None, None
        if not key:
            log.warning("the API key setting is empty (%s): no key is required, auth is off; unset it, or give a "
                        "key", source)
        return key or None, source


# The groups are listed last first: pydantic collects a model's fields from its last base up, so this order gives
# Settings.model_fields (and the validators' order) in the order of GROUPS and of docs/configuration.md.
class Settings(SecuritySettings, ExplainSettings, MonitoringSettings, ServerSettings, DecodingSettings, RequestSettings,
               BatchingSettings, DeviceSettings, RolloutSettings, ModelSettings, BaseSettings):
    """Service settings; validated once at boot so a bad value stops the start, not the first request."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", protected_namespaces=())

    @model_validator(mode="after")
    def _a_request_fits_the_queue_and_the_stop(self) -> "Settings":
        if self.queue_size and self.queue_size < self.max_images:  # (0, automatic, holds MAX_IMAGES x THREADS)
            raise ValueError(f"queue_size ({self.queue_size}) must be at least max_images ({self.max_images}): a "
                             f"request of more images than the queue holds would be refused (429) however long it "
                             f"waited")
        if self.graceful_timeout_s < self.request_timeout_s:
            raise ValueError(f"graceful_timeout_s ({self.graceful_timeout_s}) must be at least request_timeout_s "
                             f"({self.request_timeout_s:g}): a request accepted just before SIGTERM may take its whole "
                             f"deadline, and would be cut off (keep it 5 s above)")
        return self

    def batch_ceiling(self, device_type: str) -> int:
        """``max_batch_size``, or its automatic value for a model on ``device_type`` (cpu, cuda) when 0."""
        return self.max_batch_size or AUTO_MAX_BATCH_SIZE.get(device_type, AUTO_MAX_BATCH_SIZE["cpu"])

    def resolved_queue_size(self, device_type: str) -> int:
        """``queue_size``, or its automatic value when 0: what the request threads feeding one queue can hold (an
        engine serves every HTTP worker; inline, a worker its own threads), and two batches at least."""
        feeding_workers = -(-(self.workers or 1) // self.engines) if self.engines else 1
        return self.queue_size or max(feeding_workers * self.threads * self.max_images,
                                      2 * self.batch_ceiling(device_type))

    def model_processes(self) -> int:
        """How many processes load models side by side, share the host's cores and report what they serve: the
        engines under ENGINE=process, else the workers."""
        return self.engines or self.workers or 1


GROUPS: tuple[type[SettingsGroup], ...] = tuple(  # ModelSettings first
    base for base in reversed(Settings.__bases__) if issubclass(base, SettingsGroup))


class SettingsError(ValueError):
    """The environment holds a bad setting; the message names each variable, on one line."""


def load_settings() -> Settings:
    """Settings from the environment, or SettingsError naming the ``VISIONSERVE_*`` variables at fault."""
    try:
        return Settings()
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            if not error["loc"]:  # a rule across settings: its message names them as fields
                problems.append(_as_variables(error["msg"].removeprefix("Value error, ")))
                continue
            said = repr(error["input"])  # (a validator's own message may name it already)
            given = f" (got {said})" if not isinstance(error["input"], dict) and said not in error["msg"] else ""
            problems.append(f"{ENV_PREFIX}{str(error['loc'][0]).upper()}: {error['msg']}{given}")
        raise SettingsError("; ".join(problems)) from None


def _as_variables(message: str) -> str:
    """A rule's message with the settings it names as the variables that set them (``queue_size (4) must be at
    least max_images (16)``: VISIONSERVE_QUEUE_SIZE, VISIONSERVE_MAX_IMAGES): a name with an underscore anywhere, one
    without (dtype, device) only where the message starts with it, as the rules word them (not "a CUDA device")."""
    def variable(match: re.Match[str]) -> str:
        word = match.group(0)
        named = word in Settings.model_fields and ("_" in word or match.start() == 0)
        return f"{ENV_PREFIX}{word.upper()}" if named else word

    return re.sub(r"(?<![\w/.])[a-z][a-z0-9_]*(?![\w/.])", variable, message)


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning for each ``VISIONSERVE_*`` variable that is no setting (a typo would otherwise do nothing),
    with the closest setting's name."""
    known = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields} | CLIENT_VARIABLES
    warnings = []
    for name in sorted(key for key in environ if key.upper().startswith(ENV_PREFIX) and key.upper() not in known):
        suffixes = [known_name[len(ENV_PREFIX):] for known_name in known]  # the shared prefix would match anything
        close = difflib.get_close_matches(name.upper()[len(ENV_PREFIX):], suffixes, n=1, cutoff=0.7)
        hint = f" (did you mean {ENV_PREFIX}{close[0]}?)" if close else " (docs/configuration.md lists the settings)"
        warnings.append(f"{name} is not a setting and is ignored{hint}")
    # and a setting's name whose prefix is misspelt (VISONSERVE_WORKERS: before, nothing; a trial)
    for name in sorted(key for key in environ if not key.upper().startswith(ENV_PREFIX) and "_" in key):
        prefix, _, rest = name.upper().partition("_")
        if prefix != ENV_PREFIX[:-1] and difflib.SequenceMatcher(None, prefix, ENV_PREFIX[:-1]).ratio() >= 0.8 \
                and f"{ENV_PREFIX}{rest}" in known:
            warnings.append(f"{name} is not a setting and is ignored (did you mean {ENV_PREFIX}{rest}?)")
    return warnings
