"""Every shell command in the README and docs/ that calls the service runs, as printed, against the real server.

The commands are taken from the fenced ```bash blocks (a command ends where bash finds it complete), aimed at the
live server instead of localhost:8000, and run in a folder holding cat.jpg and cup.jpg: real photos of several MB,
so a form that only works for small files (a base64 body on the command line) fails here. They run as in a fresh
shell after the README's set-up (`make serve`): .venv/bin is not on the PATH.

Every command the docs show runs in such a shell as written (#46): only .venv has the project's packages (torch,
requests...) and the client's `visionserve` command, so a bare `python -m models.export` or `visionserve predict`
is caught from the text, in the bash blocks of every page and in the inline code of the pages a user follows.
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
CALLS_SERVICE = re.compile(r"localhost:8000|-m visionserve_client\b|\.venv/bin/visionserve\b")
# A command that fails in a fresh shell: a project module run by whatever `python` is first on the PATH (the
# system's has no torch), or the client's command by its bare name (it is installed into .venv/bin only).
BARE = re.compile(r"(?<![\w/.=-])(?:python3? -m (?:models|app|demo_data|visionserve_client)\b"
                  r"|visionserve (?:predict|embed|health|ready|model|-))")
# Inline `code` is checked too on these pages. Not on docs/architecture.md (a module map: "train.py  python -m
# models.train, top to bottom"), docs/configuration.md (generated from app/config.py), docs/testing.md and
# docs/performance.md (the developer's and benchmark pages), nor yet docs/training.md.
INLINE_CHECKED = ("README.md", "docs/api.md", "docs/models.md", "docs/deployment.md", "docs/training.md")
VENV_COMMAND = re.compile(r"(?<![\w/.-])\.venv/bin/([\w.-]+)")


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


def code_spans(markdown: str) -> list[str]:
    """The inline `code` outside fenced blocks, a span broken over lines joined with a space."""
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]


def shown_commands(doc: Path) -> list[str]:
    """What ``doc`` shows a user to run: its bash blocks' commands, and its inline code where it is checked."""
    markdown = doc.read_text(encoding="utf-8")
    inline = doc.relative_to(ROOT).as_posix() in INLINE_CHECKED
    return shell_commands(markdown) + (code_spans(markdown) if inline else [])


def service_commands() -> list[tuple[str, str]]:
    return [(doc.relative_to(ROOT).as_posix(), command) for doc in DOCS
            for command in shell_commands(doc.read_text(encoding="utf-8")) if CALLS_SERVICE.search(command)]


def test_the_extraction_keeps_multi_line_commands_whole() -> None:
    text = "```bash\nmake serve\n{ printf a; base64 x\n  printf b; } | curl \\\n  localhost:8000/x   # c\n```\n"
    assert shell_commands(text) == ["make serve", "{ printf a; base64 x\n  printf b; } | curl \\\n  "
                                                  "localhost:8000/x   # c"]
    assert len(service_commands()) >= 8  # README and docs/api.md hold at least these


def test_the_fresh_shell_check_catches_bare_commands() -> None:
    text = ("Run `python -m models.export --default` or `python3 -m app.configdoc\n--check`, then `visionserve "
            "predict cat.jpg`.\n```bash\npython -m models.train --data d \\\n  --epochs 1\n"
            "cd x && python -m demo_data textures --out d\nvisionserve --help\n"
            "python -m visionserve_client ready\n```\n")
    caught = [c for c in shell_commands(text) + code_spans(text) if BARE.search(c)]
    assert len(caught) == 7, caught
    fine = ("Run `.venv/bin/python -m models.export`, `.venv/bin/visionserve predict cat.jpg`, `make serve`.\n"
            "```bash\n.venv/bin/python -m models.train --data d\nOTEL_SERVICE_NAME=visionserve make serve\n"
            "python3 -c 'import json'\n.venv/bin/python -m visionserve_client ready\n```\n")
    assert not [c for c in shell_commands(fine) + code_spans(fine) if BARE.search(c)]


def test_every_command_shown_runs_in_a_fresh_shell() -> None:
    # Before (#46): README and docs/models.md said `python -m models.export ...`, "No module named 'torch'" in a
    # fresh shell after `make serve`, and docs/api.md `visionserve predict`, which .venv did not even have.
    bare = [(doc.relative_to(ROOT).as_posix(), command) for doc in [*DOCS, *(ROOT / "docs" / w for w in WALKED)]
            for command in shown_commands(doc) if BARE.search(command)]
    assert not bare, "write these as .venv/bin/python -m ... or .venv/bin/visionserve:\n" + "\n".join(
        f"{doc}: {command}" for doc, command in bare)


def _venv_commands() -> set[str]:
    return {name for doc in [*DOCS, *(ROOT / "docs" / w for w in WALKED)]
            for text in (doc.read_text(encoding="utf-8"),) for name in VENV_COMMAND.findall(text)}


def test_every_venv_command_the_docs_use_is_installed() -> None:
    names = _venv_commands()
    assert {"python", "visionserve"} <= names
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip(f"not run by the checkout's .venv ({sys.prefix})")
    missing = sorted(name for name in names if not (ROOT / ".venv" / "bin" / name).exists())
    assert not missing, f".venv/bin lacks {missing}: `make install` installs them"


@pytest.mark.parametrize("target", ["install", "serve", "test"])
def test_make_installs_the_client_command(target: str) -> None:
    # Before (#46): make installed the requirements only; the client's console script never reached .venv/bin.
    result = subprocess.run(["make", "-n", "-o", ".venv/.installed", "-W", "pyproject.toml", target], cwd=ROOT,
                            capture_output=True, text=True, check=True)
    assert re.search(r"(?:^|\s)\.venv/bin/python -m pip install .*--editable \.$", result.stdout, flags=re.M), \
        result.stdout


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
    venv_bin = Path(sys.executable).parent  # the commands' .venv/bin: they run elsewhere (photo_dir)
    if ".venv/bin/visionserve" in command and not (venv_bin / "visionserve").exists():
        pytest.fail(f"{doc}: {command}\n{venv_bin / 'visionserve'} is missing: `make install` installs it")
    aimed = re.sub(r"(?<![\w/.-])\.venv/bin/", f"{venv_bin}/",
                   command.replace("localhost:8000", f"127.0.0.1:{live_server.port}"))
    if "curl -f" not in aimed:  # an HTTP error must fail the command, not print a JSON error and exit 0
        aimed = aimed.replace("curl ", "curl -sS --fail-with-body ")
    # A fresh shell: no virtualenv active, so .venv/bin is not on the PATH.
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and Path(p).resolve() != venv_bin.resolve())
    env = {**{k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}, "PATH": path, "PYTHONPATH": str(ROOT),
           "VISIONSERVE_URL": live_server.url}
    result = subprocess.run(["bash", "-o", "pipefail", "-c", aimed], cwd=photo_dir, capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 0, f"{doc}: {command}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    assert result.stdout.strip(), f"{doc}: {command} printed nothing"
    try:
        answer = json.loads(result.stdout)
    except ValueError:
        return  # a table (the CLI) or plain text
    assert not (isinstance(answer, dict) and "error" in answer), answer
