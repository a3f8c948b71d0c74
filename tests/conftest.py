"""Shared fixtures: settings, app and client through the factory, with a tiny fake predictor."""
from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import pytest

from tests.support import scheduling
from tests.support.shared import shared_folder

# The fixtures import what they build (torch, Flask, the app) when they first run: pytest-xdist's controller loads
# this file too, and starts the workers only after; it runs no test, so it need not wait on those imports.
if TYPE_CHECKING:
    from flask import Flask
    from flask.testing import FlaskClient

    from app.config import Settings
    from app.engine.loaded.predictor import Predictor
    from app.engine.service import Service
    from harness.servers import Running
    from tests.support.fakes import ColourModel

# A test that uses one of these starts a server, loads real weights, runs torchrun, trains on photos or exports
# ONNX (the exporter takes seconds per model): it is marked slow, so `pytest -m "not slow"` stays under a minute
# (a test whose training run exports ONNX says so with the mark itself). A test that starts a server without them
# fails (see _guard).
SLOW_FIXTURES = frozenset({"real_weights", "real_app", "small_weights", "live_server", "start_server", "torchrun",
                           "photo_folder", "packaged_export", "int8_export", "onnx_export", "engine_server"})
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    """Small limits so every limit can be reached cheaply."""
    from app.config import Settings

    return Settings(weights_dir=tmp_path, device="cpu", max_batch_size=4, max_wait_ms=5, queue_size=8,
                    max_body_bytes=256 * 1024, max_pixels=200_000, max_images=4, top_k=2,
                    request_timeout_s=10, jpeg_draft_min_side=0, log_level="warning",
                    auto_batch_size=False)  # batching tests need the configured cap, not a measured one


@pytest.fixture
def model() -> ColourModel:
    from tests.support.fakes import ColourModel

    return ColourModel()


@pytest.fixture
def predictor(model: ColourModel) -> Predictor:
    from app.engine.loaded.predictor import Predictor
    from tests.support.fakes import tiny_manifest

    return Predictor(model, tiny_manifest(), device="cpu")


@pytest.fixture
def app(settings: Settings, predictor: Predictor) -> Iterator[Flask]:
    from app import EXTENSION_KEY
    from app.factory import create_app

    app = create_app(settings, predictor)
    yield app
    app.extensions[EXTENSION_KEY].shutdown(timeout=5)


@pytest.fixture
def service(app: Flask) -> Service:
    from app import EXTENSION_KEY

    return app.extensions[EXTENSION_KEY]


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


@pytest.fixture(scope="session")
def real_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model exported by the real export command into a fresh directory (once per run, shared by
    pytest-xdist's workers: tests/support/shared.py)."""
    from models.export.write import export_default

    return shared_folder(tmp_path_factory, "weights", export_default)


@pytest.fixture(scope="session")
def real_app(real_weights: Path) -> Iterator[Flask]:
    """The service on the real EfficientNet-Lite0 weights (CPU)."""
    import torch

    from app import EXTENSION_KEY
    from app.config import Settings
    from app.factory import create_app

    torch.manual_seed(0)
    settings = Settings(weights_dir=real_weights, device="cpu", max_batch_size=4, max_wait_ms=5,
                        log_level="warning")
    app = create_app(settings)
    yield app
    app.extensions[EXTENSION_KEY].shutdown(timeout=10)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark slow every test that uses a slow fixture; GPU tests run only where CUDA is present; in a pytest-xdist
    worker, the longest tests first (tests/support/scheduling.py)."""
    import torch

    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
    if hasattr(config, "workerinput"):  # every worker collects the same items, and sorts them the same way
        items.sort(key=lambda item: scheduling.rank(item.nodeid))


def pytest_configure(config: pytest.Config) -> None:
    """A pytest-xdist worker computes on its share of the cores: with torch's default (a thread per core) in
    every worker, their threads would wait on each other's. The service's JSON log handler (app/logs.py, added
    once a process) is added here on the process's own stderr: added by the first app a test built, it kept that
    test's captured stream, closed after it, and every later log line became a "--- Logging error ---" traceback
    on whatever test ran then (a CLI test's stderr read two such instead of its own lines)."""
    from app.logs import JsonFormatter

    handler = logging.StreamHandler(sys.__stderr__)
    handler.setFormatter(JsonFormatter())
    logging.getLogger().addHandler(handler)
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads() // int(workerinput["workercount"])))


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, the app, the test modules: some 450,000 objects) frozen out of the
    collector's scans, as an engine freezes its start-up before its models load (app/link/server.py): a version
    retired in a test is then collected in milliseconds (``_collect_retired``), where a walk of all of it took
    about 0.35 s, some 60 times in the fast tests. What the fixtures build with is imported first (this file
    leaves it to them, for pytest-xdist's controller), and Hypothesis: its plugins (trio's) register their random
    generators then, and its check that another object holds each cannot see frozen ones."""
    import hypothesis  # noqa: F401 - for its plugins' registrations, before the freeze

    import app.factory, app.engine.loaded.predictor, tests.support.fakes, tests.support.servers  # noqa: E401,F401
    gc.freeze()


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which a run without it lacks
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadgroup`: the groups and the order of tests/support/scheduling.py."""
    return scheduling.make_scheduler(config, log) if config.getvalue("dist") == "loadgroup" else None


@pytest.fixture(autouse=True)
def _guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test not marked slow may not start a server or load the packaged ImageNet weights."""
    if request.node.get_closest_marker("slow") is not None:
        return

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("this test starts a server or loads real weights: use a fixture from "
                             f"SLOW_FIXTURES ({', '.join(sorted(SLOW_FIXTURES))}) so it is marked slow")

    monkeypatch.setattr("harness.servers.Running.__init__", refuse)
    monkeypatch.setattr("models.pretrained.load_lite0_imagenet", refuse)


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., Running]]:
    """Start servers with ``start_server(weights, **settings)``; whatever is still running is stopped after."""
    from tests.support.servers import serve

    started: list[Running] = []

    def start(weights: Path, **settings: str) -> Running:
        log_dir = tmp_path / f"server-{len(started)}"
        log_dir.mkdir()
        started.append(serve(weights, log_dir, **settings))
        return started[-1]

    yield start
    for server in started:
        if server.process.poll() is None:
            server.stop()


@pytest.fixture
def torchrun() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run ``python -m torch.distributed.run ARGS`` from the repository root; returns the finished process."""

    def run(args: list[str], timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                              timeout=timeout_s)

    return run


@pytest.fixture(scope="session")
def small_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real export (untrained mobilenet_v3_small, 10 classes, 64x64 input) for load tests: the fault
    matrix's model."""
    from harness.faults import small_weights as export_small

    return shared_folder(tmp_path_factory, "small-weights", export_small)


@pytest.fixture(scope="session")
def live_server(real_weights: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """gunicorn on the real default model, shared by the client and protocol tests."""
    from tests.support.servers import serve

    server = serve(real_weights, tmp_path_factory.mktemp("live"), max_wait_ms="10").wait_ready()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    """Building a service sets torch's process-wide thread count; give the next test the original one back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def engine_server(small_weights: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """ENGINE=process with two HTTP workers and two engines (ENGINES_PER_DEVICE=2: each worker talks to its own) on
    the small model, started once for the tests that read it or leave it serving again (an engine they kill is back
    before they end). The tests that start their own process-mode servers run the default, one engine."""
    from tests.support.servers import serve

    server = serve(small_weights, tmp_path_factory.mktemp("engine"), engine="process", workers="2",
                   engines_per_device="2", max_wait_ms="5").wait_ready()
    yield server
    server.stop()
