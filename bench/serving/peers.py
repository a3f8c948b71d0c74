"""The peers visionserve is compared with, started like it on free loopback ports: a naive one-forward-per-request
Flask app and LitServe (in its own venv)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness.servers import Running, free_port, gunicorn_command

BENCH = Path(__file__).resolve().parents[1]


def naive(weights: Path, log_dir: Path, workers: int = 1) -> Running:
    """The one-forward-pass-per-request Flask app, under the same gunicorn config (workers, threads)."""
    port = free_port()
    env = {"NAIVE_WEIGHTS_DIR": str(weights), "VISIONSERVE_BIND": f"127.0.0.1:{port}",
           "VISIONSERVE_LOG_LEVEL": "warning", "VISIONSERVE_WORKERS": str(workers)}
    return Running("naive-flask", gunicorn_command("bench.serving.naive_app:app"), env, port, "/healthz", log_dir)


LITSERVE_VERSION = "0.2.19"
LITSERVE_VENV = BENCH / ".venv-litserve"
# LitServe's documented batching: the same batch cap as ours, and its example's 10 ms timeout.
LITSERVE_BATCH, LITSERVE_TIMEOUT_S = 8, 0.01


def litserve_python() -> Path:
    """LitServe in its own venv; our venv's packages (torch, the app) are reached through a .pth file."""
    return side_venv(LITSERVE_VENV, [f"litserve=={LITSERVE_VERSION}"])


def side_venv(venv: Path, requirements: list[str]) -> Path:
    """The python of ``venv``, made once with ``requirements`` installed and our venv's packages (torch, the app)
    reached through a .pth file: what a benchmark compares with stays out of the project's dependencies."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        ours = Path(torch_site_packages())
        site = next((venv / "lib").glob("python3*/site-packages"))
        (site / "visionserve.pth").write_text(str(ours) + "\n")
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", *requirements], check=True)
    return python


def torch_site_packages() -> str:
    """The site-packages directory that holds this interpreter's torch."""
    import torch

    return str(Path(torch.__file__).resolve().parents[1])


def litserve(weights: Path, log_dir: Path, workers: int = 1) -> Running:
    """LitServe with batching on, serving the same weights with the same decode and transform."""
    port = free_port()
    command = [str(litserve_python()), "-m", "bench.serving.litserve_app", str(port), str(weights),
               str(LITSERVE_BATCH), str(LITSERVE_TIMEOUT_S), str(workers)]
    return Running("litserve", command, {}, port, "/health", log_dir)
