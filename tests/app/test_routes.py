"""Every request form and what a good request gets (answers, headers, batches, health, CORS), through the app factory
with the fake colour model; the error statuses are tests/app/test_errors.py's."""
from __future__ import annotations

import base64
import io
import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from flask.testing import FlaskClient

from app import EXTENSION_KEY
from app.config import Settings
from app.engine.service import Service
from app.engine.contract import BatchRun, Served, stage_ms
from app.engine.ranking import top_indices
from tests.support.answers import error_of, labels_of
from tests.support.fakes import ColourModel, wait_until
from tests.support.imaging import BLUE, GREEN, RED, image_bytes


def test_multipart_images_come_back_in_order(client: FlaskClient) -> None:
    files = [(io.BytesIO(image_bytes(c)), f"{i}.jpg") for i, c in enumerate((RED, GREEN, BLUE))]
    assert labels_of(client.post("/predict", data={"image": files})) == ["red", "green", "blue"]


def test_response_shape_and_scores(client: FlaskClient) -> None:
    body = client.post("/predict?top_k=3", data=image_bytes(GREEN), content_type="image/jpeg").get_json()
    assert body["model"] == {"name": "colour", "version": "test"}
    (prediction,) = body["predictions"]
    assert prediction["label"] == "green" and prediction["index"] == 1
    scores = [c["score"] for c in prediction["top_k"]]
    assert len(scores) == 3 and scores == sorted(scores, reverse=True)
    assert prediction["score"] == scores[0] and 0 < scores[0] <= 1


@pytest.mark.parametrize("content_type", ["image/png", "application/octet-stream"])
def test_raw_body(client: FlaskClient, content_type: str) -> None:
    response = client.post("/predict", data=image_bytes(BLUE, fmt="PNG"), content_type=content_type)
    assert labels_of(response) == ["blue"]


def test_json_base64_and_data_url(client: FlaskClient) -> None:
    plain = base64.b64encode(image_bytes(RED)).decode()
    data_url = "data:image/png;base64," + base64.b64encode(image_bytes(GREEN, fmt="PNG")).decode()
    response = client.post("/predict", json={"images": [plain, data_url], "top_k": 4})
    assert labels_of(response) == ["red", "green"]
    assert all(len(p["top_k"]) == 4 for p in response.get_json()["predictions"])


def test_top_k_default_query_and_form(client: FlaskClient) -> None:
    def top_k_len(response) -> int:  # noqa: ANN001
        return len(response.get_json()["predictions"][0]["top_k"])

    assert top_k_len(client.post("/predict", data=image_bytes(), content_type="image/jpeg")) == 2
    assert top_k_len(client.post("/predict?top_k=1", data=image_bytes(), content_type="image/jpeg")) == 1
    form = {"image": (io.BytesIO(image_bytes()), "a.jpg"), "top_k": "3"}
    assert top_k_len(client.post("/predict", data=form)) == 3
    # Before: given in the body or form and in the query, the body's silently won
    form = {"image": (io.BytesIO(image_bytes()), "a.jpg"), "top_k": "3"}
    refused = client.post("/predict?top_k=1", data=form)
    assert refused.status_code == 400 and refused.get_json()["error"]["message"] == (
        "top_k is given twice, '3' in the form and '1' in the query: send it once")
    body = {"images": [base64.b64encode(image_bytes()).decode()], "outputs": ["labels"]}
    refused = client.post("/predict?outputs=labels", json=body)
    assert refused.status_code == 400 and "outputs is given twice" in refused.get_json()["error"]["message"]
    assert top_k_len(client.post("/predict?top_k=1", json={"images": body["images"]})) == 1  # the query alone


