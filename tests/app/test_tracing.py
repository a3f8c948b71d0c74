"""OpenTelemetry traces (app/web/tracing.py) with an in-memory exporter: the request span, its stages, the batch."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import pytest
from flask import Flask
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app.engine.service import Service
from app.web.tracing import register_tracing
from tests.support.fakes import ColourModel, wait_until
from tests.support.imaging import GREEN, RED, image_bytes

PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture
def traced(app: Flask, service: Service) -> Iterator[tuple[Flask, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    register_tracing(app, service.settings, exporter)
    yield app, exporter


def test_a_request_span_continues_the_callers_trace_and_has_its_stages(traced) -> None:  # noqa: ANN001
    app, exporter = traced
    headers = {"traceparent": f"00-{PARENT_TRACE}-00f067aa0ba902b7-01", "X-Request-ID": "abc"}
    answer = app.test_client().post("/predict", data=image_bytes(RED), content_type="image/jpeg", headers=headers)
    assert answer.status_code == 200
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {"POST /predict", "decode", "queue", "inference", "batch"}
    request = spans["POST /predict"]
    assert format(request.context.trace_id, "032x") == PARENT_TRACE  # continues the incoming traceparent
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["visionserve.request_id"] == "abc"
    for stage in ("decode", "queue", "inference"):
        assert spans[stage].parent.span_id == request.context.span_id
        assert request.start_time <= spans[stage].start_time <= spans[stage].end_time <= request.end_time
    assert spans["decode"].end_time <= spans["queue"].start_time
    assert spans["queue"].end_time == spans["inference"].start_time
    inference, batch = spans["inference"], spans["batch"]
    assert inference.attributes["batch.size"] == 1
    (link,) = inference.links
    assert link.context.span_id == batch.context.span_id and batch.parent is None  # the batch's own trace


def test_requests_batched_together_link_to_one_batch_span(traced, model: ColourModel,  # noqa: ANN001
                                                          service: Service) -> None:
    app, exporter = traced
    client = app.test_client()
    model.batch_sizes.clear()
    model.gate = threading.Event()  # hold the first forward pass so the next requests share a batch
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(client.post, "/predict", data=image_bytes(RED), content_type="image/jpeg")
        wait_until(lambda: len(model.batch_sizes) == 1)
        rest = [pool.submit(client.post, "/predict", data=image_bytes(GREEN), content_type="image/jpeg")
                for _ in range(2)]
        wait_until(lambda: service.loaded_version().batcher.depth == 2)
        model.gate.set()
        assert [f.result(timeout=10).status_code for f in [first, *rest]] == [200] * 3
    spans = exporter.get_finished_spans()
    shared = [s for s in spans if s.name == "inference" and s.attributes["batch.size"] == 2]
    assert len(shared) == 2 and shared[0].links[0].context.span_id == shared[1].links[0].context.span_id
    assert len([s for s in spans if s.name == "batch"]) == 2  # one per batch, not per request


def test_probes_are_not_traced_and_errors_are_marked(traced) -> None:  # noqa: ANN001
    app, exporter = traced
    client = app.test_client()
    client.get("/healthz")
    client.get("/metrics")
    assert client.post("/predict", data=b"nope", content_type="image/jpeg").status_code == 400
    assert [span.name for span in exporter.get_finished_spans()] == ["POST /predict"]  # no stages: never served


def test_tracing_is_off_by_default(app: Flask) -> None:
    assert not any("tracing" in f.__module__ for f in app.before_request_funcs.get(None, []))
