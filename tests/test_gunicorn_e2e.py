"""The real server: gunicorn on a free loopback port, driven with requests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest
import requests
import skimage.data
from PIL import Image

from tests.imaging import encode

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CATS = {281, 282, 283, 284, 285}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(weights: Path, port: int, **env: str) -> subprocess.Popen:
    variables = os.environ | {"VISIONSERVE_WEIGHTS_DIR": str(weights), "VISIONSERVE_BIND": f"127.0.0.1:{port}",
                              "VISIONSERVE_DEVICE": "cpu"} | env
    gunicorn = Path(sys.executable).with_name("gunicorn")
    return subprocess.Popen([str(gunicorn), "-c", "gunicorn.conf.py", "app.wsgi:app"], cwd=ROOT, env=variables,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_ready(url: str, process: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"gunicorn exited with {process.returncode}:\n{process.stdout.read()}")
        try:
            if requests.get(f"{url}/readyz", timeout=1).status_code == 200:
                return
        except requests.RequestException:  # the socket accepts before the worker has booted
            pass
        time.sleep(0.25)
    pytest.fail("server never became ready")


@pytest.fixture(scope="module")
def server(real_weights: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    port = _free_port()
    process = _start(real_weights, port, VISIONSERVE_MAX_WAIT_MS="20", VISIONSERVE_MAX_BATCH_SIZE="8")
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, process)
        yield url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)


def test_concurrent_requests_are_answered_right_and_batched(server: tuple[str, subprocess.Popen]) -> None:
    url, _ = server
    cat = encode(Image.fromarray(skimage.data.chelsea()), "JPEG")
    session = requests.Session()

    def call(_: int) -> requests.Response:
        return session.post(f"{url}/predict", data=cat, headers={"Content-Type": "image/jpeg"}, timeout=60)

    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(call, range(48)))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    assert {r.json()["predictions"][0]["index"] for r in responses} <= CATS
    assert max(int(r.headers["X-Batch-Size"]) for r in responses) > 1


def test_multipart_and_health_over_http(server: tuple[str, subprocess.Popen]) -> None:
    url, _ = server
    coffee = encode(Image.fromarray(skimage.data.coffee()), "PNG")
    response = requests.post(f"{url}/predict", files={"image": ("coffee.png", coffee, "image/png")}, timeout=60)
    assert response.status_code == 200 and response.json()["predictions"][0]["label"] in {"espresso", "cup"}
    assert requests.get(f"{url}/healthz", timeout=5).json()["status"] == "alive"
    assert requests.get(f"{url}/v1/models", timeout=5).json()["models"][0]["name"] == "efficientnet_lite0"
    bad = requests.post(f"{url}/predict", data=b"x" * 100, headers={"Content-Type": "image/jpeg"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_image"


def test_sigterm_stops_the_server_cleanly(server: tuple[str, subprocess.Popen]) -> None:
    _, process = server
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0


def test_bad_weights_stop_the_boot_with_a_clear_message(tmp_path: Path) -> None:
    process = _start(tmp_path, _free_port())
    output, _ = process.communicate(timeout=120)
    assert process.returncode != 0
    assert "no manifest.json" in output
