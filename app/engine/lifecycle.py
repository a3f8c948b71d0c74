"""The models of one worker over its life: the first load, load and unload calls (shared with the server's other
workers through ``Control``), following the other workers' calls, and polling the repository."""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

from app.config import Settings
from app.engine.control import WATCH_S, Control
from app.engine.manager import ModelManager, VersionState
from app.engine.model import Model
from app.engine.policy import VersionPolicy
from app.engine.registry import Registry
from app.engine.sources import Source
from app.engine.weights import resolve_device
from app.errors import LoadFailed, LoadTimeout, ServiceError

log = logging.getLogger(__name__)


class Lifecycle:
    """Which versions this worker serves, and how that changes."""

    def __init__(self, settings: Settings, source: Source, on_change: Callable[[], None] = lambda: None) -> None:
        self.settings, self.source, self.on_change = settings, source, on_change
        self.registry = Registry()
        self.manager = ModelManager(settings, source, self.registry)
        self.control = Control(settings.control_dir) if settings.control_dir is not None else None
        self._lock = threading.Lock()  # one change of the whole set at a time: a call, or another worker's
        self._applied = 0  # the control generation this worker serves
        self._stop = threading.Event()

    def boot(self) -> None:
        """Load what the server serves now (the newest shared generation, else the settings), then follow."""
        generation, desired = self.control.desired() if self.control else (0, {})
        if generation:
            self._apply(desired)
        else:
            names = self.settings.model_names() or self.source.models()
            if not names:
                raise self.source.missing()
            for name in names:
                self.manager.load(name)
        self._applied = generation
        self._report()
        if self.control is not None:
            threading.Thread(target=self._follow, name="models-follow", daemon=True).start()
        if self.settings.repository_poll_s > 0:
            threading.Thread(target=self._poll, name="models-poll", daemon=True).start()

    def snapshot(self) -> dict[str, Any]:
        """What this worker serves: {name: {"versions": [...], "default": v}}."""
        return {name: {"versions": [m.version for m in models], "default": default}
                for name, (models, default) in self.registry.snapshot().items()}

    def routed(self) -> list[Model]:
        """Every version taking traffic."""
        return [m for models, _ in self.registry.snapshot().values() for m in models]

    def load(self, name: str, config: Any = None) -> None:
        """Load ``name`` here, then in every worker of the server; raises the first refusal."""
        with self._lock:
            self.manager.load(name, config)
            generation = self._publish(name)
        self._sync(generation)

    def unload(self, name: str) -> None:
        """Unload ``name`` here, then in every worker of the server."""
        with self._lock:
            self.manager.unload(name)
            generation = self._publish(name)
        self._sync(generation)

    def index(self) -> list[VersionState]:
        """The repository index as this worker sees it."""
        return self.manager.index()

    def workers(self) -> list[dict[str, Any]]:
        """What each worker of the server serves (this one alone without a control directory)."""
        if self.control is None:
            return [{"pid": os.getpid(), "generation": 0, "models": self.snapshot(), "error": None,
                     "device": self._device()}]
        return self.control.workers()

    def close(self) -> None:
        """Stop following and polling."""
        self._stop.set()

    def _publish(self, name: str) -> int:
        if self.control is None:
            return 0
        generation = self.control.publish(self.snapshot(), name)
        if generation == self._applied + 1:  # nothing published meanwhile: this worker serves that generation
            self._applied = generation
            self._report()
        # else another worker's change came first: the follower applies the whole generation, this one included
        return generation

    def _device(self) -> str:
        return str(resolve_device(self.settings.device))

    def _report(self, error: str | None = None) -> None:
        self.on_change()
        if self.control is not None:
            self.control.report(self._applied, self.snapshot(), error, self._device())

    def _sync(self, generation: int) -> None:
        if self.control is None:
            return
        reports, behind = self.control.wait_applied(generation, self.settings.repository_sync_timeout_s)
        failed = [f"worker {r['pid']}: {r['error']}" for r in reports
                  if r.get("error") and r.get("generation", 0) >= generation]
        if failed:
            raise LoadFailed("applied here, refused by other workers (they serve what they did): " + "; ".join(failed),
                             details={"workers": reports})
        if behind:
            raise LoadTimeout(f"workers {', '.join(map(str, behind))} have not applied it within "
                              f"{self.settings.repository_sync_timeout_s:g}s; they go on trying",
                              details={"workers": reports})

    def _apply(self, desired: dict[str, Any]) -> None:
        for name, spec in desired.items():
            versions = [str(v) for v in spec["versions"]]
            self.manager.apply(name, versions, VersionPolicy("specific", tuple(versions), spec.get("default")))
        for name in set(self.registry.snapshot()) - set(desired):
            self.manager.unload(name)

    def _follow(self) -> None:
        assert self.control is not None
        while not self._stop.wait(WATCH_S):
            generation, desired = self.control.desired()
            if generation <= self._applied:
                continue
            with self._lock:
                error = None
                try:
                    self._apply(desired)
                except ServiceError as exc:
                    error = exc.message
                except Exception as exc:  # noqa: BLE001 - reported to the worker that made the call, not fatal here
                    error = repr(exc)
                self._applied = max(self._applied, generation)
                self._report(error)

    def _poll(self) -> None:
        while not self._stop.wait(self.settings.repository_poll_s):
            followed = sorted(set(self.registry.snapshot()) | set(self.settings.model_names() or
                                                                  self.source.models()))
            try:
                self.manager.poll(followed)
            except Exception:  # noqa: BLE001 - a poll that fails must not end polling
                log.exception("repository poll failed")
            self._report()
