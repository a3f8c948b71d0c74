"""OpenTelemetry traces, when the TRACING setting is on (off, nothing here is even imported).

Each request gets a SERVER span that continues the caller's ``traceparent``; once it is answered, its stages
become children placed at their real times: decode, then per batch its images ran in, the queue wait and the
inference, the latter linked to the batch's own span. A batch serves requests from many traces, so it gets a
trace of its own (made by the first request that reports it, kept by id for the others). Health probes, scrapes
and pages are not traced. The exporter, endpoint and service name come from the standard OTEL_* variables.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

from flask import Flask, Response, g, request

from app.config import Settings
from app.web.hooks import is_probe

BATCH_SPANS_KEPT = 1024  # batch span contexts kept for the requests still reporting them


def register_tracing(app: Flask, settings: Settings, exporter: Any = None) -> None:
    """Trace every request of ``app`` (``exporter``: a test's in-memory one; else OTLP over HTTP from OTEL_*)."""
    if not settings.tracing and exporter is None:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create(
        {"service.name": os.environ.get("OTEL_SERVICE_NAME", "visionserve")}))
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    _install_hooks(app, provider.get_tracer("visionserve"))


def _install_hooks(app: Flask, tracer: Any) -> None:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    propagator = TraceContextTextMapPropagator()
    batches: OrderedDict[int, Any] = OrderedDict()

    @app.before_request
    def _start_span() -> None:
        if is_probe(request.path):
            return
        carrier = {name.lower(): value for name, value in request.headers.items()}  # the getter asks lowercase
        g.trace_span = tracer.start_span(
            f"{request.method} {request.path}", context=propagator.extract(carrier),
            kind=trace.SpanKind.SERVER, attributes={"http.request.method": request.method, "url.path": request.path})

    @app.after_request
    def _end_span(response: Response) -> Response:
        span = g.pop("trace_span", None)
        if span is None:
            return response
        span.set_attribute("http.response.status_code", response.status_code)
        span.set_attribute("visionserve.request_id", g.get("request_id", ""))
        if response.status_code >= 500:
            span.set_status(trace.Status(trace.StatusCode.ERROR))
        served = g.get("served")
        if served is not None:
            _stage_spans(tracer, trace.set_span_in_context(span), served, batches)
        span.end()
        return response


def _stage_spans(tracer: Any, parent: Any, served: Any, batches: OrderedDict[int, Any]) -> None:
    from opentelemetry.trace import Link

    decoded_ns = served.started_ns + int(served.decode_s * 1e9)
    tracer.start_span("decode", context=parent, start_time=served.started_ns,
                      attributes={"images": len(served.rows)}).end(end_time=decoded_ns)
    for run in served.batches:
        batch_start = decoded_ns + int(run.queued_s * 1e9)
        batch_end = batch_start + int(run.run_s * 1e9)
        tracer.start_span("queue", context=parent, start_time=decoded_ns).end(end_time=batch_start)
        attributes = {"batch.id": run.batch_id, "batch.size": run.batch_size}
        link = Link(_batch_context(tracer, batches, run.batch_id, batch_start, batch_end, attributes))
        tracer.start_span("inference", context=parent, start_time=batch_start, links=[link],
                          attributes=attributes).end(end_time=batch_end)


def _batch_context(tracer: Any, batches: OrderedDict[int, Any], batch_id: int, start: int, end: int,
                   attributes: dict[str, int]) -> Any:
    """The span context of batch ``batch_id``: made once, in a trace of its own."""
    from opentelemetry import context as otel_context

    if batch_id not in batches:
        span = tracer.start_span("batch", context=otel_context.Context(), start_time=start, attributes=attributes)
        span.end(end_time=end)
        batches[batch_id] = span.get_span_context()
        while len(batches) > BATCH_SPANS_KEPT:
            batches.popitem(last=False)
    return batches[batch_id]
