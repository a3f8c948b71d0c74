"""``create_app``: the only wiring point (settings, the service and its models, the web layer, the protocols), and
the protocols the service speaks by default.

Imports stay inside the functions so that importing this module never loads torch or Flask before they are needed
(the gunicorn worker imports it on its loading thread, app/wsgi.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from flask import Flask

    from app.config import Settings
    from app.engine.contract import ServiceFace
    from app.engine.loaded.predictor import Predictor
    from app.engine.versions.sources import Source
    from app.web.protocol import Protocol


def default_protocols() -> "list[Protocol]":
    """The APIs the service speaks: /predict + /v1/models, and the Open Inference Protocol under /v2."""
    from app import v1, v2

    return [v1.PROTOCOL, v2.PROTOCOL]


def _placed(settings: "Settings") -> "Settings":
    """Under gunicorn with several GPUs, this worker's GPU (in the worker, after the fork: CUDA may be touched)."""
    if settings.worker_slot is None or settings.device not in ("auto", "cuda"):
        return settings
    import torch

    from app.hosting.host import placed_device

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = placed_device(settings.device, settings.worker_slot, gpus, settings.workers_per_gpu)
    return settings if device == settings.device else settings.model_copy(update={"device": device})


def create_app(settings: "Settings | None" = None, predictor: "Predictor | None" = None,
               protocols: "Sequence[Protocol] | None" = None,
               on_load_error: "Callable[[BaseException], None] | None" = None,
               source: "Source | None" = None, engine: str = "inline") -> "Flask":
    """Build the Flask app: load the models of ``settings.weights_dir`` (or take ``predictor``), build the service
    (warm-up, canaries), register the web. ``source`` replaces the directory (tests: models held in memory).

    With ``on_load_error`` the model loads in the background and the app answers at once (503 until ready; the
    gunicorn worker's way, app/wsgi.py); without it, loading happens here and a failure raises. With
    ``engine="process"`` (a gunicorn worker under ENGINE=process) the app loads no model and imports no torch: it
    waits for its engine process (app/link/client.py), and ``on_load_error`` gets the engine's boot failure.
    """
    from flask import Flask

    from app.config import load_settings
    from app.logs import configure_logging
    from app.web import init_app

    from models.data.malloc import keep_freed_memory

    settings = settings or load_settings()
    configure_logging(settings.log_level, settings.access_log)
    # before any image or body buffer is allocated, and before the request threads start
    keep_freed_memory(settings.malloc_trim_threshold_mb, settings.malloc_arena_max)
    if engine == "process":
        service = _remote_service(settings, on_load_error or _raise)
    else:
        service = _inline_service(settings, predictor, on_load_error, source)
    app = Flask(__name__)
    init_app(app, settings, service, protocols if protocols is not None else default_protocols())
    return app


def _raise(exc: BaseException) -> None:
    raise exc


def _remote_service(settings: "Settings", on_error: "Callable[[BaseException], None]") -> "ServiceFace":
    from app.hosting.host import engine_count
    from app.link.client import RemoteService

    slot = (settings.worker_slot or 0) % (settings.engines or engine_count(settings.device,
                                                                        settings.engines_per_device))
    return RemoteService.start(settings, slot, on_error)


def _inline_service(settings: "Settings", predictor: "Predictor | None",
                    on_load_error: "Callable[[BaseException], None] | None", source: "Source | None") -> "ServiceFace":
    """The engine in this process: the models loaded here (now, or on a thread with ``on_load_error``)."""
    import os

    from app.engine.service import Service
    from app.engine.versions.sources import DirectorySource, GivenSource
    from app.hosting import control

    settings = _placed(settings)
    if source is None:
        source = GivenSource(predictor) if predictor is not None else DirectorySource(settings)
    if on_load_error is None:
        return Service.build(settings, source)
    # a worker loading on a thread (gunicorn's): its ready mark says when it serves (app/hosting/worker.py)
    mark = None if settings.control_dir is None else control.ready_mark(settings.control_dir, os.getpid())
    return Service.start(settings, source, on_load_error, ready_mark=mark)
