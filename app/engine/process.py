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
import pickle
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
    client hung up (poll: no limit on the descriptor's number)."""
    poller = select.poll()
    poller.register(conn, select.POLLIN | select.POLLHUP | select.POLLERR)
    return lambda: bool(poller.poll(0))


def _answer(conn: socket.socket, answer: tuple[str, Any]) -> None:
    """Send ``answer``; one that does not pickle is answered as the server's error instead (nothing was sent yet)."""
    try:
        send(conn, answer)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        send(conn, ("error", InferenceFailed(f"the engine's answer could not be sent: {exc}")))


def _as_error(exc: BaseException) -> ServiceError:
    if isinstance(exc, ServiceError):
        return exc
    return InferenceFailed(f"the engine failed on this request: {type(exc).__name__}: {exc}")


class EngineServer:
    """Serves one engine's ``Service`` to the HTTP workers' connections."""

    def __init__(self, service: Service, path: Path) -> None:
        self.service, self.path = service, path
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def bind(self) -> None:
        """Bind (replacing a dead engine's socket file)."""
        self.path.unlink(missing_ok=True)
        self._listener.bind(str(self.path))
        self._listener.listen(1024)

    def listen(self) -> None:
        """Accept connections until the process ends."""
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
            except (EngineGone, OSError):
                return  # the HTTP worker closed it (its thread ended, or the worker exited), or it went out of step

    def _one(self, conn: socket.socket, header: tuple[Any, ...]) -> None:
        kind = header[0]
        if kind in ("infer", "abort"):  # only ever after an admission: the stream is out of step, so it ends
            raise EngineGone(f"a {kind!r} frame outside an admission")
        try:
            if kind == "admit":
                self._admitted(conn, *header[1:])
                return
            value = self._call(header)
        except (EngineGone, ConnectionError):
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is answered, never a dropped connection
            _answer(conn, ("error", _as_error(exc)))
            return
        _answer(conn, ("ok", value))

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
                header, images = self._next_frame(conn)
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
                _answer(conn, ("error", _as_error(exc)))
            return
        _answer(conn, ("ok", served))

    def _next_frame(self, conn: socket.socket) -> tuple[Any, list[bytes]]:
        """The admitted request's next frame (infer or abort), within the time a body may take to arrive and be
        parsed; a silent HTTP side ends the admission and the connection."""
        settings = self.service.settings
        conn.settimeout(settings.client_body_timeout_s + settings.request_timeout_s)
        try:
            frame = receive(conn)
        except TimeoutError:
            raise EngineGone("no infer or abort frame after the admission") from None
        conn.settimeout(None)
        if frame[0][0] not in ("infer", "abort"):
            raise EngineGone(f"a {frame[0][0]!r} frame inside an admission")
        return frame


def _serve_forever(settings: Settings, slot: int) -> None:
    control_dir = settings.control_dir
    assert control_dir is not None, "the engine process needs CONTROL_DIR (gunicorn.conf.py sets it)"
    try:
        service = Service.build(settings, DirectorySource(settings))
        server = EngineServer(service, socket_path(control_dir, slot))
        server.bind()
    except Exception as exc:  # noqa: BLE001 - said once, in the log and for the HTTP workers
        _fail(control_dir, slot, getattr(exc, "message", None) or str(exc))
    engine_failure(control_dir, slot).unlink(missing_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: _stop(service, settings))
    server.listen()


def _fail(control_dir: Path, slot: int, message: str) -> None:
    """Say why this engine cannot serve (for the HTTP workers and the master) and exit with the boot error."""
    log.error("cannot serve the model: %s", message)
    failure = engine_failure(control_dir, slot)
    partial = failure.with_name(f".{failure.name}.{os.getpid()}")
    partial.write_text(message, encoding="utf-8")
    partial.replace(failure)  # whole or not there: a worker may read it at any moment
    logging.shutdown()
    os._exit(BOOT_ERROR)


def _exit_with_the_master() -> None:
    """The master holds this process's stdin: at its end (the master died without stopping it) exit, instead of
    holding the GPU for no one."""
    def watch() -> None:
        sys.stdin.buffer.read()
        log.warning("the master is gone: the engine exits")
        logging.shutdown()
        os._exit(0)
    threading.Thread(target=watch, name="master-watch", daemon=True).start()


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
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the master's to handle: it stops the engines after
    _exit_with_the_master()
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
