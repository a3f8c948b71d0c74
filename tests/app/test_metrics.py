"""/metrics and the access log as ops read them: every alerting series from the start, probes apart, the peer."""
from __future__ import annotations

import io
import logging
import re
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import requests
from flask.testing import FlaskClient

from app import EXTENSION_KEY

from app.factory import create_app
from app.config import Settings
from app.engine.loaded.predictor import Predictor
from harness.servers import Running
from tests.support.fakes import ColourModel
from tests.support.imaging import BLUE, RED, image_bytes


def _value(text: str, series: str) -> float:
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_known_series_exist_at_zero_and_no_created_series(client: FlaskClient) -> None:
    text = client.get("/metrics").get_data(as_text=True)
    for reason in ("overloaded", "deadline_unreachable", "not_ready"):
        assert f'visionserve_rejected_total{{reason="{reason}"}}' in text
    for event in ("deadline_dropped", "client_gone", "batch_split", "batch_failed"):  # of each version served
        assert f'visionserve_batcher_events_total{{event="{event}",model="colour",version="test"}} ' in text
    assert "_created" not in text


def test_probes_and_docs_are_counted_apart_from_traffic(client: FlaskClient) -> None:
    def scrape() -> str:
        return client.get("/metrics").get_data(as_text=True)

    traffic = 'visionserve_requests_total{endpoint="/healthz",status="200"}'
    probes = 'visionserve_probe_requests_total{endpoint="/healthz",status="200"}'
    before = scrape()
    for path in ("/healthz", "/readyz", "/openapi.json", "/docs/"):
        assert client.get(path).status_code == 200
    client.post("/predict", data=image_bytes(RED), content_type="image/jpeg")
    after = scrape()
    assert _value(after, traffic) == _value(before, traffic) == 0.0
    assert _value(after, probes) == _value(before, probes) + 1
    predict = 'visionserve_requests_total{endpoint="/predict",status="200"}'
    assert _value(after, predict) == _value(before, predict) + 1


