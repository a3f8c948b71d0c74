"""Prediction monitoring through the app factory: the colour model's class follows each image's colour, so sending
another mix of images changes the class mix. Drift rises when it changes and not otherwise; /metrics counts what
was sent (classes, confidences) and nothing of warm-up or the canary; the manifest's reference is used, and a
manifest without one (older exports) still loads and serves with its first predictions as the reference."""
from __future__ import annotations

import base64
import logging
import json
import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest
from flask import Flask
from flask.testing import FlaskClient

from app import EXTENSION_KEY

from app.factory import create_app
from app.config import Settings
from app.engine.loaded.predictor import Predictor
from models.export.manifest import MANIFEST_NAME, Manifest, PredictionReference, read_manifest
from tests.support.fakes import ColourModel, export_tiny, tiny_manifest
from tests.support.imaging import BLUE, GREEN, RED, image_bytes

RED_JPEG, GREEN_JPEG, BLUE_JPEG = (image_bytes(colour) for colour in (RED, GREEN, BLUE))


def _app(settings: Settings, name: str, reference: PredictionReference | None = None, **monitoring: object) -> Flask:
    manifest = tiny_manifest(name, "1").model_copy(update={"reference": reference})
    return create_app(settings.model_copy(update={"monitor_window": 40, "monitor_min_predictions": 20,
                                                  **monitoring}), Predictor(ColourModel(), manifest, device="cpu"))


@pytest.fixture
def monitored(settings: Settings, request: pytest.FixtureRequest) -> Iterator[Flask]:
    """An app serving a colour model named after the test (the metrics registry is shared by the whole run)."""
    app = _app(settings, re.sub(r"\W", "_", request.node.name)[:40])
    yield app
    app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def _send(client: FlaskClient, images: list[bytes]) -> list[dict]:
    """Post the images four to a request; returns each image's top-1 prediction."""
    predictions = []
    for start in range(0, len(images), 4):
        chunk = images[start:start + 4]
        answer = client.post("/predict", json={"images": [base64.b64encode(image).decode() for image in chunk]})
        assert answer.status_code == 200, answer.get_json()
        predictions += answer.get_json()["predictions"]
    return predictions


def _mix(red: int, green: int, blue: int, seed: int) -> list[bytes]:
    images = [RED_JPEG] * red + [GREEN_JPEG] * green + [BLUE_JPEG] * blue
    random.Random(seed).shuffle(images)
    return images


def _monitoring(client: FlaskClient) -> dict:
    (info,) = client.get("/v1/models").get_json()["models"]
    return info["monitoring"]


def _series(client: FlaskClient, name: str, model: str, **labels: str) -> float | None:
    text = client.get("/metrics").get_data(as_text=True)
    wanted = {"model": model, "version": "1", **labels}
    for match in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if found == wanted:
            return float(match.group(2))
    return None


def test_drift_rises_when_the_photos_class_mix_changes(monitored: Flask) -> None:
    client = monitored.test_client()
    model = client.get("/v1/models").get_json()["models"][0]["name"]
    _send(client, _mix(20, 10, 10, seed=0))  # the first 40: the reference
    start = _monitoring(client)
    assert start["reference"] == {"source": "first_predictions", "predictions": 40, "complete": True,
                                  "low_confidence_threshold": 0.5, "low_confidence_share": 0.0}
    assert start["psi"] is None and _series(client, "visionserve_prediction_drift_psi", model) is None

    same_answers = _send(client, _mix(19, 11, 10, seed=1))  # the same mix, give or take one image
    same = _monitoring(client)
    assert same["predictions"] == 40 and same["psi"] < 0.01
    assert _series(client, "visionserve_prediction_drift_psi", model) == pytest.approx(same["psi"], abs=1e-6)

    recent = same_answers[20:] + _send(client, _mix(2, 2, 16, seed=2))  # the window: half of it mostly blue
    changed = _monitoring(client)
    assert changed["psi"] > 0.2 and changed["psi"] > 20 * max(same["psi"], 0.001)
    assert _series(client, "visionserve_prediction_drift_psi", model) == pytest.approx(changed["psi"], abs=1e-6)
    blue = sum(p["label"] == "blue" for p in recent)
    assert blue >= 16 and changed["top_classes"][0] == {"label": "blue", "index": 2, "count": blue,
                                                         "share": blue / 40}
    assert changed["predictions_total"] == 100


