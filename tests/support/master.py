"""The gunicorn master's engine supervision (app/link/supervisor.py) made quick for a test: its state queries, their
answer bound and its restart delay small, and every engine process it starts a script of the test's own."""
from __future__ import annotations

import subprocess
import sys
from typing import Callable

import pytest

from app.link import supervisor


def engines_started_as(monkeypatch: pytest.MonkeyPatch, script: Callable[[int], list[str]],
                       answer_s: float) -> list[subprocess.Popen[bytes]]:
    """The engine processes the master starts from now on, each ``python -c`` with ``script(how many came
    before)`` (the script and its arguments), in the order started; its state asked every 0.05 s, an answer
    waited for ``answer_s``, a dead engine restarted after 0.05 s."""
    monkeypatch.setattr(supervisor, "STATE_EVERY_S", 0.05)
    monkeypatch.setattr(supervisor, "STATE_ANSWER_S", answer_s)
    monkeypatch.setattr(supervisor, "RESTART_DELAY_S", 0.05)
    real_popen = subprocess.Popen
    spawned: list[subprocess.Popen[bytes]] = []

    def popen(command: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        child = real_popen([sys.executable, "-c", *script(len(spawned))], stdin=subprocess.PIPE, cwd=supervisor.ROOT)
        spawned.append(child)
        return child

    monkeypatch.setattr(supervisor.subprocess, "Popen", popen)
    return spawned
