"""The one settings object. Every limit is here, read from ``VISIONSERVE_*`` environment variables."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DeviceName = str
Dtype = Literal["float32", "float16", "bfloat16"]
WeightsFormatSetting = Literal["auto", "torchscript", "state_dict"]


class Settings(BaseSettings):
    """Service settings; validated once at boot so a bad value stops the start, not the first request."""

    model_config = SettingsConfigDict(env_prefix="VISIONSERVE_", extra="ignore", protected_namespaces=())

    # Model
    weights_dir: Path = Path("weights")
    weights_format: WeightsFormatSetting = "auto"  # auto: the manifest's default_format
    device: DeviceName = "auto"  # auto | cpu | cuda | cuda:N
    dtype: Dtype = "float32"  # float16 needs CUDA; bfloat16 works on CPU and CUDA
    # Intra-op threads for the forward pass. 0 = auto: on the CPU, half the cores (at least 1), because request
    # threads decode images on the same cores (measured: 1 thread gave +7 to +20% images/s on 2 cores); on CUDA,
    # torch's default.
    torch_threads: int = Field(default=0, ge=0)
    warmup: bool = True  # run every batch shape once before reporting ready (CUDA pads batches to powers of two)
    # TorchScript on CPU: torch.jit.freeze + optimize_for_inference (folds BatchNorm into convolutions, MKLDNN
    # kernels). Measured by `python -m bench.limit`: about 1.5x images/s for EfficientNet-Lite0 on 2 cores.
    jit_optimize: bool = True

    # Batching
    max_batch_size: int = Field(default=8, gt=0)
    # At warm-up, time the forward pass per batch size and cap batches where images/s stops rising (within 5%).
    auto_batch_size: bool = True
    max_wait_ms: float = Field(default=2.0, ge=0)
    # A request that finds the batcher idle, and no other request on its way, runs its batch on its own thread
    # (skipping the hand-off to the worker thread on another core: about 2 ms less per lone request on a CPU).
    # CPU only: on CUDA each request thread would tune its own cuDNN plans again (seconds, measured).
    inline_when_idle: bool = True
    queue_size: int = Field(default=64, gt=0)  # images waiting for the GPU worker, per process

    # Request limits
    max_body_bytes: int = Field(default=20 * 1024 * 1024, gt=0)
    max_pixels: int = Field(default=40_000_000, gt=0)  # width x height, checked before pixels are decoded
    max_aspect_ratio: float = Field(default=20.0, ge=1)  # long side / short side; a 1x10000 strip is refused
    max_images: int = Field(default=16, gt=0)  # images in one request
    top_k: int = Field(default=5, gt=0)  # default when the request does not say
    # Longest a request waits for its inference; a client may ask for less with X-Request-Timeout (ms).
    request_timeout_s: float = Field(default=30.0, gt=0)
    client_body_timeout_s: float = Field(default=30.0, gt=0)  # longest silence while a client sends its body
    oom_shrink_s: float = Field(default=60.0, ge=0)  # how long the batch cap stays lowered after an OOM split

    # Security: with an API key set, requests need "Authorization: Bearer <key>" or "X-API-Key: <key>".
    api_key: SecretStr | None = None
    api_key_file: Path | None = None  # e.g. a Docker secret; read at boot
    auth_health_open: bool = True  # /healthz, /readyz and /metrics stay open for probes and scrapers

    # Decoding: JPEGs larger than this on their short side are decoded at 1/2, 1/4 or 1/8 scale (libjpeg's
    # DCT scaling), never below it. 0 turns it off. See README for the measured effect on predictions.
    jpeg_draft_min_side: int = Field(default=1024, ge=0)
    # glibc only: each malloc arena keeps up to this many MiB of freed memory, so the next large image reuses it
    # instead of page-faulting fresh memory (decode 1.6x faster in the server, see app/malloc.py). 0 = glibc's
    # defaults. Costs up to this much resident memory per arena (glibc makes at most 8 per core).
    malloc_trim_threshold_mb: int = Field(default=64, ge=0)

    # gunicorn (read by gunicorn.conf.py in the master, which must not touch torch)
    bind: str = "0.0.0.0:8000"
    workers: int = Field(default=1, gt=0)  # one per GPU; scale further with more replicas
    threads: int = Field(default=32, gt=0)  # concurrent requests per worker that share one batcher
    timeout_s: int = Field(default=60, gt=0)  # gunicorn worker timeout (a stuck worker is restarted)
    graceful_timeout_s: int = Field(default=30, gt=0)  # time to finish accepted requests on SIGTERM
    keepalive_s: int = Field(default=5, ge=0)
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        value = value.strip().lower()
        if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
            return value
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {value!r}")

    @model_validator(mode="after")
    def _dtype_fits_device(self) -> "Settings":
        if self.dtype == "float16" and self.device == "cpu":
            raise ValueError("dtype float16 needs a CUDA device; use bfloat16 or float32 on cpu")
        if self.api_key_file is not None and not self.api_key_file.is_file():
            raise ValueError(f"api_key_file {self.api_key_file} does not exist")
        return self

    def resolved_api_key(self) -> str | None:
        """The API key from the setting or the key file (stripped), or None when auth is off."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        if self.api_key_file is not None:
            return self.api_key_file.read_text(encoding="utf-8").strip() or None
        return None

    def resolved_weights_dir(self) -> Path:
        """The weights directory as an absolute path (relative paths are taken from the working directory)."""
        return Path(os.path.abspath(self.weights_dir))
