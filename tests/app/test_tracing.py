"""OpenTelemetry traces (app/web/tracing.py) with an in-memory exporter: the request span, its stages, the batch."""
from __future__ import annotations

import atexit
import itertools
import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import pytest
from flask import Flask
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app import EXTENSION_KEY
from app.config import Settings
from app.engine.loaded.predictor import Predictor
from app.engine.service import Service
from app.factory import create_app
from app.web import tracing
from app.web.tracing import register_tracing
from tests.support.fakes import ColourModel, several_models_app, wait_until
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

def _one_then_two_batched(app: Flask, model: ColourModel, service: Service) -> None:
    """Three /predict requests: the first's forward pass held until the next two queue, so they share a batch."""
    client = app.test_client()
    model.batch_sizes.clear()
    model.gate = threading.Event()
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(client.post, "/predict", data=image_bytes(RED), content_type="image/jpeg")
        wait_until(lambda: len(model.batch_sizes) == 1)
        rest = [pool.submit(client.post, "/predict", data=image_bytes(GREEN), content_type="image/jpeg")
                for _ in range(2)]
        wait_until(lambda: service.loaded_version().batcher.depth == 2)
        model.gate.set()
        assert [f.result(timeout=30).status_code for f in [first, *rest]] == [200] * 3


def test_requests_batched_together_link_to_one_batch_span(traced, model: ColourModel,  # noqa: ANN001
                                                          service: Service) -> None:
    app, exporter = traced
    _one_then_two_batched(app, model, service)
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


def _links(spans) -> dict[str, int]:  # noqa: ANN001
    """Each inference span's model and version -> the span id of the batch span it links to."""
    return {f"{s.attributes['visionserve.model']} {s.attributes['visionserve.version']}": s.links[0].context.span_id
            for s in spans if s.name == "inference"}


def test_batches_of_other_models_and_versions_link_to_their_own_batch_span(settings: Settings) -> None:
    # Before: batch spans were kept by batch id alone, which every version's batcher counts from 1: the second and
    # third request's inference linked to the first one's batch (colour 1's), and only one batch span was made.
    exporter = InMemorySpanExporter()
    with several_models_app(settings) as app:
        register_tracing(app, settings, exporter)
        client = app.test_client()
        for query in ("model=colour&version=1", "model=colour&version=2", "model=shade"):
            assert client.post(f"/predict?{query}", data=image_bytes(RED), content_type="image/jpeg").status_code == 200
    spans = exporter.get_finished_spans()
    batches = {s.context.span_id: s for s in spans if s.name == "batch"}
    links = _links(spans)
    assert set(links) == {"colour 1", "colour 2", "shade 1"} and len(set(links.values())) == 3
    for served, batch_id in links.items():  # each links to the batch span of its own version, all batch 1
        batch = batches[batch_id]
        assert f"{batch.attributes['visionserve.model']} {batch.attributes['visionserve.version']}" == served
        assert batch.attributes["batch.id"] == 1


def test_a_batcher_counting_from_1_again_gets_new_batch_spans(traced, service: Service) -> None:  # noqa: ANN001
    # An engine process restarted (or a version loaded again) counts its batches from 1 again: its batch 1 is not
    # the batch 1 before it. Before: the second request linked to the first one's batch span.
    app, exporter = traced
    client = app.test_client()
    assert client.post("/predict", data=image_bytes(RED), content_type="image/jpeg").status_code == 200
    service.loaded_version().batcher._batch_ids = itertools.count(1)  # as a new batcher counts
    assert client.post("/predict", data=image_bytes(RED), content_type="image/jpeg").status_code == 200
    spans = exporter.get_finished_spans()
    inference = [s for s in spans if s.name == "inference"]
    assert [s.attributes["batch.id"] for s in inference] == [1, 1]
    assert inference[0].links[0].context.span_id != inference[1].links[0].context.span_id
    assert len([s for s in spans if s.name == "batch"]) == 2


def test_span_names_are_the_method_and_route_never_the_path(traced) -> None:  # noqa: ANN001
    # Before: "{method} {path}": every unknown path, model name and made-up method was a span name of its own.
    app, exporter = traced
    client = app.test_client()
    client.get("/wp-admin/a8f3c1d2")
    client.post("/v2/models/x9f81/infer", json={})
    client.open("/predict", method="PROPFIND")
    client.post("/v2/models/colour/versions/123456/infer", json={})
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["GET", "POST /v2/models/<name>/infer", "HTTP",
                                       "POST /v2/models/<name>/versions/<version>/infer"]
    unmatched, model, other, versioned = spans
    assert unmatched.attributes["url.path"] == "/wp-admin/a8f3c1d2" and "http.route" not in unmatched.attributes
    assert model.attributes["url.path"] == "/v2/models/x9f81/infer"
    assert model.attributes["http.route"] == "/v2/models/<name>/infer"
    assert other.attributes["http.request.method"] == "_OTHER"
    assert other.attributes["http.request.method_original"] == "PROPFIND"
    assert other.attributes["http.response.status_code"] == 405
    assert versioned.attributes["http.request.method"] == "POST" and versioned.attributes["url.scheme"] == "http"
    assert "http.request.method_original" not in versioned.attributes


