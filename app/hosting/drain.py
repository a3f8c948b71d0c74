"""SIGTERM in a gunicorn worker: drain with the listener open, then close it with nothing left in its backlog.

gunicorn alone stops accepting at SIGTERM but closes its listener only after the requests in flight finish:
connections arriving meanwhile wait unanswered in the listen backlog, and the kernel resets them when the listener
closes (24 of 96 requests in a burst, measured). Here readiness turns off at once and the worker keeps accepting
for ``shutdown_drain_s``, answering new requests as before, each answer with Connection: close (a load balancer that
has not noticed yet, or a HUP's new worker still loading, loses nothing meanwhile), then until the requests it
holds are answered, new ones getting 503 with Connection: close; all this while no other worker serves: one that
does (a HUP's new worker once loaded, the others when one worker is told to stop) gets the new connections instead
(``worker.draining``, app/hosting/worker.py; a worker still loading leaves them to the draining one while it
answers: its leaving mark, app/hosting/control.py); a whole-server stop drains every worker.
Then, on the worker's own event-loop thread, it accepts whatever is still queued (each gets its 503), closes its
listeners in the same step, so a later connect is refused (never sent, safe to retry elsewhere), and hands over to
gunicorn's graceful stop. A second SIGTERM changes nothing (a signal to the whole process group reaches the
worker twice: directly and from the master); SIGINT and SIGQUIT stop at once, as gunicorn's own. Once the worker
has stopped (its service shut down), it exits without the interpreter's teardown (``exit_now``). A HUP's old
worker answers on past ``shutdown_drain_s`` while its new worker still loads and none serves (their CONTROL_DIR marks,
``control.replacement_loading``), as long as what it admits last can still be answered in time: a new worker that
loads longer than the drain (8-9.5 s under load with two inline workers) no longer leaves a gap of 503s.
Imports only the standard library and app.hosting.control (standard library too): gunicorn.conf.py loads it in the
master.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from functools import partial
from typing import Any, Callable

from app.hosting import control


def _accept_queued_then_close(worker: Any) -> None:
    """On the worker's loop thread: take every connection already in the backlog, then close the listeners. While
    another worker still serves (app/hosting/worker.py's ``leaves_backlog``), the backlog is left to it."""
    worker.set_accept_enabled(False)
    leaves_backlog = getattr(worker, "leaves_backlog", lambda: False)()
    for listener in worker.sockets:
        with contextlib.suppress(OSError):
            while not leaves_backlog:
                before = _taken(worker)
                worker.accept(listener)  # non-blocking: stops at EAGAIN without counting a connection
                if _taken(worker) == before:
                    break
        listener.close()


def _taken(worker: Any) -> int:
    """How many connections ``worker`` has taken from its backlog: our worker's ``accepts`` (one refused at once,
    MAX_CONNECTIONS_PER_CLIENT's, adds no open connection), gthread's open ones otherwise."""
    accepts = getattr(worker, "accepts", None)
    return worker.nr_conns if accepts is None else accepts


def install(worker: Any, service_of: Callable[[Any], Any], drain_s: float, limit_s: float) -> None:
    """Replace the worker's SIGTERM handler with drain-then-stop (gthread workers; others keep gunicorn's)."""
    previous = signal.getsignal(signal.SIGTERM)
    if not callable(previous):
        return
    gthread = all(hasattr(worker, name) for name in ("method_queue", "set_accept_enabled", "accept", "nr_conns"))

    def stop() -> None:
        previous(signal.SIGTERM, None)  # gthread's handler only flags the loop and wakes it: safe from any thread

    def close_and_stop() -> None:
        _accept_queued_then_close(worker)
        stop()

    control_dir = getattr(worker, "control_dir", None)
    answer_on = None if control_dir is None else partial(control.replacement_loading, control_dir, os.getpid())

    def drain_then_stop(service: Any) -> None:
        began = time.monotonic()
        drained = service.wait_drained(drain_s, limit_s, answer_on)  # (a HUP's old worker: on while the new one loads)
        left = service.in_flight.count()
        _log(worker).info("worker %d drained in %.1f s%s", os.getpid(), time.monotonic() - began,
                          "" if drained else f": {left} request(s) still unanswered at its limit ({limit_s:g} s)")
        if gthread:
            worker.method_queue.defer(close_and_stop)
        else:
            stop()

    def on_term(signum: int, frame: Any) -> None:
        service = service_of(worker)
        if service is None:  # the app is not even imported: nothing to drain
            stop()
            return
        if service.draining:  # a second SIGTERM (the master's, after one sent to the whole process group)
            return
        service.begin_drain(limit_s)  # a request accepted in the drain is answered within it
        _log(worker).info("worker %d drains: not ready; new requests answered for %g s (each closing its "
                          "connection), then 503 until the %d in flight are answered (%g s at most)", os.getpid(),
                          drain_s, service.in_flight.count(), limit_s)
        worker.draining = True  # a worker that serves takes its new connections (app/hosting/worker.py)
        threading.Thread(target=drain_then_stop, args=(service,), name="drain", daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)


def _log(worker: Any) -> Any:
    """The worker's gunicorn logger (its error log, where gunicorn says what a worker does), or this module's."""
    return getattr(worker, "log", None) or logging.getLogger(__name__)


def exit_now(exiting: BaseException | None) -> None:
    """End a worker whose service has shut down with the status gunicorn was exiting with (``exiting``: the
    SystemExit on its way out), after the exit functions (a tracer's last spans, sent for at most
    app/web/tracing.py's EXIT_FLUSH_S) and the logs, but without the interpreter's teardown: with torch loaded,
    collecting and freeing every module took 0.6 s of CPU per worker on the 2-core VM, a third of a server's stop
    (the engine process ends through it too). Anything but a SystemExit (an exception on its way to gunicorn's
    handler) is left to take its course."""
    if not isinstance(exiting, SystemExit):
        return
    code = exiting.code
    status = code if isinstance(code, int) else (0 if code is None else 1)
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status & 0xFF)
