"""The client's embeddings from the app (fakes; MAX_IMAGES 4) over HTTP: ``Client.embed`` is one request, as
documented; ``embed_each`` and ``visionserve embed`` send a list in as many requests as the server's limits need,
each image answered with its embedding or its own error, as ``predict_each`` and ``visionserve predict`` do."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest
from flask import Flask

from app import EXTENSION_KEY
from app.config import Settings
from app.engine.loaded.predictor import Predictor
from app.factory import create_app
from tests.support.fakes import ColourModel, served_over_http, tiny_manifest
from tests.support.imaging import BLUE, RED, image_bytes
from visionserve_client import Client, Embedding, VisionServeError
from visionserve_client.__main__ import main


@pytest.fixture
def embedding_url(settings: Settings) -> Iterator[str]:
    """The app of a model that answers embeddings (ColourModel's 3 values), on a loopback port."""
    app = create_app(settings, Predictor(ColourModel(embedding=True), tiny_manifest(embedding=True), device="cpu"))
    try:
        with served_over_http(app) as url:
            yield url
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def _images(folder: Path, count: int) -> list[str]:
    """``count`` JPEGs, red and blue by turns."""
    paths = []
    for i in range(count):
        path = folder / f"{i}.jpg"
        path.write_bytes(image_bytes(RED if i % 2 == 0 else BLUE))
        paths.append(str(path))
    return paths


def test_embed_each_sends_a_list_past_max_images_in_requests_that_fit(embedding_url: str, settings: Settings,
                                                                    tmp_path: Path) -> None:
    # Before: embeddings had Client.embed alone, one request: past MAX_IMAGES (or the body limit) the whole list
    # was refused, 413.
    files = _images(tmp_path, 2 * settings.max_images + 1)  # three requests
    missing = str(tmp_path / "missing.jpg")
    with Client(embedding_url) as client:
        with pytest.raises(VisionServeError) as refused:
            client.embed(files)  # one request, as documented
        assert (refused.value.status, refused.value.code) == (413, "too_many_images")
        red, blue = client.embed(files[:2])
        results = client.embed_each([*files[:5], missing, *files[5:]])
    assert isinstance(results[5], FileNotFoundError) and results[5].filename == missing
    embedded = results[:5] + results[6:]
    assert len(embedded) == len(files) and all(isinstance(e, Embedding) for e in embedded)
    assert [e.vector for e in embedded] == [(red if i % 2 == 0 else blue).vector for i in range(len(files))]
    assert {(e.model, e.version) for e in embedded} == {("colour", "test")}  # type: ignore[union-attr]


def test_the_cli_embeds_more_files_than_a_request_holds(embedding_url: str, settings: Settings, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # Before: `visionserve embed` sent every file in one request: past MAX_IMAGES it failed whole (413, exit 1).
    files = _images(tmp_path, settings.max_images + 2)
    assert main(["embed", *files, "--url", embedding_url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "model colour version test" and len(lines) == 1 + len(files)
    assert all(line.startswith(f"{path}  3 values  [") for path, line in zip(files, lines[1:]))
    assert main(["embed", *files, "--json", "--url", embedding_url]) == 0
    answers = json.loads(capsys.readouterr().out)
    assert [a["image"] for a in answers] == files and all(len(a["vector"]) == 3 for a in answers)
    missing = str(tmp_path / "missing.jpg")
    assert main(["embed", files[0], missing, files[1], "--url", embedding_url]) == 2  # the others still answered
    said = capsys.readouterr()
    assert [line.split("  ")[0] for line in said.out.splitlines()[1:]] == [files[0], files[1]]
    # the CLI's own lines (the app served in this process may log here too, through a handler of another test's)
    assert [line for line in said.err.splitlines() if line.startswith("error: ")] == [
        f"error: {missing}: cannot read it: No such file or directory"]


@pytest.mark.slow  # a second or more (a run of the CLI, make, or workers sharing a state): the full suite's
def test_the_cli_says_a_refusal_of_every_file_once_each(app: Flask, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    files = _images(tmp_path, 2)
    with served_over_http(app) as url:  # a model exported without an embedding: each request refused, 400
        assert main(["embed", *files, "--url", url]) == 1
    said = capsys.readouterr()
    errors = said.err.splitlines()
    assert said.out == "" and len(errors) == 2
    assert all(line.startswith(f"error: {path}: ") and "no_embedding" in line for path, line in zip(files, errors))
