"""The engine process: ``python -m app.link.server SLOT``, started and restarted by the gunicorn master
(app/link/supervisor.py), one per GPU (one on a CPU host). It owns the loaded versions, the reconcile, rollouts, the
monitor, batching, decoding and the forward pass (``Service``); the HTTP workers reach it over a Unix socket in
CONTROL_DIR (app/link/wire.py) through app/link/client.py.

One thread per connection; a connection opens with the hello (a worker running other code is refused and logged),
then carries one exchange at a time:
- ``Infer``: the request admitted (``Service.admit``: readiness, routing, its outcome counted), its images run
  (``Call.infer``) and the ``Served`` answered; while it runs, anything readable from the HTTP side means its client
  hung up (the images still queued are dropped).
- ``Unanswered``: a request the HTTP side refused before sending it, admitted and ended with its error (no answer).
- ``CatalogCall``: one of ``contract.CATALOG_CALLS``; ``StateQuery``: readiness, liveness, draining.
Every answer is an ``Answer`` with the value or the ServiceError, and this engine's pid and routing generation.

Before it listens it loads its models; a model that cannot be served ends it with status 3 and its reason in
``engine-<slot>.failed``, which the HTTP workers read to stop the server with that message.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import pickle
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from app.config import Settings, load_settings
from app.engine.contract import CATALOG_CALLS, Signature, not_ready
from app.engine.service import Service
from app.engine.versions.sources import DirectorySource
from app.errors import InferenceFailed, ServiceError
from app.hosting import control
from app.link import wire

log = logging.getLogger(__name__)
BOOT_ERROR = 3  # as a gunicorn worker's boot error: the master stops instead of restarting it


def _as_error(exc: BaseException) -> ServiceError:
    if isinstance(exc, ServiceError):
        return exc
    return InferenceFailed(f"the engine failed on this request: {type(exc).__name__}: {exc}")


def _parsed_alike(parsed: Signature, answering: Signature, tensors: bool) -> None:
    """NotReady (503: send it again) when the request's tensors were shaped for a version whose input differs from
    the one routing chose (the model changed while the request was on its way; the HTTP side's signatures are then
    stale, and are dropped on this answer). Images are decoded for the answering version whatever it is."""
    if tensors and parsed.input_shape != answering.input_shape:
        raise not_ready(f"{parsed.name} changed while this request was on its way: its tensors are shaped "
                        f"{list(parsed.input_shape)} for version {parsed.version}, and version {answering.version} "
                        f"takes {list(answering.input_shape)}; send it again")


class EngineServer:
    """Serves one engine's ``Service`` to the HTTP workers' connections."""

    def __init__(self, service: Service, path: Path | None = None) -> None:
        self.service, self.path = service, path
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._handlers: dict[type, Callable[[socket.socket, Any, list[bytes]], wire.Answer | None]] = {
            wire.Infer: self._infer, wire.Unanswered: self._unanswered, wire.CatalogCall: self._catalog,
            wire.StateQuery: self._state}

    def bind(self) -> None:
        """Bind (replacing a dead engine's socket file)."""
        assert self.path is not None
        self.path.unlink(missing_ok=True)
        self._listener.bind(str(self.path))
        self._listener.listen(1024)

    def listen(self) -> None:
        """Accept connections until the process ends."""
        log.info("engine listening on %s", self.path)
        while True:
            conn, _ = self._listener.accept()
            threading.Thread(target=self.serve, args=(conn,), name="engine-connection", daemon=True).start()

    def serve(self, conn: socket.socket) -> None:
        """One HTTP worker thread's connection, until it closes or goes out of step (then it is closed)."""
        with conn:
            try:
                wire.answer_hello(conn)
                while True:
                    message, segments = wire.receive_request(conn)
                    answer = self._handlers[type(message)](conn, message, segments)
                    if answer is not None:
                        self._send(conn, answer)
            except wire.WireMismatch as exc:
                log.error("refused a connection: %s", exc)
            except (wire.EngineGone, OSError):
                return  # the HTTP worker closed it (its thread ended, or the worker exited), or it went out of step

    def _answer(self, value: Any = None, error: ServiceError | None = None) -> wire.Answer:
        return wire.Answer(value, error, engine=os.getpid(), routes=self.service.controller.routes.generation)

    def _send(self, conn: socket.socket, answer: wire.Answer) -> None:
        """Send ``answer``; one that does not pickle is answered as the server's error instead (nothing was sent)."""
        try:
            wire.send(conn, answer)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            wire.send(conn, self._answer(error=InferenceFailed(f"the engine's answer could not be sent: {exc}")))

    def _infer(self, conn: socket.socket, message: wire.Infer, images: list[bytes]) -> wire.Answer:
        """One request from admission to its answer."""
        try:
            with self.service.admit(message.model, message.version, message.client_key) as call:
                _parsed_alike(message.parsed_with, call.model, bool(message.tensors))
                served = call.infer(images, message.tensors, timeout_s=message.timeout_s, names=message.names,
                                    client_gone=functools.partial(wire.readable, conn))
        except Exception as exc:  # noqa: BLE001 - every failure is answered, never a dropped connection
            return self._answer(error=_as_error(exc))
        return self._answer(served)

    def _unanswered(self, conn: socket.socket, message: wire.Unanswered, _: list[bytes]) -> None:
        """A request the HTTP side ended before sending it: admitted and ended here as it ended there, so it counts
        in its version's traffic as it would inline."""
        with contextlib.suppress(Exception):
            with self.service.admit(message.model, message.version, message.client_key):
                if message.error is not None:
                    raise message.error

    def _catalog(self, conn: socket.socket, message: wire.CatalogCall, _: list[bytes]) -> wire.Answer:
        if message.method not in CATALOG_CALLS:
            return self._answer(error=InferenceFailed(f"no catalog call {message.method!r}"))
        try:
            value = getattr(self.service.catalog, message.method)(*message.args, **message.kwargs)
        except Exception as exc:  # noqa: BLE001 - answered
            return self._answer(error=_as_error(exc))
        return self._answer(value)

    def _state(self, conn: socket.socket, message: wire.StateQuery, _: list[bytes]) -> wire.Answer:
        service = self.service
        return self._answer(wire.EngineState(ready=service.ready, alive=service.alive, loaded=service.loaded,
                                             draining=service.draining))


def _serve_forever(settings: Settings, slot: int) -> None:
    control_dir = settings.control_dir
    assert control_dir is not None, "the engine process needs CONTROL_DIR (gunicorn.conf.py sets it)"
    try:
        service = Service.build(settings, DirectorySource(settings))
        server = EngineServer(service, control.socket_path(control_dir, slot))
        server.bind()
    except Exception as exc:  # noqa: BLE001 - said once, in the log and for the HTTP workers
        _fail(control_dir, slot, getattr(exc, "message", None) or str(exc))
    control.engine_failure(control_dir, slot).unlink(missing_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: _stop(service, settings))
    server.listen()


def _fail(control_dir: Path, slot: int, message: str) -> None:
    """Say why this engine cannot serve (for the HTTP workers and the master) and exit with the boot error."""
    log.error("cannot serve the model: %s", message)
    failure = control.engine_failure(control_dir, slot)
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
    from app.hosting.host import placed_device, visible_gpus
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
    settings = settings.model_copy(update={"device": device, "worker_slot": slot})
    _serve_forever(settings, slot)


if __name__ == "__main__":
    main()
