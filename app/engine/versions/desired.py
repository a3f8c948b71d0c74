"""The desired state: which versions of which models the server should serve, and each model's default.

``{model: {"versions": [...], "default": v}}`` under a generation number that grows with every change. Start-up,
the repository poll and the V2 load/unload calls write it; ``Applier.apply`` alone makes a worker match it,
and each worker reports what it serves after doing so. A model unloaded by a call stays in it as ``UNLOADED`` (no
versions), so a poll does not bring it back.

With one worker the state lives in memory (``DesiredState``). With several gunicorn workers it is a directory
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
from typing import Any, Callable, Iterator

from app.engine.rollouts.entry import ModelEntry, is_unloaded
from app.hosting import control

WATCH_S = 0.2  # how often a worker looks for a newer generation


def _changed(models: dict[str, ModelEntry], changes: dict[str, ModelEntry | None]) -> dict[str, ModelEntry]:
    """``models`` with ``changes`` applied (None: the model is no longer wanted)."""
    updated = dict(models)
    for name, entry in changes.items():
        if entry is None:
            updated.pop(name, None)
        else:
            updated[name] = dict(entry)
    return updated


class DesiredState:
    """One worker: the state and this worker's report in memory. ``SharedDesiredState`` keeps them in files."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._state: tuple[int, dict[str, ModelEntry]] = (0, {})
        self._reports: dict[int, dict[str, Any]] = {}

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            yield

    def read(self) -> tuple[int, dict[str, ModelEntry]]:
        """The newest generation and its models."""
        return self._state[0], dict(self._state[1])

    def _store(self, generation: int, models: dict[str, ModelEntry]) -> None:
        self._state = (generation, models)

    def _commit(self, decide: Callable[[int, dict[str, ModelEntry]], dict[str, ModelEntry] | None]
                ) -> tuple[int, bool]:
        """The newest generation once ``decide`` had its say, and whether this call wrote it (``decide`` changed
        something): a generation it did not write may be another worker's change, still to apply here."""
        with self._locked():
            generation, models = self.read()
            updated = decide(generation, models)
            if updated is None or updated == models:
                return generation, False
            self._store(generation + 1, updated)
            return generation + 1, True

    def write(self, changes: dict[str, ModelEntry | None]) -> tuple[int, bool]:
        """Apply ``changes`` to the newest generation under the lock (so calls for different models on different
        workers at once both take effect); a new generation only when something changed. Returns the newest
        generation and whether this call wrote it."""
        return self._commit(lambda _, models: _changed(models, changes))

    def write_unless_changed(self, changes: dict[str, ModelEntry | None],
                             read: dict[str, ModelEntry]) -> tuple[int, bool, bool]:
        """``write`` for a change decided on the models as ``read``: a model whose entry another writer changed
        since (a load call during a poll) keeps that newer entry. Returns the newest generation, whether this call
        wrote it, and whether every change was written."""
        kept: dict[str, ModelEntry | None] = {}

        def decide(_: int, models: dict[str, ModelEntry]) -> dict[str, ModelEntry]:
            kept.clear()
            kept.update({name: entry for name, entry in changes.items() if models.get(name) == read.get(name)})
            return _changed(models, kept)

        generation, wrote = self._commit(decide)
        return generation, wrote, len(kept) == len(changes)

    def seed(self, models: dict[str, ModelEntry]) -> int:
        """The first generation, unless a worker wrote one already."""
        return self._commit(lambda generation, _: None if generation else dict(models))[0]

    def report(self, generation: int, serving: dict[str, ModelEntry], not_served: dict[str, str], device: str,
               evidence: dict[str, Any] | None = None) -> None:
        """What this worker serves after applying ``generation``, on which device, why it could not serve each model
        it could not as asked (``not_served``; ``error``: those reasons in one line), and its rollout evidence
        (app/engine/rollouts/evidence.py); ``started``: when its process started (``control.start_time``)."""
        self._reports[self.pid] = {"pid": self.pid, "started": control.start_time(self.pid), "generation": generation,
                                   "models": serving, "not_served": dict(not_served),
                                   "error": "; ".join(not_served[name] for name in sorted(not_served)) or None,
                                   "device": device, "time": time.time(), "evidence": evidence or {}}

    def workers(self) -> list[dict[str, Any]]:
        """The reports of the live workers, by pid."""
        return [self._reports[pid] for pid in sorted(self._reports)]

    def wait_applied(self, generation: int, timeout_s: float) -> tuple[list[dict[str, Any]], list[int]]:
        """Wait until every live worker applied ``generation``; returns the reports and the pids still behind."""
        until = time.monotonic() + timeout_s
        while True:
            reports = self.workers()
            behind = [r["pid"] for r in reports if r.get("generation", 0) < generation]
            if not behind or time.monotonic() >= until:
                return reports, behind
            time.sleep(WATCH_S / 2)