class _HoldingExporter(InMemorySpanExporter):
    """Holds the first batch span of a batch of two until another request's inference span has been exported, so
    two requests of one batch report it at once."""

    def __init__(self) -> None:
        super().__init__()
        self.inference_sent = threading.Event()
        self.held = False

    def export(self, spans):  # noqa: ANN001, ANN201
        span = spans[0]
        if span.name == "batch" and span.attributes["batch.size"] == 2 and not self.held:
            self.held = True
            self.inference_sent.wait(timeout=10)
        elif span.name == "inference" and span.attributes["batch.size"] == 2 and self.held:
            self.inference_sent.set()
        return super().export(spans)


def test_requests_of_one_batch_reporting_at_once_make_one_batch_span(app: Flask, model: ColourModel,
                                                                     service: Service) -> None:
    # Before: looked up, then made, then kept without a lock: while the first request made the batch's span, the
    # second found none kept and made another.
    exporter = _HoldingExporter()
    register_tracing(app, service.settings, exporter)
    _one_then_two_batched(app, model, service)
    spans = exporter.get_finished_spans()
    assert exporter.held and exporter.inference_sent.is_set()  # the two reported the batch at once
    shared = [s for s in spans if s.name == "batch" and s.attributes["batch.size"] == 2]
    assert len(shared) == 1
    assert {s.links[0].context.span_id for s in spans if s.name == "inference" and s.attributes["batch.size"] == 2} \
        == {shared[0].context.span_id}


