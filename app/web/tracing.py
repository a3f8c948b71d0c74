"""OpenTelemetry traces, when the TRACING setting is on (off, nothing here is even imported).

Each request gets a SERVER span that continues the caller's ``traceparent``, named as HTTP's semantic conventions
say: its method and the route it matched (``POST /v2/models/<name>/infer``), its method alone when none did, so
neither a path nor a made-up method becomes a span name (``url.path`` keeps the path). Its hook runs before the
request-wide one, so a request that one refuses (401, 413) is traced too. Once it is answered, its stages become
children placed at their real times: decode, then per batch its images ran in, the queue wait and the inference, the
latter linked to the batch's own span. A batch serves requests from many traces, so it gets a trace of its own,
made by the first sampled request that reports it and kept, under what tells that batch from any other, for the
others; always exported, whatever the requests' sampler (each batch span has a sampled request linking to it). A
sampled request's span starts when its worker had it whole, and its access line carries its trace and span ids.
Health probes, scrapes and pages are not traced; an unsampled request makes no span at all. The exporter, endpoint,
sampler and service name come from the standard OTEL_* variables.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Any, Hashable

from flask import Flask, Response, g, request

from app.config import Settings
from app.web.hooks import is_probe, received_at

log = logging.getLogger(__name__)

BATCH_SPANS_KEPT = 1024  # batch span contexts kept for the requests still reporting them
EXIT_FLUSH_S = 2.0  # how long a process's last spans may take to go out when it exits (a collector away included)
# HTTP's methods as the semantic conventions know them (RFC 9110's and PATCH); any other is "_OTHER". They ask
# for OTEL_INSTRUMENTATION_HTTP_KNOWN_METHODS to replace the list.
KNOWN_METHODS = frozenset({"CONNECT", "DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "TRACE"})


def register_tracing(app: Flask, settings: Settings, exporter: Any = None) -> None:
    """Trace every request of ``app`` (``exporter``: a test's in-memory one; else OTLP over HTTP from OTEL_*)."""
    if not settings.tracing and exporter is None:
        return
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        processor: Any = BatchSpanProcessor(counted_exporter(OTLPSpanExporter()))
    else:
        processor = SimpleSpanProcessor(counted_exporter(exporter))
    resource = service_resource()
    # Not the SDK's own exit handler: it waits for an export in flight and then sends the rest, each export up to
    # OTEL_EXPORTER_OTLP_TIMEOUT with retries, so with the collector away a worker's stop took 8-19 s.
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)  # OTEL_TRACES_SAMPLER's sampler
    provider.add_span_processor(processor)
    # A batch span is made only for a sampled request that ran in it, and its trace is a root of its own: under
    # the requests' sampler a ratio would drop most of them on its own draw, leaving the requests' links to nothing.
    batches = TracerProvider(resource=resource, sampler=ALWAYS_ON, shutdown_on_exit=False)
    batches.add_span_processor(processor)
    atexit.register(shutdown_within, provider, EXIT_FLUSH_S)  # the processor both share: its spans sent
    _install_hooks(app, provider.get_tracer("visionserve"), batches.get_tracer("visionserve"))


def counted_exporter(exporter: Any) -> Any:
    """``exporter`` whose failed exports count their spans in visionserve_trace_spans_unsent_total: the SDK says
    a failure in the log alone, so an alert could not tell that traces are being lost."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from app.metrics import TRACE_SPANS_UNSENT

    class Counted(SpanExporter):
        def export(self, spans: Any) -> Any:
            try:
                result = exporter.export(spans)
            except Exception:
                TRACE_SPANS_UNSENT.inc(len(spans))
                raise
            if result is not SpanExportResult.SUCCESS:
                TRACE_SPANS_UNSENT.inc(len(spans))
            return result

        def shutdown(self) -> None:
            exporter.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return exporter.force_flush(timeout_millis)

    return Counted()


def service_resource() -> Any:
    """The spans' resource from the standard variables (OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME), its
    ``service.name`` ``visionserve`` when neither names one."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "unknown_service")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "visionserve"}))
    return resource


def shutdown_within(provider: Any, timeout_s: float) -> bool:
    """Shut ``provider`` down, its last spans sent, for at most ``timeout_s``: True when it finished in time. The
    shutdown runs on a daemon thread, left behind when the time is up (the process is on its way out: a worker ends
    with os._exit, app/hosting/drain.py's exit_now), so a stalled collector costs a stop no more than the bound."""
    try:
        thread = threading.Thread(target=provider.shutdown, name="tracing-exit", daemon=True)
        thread.start()
    except RuntimeError:  # Python 3.12+ starts no thread once the interpreter finalizes: the unsent spans are lost
        return False
    thread.join(timeout_s)
    return not thread.is_alive()


def _known_methods() -> frozenset[str]:
    """The methods named as they are: the conventions' list, or the one OTEL_INSTRUMENTATION_HTTP_KNOWN_METHODS
    gives (comma-separated, case-sensitive, replacing it)."""
    given = os.environ.get("OTEL_INSTRUMENTATION_HTTP_KNOWN_METHODS")
    if given is None:
        return KNOWN_METHODS
    return frozenset(method.strip() for method in given.split(",") if method.strip())