def test_several_workers_report_each_workers_memory_and_cpu_and_clean_up(
        small_weights: Path, start_server: Callable[..., Running], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where gunicorn.conf.py makes the multiprocess directory
    server = start_server(small_weights, workers="2").wait_ready()
    try:
        workers: set[str] = set()
        deadline = time.monotonic() + 60
        while len(workers) < 2:  # the second worker may still be loading its model
            assert time.monotonic() < deadline, workers
            text = requests.get(f"{server.url}/metrics", timeout=10).text
            workers = set(re.findall(r'^process_resident_memory_bytes\{worker="(\d+)"\} [1-9]', text, re.MULTILINE))
            time.sleep(0.2)
        assert workers == {str(pid) for pid in server.worker_pids()}
        assert re.search(r'^process_cpu_seconds_total\{worker="\d+"\} ', text, re.MULTILINE)
        assert 'visionserve_rejected_total{reason="overloaded"} 0.0' in text and "_created" not in text
        assert list(tmp_path.glob("visionserve-metrics-*"))
    finally:
        assert server.stop() == 0
    assert not list(tmp_path.glob("visionserve-metrics-*")), "the multiprocess directory outlived the server"


def test_the_access_line_has_the_peer_and_a_trusted_forwarded_for(settings: Settings, predictor: Predictor,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    for trusted in (False, True):
        app = create_app(settings.model_copy(update={"trust_forwarded_for": trusted}), predictor)
        try:
            caplog.clear()
            with caplog.at_level(logging.DEBUG, logger="visionserve.access"):
                app.test_client().post("/predict", data=image_bytes(RED), content_type="image/jpeg",
                                       headers={"X-Forwarded-For": "203.0.113.7"},
                                       environ_base={"REMOTE_ADDR": "10.0.0.2"})
            (record,) = [r for r in caplog.records if getattr(r, "route", None) == "/predict"]
            assert record.client == "10.0.0.2"
            assert getattr(record, "forwarded_for", None) == ("203.0.113.7" if trusted else None)
        finally:
            app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_access_log_errors_keeps_the_error_answers_lines_and_off_none(settings: Settings, predictor: Predictor,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    # A soak: one 350-byte line a request at info, 1.6-2 GB a day at 55 requests a second, and no way to keep only
    # the answers worth reading but LOG_LEVEL=warning, which drops the server's other info lines too.
    from app.logs import configure_access_log

    said: dict[str, list[int]] = {}
    try:
        for access in ("all", "errors", "off"):
            app = create_app(settings.model_copy(update={"access_log": access, "log_level": "info"}), predictor)
            try:
                caplog.clear()
                client = app.test_client()
                assert client.post("/predict", data=image_bytes(RED), content_type="image/jpeg").status_code == 200
                assert client.post("/predict", data=b"not an image", content_type="image/jpeg").status_code == 400
                assert client.get("/nowhere").status_code == 404
                said[access] = [r.status for r in caplog.records if r.name == "visionserve.access"]
            finally:
                app.extensions[EXTENSION_KEY].shutdown(timeout=5)
    finally:
        configure_access_log("all")
    assert said == {"all": [200, 400, 404], "errors": [400, 404], "off": []}


def test_readiness_the_inference_thread_and_the_queue_capacity_are_metrics(client: FlaskClient,
                                                                            service) -> None:  # noqa: ANN001
    # What the alert rules read (deploy/prometheus/alerts.yml): readiness and the thread as gauges, and the queue's
    # capacity beside its depth.
    def value(name: str) -> float:
        line = next(line for line in client.get("/metrics").get_data(as_text=True).splitlines()
                    if line.startswith(name + " ") or line.startswith(name + "{"))
        return float(line.split()[-1])

    assert value("visionserve_ready") == 1 and value("visionserve_batcher_alive") == 1
    # per model version, so a swap shows the old queue draining beside the new one
    assert value('visionserve_queue_capacity{model="colour",version="test"}') == service.settings.resolved_queue_size("cpu")
    service.begin_drain()
    assert value("visionserve_ready") == 0
    service.loaded_version().batcher.stop(timeout=5)
    assert value("visionserve_batcher_alive") == 0


def _stage_seconds(text: str) -> dict[tuple[str, str], float]:
    return {(m.group(1), m.group(2)): float(m.group(3)) for m in re.finditer(
        r'^visionserve_stage_duration_seconds_(sum|count)\{model="colour",stage="(\w+)",version="test"\} (\S+)$', text,
        re.M)}


def test_a_405_counts_under_the_route_it_reached_and_a_404_as_unmatched(client: FlaskClient) -> None:
    # Before: a wrong method counted as endpoint="unmatched", with the 404s, hiding which route was misused.
    assert client.get("/predict").status_code == 405
    assert client.delete("/v2/models/colour/infer").status_code == 405
    assert client.get("/no/such/path").status_code == 404
    text = client.get("/metrics").get_data(as_text=True)
    assert 'visionserve_requests_total{endpoint="/predict",status="405"}' in text
    assert 'visionserve_requests_total{endpoint="/v2/models/<name>/infer",status="405"}' in text, [
        line for line in text.splitlines() if "405" in line]
    assert 'visionserve_requests_total{endpoint="unmatched",status="404"}' in text
    assert 'endpoint="unmatched",status="405"' not in text


def test_metrics_count_requests_batches_and_rejections(client: FlaskClient) -> None:
    before = _stage_seconds(client.get("/metrics").get_data(as_text=True))  # the process's registry: other tests'
    client.post("/predict", data=image_bytes(), content_type="image/jpeg")
    client.post("/predict", data=b"junk", content_type="image/jpeg")
    text = client.get("/metrics").get_data(as_text=True)
    assert 'visionserve_requests_total{endpoint="/predict",status="200"}' in text
    assert 'visionserve_requests_total{endpoint="/predict",status="400"}' in text
    for name in ('visionserve_batch_size_count{model="colour",version="test"}',
                 'visionserve_stage_duration_seconds_count{model="colour",stage="decode",version="test"}',
                 'stage="queue"', 'stage="inference"', "visionserve_queue_depth",
                 'visionserve_model_info{device="cpu",dtype="float32",name="colour",version="test"} 1.0'):
        assert name in text
    cpu = {m.group(1): float(m.group(2)) for m in
           re.finditer(r'^visionserve_stage_cpu_seconds_total\{model="colour",stage="(\w+)",version="test"\} (\S+)$',
                       text, re.M)}
    assert cpu["decode"] > 0 and cpu["inference"] > 0 and 0 < cpu["forward"] <= cpu["inference"]
    # the forward pass's own time per batch, within its batch's
    seconds = {key: value - before.get(key, 0.0) for key, value in _stage_seconds(text).items()}
    assert seconds["count", "forward"] == seconds["count", "inference"] >= 1
    assert 0 < seconds["sum", "forward"] <= seconds["sum", "inference"]


def test_a_batch_that_decodes_its_images_as_it_is_made_counts_that_as_their_decode(settings: Settings,
                                                                                    predictor: Predictor) -> None:
    # The device path decodes a batch's JPEGs as the batch is made (on the CPU here, nvJPEG on a GPU): that CPU is
    # the images' decode stage, told with the forward pass; a batch of a client's pixels decodes nothing
    class Told:
        def __init__(self) -> None:
            self.forward_passes: list[tuple[float, float, float]] = []

        def forward_ran(self, wall_s: float, cpu_s: float, decode_cpu_s: float = 0.0) -> None:
            self.forward_passes.append((wall_s, cpu_s, decode_cpu_s))

    app = create_app(settings.model_copy(update={"decode_path": "device"}), predictor)
    try:
        version = app.extensions[EXTENSION_KEY].loaded_version()
        told = Told()
        version.observer = told
        photos = [version.decoder.prepare(image_bytes(RED, size=(400, 300))) for _ in range(4)]
        version.run_batch(photos)
        pixels = version.run_batch([np.zeros(predictor.manifest.preprocess.input_shape, np.float32)])
        assert pixels.shape[0] == 1
        (_, _, photos_decode_s), (_, _, pixels_decode_s) = told.forward_passes
        assert photos_decode_s > 0 and pixels_decode_s == 0
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_a_batch_split_for_memory_counts_every_pass_it_ran(settings: Settings, predictor: Predictor,
                                                           model: ColourModel) -> None:
    # Four photos that fit one at a time (on the device path, which decodes them as each batch is made): the batch
    # of four and its halves raise out of memory, the four single passes answer. Each pass that answered is a
    # forward pass's time, every pass's CPU counts; before, only the last pass told was held with the batch
    app = create_app(settings.model_copy(update={"decode_path": "device"}), predictor)
    model.oom_above = 1  # after its load, whose warm-up runs larger batches
    try:
        client = app.test_client()
        before = _stage_seconds(client.get("/metrics").get_data(as_text=True))
        files = [(io.BytesIO(image_bytes(colour, size=(400, 300))), f"{i}.jpg")
                 for i, colour in enumerate((RED, BLUE, RED, BLUE))]
        response = client.post("/predict", data={"image": files})
        assert response.status_code == 200, response.get_json()
        assert [p["label"] for p in response.get_json()["predictions"]] == ["red", "blue", "red", "blue"]
        assert model.batch_sizes[-7:] == [4, 2, 1, 1, 2, 1, 1]
        text = client.get("/metrics").get_data(as_text=True)
        seconds = {key: value - before.get(key, 0.0) for key, value in _stage_seconds(text).items()}
        assert (seconds["count", "inference"], seconds["count", "forward"]) == (1, 4)
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_many_values_observed_at_once_land_as_one_by_one(tmp_path: Path) -> None:
    # observe_many writes a batch's or a loop turn's values as one increment per bucket: the same series as
    # observe() of each (it reads prometheus-client's own fields, so a client upgrade that moves them fails here)
    from prometheus_client import CollectorRegistry, Histogram

    from app.metrics import observe_many

    registry = CollectorRegistry()
    one_by_one = Histogram("one", "", ["k"], buckets=(0.1, 0.5, 1.0), registry=registry)
    at_once = Histogram("many", "", ["k"], buckets=(0.1, 0.5, 1.0), registry=registry)
    values = [0.0, 0.1, 0.100001, 0.5, 0.7, 1.0, 3.0, float("inf"), -1.0, 0.05]
    for value in values:
        one_by_one.labels("a").observe(value)
    observe_many(at_once.labels("a"), values)
    observe_many(at_once.labels("a"), [])
    series = {name: {(s.name.split("_", 1)[1], s.labels.get("le")): s.value
                     for s in metric.samples if not s.name.endswith("_created")}
              for metric in registry.collect() for name in [metric.name]}
    assert series["one"] == series["many"] and series["many"][("count", None)] == len(values)


def test_a_loop_s_request_tally_writes_the_series_each_request_would() -> None:
    from app.metrics import VERSION_REQUEST_SECONDS, VERSION_REQUESTS, RequestTally

    ok, refused = (VERSION_REQUESTS.labels("tally", "1", "live", outcome) for outcome in ("ok", "refused"))
    seconds = VERSION_REQUEST_SECONDS.labels("tally", "1")
    before = (ok._value.get(), refused._value.get(), seconds._sum.get())
    tally = RequestTally()
    for _ in range(2):
        tally.count("tally", "1", "live", "ok", 1, [0.25])
    tally.count("tally", "1", "live", "ok", 2, [0.25, 0.25])  # several of a turn at once
    tally.count("tally", "1", "live", "refused", 1, None)
    assert (ok._value.get(), refused._value.get()) == before[:2]  # nothing written before the flush
    tally.flush()
    tally.flush()  # a second flush has nothing left to write
    assert (ok._value.get() - before[0], refused._value.get() - before[1]) == (4, 1)
    assert seconds._sum.get() - before[2] == pytest.approx(1.0)


def test_a_loop_s_request_tally_holds_its_counts_until_they_are_due_then_writes_them_together() -> None:
    import time

    from app.metrics import VERSION_REQUESTS, RequestTally

    ok = VERSION_REQUESTS.labels("held", "1", "live", "ok")
    before = ok._value.get()
    tally = RequestTally(flush_s=60.0)
    assert tally.due_at is None  # nothing held
    counted_at = time.monotonic()
    tally.count("held", "1", "live", "ok", 1, [0.25])
    due = tally.due_at
    assert due is not None and counted_at + 60 <= due <= time.monotonic() + 60  # from the first count held
    tally.count("held", "1", "live", "ok", 2, [0.25, 0.25])
    assert tally.due_at == due  # a later count does not put it off
    tally.flush_when_due(due - 0.001)
    assert ok._value.get() == before  # held
    tally.flush_when_due(due)
    assert ok._value.get() == before + 3 and tally.due_at is None  # written together, nothing held


def test_a_forked_child_writes_its_metrics_to_a_file_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # app.metrics gives prometheus-client's multiprocess values a kept process id (no system call per write),
    # renewed in a forked child: the child's writes must still land in a file of its own, as with os.getpid
    import os

    from prometheus_client import CollectorRegistry, Counter
    from prometheus_client import values as prometheus_values
    from prometheus_client.multiprocess import MultiProcessCollector

    from app import metrics

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(prometheus_values, "ValueClass",
                        prometheus_values.MultiProcessValue(process_identifier=metrics.this_process))
    counter = Counter("forked", "", registry=CollectorRegistry())
    counter.inc()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child process
        try:
            counter.inc(5)
        finally:
            os._exit(0 if metrics.this_process() == os.getpid() else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and metrics.this_process() == os.getpid()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"counter_{os.getpid()}.db", f"counter_{child}.db"])
    registry = CollectorRegistry()
    MultiProcessCollector(registry, str(tmp_path))
    assert registry.get_sample_value("forked_total") == 6


def test_increments_written_together_land_as_one_by_one_in_the_multiprocess_files_and_a_fork_s_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Increments writes under prometheus-client's lock straight into its files (its own fields: a client upgrade
    # that moves them fails here): the same aggregated series as inc() and observe() one by one, a value's first
    # write placing it in the file, and a forked child's writes in a file of its own
    import os

    from prometheus_client import CollectorRegistry, Counter, Histogram
    from prometheus_client import values as prometheus_values
    from prometheus_client.multiprocess import MultiProcessCollector

    from app import metrics

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(prometheus_values, "ValueClass",
                        prometheus_values.MultiProcessValue(process_identifier=metrics.this_process))
    made = CollectorRegistry()
    counters = {way: Counter(f"{way}_events", "", ["k"], registry=made) for way in ("one", "many")}
    histograms = {way: Histogram(f"{way}_seconds", "", ["k"], buckets=(0.1, 0.5, 1.0), registry=made)
                  for way in ("one", "many")}
    values = [0.0, 0.1, 0.100001, 0.5, 0.7, 1.0, 3.0, float("inf"), -1.0, 0.05]
    many = [value * scale for value in values for scale in (1.0, 0.5, 2.0, 0.25, 4.0, 8.0)]  # bucketed by numpy
    assert len(many) > metrics.BUCKETED_ONE_BY_ONE >= len(values)

    def one_by_one() -> None:
        counters["one"].labels("a").inc(2)
        counters["one"].labels("b").inc(0.5)
        for value in values:
            histograms["one"].labels("a").observe(value)
        histograms["one"].labels("b").observe(0.3)
        for value in many:
            histograms["one"].labels("d").observe(value)
        for value in (0.2, 0.2, 0.2, 1.0, 1.0):  # one value many times (a bundle's decode stage)
            histograms["one"].labels("c").observe(value)

    def together() -> None:
        writes = metrics.Increments()
        writes.inc(counters["many"].labels("a"), 2)
        writes.inc(counters["many"].labels("b"), 0.5)
        writes.observe(histograms["many"].labels("a"), values)
        writes.observe(histograms["many"].labels("b"), [0.3])
        writes.observe(histograms["many"].labels("b"), [])
        writes.observe(histograms["many"].labels("d"), many)
        writes.observe_times(histograms["many"].labels("c"), 0.2, 3)
        writes.observe_times(histograms["many"].labels("c"), 1.0, 2)  # on a bucket's bound: in that bucket
        writes.observe_times(histograms["many"].labels("c"), 0.7, 0)
        writes.write()
        writes.write()  # nothing left: writes nothing more

    for _ in range(2):  # a value's first write places it, the next ones overwrite it
        together()
        one_by_one()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child process: Increments alone must tell the fork
        try:
            together()
        finally:
            os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    together()  # the parent's own values: had the child written into the parent's file, these write over it
    for _ in range(2):
        one_by_one()
    assert {p.name for p in tmp_path.iterdir()} == {f"{kind}_{pid}.db" for kind in ("counter", "histogram")
                                                    for pid in (os.getpid(), child)}
    registry = CollectorRegistry()
    MultiProcessCollector(registry, str(tmp_path))
    read = {(s.name, tuple(sorted(s.labels.items()))): s.value for metric in registry.collect() for s in metric.samples}

    def way(prefix: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {(name.removeprefix(prefix), labels): value for (name, labels), value in read.items()
                if name.startswith(prefix)}

    assert way("one_") == way("many_") and len(way("many_")) > 10
    assert way("many_")[("events_total", (("k", "a"),))] == 8  # both processes'
    assert way("many_")[("seconds_count", (("k", "a"),))] == 4 * len(values)
    assert way("many_")[("seconds_count", (("k", "d"),))] == 4 * len(many)


def test_many_values_written_together_land_in_the_buckets_one_by_one_bisect_puts_them_in(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Past BUCKETED_ONE_BY_ONE values numpy buckets them: each bucket's count as a bisect of each value makes it, on a
    # bound in that bound's bucket, NaN in none (in the sum, as observe() adds it), infinities in the first and last
    import numpy as np
    from prometheus_client import CollectorRegistry, Histogram

    from app import metrics

    histogram = Histogram("bucketed_seconds", "", buckets=(0.1, 0.5, 1.0), registry=CollectorRegistry())
    rng = np.random.default_rng(0)
    values = [*rng.uniform(-0.5, 2.0, 200).tolist(), 0.1, 0.5, 1.0, float("nan"), float("inf"), float("-inf")]

    def pairs(one_by_one: int) -> dict[int, float]:
        monkeypatch.setattr(metrics, "BUCKETED_ONE_BY_ONE", one_by_one)
        writes = metrics.Increments()
        writes.observe(histogram, values)
        return {id(value): amount for value, amount in writes._pairs[1:]}

    by_numpy, by_bisect = pairs(48), pairs(len(values))
    assert by_numpy == by_bisect and sum(by_numpy.values()) == len(values) - 1


def test_the_gpu_memory_gauges_are_read_once_a_second_at_most(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.cuda.memory_allocated and memory_reserved each build the allocator's whole statistics dict: read at every
    # settle they were 5% of an engine's interpreter lock on an H200. A gauge scraped every few seconds needs one a
    # second.
    import app.metrics as metrics

    reads: list[int] = []
    observer = metrics.MetricsObserver(lambda: reads.append(1) or {"allocated": 10 * len(reads)}, "m", "1")
    clock = iter([100.0, 100.2, 100.9, 101.0, 101.5, 102.1])
    monkeypatch.setattr(metrics.time, "monotonic", lambda: next(clock))
    for _ in range(6):
        observer.settle()
    assert len(reads) == 3  # at 100.0, 101.0 and 102.1
    assert metrics.GPU_MEMORY.labels("allocated")._value.get() == 30


def test_every_gauge_forgets_a_dead_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A gauge of a process that died (an engine killed, then restarted by the master, which marks the dead pid:
    # gunicorn.conf.py's _forget) must go with it. visionserve_model_info was multiprocess_mode="max", whose files
    # stay: after the restart and an unload the model still read 1.
    import os

    from prometheus_client import CollectorRegistry, Gauge
    from prometheus_client import values as prometheus_values
    from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

    from app import metrics

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(prometheus_values, "ValueClass",
                        prometheus_values.MultiProcessValue(process_identifier=metrics.this_process))
    modes = {name: gauge._multiprocess_mode for name, gauge in vars(metrics).items() if isinstance(gauge, Gauge)}
    assert modes["MODEL_INFO"] and len(modes) >= 10
    made = CollectorRegistry()
    mirrors = {name: Gauge(f"mirror_{name.lower()}", "", multiprocess_mode=mode, registry=made)
               for name, mode in modes.items()}
    child = os.fork()
    if child == 0:  # pragma: no cover - the child process: the engine that served the model, then died
        try:
            for mirror in mirrors.values():
                mirror.set(1)
        finally:
            os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    mark_process_dead(child, str(tmp_path))
    for mirror in mirrors.values():
        mirror.set(0)  # the live process's values: its restart, which unloaded the model
    registry = CollectorRegistry()
    MultiProcessCollector(registry, str(tmp_path))
    read = {metric.name.removeprefix("mirror_").upper(): [sample.value for sample in metric.samples]
            for metric in registry.collect()}
    assert read == {name: [0.0] for name in modes}


def _info_and_capacity(model: str, version: str) -> tuple[float | None, float | None]:
    from prometheus_client import REGISTRY

    return (REGISTRY.get_sample_value("visionserve_model_info", {"name": model, "version": version, "device": "cpu",
                                                                 "dtype": "float32"}),
            REGISTRY.get_sample_value("visionserve_queue_capacity", {"model": model, "version": version}))


def test_a_replaced_copy_s_end_leaves_its_version_s_series_to_the_copy_loaded_again(settings: Settings) -> None:
    # Version 1 replaced while a request held it, then rolled back to: a fresh copy of 1 serves while the old one
    # drains. The old copy's end set the shared visionserve_model_info series to 0 while 1 served.
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from app.engine.service import Service
    from tests.support.fakes import FakeRepository, infer, wait_until

    repository = FakeRepository()
    held_model = repository.add("colour", "1")
    service = Service.build(settings, repository)  # type: ignore[arg-type]
    try:
        replaced = service.loaded_version("colour")
        assert _info_and_capacity("colour", "1") == (1, 8)
        held_model.batch_sizes.clear()
        held_model.gate = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(infer, service, [image_bytes(RED)])  # in version 1's forward pass
            wait_until(lambda: bool(held_model.batch_sizes))
            repository.held["colour"]["1"] = ColourModel()  # what version 1 loads as again: a copy of its own
            repository.add("colour", "2")
            service.catalog.load("colour")  # 2 replaces 1, whose copy drains the held request
            service.catalog.load("colour", config={"default_version": "1"})  # rolled back: 1 loads again
            held_model.gate.set()
            assert held.result(timeout=10).version == "1"
        wait_until(lambda: not any(t.name == "retire-colour-1" for t in threading.enumerate()))  # the old one ended
        assert service.loaded_version("colour", "1") is not replaced
        assert infer(service, [image_bytes(RED)]).version == "1"
        assert _info_and_capacity("colour", "1") == (1, 8)
        service.catalog.unload("colour")
        wait_until(lambda: _info_and_capacity("colour", "1") == (0, 0))  # once unloaded, its series read 0
    finally:
        service.shutdown(timeout=5)


def test_batcher_alive_reads_0_while_any_served_version_s_thread_is_dead(settings: Settings) -> None:
    # A batcher's start set the one gauge to 1 whatever the others were: another model loaded after a version's
    # thread died read 1 while /healthz said dead.
    from prometheus_client import REGISTRY

    from app.engine.service import Service
    from tests.support.fakes import FakeRepository

    def alive() -> float | None:
        return REGISTRY.get_sample_value("visionserve_batcher_alive")

    repository = FakeRepository()
    repository.add("colour", "1")
    service = Service.build(settings, repository)  # type: ignore[arg-type]
    try:
        assert alive() == 1
        service.loaded_version("colour").batcher.stop(timeout=5)  # stands for the inference thread dying
        assert alive() == 0 and not service.alive
        repository.add("shade", "1")
        service.catalog.load("shade")  # its thread starts
        assert service.loaded_version("shade").batcher.is_alive()
        assert alive() == 0 and not service.alive
        service.catalog.unload("colour")  # the dead one leaves: every served version's thread runs
        assert alive() == 1 and service.alive
    finally:
        service.shutdown(timeout=5)


def test_cors_preflights_are_counted_apart_from_traffic(settings: Settings, predictor: Predictor) -> None:
    # A preflight, answered by the before hook, counted as /predict traffic: it diluted the 5xx and 429 ratios the
    # alerts read and the /predict latency.
    app = create_app(settings.model_copy(update={"cors_origins": "https://ui.example"}), predictor)
    client = app.test_client()
    try:
        def counts() -> dict[str, float]:
            text = client.get("/metrics").get_data(as_text=True)
            return {name: _value(text, name) for name in (
                'visionserve_requests_total{endpoint="/predict",status="204"}',
                'visionserve_requests_total{endpoint="/predict",status="200"}',
                'visionserve_request_duration_seconds_count{endpoint="/predict"}',
                'visionserve_cors_preflights_total{endpoint="/predict",status="204"}')}

        before = counts()
        origin = {"Origin": "https://ui.example"}
        for _ in range(3):
            assert client.options("/predict", headers={**origin, "Access-Control-Request-Method": "POST"}
                                  ).status_code == 204
        assert client.post("/predict", data=image_bytes(RED), content_type="image/jpeg",
                           headers=origin).status_code == 200
        assert client.options("/predict").status_code == 204  # no preflight: the path's Allow, traffic as any
        after = counts()
        assert [after[name] - before[name] for name in after] == [1, 1, 2, 3]
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_each_loaded_version_s_weights_memory_is_a_metric_until_it_is_unloaded(settings: Settings) -> None:
    # Before: memory per version was in /v1/models alone, nothing to graph or alert on per model (a multi-model
    # operator's trial)
    from prometheus_client import REGISTRY

    from app.engine.service import Service
    from tests.support.fakes import FakeRepository

    repository = FakeRepository()
    repository.add("colour", "1")
    repository.add("other", "1")
    with_default = settings.model_copy(update={"default_model": "colour"})
    service = Service.build(with_default, repository)  # type: ignore[arg-type]
    try:
        memory = {info.name: info.memory_bytes for info in service.catalog.versions()}
        assert memory["other"] > 0
        for name in ("colour", "other"):
            assert REGISTRY.get_sample_value("visionserve_model_memory_bytes",
                                             {"model": name, "version": "1"}) == memory[name]
        service.catalog.unload("other")
        assert REGISTRY.get_sample_value("visionserve_model_memory_bytes", {"model": "other", "version": "1"}) == 0
    finally:
        service.shutdown(timeout=5)
