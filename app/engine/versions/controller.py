"""The versions machinery of one process that serves models, built and owned in one place: the apply step
(``Applier``), its side of the state shared between processes (``WorkerSync``), the rollout changes and the writers
(start-up, the poll, the load and unload calls, the follow thread). ``Service`` starts and stops it and routes
requests through its table; the catalog only reads it and hands it calls."""
from __future__ import annotations

from typing import Any, Callable

from app.config import Settings
from app.engine.rollouts.evidence import Evidence
from app.engine.versions.apply import Applier
from app.engine.versions.desired import desired_state
from app.engine.versions.rollout_changes import RolloutChanges
from app.engine.versions.routing import RoutingTable
from app.engine.versions.sources import Source
from app.engine.versions.sync import WorkerSync
from app.engine.versions.writers import Writers


class VersionsController:
    """This process's versions: what it serves (``routes``), how that changes (``writers``, ``rollout_changes``,
    both through ``applier`` and ``sync``), and the rollout ``evidence`` its requests add to."""

    def __init__(self, settings: Settings, source: Source, on_report: Callable[[], None]) -> None:
        self.source = source
        self.applier = Applier(settings, source)
        self.sync = WorkerSync(desired_state(settings.control_dir), self._report_body,
                               settings.repository_sync_timeout_s, on_report)
        self.rollout_changes = RolloutChanges(self.applier, self.sync)
        self.writers = Writers(settings, source, self.applier, self.sync, self.rollout_changes)

    @property
    def routes(self) -> RoutingTable:
        """What serves now: the routing table requests take their version from."""
        return self.applier.routes

    @property
    def evidence(self) -> Evidence:
        """This process's rollout evidence (comparisons, each version's traffic)."""
        return self.applier.evidence

    def boot(self) -> None:
        """Load the first models (the settings', each as its policy picks) and start following the shared state."""
        self.writers.boot()

    def close(self) -> None:
        """Stop following the shared state and polling."""
        self.writers.close()

    def _report_body(self) -> dict[str, Any]:
        return {"models": self.applier.serving(), "not_served": self.applier.not_served,
                "device": str(self.applier.device), "evidence": self.applier.evidence.dump()}
