"""The worker's WSGI app from its first second: it answers while torch, Flask and the app are imported, then hands over.

A gunicorn worker imported torch and the app before it could answer anything (about 3.5 s here), so connections
made meanwhile waited in the listen backlog. ``StartingApp`` is what gunicorn loads instead (app/wsgi.py): it
starts a thread that imports and builds the real app, answers every request at once until that app exists, then
passes every request to it, in the same worker, with no restart and no connection dropped.

Meanwhile it answers as the real app does while its model loads: ``/healthz`` and ``/v2/health/live`` 200, ``/v2``
the server's metadata, ``/readyz``, ``/v2/health/ready`` and a model's V2 readiness (``{"name": ..., "ready":
false}``) 503, everything else ``503 not_ready`` with ``Retry-After`` (the OpenAPI document lists it on every
operation), in the error shape of the path (``{"error": "<message>"}`` under /v2), with an ``X-Request-ID`` and one
access-log line. It checks no API key (its answers hold nothing but "starting"), and closes the connection after a
body it cannot have read (chunked, over ``max_body_bytes``, or sent after ``100 Continue``). Its answers are counted
as the app counts them (``visionserve_requests_total``, endpoint ``starting``; a probe's in
``visionserve_probe_requests_total``), held here and written once the app exists (``_hand_over``): a reload's 503s
count in the 5xx ratio. Standard library and request_framing's error shape and request id only (the worker class
loaded it already): no request waits for the imports it is answering around.
"""
from __future__ import annotations

import collections
import json
import logging
import re
import threading
import time
from typing import Any, Callable, Iterable

from app import __version__
from app.hosting.request_framing import error_body, request_id_of
from app.logs import ACCESS_LOGGER

