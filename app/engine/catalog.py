"""The served models as protocols see them: what they read (each loaded version's facts, the default model, what
every worker serves, the repository index, the rollouts) and the calls that change them (load, unload, promote,
rollback). Plain data out, never a loaded version: protocols reach the engine through ``Service.admit`` for
requests and through this for everything about models, and nothing else.

It also builds and holds the versions wing's objects: the apply step, the sync between workers, the rollout
changes and the writers (app/engine/versions/).
"""
from __future__ import annotations

from typing import Any, Callable

from app.config import Settings
from app.engine.contract import VersionInfo
from app.engine.loaded.version import LoadedVersion
from app.engine.rollouts.entry import ModelEntry
from app.engine.versions.apply import Applier
from app.engine.versions.desired import desired_state
from app.engine.versions.rollout_changes import RolloutChanges
from app.engine.versions.sources import Source
from app.engine.versions.states import VersionState
from app.engine.versions.sync import WorkerSync
from app.engine.versions.writers import Writers


class Catalog:
    """What protocols read about the served models and the calls that change them; ``wait_loaded`` makes a call
    that reaches a worker still starting wait for its first models."""

    def __init__(self, settings: Settings, source: Source, wait_loaded: Callable[[float], None],
                 on_report: Callable[[], None]) -> None:
        self.settings, self.source, self._wait_loaded = settings, source, wait_loaded
        self.applier = Applier(settings, source)
        self.sync = WorkerSync(desired_state(settings.control_dir), self._report_body,
                               settings.repository_sync_timeout_s, on_report)
        self.rollout_changes = RolloutChanges(self.applier, self.sync)
        self.writers = Writers(settings, source, self.applier, self.sync, self.rollout_changes)

    def _report_body(self) -> dict[str, Any]:
        return {"models": self.applier.serving(), "device": str(self.applier.device),
                "evidence": self.applier.evidence.dump()}

    # -- what protocols read ---------------------------------------------------------------------------------------

    def versions(self) -> list[VersionInfo]:
        """Every loaded version this worker serves, by model."""
        roles = self.rollout_changes.roles()
        return [self._info(loaded, loaded.version == default, roles.get((loaded.name, loaded.version)))
                for versions, default in self.applier.routes.routes().values() for loaded in versions]

    def version(self, name: str | None, version: str | None = None) -> VersionInfo:
        """The version a request for ``name`` at ``version`` would get now (NotFound)."""
        loaded = self.applier.routes.find(name, version)
        default = self.applier.routes.routes().get(loaded.name, ([], None))[1]
        return self._info(loaded, loaded.version == default, self.rollout_changes.roles().get((loaded.name,
                                                                                                loaded.version)))

    def _info(self, loaded: LoadedVersion, default: bool, role: str | None) -> VersionInfo:
        predictor, batcher = loaded.predictor, loaded.batcher
        return VersionInfo(
            manifest=predictor.manifest, weights_format=predictor.weights_format, device=str(predictor.device),
            dtype=predictor.dtype_name, warmed_batch_sizes=list(predictor.warmed_batch_sizes),
            alive=batcher.is_alive(), default=default, role=role, memory_bytes=predictor.weights_bytes,
            device_memory_bytes=loaded.device_memory_bytes, monitoring=loaded.monitor.snapshot(),
            batch_cap=batcher.max_batch_size, current_max_batch_size=batcher.current_max_batch_size,
            queue_depth=batcher.depth, profile=dict(loaded.batch_profile))

    def default_model(self) -> str | None:
        """The model requests naming none get (None: they must name one)."""
        return self.applier.routes.default_model()

    def serving(self) -> dict[str, ModelEntry]:
        """What this worker serves: {name: {"versions": [...], "default": v}}."""
        return self.applier.serving()

    def workers(self) -> list[dict[str, Any]]:
        """What each worker of the server serves (its last report)."""
        return self.sync.workers()

    def index(self) -> list[VersionState]:
        """Every version in the repository or in memory, with this worker's state of it."""
        return self.applier.index()

    def in_repository(self, name: str, version: str | None = None) -> bool:
        """Whether the repository holds model ``name`` (at ``version``), loaded or not."""
        return name in self.source.models() and (version is None or version in self.source.versions(name))

    def roles(self) -> dict[tuple[str, str], str]:
        """(model, version) -> its role now: live, canary, shadow or previous."""
        return self.rollout_changes.roles()

    def rollouts(self) -> dict[str, dict[str, Any]]:
        """Every model with a rollout, a previous default or a watch: its rollout and the evidence over every
        worker (app/engine/rollouts/rules.summary)."""
        return self.rollout_changes.summaries()

    # -- the calls that change them --------------------------------------------------------------------------------

    def load(self, name: str, config: Any = None) -> ModelEntry:
        """A V2 load call (app/engine/versions/writers.py ``Writers.load``); returns what this worker serves of it."""
        self._wait_loaded(self.settings.repository_sync_timeout_s)
        self.writers.load(name, config)
        return self._served(name)

    def unload(self, name: str) -> ModelEntry:
        """A V2 unload call; returns what this worker serves of it (nothing)."""
        self._wait_loaded(self.settings.repository_sync_timeout_s)
        self.writers.unload(name)
        return self._served(name)

    def promote(self, name: str, version: str | None = None) -> ModelEntry:
        """A promote call (``RolloutChanges.promote``); returns the model's entry now."""
        self._wait_loaded(self.settings.repository_sync_timeout_s)
        return self.rollout_changes.promote(name, version)

    def rollback(self, name: str, version: str | None = None) -> ModelEntry:
        """A rollback call (``RolloutChanges.rollback``); returns the model's entry now."""
        self._wait_loaded(self.settings.repository_sync_timeout_s)
        return self.rollout_changes.rollback(name, version)

    def _served(self, name: str) -> ModelEntry:
        return self.applier.serving().get(name, {"versions": [], "default": None})
