"""Tiny fakes: a 4-class colour "model" and its manifest, so routes and batching run without real weights."""
from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, NamedTuple, Sequence

import torch
import torch.nn as nn

from models.export.manifest import EmbeddingOutput, Manifest, WeightsFile
from models.presets import EvalPreset

if TYPE_CHECKING:
    from flask import Flask

    from app.config import Settings
    from app.engine.contract import Served
    from app.engine.service import Service

LABELS = ["red", "green", "blue", "other"]
SERVER_POLL_S = 0.01  # how often an HTTP server a test runs in this process looks for its stop


def tiny_manifest(name: str = "colour", version: str = "test", embedding: bool = False) -> Manifest:
    """A manifest for an 8x8-input model with four classes (files are never read: the model is passed in);
    ``embedding``: it answers ColourModel's 3-value embedding too."""
    sha = "0" * 64
    return Manifest(name=name, version=version, arch="fake", labels=LABELS,
                    preprocess=EvalPreset(resize_size=8, crop_size=8, mean=(0.5,) * 3, std=(0.5,) * 3),
                    files={"state_dict": WeightsFile(path="none.pt", sha256=sha)}, default_format="state_dict",
                    embedding=EmbeddingOutput(layer="head", dim=3) if embedding else None)


class ColourModel(nn.Module):
    """Logits = mean of each colour channel (and a fixed 'other'), so a red image is 'red' and so on.

    ``gate`` (when set) blocks every forward pass until released, ``fail_when`` makes a batch raise, and
    ``batch_sizes`` records the size of every batch it saw. ``embedding``: it answers (logits, embedding) as an
    export with an embedding does, the embedding being the colour means shifted to 0..2, L2-normalised.
    """

    def __init__(self, embedding: bool = False) -> None:
        super().__init__()
        self.embedding = embedding
        self.batch_sizes: list[int] = []
        self.threads: list[int] = []  # threading.get_ident() of every forward pass
        self.gate: threading.Event | None = None
        self.fail_when: float | None = None  # raise when any image's mean red value exceeds this
        self.oom_above: int | None = None  # raise CUDA out-of-memory for batches larger than this
        self.delay_s = 0.0  # each forward pass takes this long at least

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.batch_sizes.append(x.shape[0])
        self.threads.append(threading.get_ident())
        if self.gate is not None:
            self.gate.wait(timeout=10)
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.oom_above is not None and x.shape[0] > self.oom_above:
            raise torch.cuda.OutOfMemoryError(f"fake: {x.shape[0]} images do not fit")
        means = x.mean(dim=(2, 3))
        if self.fail_when is not None and bool((means[:, 0] > self.fail_when).any()):
            raise RuntimeError("fake forward failure")
        other = torch.full((x.shape[0], 1), -0.5, device=x.device, dtype=x.dtype)
        logits = torch.cat([means, other], dim=1) * 10
        if self.embedding:
            return logits, torch.nn.functional.normalize(means + 1, dim=1)
        return logits


