"""The gunicorn master's engine processes (``ENGINE=process``): one per GPU (one on a CPU host), each started as
``python -m app.engine.process SLOT`` (a fresh interpreter: the master never imports torch or touches CUDA, and no
process that used CUDA is ever forked), watched by a thread, restarted when it dies, stopped after the HTTP
workers at shutdown. Standard library only: it runs in the master.

An engine that exits with the boot-error status (3: a model that cannot be served) is not restarted: it wrote why
to ``engine-<slot>.failed``, and the HTTP workers stop the server with that message, as a worker that cannot load
its model does with ``ENGINE=inline``.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger("gunicorn.error")
BOOT_ERROR = 3  # app/engine/process.py's exit status when nothing can be served
RESTART_DELAY_S = 1.0  # after a crash, before starting it again (a crash loop costs one start a second)


class Engine:
    """One engine process and the thread that restarts it."""

    def __init__(self, slot: int, on_death: Callable[[int], None]) -> None:
        self.slot, self._on_death = slot, on_death
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._stopping = threading.Event()

    def start(self) -> "Engine":
        """Start the process and its watcher."""
        self._spawn()
        threading.Thread(target=self._watch, name=f"engine-{self.slot}-watch", daemon=True).start()
        return self

    def _spawn(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "app.engine.process", str(self.slot)],
                                        cwd=Path(__file__).resolve().parents[1])
        log.info("engine %d started (pid %d)", self.slot, self.process.pid)

    def _watch(self) -> None:
        while not self._stopping.is_set():
            assert self.process is not None
            status = self.process.wait()
            self._on_death(self.process.pid)
            if self._stopping.is_set():
                return
            if status == BOOT_ERROR:
                log.error("engine %d cannot serve its models (exit %d); not restarted", self.slot, status)
                return
            log.warning("engine %d (pid %d) died with status %d; restarting it", self.slot, self.process.pid, status)
            time.sleep(RESTART_DELAY_S)
            self.restarts += 1
            self._spawn()

    def stop(self, timeout_s: float) -> None:
        """SIGTERM (it finishes what is queued), then SIGKILL after ``timeout_s``."""
        self._stopping.set()
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("engine %d did not stop within %gs; killing it", self.slot, timeout_s)
            process.kill()
            process.wait()


def start_engines(count: int, on_death: Callable[[int], None]) -> list[Engine]:
    """``count`` engines, slots 0..count-1."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return [Engine(slot, on_death).start() for slot in range(count)]