def test_class_counts_and_the_confidence_histogram_are_what_was_sent_and_exclude_warm_up(
        monitored: Flask) -> None:
    client = monitored.test_client()
    model = client.get("/v1/models").get_json()["models"][0]["name"]
    # warmed up and canaried at start: neither counted
    assert _series(client, "visionserve_top1_confidence_count", model) is None
    assert _monitoring(client)["predictions_total"] == 0
    # Colours from sure to unsure: the fake's logits are 10 x each channel's mean
    colours = [RED, GREEN, BLUE, (140, 120, 110), (120, 128, 125), (100, 110, 130), (128, 126, 124), (30, 160, 150)]
    images = [image_bytes(colour) for colour in colours for _ in range(3)]
    predictions = _send(client, images)
    for label in {p["label"] for p in predictions}:
        sent = sum(p["label"] == label for p in predictions)
        assert _series(client, "visionserve_predicted_class_total", model, label=label) == sent
    scores = [p["score"] for p in predictions]
    assert min(scores) < 0.5 < max(scores)  # the histogram is spread, not all in one bucket
    for edge in ("0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8", "0.9", "1.0", "+Inf"):
        expected = sum(score <= float(edge) for score in scores)
        assert _series(client, "visionserve_top1_confidence_bucket", model, le=edge) == expected, edge
    assert _series(client, "visionserve_top1_confidence_sum", model) == pytest.approx(sum(scores), abs=1e-4)
    assert _monitoring(client)["low_confidence_ratio"] == pytest.approx(sum(s < 0.5 for s in scores) / len(scores),
                                                                       abs=1e-6)
    assert _series(client, "visionserve_low_confidence_ratio", model) == pytest.approx(
        sum(s < 0.5 for s in scores) / len(scores))


def _validation_reference(class_counts: list[int], confident: int) -> PredictionReference:
    """A manifest's reference of ``class_counts`` predictions, ``confident`` of them at or above 0.5."""
    return PredictionReference(source="validation", predictions=sum(class_counts), class_counts=class_counts,
                               confidence_buckets=[0.5, 1.0],
                               confidence_counts=[sum(class_counts) - confident, confident],
                               low_confidence_threshold=0.5, low_confidence_share=0.1)


def test_the_manifest_reference_is_the_one_compared_with(settings: Settings) -> None:
    app = _app(settings, "with_reference", _validation_reference([10, 10, 10, 0], confident=27))
    try:
        client = app.test_client()
        _send(client, _mix(7, 7, 6, seed=3))  # 20 = MONITOR_MIN_PREDICTIONS: reported at once, no collecting
        steady = _monitoring(client)
        assert steady["reference"] == {"source": "validation", "predictions": 30, "complete": True,
                                       "low_confidence_threshold": 0.5, "low_confidence_share": 0.1}
        assert steady["psi"] < 0.01 and steady["psi_bins"] == 4
        _send(client, [RED_JPEG] * 20)
        assert _monitoring(client)["psi"] > 0.2
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_a_manifest_reference_smaller_than_the_least_window_is_left_for_the_first_predictions(
        settings: Settings) -> None:
    # Before: a small folder's 12 held-out images' predictions were the reference: a balanced stream of the classes
    # the model told right read as drifted (a new user's trial: 18 predictions, PSI 0.239 of a correct stream).
    app = _app(settings, "small_reference", _validation_reference([2, 6, 4, 0], confident=11))
    try:
        client = app.test_client()
        _send(client, _mix(7, 7, 6, seed=3))
        collecting = _monitoring(client)
        assert collecting["reference"]["source"] == "first_predictions" and collecting["psi"] is None
        _send(client, _mix(7, 7, 6, seed=4))  # the first window (40) makes the reference; then 20 alike
        assert _monitoring(client)["reference"] == {"source": "first_predictions", "predictions": 40,
                                                    "complete": True, "low_confidence_threshold": 0.5,
                                                    "low_confidence_share": 0.0}
        _send(client, _mix(7, 7, 6, seed=5))
        assert _monitoring(client)["psi"] < 0.1
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


@pytest.mark.slow  # seconds of training, export or a fresh interpreter: the full suite's
def test_a_manifest_without_a_reference_loads_and_serves(tmp_path: Path) -> None:
    weights = export_tiny(tmp_path / "weights")
    written = json.loads((weights / MANIFEST_NAME).read_text())
    assert written["reference"] is None  # no validation split: none recorded
    del written["reference"]  # as manifests written before the field
    (weights / MANIFEST_NAME).write_text(json.dumps(written))
    assert read_manifest(weights).reference is None
    app = create_app(Settings(weights_dir=weights, device="cpu", max_batch_size=2, log_level="warning",
                              monitor_window=10, monitor_min_predictions=5))
    try:
        client = app.test_client()
        assert client.post("/predict", data=RED_JPEG, content_type="image/jpeg").status_code == 200
        monitoring = _monitoring(client)
        assert monitoring["reference"]["source"] == "first_predictions"
        assert (monitoring["predictions"], monitoring["reference"]["predictions"]) == (1, 1)
        assert monitoring["reference"]["complete"] is False
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_a_reference_that_does_not_fit_the_labels_is_refused() -> None:
    manifest = tiny_manifest().model_dump()
    reference = dict(source="validation", predictions=3, class_counts=[1, 1, 1], confidence_buckets=[1.0],
                     confidence_counts=[3], low_confidence_threshold=0.5, low_confidence_share=0.0)
    with pytest.raises(ValueError, match="3 entries for 4 labels"):
        Manifest.model_validate({**manifest, "reference": reference})
    with pytest.raises(ValueError, match="add up"):
        Manifest.model_validate({**manifest, "reference": {**reference, "class_counts": [1, 1, 1, 1]}})