def _install_hooks(app: Flask, tracer: Any, batch_tracer: Any) -> None:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    propagator = TraceContextTextMapPropagator()
    batches = BatchSpans(batch_tracer)
    known = _known_methods()

    def _start_span() -> None:
        req = request._get_current_object()
        if is_probe(req.path):
            return
        carrier = {name.lower(): value for name, value in req.headers.items()}  # the getter asks lowercase
        method = req.method if req.method in known else "_OTHER"
        attributes = {"http.request.method": method, "url.path": req.path, "url.scheme": req.scheme}
        original = req.environ.get("REQUEST_METHOD", method)  # werkzeug upper-cases the method it hands over
        if original != method:
            attributes["http.request.method_original"] = original
        name = "HTTP" if method == "_OTHER" else method
        if req.url_rule is not None:  # the rule's template: a path (a model's name, a stranger's probe) never is
            attributes["http.route"] = req.url_rule.rule
            name = f"{name} {req.url_rule.rule}"
        g.trace_span = span = tracer.start_span(name, context=propagator.extract(carrier),
                                                kind=trace.SpanKind.SERVER, attributes=attributes,
                                                start_time=_received_ns(req.environ))
        if span.is_recording():  # its access line names the trace (app/web/hooks.py adds the fields it finds)
            context = span.get_span_context()
            g.log_fields = {"trace_id": format(context.trace_id, "032x"), "span_id": format(context.span_id, "016x")}

    # First of the before hooks, whenever registered: the request-wide hook (app/web/hooks.py) refuses requests
    # (401, 413) by raising, and Flask then calls no later before hook. Not a second hook on every request: off,
    # tracing installs none.
    app.before_request_funcs.setdefault(None, []).insert(0, _start_span)

    @app.after_request
    def _end_span(response: Response) -> Response:
        span = g.pop("trace_span", None)
        if span is None:
            return response
        try:
            if span.is_recording():  # not, when the caller's traceparent says unsampled: nothing of it is kept
                _describe(span, response.status_code, tracer, batches)
        except Exception:  # noqa: BLE001 - a trace is never worth a request's answer
            log.exception("tracing a request failed; its answer stands")
        finally:
            span.end()
        return response


def _received_ns(environ: dict[str, Any]) -> int:
    """When the worker had the request whole (its ``time.monotonic()`` on the socket it hands over), in the epoch's
    nanoseconds: the request's duration in the histogram and the access line counts from then, a wait for a request
    thread (a burst beyond THREADS) included; now, where no worker said."""
    arrived = received_at(environ)
    now_ns = time.time_ns()
    return now_ns if arrived is None else now_ns - max(0, int((time.monotonic() - arrived) * 1e9))


def _describe(span: Any, status: int, tracer: Any, batches: BatchSpans) -> None:
    """The answered request's attributes and status on ``span``, and its stages under it."""
    from opentelemetry import trace

    span.set_attribute("http.response.status_code", status)
    span.set_attribute("visionserve.request_id", g.get("request_id", ""))
    if status >= 500:  # a 4xx is the client's: a SERVER span's status stays unset (the conventions)
        span.set_attribute("error.type", str(status))
        span.set_status(trace.Status(trace.StatusCode.ERROR))
    served = g.get("served")
    if served is not None:
        _stage_spans(tracer, trace.set_span_in_context(span), served, batches)


def _stage_spans(tracer: Any, parent: Any, served: Any, batches: BatchSpans) -> None:
    from opentelemetry.trace import Link

    decoded_ns = served.started_ns + int(served.decode_s * 1e9)
    tracer.start_span("decode", context=parent, start_time=served.started_ns,
                      attributes={"images": len(served.rows)}).end(end_time=decoded_ns)
    model, version = served.model, served.version
    for run in served.batches:
        batch_start = decoded_ns + int(run.queued_s * 1e9)
        batch_end = batch_start + int(run.run_s * 1e9)
        tracer.start_span("queue", context=parent, start_time=decoded_ns).end(end_time=batch_start)
        attributes = {"batch.id": run.batch_id, "batch.size": run.batch_size, "visionserve.model": model,
                      "visionserve.version": version}
        # A batch id counts one version's batches in one batcher: another model, another version, a version loaded
        # again or an engine process restarted count from 1 as well. The answer does not say which engine ran it,
        # but the batch's size and forward-pass time (one float, the same for every request of the batch) tell
        # two batches of one id apart.
        key = (model, version, run.batch_id, run.batch_size, run.run_s)
        link = Link(batches.context(key, batch_start, batch_end, attributes))
        tracer.start_span("inference", context=parent, start_time=batch_start, links=[link],
                          attributes=attributes).end(end_time=batch_end)


class BatchSpans:
    """The span contexts of the batches requests reported lately (the last BATCH_SPANS_KEPT), each batch's span
    made once, by the first request that reports it; requests report from many threads at once."""

    def __init__(self, tracer: Any) -> None:
        self._tracer = tracer
        self._contexts: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def context(self, key: Hashable, start: int, end: int, attributes: dict[str, Any]) -> Any:
        """The span context of batch ``key``; its span, in a trace of its own, made now when it has none."""
        from opentelemetry import context as otel_context

        with self._lock:  # looked up and made in one step: two requests of a batch, one span
            known = self._contexts.get(key)
            if known is not None:
                return known
            span = self._tracer.start_span("batch", context=otel_context.Context(), start_time=start,
                                           attributes=attributes)
            self._contexts[key] = made = span.get_span_context()
            if len(self._contexts) > BATCH_SPANS_KEPT:
                self._contexts.popitem(last=False)
        span.end(end_time=end)  # outside the lock: a synchronous exporter sends it here
        return made