def test_the_top_classes_are_a_stable_sort_s_first_whatever_the_ties_nan_or_rows() -> None:
    rng = np.random.default_rng(0)
    for trial in range(3000):  # every path: k 1, argmax passes (k to 16), the partial sort; one row, two, many
        columns, rows = int(rng.integers(1, 200)), int(rng.integers(1, 20 if trial % 3 else 4))
        k = int(rng.integers(1, min(columns, 40) + 1))
        scores = (rng.integers(0, 6, (rows, columns)).astype(np.float32) if trial % 2  # many ties
                  else rng.random((rows, columns), dtype=np.float32))
        if trial % 5 == 0:  # -inf (a softmax of -inf logits) among the highest of a row: all but a few columns
            row = int(rng.integers(0, rows))
            scores[row, rng.random(columns) < 0.97] = -np.inf
        if trial % 7 == 0:
            scores[int(rng.integers(0, rows)), rng.integers(0, columns)] = np.nan
        assert np.array_equal(top_indices(scores, k), np.argsort(-scores, axis=1, kind="stable")[:, :k])
    counts = np.array([[3, 9, 9, 1, 0, 7, 2, 8, 5, 4, 6, 9]])  # whole numbers (no -inf to set): ranked all the same
    assert top_indices(counts, 2).tolist() == [[1, 2]]
    tied = np.zeros((2, 1000), dtype=np.float32)
    tied[0, [7, 3, 900]] = 0.3  # a three-way tie for first: the lower index first
    tied[1, 999] = 1.0
    served = Served(tied, (BatchRun(len(tied), 1, 2, 0.0, 0.0),), "m", "1", [f"c{i}" for i in range(1000)], 0.0)
    assert [[r.index for r in top] for top in served.top_k(2)] == [[3, 7], [999, 0]]
    assert [[r.label for r in top] for top in served.top_k(1)] == [["c3"], ["c999"]]


def test_server_timing_batch_size_and_request_id(client: FlaskClient) -> None:
    response = client.post("/predict", data=image_bytes(), content_type="image/jpeg",
                           headers={"X-Request-ID": "abc-123"})
    timing = response.headers["Server-Timing"]
    for metric in ("decode;dur=", "queue;dur=", "inference;dur=", 'batch;desc="1"'):
        assert metric in timing
    assert response.headers["X-Batch-Size"] == "1"
    assert response.headers["X-Request-ID"] == "abc-123"
    assert len(client.get("/healthz", headers={"X-Request-ID": "bad id <script>"}).headers["X-Request-ID"]) == 32


def test_concurrent_requests_share_batches(client: FlaskClient, model: ColourModel, service: Service) -> None:
    # Park the worker in a forward pass so the other requests queue up behind it, then let them run together.
    model.batch_sizes.clear()
    model.gate = threading.Event()

    def call(color: tuple[int, int, int]) -> str:
        return labels_of(client.post("/predict", data=image_bytes(color), content_type="image/jpeg"))[0]

    colors = [RED, GREEN, BLUE, RED] * 2
    with ThreadPoolExecutor(8) as pool:
        first = pool.submit(call, colors[0])
        wait_until(lambda: len(model.batch_sizes) == 1)
        rest = [pool.submit(call, c) for c in colors[1:]]
        wait_until(lambda: service.loaded_version().batcher.depth == 7)
        model.gate.set()
        assert [first.result(timeout=10)] + [f.result(timeout=10) for f in rest] == ["red", "green", "blue", "red"] * 2
    assert model.batch_sizes == [1, 4, 3]


def test_health_endpoints_and_draining(client: FlaskClient, service: Service) -> None:
    assert client.get("/healthz").get_json()["status"] == "alive"
    ready = client.get("/readyz")
    assert ready.status_code == 200 and all(ready.get_json()["checks"].values())
    service.begin_drain()
    draining = client.get("/readyz")  # before: "accepting" false, while the drain still answers new requests
    assert draining.status_code == 503
    assert not draining.get_json()["checks"]["not_draining"] and draining.get_json()["checks"]["accepting"]
    assert client.get("/healthz").status_code == 200  # liveness does not follow readiness
    # Before: 503 from the drain's first moment, where a load balancer still sending, or a HUP's new worker still
    # loading, left the requests to this worker, which could answer them.
    answered = client.post("/predict", data=image_bytes(), content_type="image/jpeg")
    assert answered.status_code == 200 and answered.headers["Connection"] == "close"  # the next one goes elsewhere
    service.stop_serving()  # the drain's window is over
    assert not client.get("/readyz").get_json()["checks"]["accepting"]
    response = client.post("/predict", data=image_bytes(), content_type="image/jpeg")
    error_of(response, 503, "not_ready")
    assert response.headers["Retry-After"] and response.headers["Connection"] == "close"