_write_atomic = control.write_json  # (a module name of its own: tests make the writes fail here)


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


class SharedDesiredState(DesiredState):
    """Several workers: the state in ``root/desired.json`` under a file lock, each worker's report in
    ``root/worker-<pid>.json``."""

    def __init__(self, root: Path, pid: int | None = None) -> None:
        super().__init__()
        self.root, self.pid = root, pid or self.pid
        root.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.root / control.LOCK, "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def read(self) -> tuple[int, dict[str, ModelEntry]]:
        """The newest generation and its models."""
        data = _read(self.root / control.DESIRED) or {}
        return int(data.get("generation", 0)), dict(data.get("models", {}))

    def _store(self, generation: int, models: dict[str, ModelEntry]) -> None:
        _write_atomic(self.root / control.DESIRED, {"generation": generation, "models": models})

    def report(self, generation: int, serving: dict[str, ModelEntry], not_served: dict[str, str], device: str,
               evidence: dict[str, Any] | None = None) -> None:
        """What this worker serves after applying ``generation``, on which device, what it could not serve and why,
        and its rollout evidence."""
        super().report(generation, serving, not_served, device, evidence)
        _write_atomic(control.report(self.root, self.pid), self._reports[self.pid])

    def workers(self) -> list[dict[str, Any]]:
        """The reports of the live workers, by pid: a report counts while the process that wrote it lives (its pid,
        started when the report says), not a later one given its pid, nor a thread whose id it is."""
        reports = [_read(path) for path in sorted(self.root.glob(control.REPORTS))]
        return sorted((r for r in reports if isinstance(r, dict)
                       and control.process_alive(int(r.get("pid", 0)), r.get("started"))), key=lambda r: r["pid"])


def desired_state(control_dir: Path | None) -> DesiredState:
    """The shared state when the server has a control directory (several workers), else one in memory."""
    return SharedDesiredState(control_dir) if control_dir is not None else DesiredState()


def kept_from_an_earlier_run(control_dir: Path) -> str | None:
    """What ``control_dir``'s desired state, which an earlier run left, holds (a new master's workers serve it, not
    the repository's policies afresh), as its start says it; None when there is none."""
    data = _read(control_dir / control.DESIRED)
    if not isinstance(data, dict) or not isinstance(data.get("models"), dict) or not data.get("generation"):
        return None
    said = []
    for name, entry in sorted(data["models"].items()):
        if not isinstance(entry, dict) or not isinstance(entry.get("versions"), list):
            said.append(f"{name} unreadable")  # (the workers say why as they apply it: never the master's end)
            continue
        if is_unloaded(entry):
            said.append(f"{name} unloaded by a call")
            continue
        one = f"{name} versions {', '.join(map(str, entry['versions']))}, default {entry.get('default')}"
        one += " (a call's: held)" if entry.get("held") else ""
        if entry.get("rolled_back"):
            one += f", {', '.join(map(str, entry['rolled_back']))} rolled back"
        if isinstance(entry.get("rollout"), dict) and entry["rollout"].get("candidate"):
            one += f", candidate {entry['rollout']['candidate']}"
        said.append(one)
    return f"generation {data['generation']}: {'; '.join(said) or 'no model'}"
