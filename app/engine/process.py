"""The engine process: ``python -m app.engine.process SLOT``, started and restarted by the gunicorn master
(gunicorn.conf.py), one per GPU (one on a CPU host). It owns the loaded versions, the reconcile, rollouts, the
monitor, batching, decoding and the forward pass (``Service``); the HTTP workers reach it over a Unix socket in
CONTROL_DIR (app/engine/wire.py) through app/remote_engine.py.

One thread per connection; each connection carries one request at a time:
- ``("admit", model, version, client_key)`` enters ``Service.admit`` and answers the request's ``Signature``; the
  request stays admitted (counted as on its way to the next batch) until the next frame: ``("infer", options)``
  with the images as segments (answered with ``Served``), or ``("abort", error)`` when the HTTP side refused the
  body (the error ends the admission, counted as the protocol's error would be). While inferring, any byte from
  the HTTP side means its client hung up (the images still queued are dropped).
- ``("catalog", method, args, kwargs)``: a ``Catalog`` call; ``("state",)``: readiness, liveness, draining.
Every answer is ``("ok", value)`` or ``("error", ServiceError)``.

Before it listens it loads its models; a model that cannot be served ends it with status 3 and its reason in
``engine-<slot>.failed``, which the HTTP workers read to stop the server with that message.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from app.config import Settings, load_settings
from app.engine.service import Service
from app.engine.versions.sources import DirectorySource
from app.engine.wire import CATALOG_CALLS, EngineGone, engine_failure, receive, send, socket_path
from app.errors import InferenceFailed, ServiceError

log = logging.getLogger(__name__)
BOOT_ERROR = 3  # as a gunicorn worker's boot error: the master stops instead of restarting it


def _gone_watch(conn: socket.socket) -> Callable[[], bool]:
    """While an inference runs, anything readable on the connection (a byte, or its close) means the HTTP side's
    client hung up."""
    def gone() -> bool:
        try:
            return bool(select.select([conn], [], [], 0)[0])
        except (OSError, ValueError):
            return True
    return gone


def _as_error(exc: BaseException) -> ServiceError:
    if isinstance(exc, ServiceError):
        return exc
    return InferenceFailed(f"the engine failed on this request: {type(exc).__name__}: {exc}")


class EngineServer:
    """Serves one engine's ``Service`` to the HTTP workers' connections."""

    def __init__(self, service: Service, path: Path) -> None:
        self.service, self.path = service, path
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def listen(self) -> None:
        """Bind (replacing a dead engine's socket file) and accept connections until the process ends."""
        self.path.unlink(missing_ok=True)
        self._listener.bind(str(self.path))
        self._listener.listen(1024)
        log.info("engine listening on %s", self.path)
        while True:
            conn, _ = self._listener.accept()
            threading.Thread(target=self._serve, args=(conn,), name="engine-connection", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    header, _ = receive(conn)
                    self._one(conn, header)
            except (EngineGone, ConnectionError):
                return  # the HTTP worker closed it (its thread ended, or the worker exited)

    def _one(self, conn: socket.socket, header: tuple[Any, ...]) -> None:
        kind = header[0]
        try:
            if kind == "admit":
                self._admitted(conn, *header[1:])
                return
            value = self._call(header)
        except Exception as exc:  # noqa: BLE001 - every failure is answered, never a dropped connection
            send(conn, ("error", _as_error(exc)))
            return
        send(conn, ("ok", value))

    def _call(self, header: tuple[Any, ...]) -> Any:
        if header[0] == "state":
            service = self.service
            return {"ready": service.ready, "alive": service.alive, "loaded": service.loaded,
                    "draining": service.draining}
        if header[0] == "catalog" and header[1] in CATALOG_CALLS:
            _, method, args, kwargs = header
            return getattr(self.service.catalog, method)(*args, **kwargs)
        raise ValueError(f"unknown engine call {header[0]!r}")

    def _admitted(self, conn: socket.socket, model: str | None, version: str | None, client_key: str | None,
                  images: int, timeout_s: float | None) -> None:
        """One request from admission to its answer, holding the admission while the HTTP side reads the body."""
        aborted = False
        try:
            with self.service.admit(model, version, client_key, images, timeout_s) as call:
                send(conn, ("ok", call.model))
                header, images = receive(conn)
                if header[0] == "abort":
                    aborted = True
                    if header[1] is not None:
                        raise header[1]  # the protocol's refusal, counted as the request's outcome
                    return  # the protocol asked nothing of the model: the admission ends as it would here
                options = header[1]
                served = call.infer(images, options.get("tensors", ()), timeout_s=options["timeout_s"],
                                    names=options.get("names", ()), client_gone=_gone_watch(conn))
        except (EngineGone, ConnectionError):
            raise
        except Exception as exc:  # noqa: BLE001 - answered, but for an abort: the HTTP side has its error already
            if not aborted:
                send(conn, ("error", _as_error(exc)))
            return
        send(conn, ("ok", served))


def _serve_forever(settings: Settings, slot: int) -> None:
    control_dir = settings.control_dir
    assert control_dir is not None, "the engine process needs CONTROL_DIR (gunicorn.conf.py sets it)"
    try:
        service = Service.build(settings, DirectorySource(settings))
    except Exception as exc:  # noqa: BLE001 - said once, in the log and for the HTTP workers
        message = getattr(exc, "message", None) or str(exc)
        log.error("cannot serve the model: %s", message)
        engine_failure(control_dir, slot).write_text(message, encoding="utf-8")
        logging.shutdown()
        os._exit(BOOT_ERROR)
    engine_failure(control_dir, slot).unlink(missing_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: _stop(service, settings))
    EngineServer(service, socket_path(control_dir, slot)).listen()


def _stop(service: Service, settings: Settings) -> None:
    """SIGTERM from the master (after the HTTP workers drained): finish what is queued, then exit."""
    service.shutdown(timeout=settings.graceful_timeout_s)
    logging.shutdown()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    """Run engine ``SLOT`` (its GPU follows from it) until the master stops it."""
    from app.host import engine_count, placed_device, visible_gpus
    from app.logs import configure_logging
    from models.data.malloc import keep_freed_memory

    args = sys.argv[1:] if argv is None else argv
    slot = int(args[0]) if args else 0
    settings = load_settings()
    configure_logging(settings.log_level)
    keep_freed_memory(settings.malloc_trim_threshold_mb)
    gpus = visible_gpus() if settings.device != "cpu" else 0
    device = placed_device(settings.device, slot, gpus, 1)  # engine N on GPU N
    # The engines are the processes that run forward passes: each takes its share of the cores.
    settings = settings.model_copy(update={"device": device, "worker_slot": slot,
                                           "workers": engine_count(settings.device)})
    _serve_forever(settings, slot)


if __name__ == "__main__":
    main()