def test_a_drain_that_answers_for_a_reload_stays_ready(client: FlaskClient, service: Service, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: a HUP's old worker, answering every request while its replacement loaded, said 503 for the whole
    # reload (16 s of an inline worker's load): a readiness probe would take a serving pod out of its Service (an
    # operator's trial). A stop (no new worker loading) is not ready from the drain's first moment, as before.
    from app.hosting import control

    monkeypatch.setattr(service.settings, "control_dir", tmp_path)
    service.begin_drain()
    assert client.get("/readyz").status_code == 503  # a stop: nothing loads beside it
    other = os.getppid()  # a live process other than this one: the HUP's new worker
    control.loading_mark(tmp_path, other).touch()  # loading
    reloading = client.get("/readyz")
    assert reloading.status_code == 200 and not reloading.get_json()["checks"]["not_draining"]
    control.ready_mark(tmp_path, other).touch()  # it serves: the probes are its
    assert client.get("/readyz").status_code == 503
    control.ready_mark(tmp_path, other).unlink()
    service.stop_serving()  # refusing: never ready again
    assert client.get("/readyz").status_code == 503


def test_readiness_that_waits_for_another_worker_says_so(client: FlaskClient, service: Service,
                                                          monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Before: 503 with every check true and no reason, while the other worker behind the port still loaded.
    monkeypatch.setattr(service, "settings", service.settings.model_copy(update={"workers": 2,
                                                                                 "control_dir": tmp_path}))
    reports = [{"pid": 1, "models": {"colour": {}}}, {"pid": 2, "models": {}}]
    monkeypatch.setattr(service.catalog, "workers", lambda: reports)
    waiting = client.get("/readyz")
    assert waiting.status_code == 503 and all(waiting.get_json()["checks"].values())
    assert waiting.get_json()["reason"].startswith("1 of 2 worker processes serve their models")
    reports[1]["models"] = {"colour": {}}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and "reason" not in ready.get_json()


def test_a_request_accepted_in_the_drain_is_answered_before_the_drain_must_end(
        client: FlaskClient, model: ColourModel, service: Service) -> None:
    # Before: a request accepted during the drain's window (SHUTDOWN_DRAIN_S after SIGTERM) had a whole
    # REQUEST_TIMEOUT_S for its deadline, while its worker is stopped GRACEFUL_TIMEOUT_S after SIGTERM: one accepted
    # 4.9 s into the default drain could wait to 34.9 s, past the drain's 34 s and at gunicorn's SIGKILL (35 s), its
    # connection reset. Now its deadline is what is left of the drain: 504 in time, at worst.
    model.batch_sizes.clear()
    model.gate = threading.Event()  # the forward pass held: what is queued behind it waits for its deadline
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(client.post, "/predict", data=image_bytes(RED), content_type="image/jpeg")
        wait_until(lambda: len(model.batch_sizes) == 1)
        service.begin_drain(within_s=1.5)  # as a worker's SIGTERM handler: GRACEFUL_TIMEOUT_S - 1
        started = time.monotonic()
        late = pool.submit(client.post, "/predict", data=image_bytes(RED), content_type="image/jpeg")
        encoded = base64.b64encode(image_bytes(RED)).decode()
        v2 = pool.submit(client.post, "/v2/models/colour/infer", json={"inputs": [
            {"name": "images", "datatype": "BYTES", "shape": [1], "data": [encoded]}]})
        late_error = error_of(late.result(timeout=10), 504, "deadline_exceeded")["message"]
        assert v2.result(timeout=10).status_code == 504
        for message in (late_error, v2.result().get_json()["error"]):  # REQUEST_TIMEOUT_S here, 10 s, cut to 1.5
            assert 0 < float(re.search(r"within the request's ([0-9.]+)s deadline", message)[1]) <= 1.5, message
        assert late.result().headers["Connection"] == v2.result().headers["Connection"] == "close"
        model.gate.set()
        assert first.result(timeout=10).status_code == 200  # accepted before the drain: its own deadline
    wait_until(lambda: time.monotonic() - started > 0.5)  # less than a second left: sent elsewhere, not in a hurry
    error_of(client.post("/predict", data=image_bytes(RED), content_type="image/jpeg"), 503, "not_ready")


def test_dead_batcher_fails_liveness(client: FlaskClient, service: Service) -> None:
    service.loaded_version().batcher.stop(timeout=5)
    assert client.get("/healthz").status_code == 503
    assert client.get("/readyz").status_code == 503


def test_the_deadline_counts_the_decode_too(client: FlaskClient, service: Service,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: X-Request-Timeout counted from queueing, after the decode: a decode that outlasted the client's 50 ms
    # was answered 200 long after the client had given up.
    version = service.loaded_version()
    decode, started = version.decoder.prepare, time.monotonic()

    def slow(data: bytes) -> object:  # a decode that ends well past the request's deadline, however fast the rest
        wait_until(lambda: time.monotonic() > started + 0.1)
        return decode(data)

    monkeypatch.setattr(version.decoder, "prepare", slow)
    response = client.post("/predict", headers={"X-Request-Timeout": "50"}, data=image_bytes(RED),
                           content_type="image/jpeg")
    error_of(response, 504, "deadline_exceeded")


def test_a_deadline_that_passes_while_the_images_decode_stops_the_decode(client: FlaskClient, service: Service,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Before (a security review): every image of the request was decoded whatever the deadline (16 large PNGs held
    # a worker 54-62 s for a 30 s deadline), the 504 coming after the last.
    version = service.loaded_version()
    decode, decoded = version.decoder.prepare, []

    def slow(data: bytes) -> object:  # the first image's decode ends past the request's 50 ms
        started = time.monotonic()
        wait_until(lambda: time.monotonic() > started + 0.1)
        decoded.append(data)
        return decode(data)

    monkeypatch.setattr(version.decoder, "prepare", slow)
    files = {"image": [(io.BytesIO(image_bytes(RED)), f"{i}.jpg") for i in range(3)]}
    response = client.post("/predict", headers={"X-Request-Timeout": "50"}, data=files,
                           content_type="multipart/form-data")
    assert "while its images were decoded (1 of 3)" in error_of(response, 504, "deadline_exceeded")["message"]
    assert len(decoded) == 1


def test_one_model_s_endpoint_answers_as_the_listing_does_of_it(client: FlaskClient) -> None:
    # Before: GET /v1/models/colour was a 404 (a new user's trial, as TorchServe's GET /models/{name} and Triton's
    # GET /v2/models/{name} answer)
    listing, one = client.get("/v1/models").get_json(), client.get("/v1/models/colour").get_json()
    assert one["models"] == listing["models"] and one["default_model"] == listing["default_model"]
    assert client.get("/v1/models/colour?labels=1").get_json()["models"][0]["labels"] == [
        "red", "green", "blue", "other"]
    error = error_of(client.get("/v1/models/nope"), 404, "not_found")
    # the models with their versions and default, as every other 404 not_found names them (before: names alone)
    assert error["message"].startswith("no model 'nope' is loaded") and error["details"] == {
        "models": [{"name": "colour", "versions": ["test"], "default": "test"}]}
    predicted = error_of(client.post("/predict?model=nope", data=image_bytes()), 404, "not_found")
    assert predicted["details"] == error["details"]


def test_one_model_s_endpoint_shows_that_model_alone_beside_others(settings: Settings) -> None:
    from tests.support.fakes import several_models_app

    with several_models_app(settings) as app:
        shade = app.test_client().get("/v1/models/shade").get_json()
        assert [(m["name"], m["version"]) for m in shade["models"]] == [("shade", "1")]
        assert all(set(worker["models"]) == {"shade"} for worker in shade["workers"]) and shade["workers"]
        colour = app.test_client().get("/v1/models/colour").get_json()
        assert sorted(m["version"] for m in colour["models"]) == ["1", "2"]


def test_models_endpoint(client: FlaskClient) -> None:
    (info,) = client.get("/v1/models").get_json()["models"]
    assert info["name"] == "colour" and info["num_classes"] == 4 and info["device"] == "cpu"
    assert info["memory_format"] == "contiguous"
    assert info["batching"]["max_batch_size"] == 4 and info["limits"]["max_images"] == 4
    assert info["warmed_batch_sizes"] == [1, 2, 3, 4] and info["ready"] is True
    assert "labels" not in info
    assert client.get("/v1/models?labels=1").get_json()["models"][0]["labels"] == ["red", "green", "blue", "other"]


def test_request_larger_than_max_batch_size_is_split(settings, predictor, model: ColourModel,  # noqa: ANN001
                                                     caplog: pytest.LogCaptureFixture) -> None:
    from app.factory import create_app

    app = create_app(settings.model_copy(update={"max_images": 6}), predictor)
    try:
        model.batch_sizes.clear()
        colors = [RED, GREEN, BLUE, RED, GREEN, BLUE]
        files = [(io.BytesIO(image_bytes(c)), f"{i}.jpg") for i, c in enumerate(colors)]
        with caplog.at_level(logging.INFO, logger="visionserve.access"):
            response = app.test_client().post("/predict", data={"image": files})
        assert labels_of(response) == ["red", "green", "blue", "red", "green", "blue"]
        assert model.batch_sizes == [4, 2]
        assert response.headers["X-Batch-Size"] == "4,4,4,4,2,2"
        assert 'batch;desc="4+2"' in response.headers["Server-Timing"]
        # The header and the access line report the same queue and inference (app/engine/call.stage_ms).
        header = dict(re.findall(r"(\w+);dur=([\d.]+)", response.headers["Server-Timing"]))
        (line,) = [r for r in caplog.records if getattr(r, "route", None) == "/predict"]
        assert float(header["queue"]) == pytest.approx(line.queue_ms, abs=0.006)
        assert float(header["inference"]) == pytest.approx(line.inference_ms, abs=0.006)
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_inference_is_the_wall_time_of_the_requests_distinct_batches() -> None:
    # One batch shared by three images: its forward pass counts once, not once per image.
    assert stage_ms([BatchRun(3, 5, 3, 0.002, 0.010)]) == pytest.approx((2.0, 10.0))
    # Four images in batch 7, then two in batch 8, which waited behind batch 7 and 5 ms more: the batcher runs one
    # batch at a time, so inference is 20 + 15 ms (not the larger alone), and the queue is the rest of the 50 ms
    # from queueing to the end of batch 8 (10 ms before batch 7, 5 ms between them).
    assert stage_ms([BatchRun(4, 7, 4, 0.010, 0.020), BatchRun(2, 8, 2, 0.035, 0.015)]) == pytest.approx((15.0, 35.0))


@pytest.mark.parametrize("inline", [True, False])
def test_a_lone_request_runs_its_batch_inline_unless_turned_off(settings, predictor,  # noqa: ANN001
                                                                 inline: bool) -> None:
    from app.factory import create_app

    app = create_app(settings.model_copy(update={"inline_when_idle": inline}), predictor)
    try:
        service: Service = app.extensions[EXTENSION_KEY]
        before = service.loaded_version().batcher.batches_run
        response = app.test_client().post("/predict", data=image_bytes(GREEN), content_type="image/jpeg")
        assert labels_of(response) == ["green"] and response.headers["X-Batch-Size"] == "1"
        assert service.loaded_version().batcher.batches_run == before + 1
        assert service.loaded_version().batcher.batches_inline == (1 if inline else 0)
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_scores_are_rounded_to_the_configured_digits(settings: Settings, predictor) -> None:  # noqa: ANN001
    from app.factory import create_app

    app = create_app(settings.model_copy(update={"score_digits": 3}), predictor)
    try:
        body = app.test_client().post("/predict", data=image_bytes(GREEN), content_type="image/jpeg").get_json()
        scores = [s["score"] for p in body["predictions"] for s in p["top_k"]]
        assert all(round(s, 3) == s for s in scores) and any(s != 0 for s in scores)
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_the_default_queue_holds_every_image_its_request_threads_hold(predictor) -> None:  # noqa: ANN001
    # Before: a 64-image queue, so six concurrent 16-image requests on an idle server got two 429s; then a 128-image
    # one, which refused at C=16 x 16 images what would have been answered in time (what refuses is time).
    from app.factory import create_app

    defaults = Settings(device="cpu", max_batch_size=4, auto_batch_size=False, max_wait_ms=5)
    assert defaults.resolved_queue_size("cpu") == defaults.threads * defaults.max_images == 512
    engine = defaults.model_copy(update={"workers": 5, "engines": 2})  # an engine serves every HTTP worker's threads
    assert engine.resolved_queue_size("cpu") == 3 * 512
    app = create_app(defaults, predictor)
    model = predictor.module
    try:
        model.gate = threading.Event()
        client = app.test_client()
        files = lambda: {"image": [(io.BytesIO(image_bytes(RED)), f"{i}.jpg") for i in range(16)]}  # noqa: E731
        with ThreadPoolExecutor(6) as pool:
            calls = [pool.submit(client.post, "/predict", data=files()) for _ in range(6)]
            wait_until(lambda: app.extensions[EXTENSION_KEY].loaded_version().batcher.depth >= 80)
            model.gate.set()
            assert [c.result(timeout=30).status_code for c in calls] == [200] * 6
    finally:
        model.gate = None
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_cors_is_off_by_default_and_answers_preflights_for_allowed_origins(settings: Settings,
                                                                           predictor) -> None:  # noqa: ANN001
    from app import EXTENSION_KEY
    from app.factory import create_app
    from app.hosting.browser_origins import LOOP_ORIGINS

    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, x-request-timeout"}
    off = create_app(settings, predictor)
    on = create_app(Settings.model_validate({**settings.model_dump(), "api_key": "k",
                                             "cors_origins": "https://app.example, https://other.example/"}),
                    predictor)
    try:
        answer = off.test_client().post("/predict", data=image_bytes(), content_type="image/jpeg",
                                        headers={"Origin": "https://app.example"})
        assert answer.status_code == 200 and "Access-Control-Allow-Origin" not in answer.headers
        client = on.test_client()
        answer = client.options("/predict", headers=preflight)  # no key: browsers send preflights without one
        assert answer.status_code == 204 and "Content-Type" not in answer.headers  # (was text/html, of no body)
        assert answer.headers["Access-Control-Allow-Origin"] == "https://app.example"
        assert "POST" in answer.headers["Access-Control-Allow-Methods"]
        assert "X-Request-Timeout" in answer.headers["Access-Control-Allow-Headers"]
        stranger = client.options("/predict", headers={**preflight, "Origin": "https://evil.example"})
        assert "Access-Control-Allow-Origin" not in stranger.headers
        answer = client.post("/predict", data=image_bytes(), content_type="image/jpeg",
                             headers={"Origin": "https://other.example", "Authorization": "Bearer k"})
        assert answer.status_code == 200 and answer.headers["Access-Control-Allow-Origin"] == "https://other.example"
        assert "Server-Timing" in answer.headers["Access-Control-Expose-Headers"]
        assert "Origin" in answer.headers["Vary"]
        refused = client.post("/predict", data=image_bytes(), content_type="image/jpeg",
                              headers={"Origin": "https://app.example"})  # CORS is no way around the key
        assert refused.status_code == 401 and refused.headers["Access-Control-Allow-Origin"] == "https://app.example"
        # the worker loop's own answers (a 408, a 431) say the same: the app built last configures them
        assert LOOP_ORIGINS.allows("https://other.example") and not LOOP_ORIGINS.allows("https://evil.example")
        create_app(settings, predictor).extensions[EXTENSION_KEY].shutdown(timeout=5)
        assert not LOOP_ORIGINS.origins
    finally:
        LOOP_ORIGINS.configure(frozenset())
        for app in (off, on):
            app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_cors_lets_a_browser_send_and_read_every_header_the_api_uses(settings: Settings, predictor,  # noqa: ANN001
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    # Before: a browser could not send the CLIENT_KEY_HEADER (here renamed) or a binary V2 request's framing, nor
    # read an explanation's X-Explained-* headers; a preflight's X-Request-ID was empty, not the caller's, and its
    # access line had request_id null and duration -0.0.
    from app import EXTENSION_KEY
    from app.factory import create_app

    app = create_app(Settings.model_validate({**settings.model_dump(), "api_key": "k", "cors_origins": "*",
                                              "client_key_header": "X-Tenant"}), predictor)
    try:
        client = app.test_client()
        with caplog.at_level(logging.INFO, logger="visionserve.access"):
            answer = client.options("/v2/models/colour/infer", headers={
                "Origin": "https://app.example", "Access-Control-Request-Method": "POST", "X-Request-ID": "pre-1",
                "Access-Control-Request-Headers": "x-tenant, inference-header-content-length"})
        assert answer.status_code == 204 and answer.headers["X-Request-ID"] == "pre-1"
        allowed = {name.strip().lower() for name in answer.headers["Access-Control-Allow-Headers"].split(",")}
        assert {"x-tenant", "inference-header-content-length", "authorization", "tracestate"} <= allowed
        (line,) = [r for r in caplog.records if r.msg == "request"]
        assert (line.status, line.request_id, line.method) == (204, "pre-1", "OPTIONS") and line.duration_ms >= 0
        explained = client.post("/explain?format=png", data=image_bytes(), content_type="image/jpeg",
                                headers={"Origin": "https://app.example", "Authorization": "Bearer k"})
        exposed = {name.strip() for name in explained.headers["Access-Control-Expose-Headers"].split(",")}
        assert {"X-Explained-Class", "X-Explained-Index", "X-Explained-Score", "X-Request-ID", "Retry-After",
                "Inference-Header-Content-Length"} <= exposed
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_cuda_out_of_memory_splits_the_batch_and_lowers_the_cap(client: FlaskClient, model: ColourModel) -> None:
    model.batch_sizes.clear()
    model.oom_above = 1
    files = [(io.BytesIO(image_bytes(c)), f"{i}.jpg") for i, c in enumerate((RED, BLUE, RED, BLUE))]
    response = client.post("/predict", data={"image": files})
    assert response.status_code == 200
    assert [p["label"] for p in response.get_json()["predictions"]] == ["red", "blue", "red", "blue"]
    assert model.batch_sizes == [4, 2, 1, 1, 2, 1, 1]
    assert client.get("/v1/models").get_json()["models"][0]["batching"]["current_max_batch_size"] == 1
    splits = re.search(r'^visionserve_batcher_events_total\{event="batch_split",model="colour",version="test"\} (\S+)$',
                       client.get("/metrics").get_data(as_text=True), re.M)
    assert splits and float(splits.group(1)) >= 1  # (counted as the served version's)


def test_predict_takes_a_body_compressed_with_gzip_in_every_form_and_refuses_one_that_is_not(
        client: FlaskClient) -> None:
    # Before: the header was ignored: a gzip body was "not an image" (400 invalid_image, or invalid_json for JSON),
    # a plain body said to be gzip was answered as plain.
    import gzip

    red, blue = image_bytes(RED), image_bytes(BLUE)
    as_json = ('{"images": ["%s", "%s"]}' % (base64.b64encode(red).decode(), base64.b64encode(blue).decode())).encode()
    zipped = {"Content-Encoding": "gzip"}
    assert labels_of(client.post("/predict", data=gzip.compress(red), content_type="image/jpeg",
                                 headers=zipped)) == ["red"]
    assert labels_of(client.post("/predict", data=gzip.compress(as_json), content_type="application/json",
                                 headers=zipped)) == ["red", "blue"]
    parts = b"".join(b'--b0und\r\nContent-Disposition: form-data; name="image"; filename="x.jpg"\r\n'
                     b"Content-Type: image/jpeg\r\n\r\n" + data + b"\r\n" for data in (red, blue))
    assert labels_of(client.post("/predict", data=gzip.compress(parts + b"--b0und--\r\n"), headers=zipped,
                                 content_type="multipart/form-data; boundary=b0und")) == ["red", "blue"]
    refused = client.post("/predict", data=red, content_type="image/jpeg", headers=zipped)
    assert error_of(refused, 400, "invalid_request")["message"].startswith("the body is not valid gzip data")
    refused = client.post("/predict", data=red, content_type="image/jpeg", headers={"Content-Encoding": "br"})
    assert error_of(refused, 415, "unsupported_media_type")["message"].startswith("Content-Encoding 'br' is not")
    assert refused.headers["Accept-Encoding"] == "gzip, deflate, identity"