class _StalledExporter:
    """An OTLP exporter whose collector never answers: an export waits until released."""

    def __init__(self) -> None:
        self.exporting, self.released = threading.Event(), threading.Event()

    def export(self, spans):  # noqa: ANN001, ANN201
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.exporting.set()
        self.released.wait(timeout=60)
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.released.set()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def test_a_stalled_collector_holds_the_exit_for_the_bound_only(app: Flask, service: Service,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the SDK's own exit handler waited for the export in flight (up to 30 s), then sent the rest, each
    # export up to OTEL_EXPORTER_OTLP_TIMEOUT with retries: a worker's stop took 8-19 s with the collector away.
    from opentelemetry.exporter.otlp.proto.http import trace_exporter

    stalled = _StalledExporter()
    monkeypatch.setattr(trace_exporter, "OTLPSpanExporter", lambda: stalled)
    monkeypatch.setattr(tracing, "EXIT_FLUSH_S", 0.05)
    registered: list[tuple[object, tuple[object, ...]]] = []
    monkeypatch.setattr(atexit, "register", lambda func, *args: registered.append((func, args)))
    register_tracing(app, service.settings.model_copy(update={"tracing": True}))
    try:
        assert [(func, args[1:]) for func, args in registered] == [(tracing.shutdown_within, (0.05,))]
        assert app.test_client().post("/predict", data=image_bytes(RED), content_type="image/jpeg").status_code == 200
        func, args = registered[0]
        assert func(*args) is False  # it returned, the bound passed, with the export still waiting
        assert stalled.exporting.is_set() and not stalled.released.is_set()
    finally:
        stalled.released.set()


def test_requests_the_hooks_refuse_are_traced(settings: Settings, predictor: Predictor) -> None:
    # Before: the tracing hook ran after the request-wide one, which refuses by raising: no span for a 401 or 413.
    app = create_app(Settings.model_validate({**settings.model_dump(), "api_key": "s3cret"}), predictor)
    try:
        exporter = InMemorySpanExporter()
        register_tracing(app, settings, exporter)
        client = app.test_client()
        assert client.post("/predict", data=image_bytes(RED), content_type="image/jpeg").status_code == 401
        big = b"x" * (settings.max_body_bytes + 1)
        answer = client.post("/predict", data=big, content_type="image/jpeg", headers={"X-API-Key": "s3cret"})
        assert answer.status_code == 413
        spans = exporter.get_finished_spans()
        assert [(s.name, s.attributes["http.response.status_code"]) for s in spans] == [
            ("POST /predict", 401), ("POST /predict", 413)]
        assert all(s.attributes["visionserve.request_id"] for s in spans)
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_an_unsampled_request_makes_no_span(traced) -> None:  # noqa: ANN001
    # Before: its own span was not recorded, but the batch it ran in got a root span of its own, exported.
    app, exporter = traced
    headers = {"traceparent": f"00-{PARENT_TRACE}-00f067aa0ba902b7-00"}
    answer = app.test_client().post("/predict", data=image_bytes(RED), content_type="image/jpeg", headers=headers)
    assert answer.status_code == 200
    assert exporter.get_finished_spans() == ()


def test_a_trace_that_fails_never_fails_the_answer(traced, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
                                                   caplog: pytest.LogCaptureFixture) -> None:
    # Before: an exception making the stages' spans left the request's span unended and the answer a 500.
    app, exporter = traced

    def broken(*args: object) -> None:
        raise RuntimeError("stage spans broke")

    monkeypatch.setattr(tracing, "_stage_spans", broken)
    with caplog.at_level(logging.ERROR, logger=tracing.__name__):
        answer = app.test_client().post("/predict", data=image_bytes(RED), content_type="image/jpeg")
    assert answer.status_code == 200 and answer.get_json()["predictions"]
    assert [s.name for s in exporter.get_finished_spans()] == ["POST /predict"]  # ended all the same
    assert "stage spans broke" in caplog.text


def test_a_ratio_sampler_keeps_the_batch_spans_its_sampled_requests_link_to(
        app: Flask, service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: each batch span was a root the requests' sampler drew for on its own; at a ratio of 1% about 99% of
    # them were dropped while the sampled requests' inference spans still linked to them.
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")  # no new trace is sampled: a caller's sampled one is
    exporter = InMemorySpanExporter()
    register_tracing(app, service.settings, exporter)
    client = app.test_client()
    for i in range(3):
        headers = {"traceparent": f"00-{PARENT_TRACE[:-1]}{i}-00f067aa0ba902b7-01"}
        assert client.post("/predict", data=image_bytes(RED), content_type="image/jpeg",
                           headers=headers).status_code == 200
    assert client.post("/predict", data=image_bytes(RED), content_type="image/jpeg").status_code == 200  # none
    spans = exporter.get_finished_spans()
    batches = {s.context.span_id for s in spans if s.name == "batch"}
    links = [s.links[0].context.span_id for s in spans if s.name == "inference"]
    assert len(links) == 3 and set(links) == batches  # each sampled request's batch, and no other


def test_the_service_name_comes_from_the_standard_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: service.name was OTEL_SERVICE_NAME or "visionserve", overriding OTEL_RESOURCE_ATTRIBUTES' own.
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=vision-prod,deployment.environment=prod")
    attributes = tracing.service_resource().attributes
    assert attributes["service.name"] == "vision-prod" and attributes["deployment.environment"] == "prod"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "vision-eu")  # the SDK's order: it wins over the attributes
    assert tracing.service_resource().attributes["service.name"] == "vision-eu"
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES")
    assert tracing.service_resource().attributes["service.name"] == "visionserve"


def test_a_request_span_starts_when_its_worker_had_it_and_its_access_line_names_the_trace(
        traced, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    # Before: the span began when a request thread took the request, short of the access line's duration by the
    # wait for a thread (10 ms in a burst); and no access line said which trace it was.
    app, exporter = traced

    class Socket:  # what the worker's loop hands over: when it had the request whole (app/hosting/client_socket.py)
        received_at = time.monotonic() - 0.25
        body_held = True

    headers = {"traceparent": f"00-{PARENT_TRACE}-00f067aa0ba902b7-01"}
    before_ns = time.time_ns()
    with caplog.at_level(logging.INFO, logger="visionserve.access"):
        answer = app.test_client().post("/predict", data=image_bytes(RED), content_type="image/jpeg",
                                        headers=headers, environ_base={"gunicorn.socket": Socket()})
    assert answer.status_code == 200
    (request,) = [s for s in exporter.get_finished_spans() if s.name == "POST /predict"]
    assert before_ns - 300_000_000 < request.start_time < before_ns - 200_000_000
    (line,) = [r for r in caplog.records if r.name == "visionserve.access"]
    assert line.trace_id == PARENT_TRACE and line.span_id == format(request.context.span_id, "016x")


def _unsent(app: Flask) -> float:
    text = app.test_client().get("/metrics").get_data(as_text=True)
    return float(re.search(r"^visionserve_trace_spans_unsent_total (\S+)$", text, re.M).group(1))


def test_spans_an_exporter_could_not_send_are_counted(app: Flask, service: Service) -> None:
    # Before: a collector away or refusing was said in the log alone: no alert could tell traces were being lost.
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class Refused(SpanExporter):
        def export(self, spans) -> SpanExportResult:  # noqa: ANN001
            return SpanExportResult.FAILURE

    register_tracing(app, service.settings, Refused())
    before = _unsent(app)
    headers = {"traceparent": f"00-{PARENT_TRACE}-00f067aa0ba902b7-01"}
    answer = app.test_client().post("/predict", data=image_bytes(RED), content_type="image/jpeg", headers=headers)
    assert answer.status_code == 200  # a trace that cannot go out never fails the answer
    assert _unsent(app) - before == 5  # the request, its decode, queue, inference and the batch's span
