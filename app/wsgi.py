"""gunicorn target: ``gunicorn -c gunicorn.conf.py app.wsgi:app``. Each worker answers from its first second.

``app`` is a ``StartingApp`` (app/hosting/starting.py): while a thread imports torch, Flask and the app and builds it, the
worker already answers (/healthz 200, /readyz and everything else 503 not_ready with Retry-After); then the real
app takes every request, and it too answers 503 while the model loads and warms up in the background. A model
that cannot be served, or an app that cannot be imported, ends the worker with gunicorn's boot-error status, so
the master stops with the message instead of restarting it forever.

Importing this module loads nothing heavy (app.config and pydantic the master has loaded already): the worker
reaches its event loop at once.
"""
import logging
import os
from functools import partial
from pathlib import Path
from typing import Callable

from app.config import load_settings
from app.hosting.control import tell_boot_failure
from app.hosting.host import engine_mode
from app.hosting.starting import StartingApp, WSGIApp

log = logging.getLogger(__name__)

WORKER_BOOT_ERROR = 3  # gunicorn.workers.base.Worker.WORKER_BOOT_ERROR: the master halts, it does not respawn


def _stop_worker(exc: BaseException) -> None:
    log.error("cannot serve the model: %s", exc)
    if control_dir := os.environ.get("VISIONSERVE_CONTROL_DIR"):  # the master says it last (gunicorn.conf.py)
        tell_boot_failure(Path(control_dir), os.getppid(), f"cannot serve the model: {exc}")
    log.debug("the load failed here", exc_info=exc)
    logging.shutdown()
    os._exit(WORKER_BOOT_ERROR)  # from a loader thread: sys.exit would end only the thread


def _load() -> Callable[[], WSGIApp]:
    """Import what the app needs (the slow part: torch and the engine unless it runs in its own process, Flask, the
    protocols); return its builder."""
    settings = load_settings()
    engine = engine_mode(settings.engine, settings.device)
    if engine == "inline":
        import app.engine.service  # noqa: F401 - torch
    import app.v1  # noqa: F401 - Flask and the web layer
    import app.v2  # noqa: F401
    from app.factory import create_app

    return partial(create_app, settings, on_load_error=_stop_worker, engine=engine)


app = StartingApp(_load, _stop_worker, load_settings().max_body_bytes).start()
