"""Every shell command in the README and docs/ that calls the service runs, as printed, against the real server.

The commands are taken from the fenced ```bash blocks (a command ends where bash finds it complete), aimed at the
live server instead of localhost:8000, and run in a folder holding cat.jpg and cup.jpg: real photos of several MB,
so a form that only works for small files (a base64 body on the command line) fails here.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import skimage.data
from PIL import Image

from harness.servers import ROOT, Running

# docs/training.md and docs/models.md run whole, in order, with their own servers: tests/server/test_docs_walkthrough.py
WALKED = ("training.md", "models.md")
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in WALKED)]
CALLS_SERVICE = re.compile(r"localhost:8000|-m visionserve_client\b")


def _complete(text: str) -> bool:
    return subprocess.run(["bash", "-n", "-c", text], capture_output=True).returncode == 0


def shell_commands(markdown: str) -> list[str]:
    """The commands of every ```bash block, multi-line ones (pipes, backslashes, { } groups) kept whole."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", markdown, flags=re.S | re.M):
        pending = ""
        for line in block.splitlines():
            pending += line + "\n"
            if pending.strip() and not line.rstrip().endswith("\\") and _complete(pending):
                commands.append(pending.strip())
                pending = ""
        assert not pending.strip(), f"an incomplete command in a bash block: {pending}"
    return commands


def service_commands() -> list[tuple[str, str]]:
    return [(doc.relative_to(ROOT).as_posix(), command) for doc in DOCS
            for command in shell_commands(doc.read_text(encoding="utf-8")) if CALLS_SERVICE.search(command)]


def test_the_extraction_keeps_multi_line_commands_whole() -> None:
    text = "```bash\nmake serve\n{ printf a; base64 x\n  printf b; } | curl \\\n  localhost:8000/x   # c\n```\n"
    assert shell_commands(text) == ["make serve", "{ printf a; base64 x\n  printf b; } | curl \\\n  "
                                                  "localhost:8000/x   # c"]
    assert len(service_commands()) >= 8  # README and docs/api.md hold at least these


def _photo(path: Path, image: np.ndarray, scale: int) -> Path:
    """The photo enlarged to a phone camera's size, with a camera's sensor noise (a smooth enlargement would
    compress to a fraction of a real photo's bytes)."""
    picture = Image.fromarray(image)
    big = np.asarray(picture.resize((picture.width * scale, picture.height * scale), Image.Resampling.BICUBIC))
    noise = np.random.default_rng(0).normal(0, 4, big.shape)
    Image.fromarray(np.clip(big + noise, 0, 255).astype(np.uint8)).save(path, quality=95)
    return path


@pytest.fixture(scope="module")
def photo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("photos")
    cat = _photo(folder / "cat.jpg", skimage.data.chelsea(), 8)  # 3608 x 2400
    _photo(folder / "cup.jpg", skimage.data.coffee(), 6)
    assert cat.stat().st_size > 2_000_000, cat.stat().st_size  # several MB, as a phone's photo
    return folder


@pytest.mark.parametrize("doc, command", service_commands(), ids=lambda value: str(value)[:60])
def test_documented_command_works(live_server: Running, photo_dir: Path, doc: str, command: str) -> None:
    aimed = command.replace("localhost:8000", f"127.0.0.1:{live_server.port}").replace(".venv/bin/python",
                                                                                      sys.executable)
    if "curl -f" not in aimed:  # an HTTP error must fail the command, not print a JSON error and exit 0
        aimed = aimed.replace("curl ", "curl -sS --fail-with-body ")
    result = subprocess.run(["bash", "-o", "pipefail", "-c", aimed], cwd=photo_dir, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, f"{doc}: {command}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    assert result.stdout.strip(), f"{doc}: {command} printed nothing"
    try:
        answer = json.loads(result.stdout)
    except ValueError:
        return  # a table (the CLI) or plain text
    assert not (isinstance(answer, dict) and "error" in answer), answer
