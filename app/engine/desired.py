"""The desired state: which versions of which models the server should serve, and each model's default.

``{model: {"versions": [...], "default": v}}`` under a generation number that grows with every change. Start-up,
the repository poll and the V2 load/unload calls write it; ``Reconciler.reconcile`` alone makes a worker match it,
and each worker reports what it serves after doing so. A model unloaded by a call stays in it as ``UNLOADED`` (no
versions), so a poll does not bring it back.

With one worker the state lives in memory (``LocalDesiredState``). With several gunicorn workers it is a directory
the master made before the fork (``CONTROL_DIR``, ``SharedDesiredState``): ``desired.json`` under a file lock, and
a ``worker-<pid>.json`` report per worker, so a change made in one worker reaches the others, and a worker started
later (a restart, ``kill -HUP``) serves the same set. Standard library only: the gunicorn master imports it.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Protocol

WATCH_S = 0.2  # how often a worker looks for a newer generation
DESIRED, LOCK = "desired.json", "lock"
Entry = dict[str, Any]  # {"versions": [...], "default": v}
UNLOADED: Entry = {"versions": [], "default": None}  # unloaded by a call: served nowhere, and the poll leaves it


class DesiredState(Protocol):
    """Where the desired state and the workers' reports live."""

    def read(self) -> tuple[int, dict[str, Entry]]: ...
    def write(self, changes: dict[str, Entry | None]) -> int: ...
    def seed(self, models: dict[str, Entry]) -> int: ...
    def report(self, generation: int, serving: dict[str, Entry], error: str | None, device: str) -> None: ...
    def workers(self) -> list[dict[str, Any]]: ...
    def wait_applied(self, generation: int, timeout_s: float) -> tuple[list[dict[str, Any]], list[int]]: ...


def _changed(models: dict[str, Entry], changes: dict[str, Entry | None]) -> dict[str, Entry]:
    """``models`` with ``changes`` applied (None: the model is no longer wanted)."""
    updated = dict(models)
    for name, entry in changes.items():
        if entry is None:
            updated.pop(name, None)
        else:
            updated[name] = {"versions": list(entry["versions"]), "default": entry["default"]}
    return updated


def _worker_report(generation: int, serving: dict[str, Entry], error: str | None, device: str) -> dict[str, Any]:
    return {"pid": os.getpid(), "generation": generation, "models": serving, "error": error, "device": device,
            "time": time.time()}


class LocalDesiredState:
    """One worker: the state in memory, and this worker's report as the only one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation, self._models = 0, {}  # type: tuple[int, dict[str, Entry]]
        self._report: dict[str, Any] | None = None

    def read(self) -> tuple[int, dict[str, Entry]]:
        """The newest generation and its models."""
        with self._lock:
            return self._generation, dict(self._models)

    def write(self, changes: dict[str, Entry | None]) -> int:
        """Apply ``changes``; a new generation only when something changed. Returns the generation."""
        with self._lock:
            updated = _changed(self._models, changes)
            if updated != self._models:
                self._generation, self._models = self._generation + 1, updated
            return self._generation

    def seed(self, models: dict[str, Entry]) -> int:
        """The first generation, unless there is one already."""
        with self._lock:
            if not self._generation:
                self._generation, self._models = 1, dict(models)
            return self._generation

    def report(self, generation: int, serving: dict[str, Entry], error: str | None, device: str) -> None:
        """What this worker serves after applying ``generation``."""
        self._report = _worker_report(generation, serving, error, device)

    def workers(self) -> list[dict[str, Any]]:
        """This worker's report."""
        return [self._report] if self._report else []

    def wait_applied(self, generation: int, timeout_s: float) -> tuple[list[dict[str, Any]], list[int]]:
        """Nothing to wait for: the only worker applied it before writing it."""
        return self.workers(), []


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


class SharedDesiredState:
    """Several workers: the state in ``root/desired.json``, each worker's report in ``root/worker-<pid>.json``."""

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

    def read(self) -> tuple[int, dict[str, Entry]]:
        """The newest generation and its models."""
        data = _read(self.root / DESIRED) or {}
        return int(data.get("generation", 0)), dict(data.get("models", {}))

    def _commit(self, decide: Any) -> int:
        with self._locked():
            generation, models = self.read()
            updated = decide(generation, models)
            if updated is None or updated == models:
                return generation
            _write_atomic(self.root / DESIRED, {"generation": generation + 1, "models": updated})
            return generation + 1

    def write(self, changes: dict[str, Entry | None]) -> int:
        """Apply ``changes`` to the newest generation under the lock (so calls for different models on different
        workers at once both take effect); a new generation only when something changed. Returns the generation."""
        return self._commit(lambda _, models: _changed(models, changes))

    def seed(self, models: dict[str, Entry]) -> int:
        """The first generation, unless a worker wrote one already."""
        return self._commit(lambda generation, _: None if generation else dict(models))

    def report(self, generation: int, serving: dict[str, Entry], error: str | None, device: str) -> None:
        """What this worker serves after applying ``generation``, on which device, and why it could not apply it."""
        _write_atomic(self.root / f"worker-{self.pid}.json", {**_worker_report(generation, serving, error, device),
                                                              "pid": self.pid})

    def forget(self, pid: int) -> None:
        """A worker ended: drop its report (the master calls this)."""
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


def desired_state(control_dir: Path | None) -> DesiredState:
    """The shared state when the server has a control directory (several workers), else one in memory."""
    return SharedDesiredState(control_dir) if control_dir is not None else LocalDesiredState()
