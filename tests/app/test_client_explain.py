"""The client's explanations from the app over HTTP (a model Grad-CAM explains in microseconds): ``Client.explain``
answers /explain's map as an Explanation, ``explain_overlay`` its PNG with the class it explains; a class named by
label or index; a version without gradients is the server's ``no_gradients``."""
from __future__ import annotations

import io
from typing import Iterator

import pytest
from PIL import Image

from app import EXTENSION_KEY
from app.config import Settings
from app.engine.loaded.predictor import Predictor
from app.factory import create_app
from tests.support.fakes import ColourModel, ConvColourModel, served_over_http, tiny_manifest
from tests.support.imaging import RED, image_bytes
from visionserve_client import Client, Explanation, Overlay, VisionServeError


def _served(settings: Settings, model: object) -> Iterator[str]:
    app = create_app(settings, Predictor(model, tiny_manifest(), device="cpu"))
    try:
        with served_over_http(app) as url:
            yield url
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


@pytest.fixture
def explaining_url(settings: Settings) -> Iterator[str]:
    yield from _served(settings, ConvColourModel())


def test_explain_answers_the_map_of_the_top_class_or_of_a_named_one(explaining_url: str) -> None:
    # Before: the client had no explanations (a new user's trial: "why this label" needed plain HTTP)
    photo = image_bytes(RED)
    with Client(explaining_url) as client:
        top = client.predict(photo, top_k=3)
        found = client.explain(photo)
        assert isinstance(found, Explanation)
        assert (found.label, found.index, found.score) == (top.label, top.index, top.score)
        assert (found.model, found.version) == ("colour", "test")
        assert found.grid and all(0 <= value <= 1 for row in found.grid for value in row)
        left, top_edge, right, bottom = found.crop
        assert 0 <= left < right and 0 <= top_edge < bottom
        other = next(c for c in top.top_k if c.label != top.label)
        assert client.explain(photo, label=other.label).index == other.index
        assert client.explain(photo, class_index=other.index).label == other.label
        drawn = client.explain_overlay(photo, label=other.label)
        with pytest.raises(ValueError, match="not both"):
            client.explain(photo, label="red", class_index=0)
    assert isinstance(drawn, Overlay) and (drawn.label, drawn.index, drawn.version) == (other.label, other.index,
                                                                                         "test")
    assert drawn.score == other.score
    assert Image.open(io.BytesIO(drawn.png)).format == "PNG"


def test_a_version_without_a_feature_map_is_the_server_s_no_gradients(settings: Settings) -> None:
    for url in _served(settings, ColourModel()):
        with Client(url) as client, pytest.raises(VisionServeError) as refused:
            client.explain(image_bytes(RED))
        assert (refused.value.status, refused.value.code) == (422, "no_gradients")