StartResponse = Callable[..., Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

RETRY_AFTER_S = 5  # app.engine.lifecycle.NOT_READY_RETRY_S (a test keeps them equal): every 503's Retry-After
MESSAGE = "the model is still loading"  # what app.engine.service says while loading (a test compares)

# Probes answered as the loading app answers them: path -> (status, body).
PROBES: dict[str, tuple[int, dict[str, Any]]] = {
    "/healthz": (200, {"status": "alive", "checks": {"batcher_thread": True}}),
    "/readyz": (503, {"status": "not_ready", "checks": {"model_loaded": False, "warmed_up": False,
                                                        "batcher_thread": True, "not_draining": True,
                                                        "accepting": True}}),
    "/v2/health/live": (200, {"live": True}),
    "/v2/health/ready": (503, {"ready": False}),
}
V2_EXTENSIONS = ["classification", "binary_tensor_data", "model_repository"]  # app.v2.routes.EXTENSIONS (a test
# keeps them equal)
# Answered as the app answers them whatever its models' state, and not probes: the V2 server's metadata.
ANSWERED: dict[str, tuple[int, dict[str, Any]]] = {
    "/v2": (200, {"name": "visionserve", "version": __version__, "extensions": V2_EXTENSIONS}),
}
_REASONS = {200: "OK", 503: "Service Unavailable"}

access_log = logging.getLogger(ACCESS_LOGGER)
log = logging.getLogger(__name__)


def force_close(start_response: StartResponse) -> None:
    """Make gunicorn close the connection after this answer (it drops an app's own ``Connection`` header); its
    ``start_response`` is a bound method of the response, which has ``force_close``. Other servers: nothing."""
    close = getattr(getattr(start_response, "__self__", None), "force_close", None)
    if callable(close):
        close()


def _unread_body(environ: dict[str, Any], max_body_bytes: int) -> bool:
    """A body the worker's event loop did not read whole: chunked, announced over the limit, or sent after
    gunicorn's ``100 Continue`` (it skips at most 64 KiB of one before the next request, then drops the
    connection its answer called kept alive)."""
    if "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower():
        return True
    length = environ.get("CONTENT_LENGTH") or "0"
    if not length.isdigit() or int(length) > max_body_bytes:
        return True
    return int(length) > 0 and environ.get("HTTP_EXPECT", "").strip().lower() == "100-continue"


# A model's or a version's V2 readiness (app/v2/routes.py's model_ready): its own shape, not ready
_MODEL_READY = re.compile(r"/v2/models/([^/]+)(?:/versions/[^/]+)?/ready")


def starting_answer(environ: dict[str, Any], request_id: str) -> tuple[int, dict[str, Any], dict[str, str]]:
    """Status, JSON body and extra headers for a request that arrives before the app exists."""
    path = environ.get("PATH_INFO", "")
    if path in PROBES or path in ANSWERED:
        status, body = PROBES.get(path) or ANSWERED[path]
        return status, body, {}
    if (model := _MODEL_READY.fullmatch(path)) is not None:
        return 503, {"name": model[1], "ready": False}, {}
    return 503, error_body(path, "not_ready", MESSAGE, request_id), {"Retry-After": str(RETRY_AFTER_S)}


class StartingApp:
    """A WSGI app that builds the real one on a thread and answers for it until then (see the module docstring).

    ``load`` imports what the app needs (the slow part) and returns a function that builds it; the worker's stop
    is checked between the two, so a worker told to stop while importing builds nothing. ``on_error`` gets an
    import or build failure (app/wsgi.py ends the worker with gunicorn's boot-error status).
    """

    def __init__(self, load: Callable[[], Callable[[], WSGIApp]], on_error: Callable[[BaseException], None],
                 max_body_bytes: int, count: Callable[[bool, str, int, int], None] | None = None) -> None:
        self.max_body_bytes = max_body_bytes
        self._count = count or count_answers  # (probe, path, status, times) into the metrics
        self.app: WSGIApp | None = None
        self._load, self._on_error = load, on_error
        self._counted: collections.Counter[tuple[bool, str, int]] = collections.Counter()  # (probe, path, status)
        self._counting = threading.Lock()
        self._handed_over = False  # the counts written to the metrics: later answers are written as they come
        # Not a daemon: a worker that stops mid-import waits for the import to end instead of finalising the
        # interpreter under it; then it builds nothing (_stopping).
        self._thread = threading.Thread(target=self._run, name="app-import")

    def start(self) -> "StartingApp":
        """Begin importing and building the real app."""
        self._thread.start()
        return self

    @property
    def extensions(self) -> dict[str, Any]:
        """The real app's extensions once it exists (gunicorn.conf.py finds the service there), else none."""
        return getattr(self.app, "extensions", {})

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the real app (tests); returns whether it exists."""
        self._thread.join(timeout_s)
        return self.app is not None

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            build = self._load()
            if _stopping():
                return
            self._hand_over(build())
        except BaseException as exc:  # noqa: BLE001 - handed to on_error, which decides the worker's fate
            if _stopping():  # imports fail at interpreter shutdown (atexit registrations): not the app's fault
                log.debug("the app was not built: the worker is stopping", exc_info=exc)
                return
            self._on_error(exc)
            return
        log.info("the app took over", extra={"import_s": round(time.perf_counter() - started, 2)})

    def _hand_over(self, app: WSGIApp) -> None:
        """The real app takes every request from now on; what was answered until then is written to its metrics."""
        with self._counting:
            self.app, self._handed_over = app, True
            counted, self._counted = self._counted, collections.Counter()
        for (probe, path, status), times in counted.items():
            self._count(probe, path, status, times)

    def _note(self, probe: bool, path: str, status: int) -> None:
        path = path if probe else ""  # (a probe's series is its path; traffic's is the endpoint "starting")
        with self._counting:
            if not self._handed_over:
                self._counted[probe, path, status] += 1
                return
        self._count(probe, path, status, 1)  # answered just as the app took over: the metrics are imported

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        app = self.app
        if app is not None:
            return app(environ, start_response)
        return self._answer(environ, start_response)

    def _answer(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        started = time.perf_counter()
        said_id = request_id_of(environ.get("HTTP_X_REQUEST_ID"))
        status, body, headers = starting_answer(environ, said_id)
        data = json.dumps(body).encode()
        if _unread_body(environ, self.max_body_bytes):
            force_close(start_response)
            headers["Connection"] = "close"
        start_response(f"{status} {_REASONS[status]}", [
            ("Content-Type", "application/json"), ("Content-Length", str(len(data))), ("X-Request-ID", said_id),
            *headers.items()])
        path = environ.get("PATH_INFO", "")
        probe = path in PROBES
        self._note(probe, path, status)
        access_log.log(logging.DEBUG if probe else logging.INFO, "request", extra={
            "request_id": said_id, "client": environ.get("REMOTE_ADDR"), "method": environ.get("REQUEST_METHOD"),
            "route": "starting", "path": path, "status": status,
            "error": None if status < 400 or probe else "not_ready",
            "duration_ms": round((time.perf_counter() - started) * 1000, 2)})
        return [data]


def count_answers(probe: bool, path: str, status: int, times: int) -> None:
    """``times`` answers of the starting app in the metrics, as the app counts its own (app/web/hooks.py)."""
    from app.metrics import PROBES as PROBE_REQUESTS, REQUESTS, STARTING, series

    if probe:
        series(PROBE_REQUESTS, path, str(status)).inc(times)
    else:
        series(REQUESTS, STARTING, str(status)).inc(times)


def _stopping() -> bool:
    """The worker's main thread has ended (it is exiting, and waits for this thread)."""
    return not threading.main_thread().is_alive()