class ConvColourModel(nn.Module):
    """ColourModel's answers from a convolution and a pooling (a 1x1 convolution copies each colour channel and adds
    a fixed 'other' map, the mean over the image is the logit): a model Grad-CAM can explain (its feature map is
    the convolution's output), in microseconds."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Conv2d(3, 4, kernel_size=1)
        with torch.no_grad():
            self.features.weight.zero_()
            for channel in range(3):
                self.features.weight[channel, channel] = 10.0
            self.features.bias.copy_(torch.tensor([0.0, 0.0, 0.0, -5.0]))
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.features(x)).flatten(1)


def infer(service: Service, images: Sequence[bytes] = (), tensors: Sequence[torch.Tensor] = (), *,
          name: str | None = None, version: str | None = None, client_gone: Callable[[], bool] | None = None,
          timeout_s: float = 5.0, embedding: bool = False, arrived: float | None = None) -> Served:
    """One request through the engine as a protocol sends it: admitted to ``name``/``version``, then inferred."""
    with service.admit(name, version) as call:
        return call.infer(images, tensors, timeout_s=timeout_s, client_gone=client_gone, embedding=embedding,
                          arrived=arrived)


WAIT_POLL_MAX_S = 0.02  # a long wait's polls: a condition that asks a server is a request each time


def wait_until(condition: Callable[[], bool], timeout: float = 10) -> None:
    """Poll ``condition`` until it holds, every millisecond at first and less often as the wait goes on (at most
    every WAIT_POLL_MAX_S: a wait of seconds polling every millisecond kept a core busy, the suite's CPU being what
    bounds its time); fail the test after ``timeout`` seconds."""
    deadline, pause = time.monotonic() + timeout, 0.001
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(pause)
        pause = min(pause * 1.5, WAIT_POLL_MAX_S)


@contextlib.contextmanager
def served_over_http(wsgi_app: Callable) -> Iterator[str]:
    """``wsgi_app`` on a free loopback port in this process (werkzeug, threaded); yields its base URL."""
    from werkzeug.serving import make_server

    server = make_server("127.0.0.1", 0, wsgi_app, threaded=True)
    # its stop looked for every SERVER_POLL_S: at werkzeug's default (0.5 s) each test's end waited half a second
    threading.Thread(target=server.serve_forever, args=(SERVER_POLL_S,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()


def export_tiny(out: Path, name: str = "mine", version: str = "1", force: bool = False, seed: int = 0,
                packages: tuple[tuple[str, str], ...] = (), head_scale: float = 1.0, copied: bool = True) -> Path:
    """A real export of an untrained 3-class mobilenet_v3_small at 32 px into ``out`` (seconds on a CPU); another
    ``seed``, other weights; ``packages`` as models.export takes them (("onnx", "float32"): the ONNX file).
    ``head_scale`` multiplies the head's weights: the untrained logits are about 1e-10 apart, so every class scores
    the same (top-1 is the first class whatever the photo); 1e10 gives each photo its own scores and top-1.

    Into a new or empty ``out``, an export this process made with the same arguments is copied (its files new, as
    a fresh export's: the export is deterministic) and published as the export publishes (whole, at once), not made
    again: TorchScript's scripting alone took 0.7 s of CPU a call, some 50 calls a run. Into a folder that holds
    files, with ``force``, or ``copied=False`` (a test that patches the exporter), the export runs."""
    from models.export.publish import staging_beside

    key = (name, version, seed, packages, head_scale)
    fresh = copied and not force and (not out.exists() or (out.is_dir() and not any(out.iterdir())))
    if fresh and key in _EXPORTED:
        out.parent.mkdir(parents=True, exist_ok=True)
        with staging_beside(out) as staging:
            shutil.copytree(_EXPORTED[key], staging / "export", copy_function=shutil.copyfile)
            os.rename(staging / "export", out)  # (onto an empty folder too)
        return out
    _export_tiny(out, name, version, force, seed, packages, head_scale)
    if fresh:
        kept = Path(tempfile.mkdtemp(prefix="export-tiny-", dir=_kept_exports()))
        shutil.copytree(out, kept, copy_function=shutil.copyfile, dirs_exist_ok=True)
        _EXPORTED[key] = kept
    return out


_EXPORTED: dict[tuple, Path] = {}  # export_tiny's arguments -> a copy of what the export wrote


@functools.lru_cache(maxsize=1)
def _kept_exports() -> str:
    """This process's folder of export_tiny's copies, removed at its exit."""
    folder = tempfile.mkdtemp(prefix="export-tiny-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def _export_tiny(out: Path, name: str, version: str, force: bool, seed: int, packages: tuple[tuple[str, str], ...],
                 head_scale: float) -> None:
    from models.export.write import export_model
    from models.architectures import build_model, head_of

    torch.manual_seed(seed)
    model = build_model("mobilenet_v3_small", 3)
    with torch.no_grad():
        head_of(model).weight.mul_(head_scale)
    export_model(model, out_dir=out, name=name, version=version,
                 arch="mobilenet_v3_small", labels=["a", "b", "c"], preset=EvalPreset(resize_size=40, crop_size=32),
                 force=force, packages=packages)


class FakeRepository:
    """A model source of ColourModel versions, held in memory: ``add`` a version, ``fail`` one, count loads."""

    def __init__(self) -> None:
        self.held: dict[str, dict[str, ColourModel]] = {}
        self.broken: dict[tuple[str, str], str] = {}
        self.loads: list[tuple[str, str]] = []
        self.gate: threading.Event | None = None  # when set, loads wait for it
        self.stamps: dict[tuple[str, str], int] = {}
        self.default: str | None = None  # the default model the repository names
        self.policies: dict[str, dict[str, object]] = {}  # a model's policy.json
        self.misplaced: dict[tuple[str, str], str] = {}  # what a version's manifest says against it (``misplace``)

    def add(self, name: str, version: str) -> ColourModel:
        """A new version of ``name``; returns its model (to gate or inspect)."""
        model = self.held.setdefault(name, {})[version] = ColourModel()
        self.stamps[(name, version)] = self.stamps.get((name, version), 0) + 1
        return model

    def fail(self, name: str, version: str, reason: str) -> None:
        """Make loading ``version`` raise ModelLoadError(reason)."""
        self.add(name, version)
        self.broken[(name, version)] = reason

    def misplace(self, name: str, version: str, reason: str) -> None:
        """``fail``, told by its manifest too (``unservable``), as a version folder copied by hand is."""
        self.fail(name, version, reason)
        self.misplaced[(name, version)] = reason

    def strays(self, name: str) -> list[str]:
        """None: every version it holds is an export."""
        return []

    def unservable(self, name: str, version: str) -> str | None:
        return self.misplaced.get((name, version))

    def models(self) -> list[str]:
        return sorted(self.held)

    def default_model(self) -> str | None:
        return self.default

    def versions(self, name: str) -> list[str]:
        from models.export.repository import version_order

        return sorted(self.held.get(name, {}), key=version_order)

    def policy(self, name: str) -> dict[str, object] | None:
        return self.policies.get(name)

    def stamp(self, name: str, version: str) -> tuple[int, int]:
        return (self.stamps[(name, version)], 0)

    def size_bytes(self, name: str, version: str) -> int:
        return 1024 * 1024

    def load(self, name: str, version: str):  # noqa: ANN201 - a Predictor
        from app.engine.loaded.predictor import Predictor
        from models.export.checks import ModelLoadError

        self.loads.append((name, version))
        if self.gate is not None:
            self.gate.wait(10)
        if (name, version) in self.broken:
            raise ModelLoadError(self.broken[(name, version)])
        return Predictor(self.held[name][version], tiny_manifest(name, version), device="cpu",
                         weights_bytes=1024 * 1024)

    def missing(self) -> Exception:
        return RuntimeError("nothing to serve")


class OtherInputRepository(FakeRepository):
    """FakeRepository whose version "2" takes 16x16 inputs (another eval transform), the others 8x8."""

    def load(self, name: str, version: str):  # noqa: ANN201 - a Predictor
        from app.engine.loaded.predictor import Predictor

        predictor = super().load(name, version)
        if version != "2":
            return predictor
        manifest = tiny_manifest(name, version)
        manifest = manifest.model_copy(update={"preprocess": manifest.preprocess.model_copy(
            update={"resize_size": 16, "crop_size": 16})})
        return Predictor(predictor.module, manifest, device="cpu", weights_bytes=1024 * 1024)


@contextlib.contextmanager
def several_models_app(settings: Settings) -> Iterator[Flask]:
    """The app factory's app serving colour 1 and 2 (2 its default version) and shade 1 (FakeRepository), shut
    down after."""
    from app import EXTENSION_KEY
    from app.factory import create_app

    repository = FakeRepository()
    for name, version in (("colour", "1"), ("colour", "2"), ("shade", "1")):
        repository.add(name, version)
    app = create_app(settings.model_copy(update={"version_policy": "all"}), source=repository)  # type: ignore
    try:
        yield app
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


class LoadingApp(NamedTuple):
    """An app whose model is still loading (``loading_app``): ``loaded()`` lets its load finish."""

    app: Flask
    repository: FakeRepository
    failures: list[BaseException]  # what the app's start-up said could not be served

    def loaded(self) -> None:
        assert self.repository.gate is not None
        self.repository.gate.set()


@contextlib.contextmanager
def loading_app(settings: Settings) -> Iterator[LoadingApp]:
    """The app factory's app whose colour 1 loads only once ``loaded()`` is called (or the block ends); then it
    shuts down, the load finished first (no thread is left in torch)."""
    from app import EXTENSION_KEY
    from app.factory import create_app

    repository = FakeRepository()
    repository.add("colour", "1")
    repository.gate = threading.Event()
    failures: list[BaseException] = []
    app = create_app(settings, source=repository, on_load_error=failures.append)  # type: ignore[arg-type]
    try:
        yield LoadingApp(app, repository, failures)
    finally:
        repository.gate.set()
        service = app.extensions[EXTENSION_KEY]
        wait_until(lambda: service.ready or bool(failures))
        service.shutdown(timeout=5)


class PooledStreams:
    """``torch.cuda.Stream`` on a machine without CUDA: each stream made is recorded with its device and priority, and
    ``priority_range`` is a device's as PyTorch reports it (``highest``: -3 where it offers four pools, as on an
    H100; -1 where the device has two priorities)."""

    def __init__(self, highest: int) -> None:
        self.highest = highest
        self.made: list[tuple[torch.device, int]] = []
        fake = self

        class Stream:
            def __init__(self, device: torch.device, priority: int = 0) -> None:
                self.device, self.priority = device, priority
                fake.made.append((device, priority))

            @staticmethod
            def priority_range() -> tuple[int, int]:
                return 0, fake.highest

            def wait_stream(self, other: object) -> None:
                """Ordering does not arise without a device."""

        self.Stream = Stream
