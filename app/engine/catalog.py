"""The served models as protocols see them: what they read (each loaded version's facts, the default model, what
every worker serves, the repository index, the rollouts) and the calls that change them (load, unload, promote,
rollback). Plain data out, never a loaded version: protocols reach the engine through ``Service.admit`` for
requests and through this for everything about models, and nothing else. It implements ``contract.CatalogFace``,
the one list of catalog calls (an HTTP worker's ``RemoteCatalog`` makes the same calls over the engine's socket).

It reads the versions machinery and hands it calls; ``VersionsController`` (app/engine/versions/controller.py)
builds and owns it.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from app.config import Settings
from app.engine.contract import ModelsOverview, RepositoryOverview, Signature, VersionInfo, VersionState
from app.engine.loaded.version import LoadedVersion
from app.engine.rollouts.entry import ModelEntry
from app.engine.versions.controller import VersionsController
from app.engine.versions.routing import check_names

log = logging.getLogger(__name__)


class Catalog:
    """What protocols read about the served models and the calls that change them; ``wait_loaded`` makes a call
    that reaches a worker still starting wait for its first models."""

    def __init__(self, settings: Settings, controller: VersionsController,
                 wait_loaded: Callable[[float], None]) -> None:
        self.settings, self._wait_loaded = settings, wait_loaded
        self._source, self._applier, self._sync = controller.source, controller.applier, controller.sync
        self._writers, self._rollout_changes = controller.writers, controller.rollout_changes

    # -- what protocols read ---------------------------------------------------------------------------------------

    def versions(self) -> list[VersionInfo]:
        """Every loaded version this worker serves, by model."""
        roles = self._rollout_changes.roles()
        return [self._info(loaded, loaded.version == default, roles.get((loaded.name, loaded.version)))
                for versions, default in self._applier.routes.routes().values() for loaded in versions]

    def overview(self) -> ModelsOverview:
        """Every loaded version, what each worker serves, the default model and the rollouts, in one call (read one
        after the other, as the four calls would be)."""
        return ModelsOverview(self.versions(), self.workers(), self.default_model(), self.rollouts())

    def repository_overview(self) -> RepositoryOverview:
        """Every version's state, the roles and the rollouts, in one call (read one after the other, as the three
        calls would be)."""
        return RepositoryOverview(self.index(), self.roles(), self.rollouts())

    def version(self, name: str | None, version: str | None = None) -> VersionInfo:
        """The version a request for ``name`` at ``version`` would get now (NotFound)."""
        loaded = self._applier.routes.find(name, version)
        default = self._applier.routes.routes().get(loaded.name, ([], None))[1]
        return self._info(loaded, loaded.version == default, self._rollout_changes.roles().get((loaded.name,
                                                                                                loaded.version)))

    def settle_figures(self) -> None:
        """Every routed version's figures held since its last settle (METRICS_FLUSH_MS) written now: a scrape of
        /metrics asks first, so it sees every request answered before it."""
        for loaded in self._applier.routes.all_versions():
            _settle(loaded)

    def _info(self, loaded: LoadedVersion, default: bool, role: str | None) -> VersionInfo:
        _settle(loaded)  # its monitoring as of every request answered before this read
        predictor, batcher = loaded.predictor, loaded.batcher
        return VersionInfo(
            manifest=predictor.manifest, weights_format=predictor.weights_format, device=str(predictor.device),
            dtype=predictor.dtype_name, memory_format=predictor.memory_format,
            warmed_batch_sizes=list(predictor.warmed_batch_sizes),
            alive=batcher.is_alive(), default=default, role=role, memory_bytes=predictor.weights_bytes,
            device_memory_bytes=loaded.device_memory_bytes, monitoring=loaded.monitor.snapshot(),
            batch_cap=batcher.max_batch_size, current_max_batch_size=batcher.current_max_batch_size,
            queue_depth=batcher.depth, profile=dict(loaded.batch_profile))

    def signature(self, name: str | None, version: str | None = None) -> Signature:
        """What a request for ``name`` at ``version`` is parsed with now (NotFound): the version's name, classes and
        input shape, as ``Call.model`` (an HTTP worker of the engine process keeps these, ``routes_generation``)."""
        return self._applier.routes.find(name, version).signature

    def routes_generation(self) -> int:
        """Grows whenever what serves changes (a version routed or removed, the default model named)."""
        return self._applier.routes.generation

    def default_model(self) -> str | None:
        """The model requests naming none get (None: they must name one)."""
        return self._applier.routes.default_model()

    def serving(self) -> dict[str, ModelEntry]:
        """What this worker serves: {name: {"versions": [...], "default": v}}."""
        return self._applier.serving()

    def workers(self) -> list[dict[str, Any]]:
        """What each worker of the server serves (its last report)."""
        return self._sync.workers()

    def index(self) -> list[VersionState]:
        """Every version in the repository or in memory, with this worker's state of it."""
        return self._applier.index(self._sync.read()[1])

    def in_repository(self, name: str, version: str | None = None) -> bool:
        """Whether the repository holds model ``name`` (at ``version``), loaded or not."""
        check_names(name, version)
        return name in self._source.models() and (version is None or version in self._source.versions(name))

    def roles(self) -> dict[tuple[str, str], str]:
        """(model, version) -> its role now: live, canary, shadow or previous."""
        return self._rollout_changes.roles()

    def rollouts(self) -> dict[str, dict[str, Any]]:
        """Every model with a rollout, a previous default or a watch: its rollout and the evidence over every
        worker (app/engine/rollouts/rules.summary)."""
        return self._rollout_changes.summaries()

    # -- the calls that change them --------------------------------------------------------------------------------

    def load(self, name: str, config: Any = None) -> ModelEntry:
        """A V2 load call (app/engine/versions/writers.py ``Writers.load``); returns what this worker serves of it."""
        check_names(name)
        self._writers.load(name, config, start_within_s=self._wait_to_change())
        return self._served(name)

    def unload(self, name: str) -> ModelEntry:
        """A V2 unload call; returns what this worker serves of it (nothing)."""
        check_names(name)
        self._writers.unload(name, start_within_s=self._wait_to_change())
        return self._served(name)

    def promote(self, name: str, version: str | None = None) -> ModelEntry:
        """A promote call (``RolloutChanges.promote``); returns the model's entry now."""
        check_names(name, version)
        return self._rollout_changes.promote(name, version, start_within_s=self._wait_to_change())

    def rollback(self, name: str, version: str | None = None) -> ModelEntry:
        """A rollback call (``RolloutChanges.rollback``); returns the model's entry now."""
        check_names(name, version)
        return self._rollout_changes.rollback(name, version, start_within_s=self._wait_to_change())

    def _wait_to_change(self) -> float:
        """A change call starts within REPOSITORY_SYNC_TIMEOUT_S: this waits for the first models (a worker still
        starting) and returns what is left of it for another change under way to end (``Applier.changing``)."""
        start_by = time.monotonic() + self.settings.repository_sync_timeout_s
        self._wait_loaded(self.settings.repository_sync_timeout_s)
        return max(0.0, start_by - time.monotonic())

    def _served(self, name: str) -> ModelEntry:
        return self._applier.serving().get(name, {"versions": [], "default": None})


def _settle(loaded: LoadedVersion) -> None:
    """``loaded``'s held figures written for a reader; a fault is logged, never the read's failure (the batcher's
    own settle is guarded alike: accounting never fails what it accounts for)."""
    try:
        loaded.settle()
    except Exception:  # noqa: BLE001 - see above
        log.exception("writing the figures of model %s version %s failed", loaded.name, loaded.version)
