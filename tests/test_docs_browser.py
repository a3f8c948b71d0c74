"""/docs in a real browser (headless Chromium): a person picks a photo, presses Execute and gets an answer.

Needs chromium and chromium-driver (Debian packages; .ci/run installs them) and selenium (requirements.txt).
"""
from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Iterator

import pytest
from flask import Flask
from werkzeug.serving import make_server

from tests.imaging import RED, image_bytes

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs chromium and chromium-driver")]


@pytest.fixture
def docs_url(app: Flask) -> Iterator[str]:
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/docs/"
    server.shutdown()


@pytest.fixture
def browser() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM  # type: ignore[assignment]
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=DRIVER))
    driver.implicitly_wait(10)
    yield driver
    driver.quit()


def _try_predict(browser, url: str, content_type: str):  # noqa: ANN001, ANN202 - selenium objects
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    browser.get(url)
    operation = browser.find_element(By.ID, "operations-default-post_predict")
    operation.find_element(By.CSS_SELECTOR, ".opblock-summary").click()
    operation.find_element(By.CSS_SELECTOR, ".try-out__btn").click()
    body = operation.find_element(By.CSS_SELECTOR, ".opblock-section-request-body")
    Select(body.find_element(By.TAG_NAME, "select")).select_by_visible_text(content_type)
    return operation, body


def _execute(operation) -> tuple[str, str]:  # noqa: ANN001
    from selenium.webdriver.common.by import By

    operation.find_element(By.CSS_SELECTOR, ".execute").click()
    answer = operation.find_element(By.CSS_SELECTOR, ".live-responses-table .response")
    return (answer.find_element(By.CSS_SELECTOR, ".response-col_status").text,
            answer.find_element(By.CSS_SELECTOR, ".response-col_description").text)


@pytest.mark.parametrize("content_type", ["multipart/form-data", "image/*"])
def test_a_photo_picked_in_docs_is_classified(browser, docs_url: str, tmp_path: Path,  # noqa: ANN001
                                               content_type: str) -> None:
    # Before: the multipart form showed text boxes of random characters and no file picker, and a top_k box
    # pre-filled with 0 (400).
    from selenium.webdriver.common.by import By

    photo = tmp_path / "red.jpg"
    photo.write_bytes(image_bytes(RED, size=(64, 48)))
    operation, body = _try_predict(browser, docs_url, content_type)
    (picker,) = body.find_elements(By.CSS_SELECTOR, "input[type=file]")
    picker.send_keys(str(photo))
    status, answer = _execute(operation)
    assert status == "200", answer[:500]
    assert '"label": "red"' in answer


def test_the_json_example_in_docs_is_answered(browser, docs_url: str) -> None:  # noqa: ANN001
    operation, _ = _try_predict(browser, docs_url, "application/json")
    status, answer = _execute(operation)
    assert status == "200", answer[:500]
    assert '"predictions"' in answer
