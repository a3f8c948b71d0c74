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