def test_monitor_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="monitor_min_predictions"):
        Settings(monitor_window=100, monitor_min_predictions=200)


def test_predictions_held_while_images_wait_are_all_counted_once_every_answer_is_back(settings: Settings) -> None:
    # Six clients at once, figures held while images wait (never written for time): each batch that empties the queue
    # writes what the batches before it held, before its answers leave; nothing is lost or counted twice.
    app = _app(settings, "held_under_load", metrics_flush_ms=60_000, queue_size=64)
    try:
        client = app.test_client()
        sent = [_mix(2, 1, 1, seed=seed) for seed in range(6)]
        with ThreadPoolExecutor(len(sent)) as pool:
            answers = [p for predictions in pool.map(lambda images: _send(client, images), sent * 3)
                       for p in predictions]
        assert len(answers) == 72 and _monitoring(client)["predictions_total"] == 72
        for label in ("red", "green", "blue"):
            count = sum(p["label"] == label for p in answers)
            assert _series(client, "visionserve_predicted_class_total", "held_under_load", label=label) == count
        assert _series(client, "visionserve_top1_confidence_count", "held_under_load") == 72
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_a_scrape_and_a_monitoring_read_count_every_answer_before_them_however_long_the_figures_are_held(
        settings: Settings) -> None:
    # A version writes its batches' figures once a METRICS_FLUSH_MS at most: a reader asks for them first. Before
    # (without the ask), both read the first request's figures alone for the five seconds here.
    app = _app(settings, "held_long", metrics_flush_ms=5000)
    try:
        client = app.test_client()
        _send(client, [RED_JPEG])  # the first batch settles at once: none did before
        _send(client, [RED_JPEG, RED_JPEG, BLUE_JPEG])
        assert _series(client, "visionserve_predicted_class_total", "held_long", label="red") == 3  # a scrape
        _send(client, [BLUE_JPEG])
        assert _monitoring(client)["predictions_total"] == 5  # /v1/models: each version's own figures
        assert _series(client, "visionserve_predicted_class_total", "held_long", label="blue") == 2
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_a_fault_writing_the_held_figures_fails_no_read_that_asked_for_them(
        settings: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # A full metrics folder (ENOSPC) is logged, as the batcher's own writes are. Before: /metrics, /v1/models and the
    # V2 per-model readiness probe answered 500 once a reader asked for what a version held.
    from app.metrics import MetricsObserver

    app = _app(settings, "faulty_writes", metrics_flush_ms=5000)
    try:
        client = app.test_client()
        _send(client, [RED_JPEG])  # the first batch settles at once

        def full(*_: object, **__: object) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(MetricsObserver, "predictions", full)
        for path in ("/metrics", "/v1/models", "/v2/models/faulty_writes/ready"):
            _send(client, [BLUE_JPEG])  # held
            with caplog.at_level(logging.ERROR, logger="app.engine.catalog"):
                assert client.get(path).status_code == 200, path
        assert "writing the figures of model faulty_writes version 1 failed" in caplog.text
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_a_restart_in_the_same_control_dir_judges_drift_by_the_first_start_s_reference(
        settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Before: every start took its own first predictions as the reference, so a worker restarted, a reload or a
    # deploy after the mix had drifted made the drifted mix the baseline: the drift series went away, then read 0.
    kept = settings.model_copy(update={"control_dir": tmp_path})
    first = _app(kept, "kept_reference")
    try:
        _send(first.test_client(), _mix(20, 10, 10, seed=0))  # the first 40: the reference, kept
    finally:
        first.extensions[EXTENSION_KEY].shutdown(timeout=5)
    for restart in range(2):  # the same version again (a worker restarted): the kept reference, complete at once
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="app.engine.loaded.monitor"):
            app = _app(kept, "kept_reference")
        try:
            client = app.test_client()
            assert _monitoring(client)["reference"] == {
                "source": "first_predictions", "predictions": 40, "complete": True,
                "low_confidence_threshold": 0.5, "low_confidence_share": 0.0}
            assert "an earlier start of it in this server made" in caplog.text
            _send(client, _mix(2, 2, 36, seed=restart + 1))  # drifted: mostly blue
            assert _monitoring(client)["psi"] > 0.2  # judged against the first start's mix, not this one
        finally:
            app.extensions[EXTENSION_KEY].shutdown(timeout=5)
    other = _app(settings.model_copy(update={"control_dir": tmp_path / "another"}), "kept_reference")
    try:  # another server (its own CONTROL_DIR) takes its own
        assert _monitoring(other.test_client())["reference"]["complete"] is False
    finally:
        other.extensions[EXTENSION_KEY].shutdown(timeout=5)
