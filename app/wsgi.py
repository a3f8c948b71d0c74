"""gunicorn target: ``gunicorn -c gunicorn.conf.py app.wsgi:app``. Each worker loads its model in the background.

The worker answers from its first second (/healthz 200, /readyz and inference 503 with Retry-After) while the model
loads and warms up. A model that cannot be served ends the worker with gunicorn's boot-error status, so the master
stops with the message instead of restarting it forever.
"""
import logging
import os

from app import create_app

log = logging.getLogger(__name__)

WORKER_BOOT_ERROR = 3  # gunicorn.workers.base.Worker.WORKER_BOOT_ERROR: the master halts, it does not respawn


def _stop_worker(exc: BaseException) -> None:
    log.error("cannot serve the model: %s", exc)
    log.debug("the load failed here", exc_info=exc)
    logging.shutdown()
    os._exit(WORKER_BOOT_ERROR)  # from the loader thread: sys.exit would end only the thread


app = create_app(on_load_error=_stop_worker)
