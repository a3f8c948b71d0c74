"""The command line says the server's refusals in its own words: an option where the server names a parameter."""
from __future__ import annotations

from pathlib import Path

import pytest
from flask import Flask

from tests.support.fakes import served_over_http
from tests.support.imaging import RED, image_bytes
from visionserve_client.__main__ import main


@pytest.mark.parametrize("top_k", ["9", "1001"])  # (below 1 the command line refuses it: exit 2)
def test_a_top_k_out_of_range_is_said_as_the_option(app: Flask, tmp_path: Path, top_k: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    image = tmp_path / "red.jpg"
    image.write_bytes(image_bytes(RED))
    with served_over_http(app) as url:
        assert main(["predict", str(image), "--top-k", top_k, "--url", url]) == 1
    said = capsys.readouterr()
    text = said.out + said.err
    assert f"--top-k must be from 1 to 4, got {top_k}" in text and "top_k (" not in text, text


def test_a_folder_is_every_image_under_it_in_order(app: Flask, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # Before: "error: photos: cannot read it: Is a directory"
    import json

    from tests.support.imaging import BLUE, GREEN

    photos = tmp_path / "photos"
    (photos / "more").mkdir(parents=True)
    (photos / ".hidden").mkdir()
    for path, colour in ((photos / "b.jpg", BLUE), (photos / "a.jpg", RED), (photos / "more" / "c.jpg", GREEN),
                         (photos / ".hidden" / "d.jpg", RED), (photos / ".e.jpg", RED)):
        path.write_bytes(image_bytes(colour))
    (tmp_path / "empty").mkdir()
    with served_over_http(app) as url:
        assert main(["predict", str(photos), "--json", "--url", url]) == 0
        answered = json.loads(capsys.readouterr().out)
        assert [(Path(row["image"]).relative_to(photos).as_posix(), row["label"]) for row in answered] == [
            ("a.jpg", "red"), ("b.jpg", "blue"), ("more/c.jpg", "green")]
        assert main(["predict", str(tmp_path / "empty"), "--url", url]) == 2  # a folder of none: its error
    assert f"{tmp_path / 'empty'}: cannot read it" in capsys.readouterr().err
