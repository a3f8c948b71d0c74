"""Several gunicorn workers, one set of models: the workers of one server share repository loads through a
directory (``CONTROL_DIR``, made by gunicorn.conf.py in the master before the fork).

The worker that takes a load or unload call applies it first (so a refusal changes nothing anywhere), then
publishes the model as it now serves it in a new generation of ``desired.json`` (the whole set the server
serves); every other worker applies each new generation within ``WATCH_S`` and writes what it serves to
``worker-<pid>.json``, and the call answers once every live worker has applied it. A worker started later (a
restart, ``kill -HUP``) applies the newest generation before it reports ready. Standard library only.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

WATCH_S = 0.2  # how often a worker looks for a new generation
DESIRED, LOCK = "desired.json", "lock"


def _write_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, sort_keys=True), encoding="utf-8")
    tmp.replace(path)


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Control:
    """This worker's view of the shared directory."""

    def __init__(self, root: Path, pid: int | None = None) -> None:
        self.root = root
        self.pid = pid or os.getpid()
        root.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.root / LOCK, "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def desired(self) -> tuple[int, dict[str, Any]]:
        """The newest generation and the models it serves ({name: {"versions": [...], "default": v}})."""
        data = _read(self.root / DESIRED) or {}
        return int(data.get("generation", 0)), dict(data.get("models", {}))

    def publish(self, served: dict[str, Any], name: str) -> int:
        """The next generation: the last one with model ``name`` as this worker now serves it (``served``, this
        worker's whole set, seeds the first generation); returns its number. Changing one model only, two calls
        for different models on different workers at once both take effect."""
        with self._locked():
            generation, models = self.desired()
            if generation == 0:
                models = dict(served)
            if name in served:
                models[name] = served[name]
            else:
                models.pop(name, None)
            _write_atomic(self.root / DESIRED, {"generation": generation + 1, "models": models})
        return generation + 1

    def report(self, generation: int, models: dict[str, Any], error: str | None = None,
               device: str | None = None) -> None:
        """What this worker serves after applying ``generation``, on which device (and why it could not apply it,
        if it could not)."""
        _write_atomic(self.root / f"worker-{self.pid}.json", {"pid": self.pid, "generation": generation,
                                                              "models": models, "error": error, "device": device,
                                                              "time": time.time()})

    def forget(self, pid: int) -> None:
        """A worker ended: drop its report."""
        with contextlib.suppress(OSError):
            (self.root / f"worker-{pid}.json").unlink()

    def workers(self) -> list[dict[str, Any]]:
        """The reports of the live workers, by pid."""
        reports = [_read(path) for path in sorted(self.root.glob("worker-*.json"))]
        return sorted((r for r in reports if isinstance(r, dict) and _alive(int(r.get("pid", 0)))),
                      key=lambda r: r["pid"])

    def wait_applied(self, generation: int, timeout_s: float) -> tuple[list[dict[str, Any]], list[int]]:
        """Wait until every live worker applied ``generation``; returns the reports and the pids still behind."""
        until = time.monotonic() + timeout_s
        while True:
            reports = self.workers()
            behind = [r["pid"] for r in reports if r.get("generation", 0) < generation]
            if not behind or time.monotonic() >= until:
                return reports, behind
            time.sleep(WATCH_S / 2)
