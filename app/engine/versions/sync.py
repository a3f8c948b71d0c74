"""The sync between a server's workers: which generation of the desired state this worker serves, writing a change
it has applied, its report (what it serves, on which device, why it could not apply a generation, its rollout
evidence), and waiting for the other workers to apply a call's change.

The state itself and the reports live in app/engine/versions/desired.py (memory with one worker, ``CONTROL_DIR``
with several); this object is one worker's side of it.
"""
from __future__ import annotations

from typing import Any, Callable

from app.engine.rollouts.entry import ModelEntry
from app.engine.versions.desired import DesiredState
from app.errors import LoadFailed, LoadTimeout


class WorkerSync:
    """This worker's place in the desired state: the generation it applied, what it writes and reports.

    ``describe`` gives the report's body when it is written: {"models": what it serves, "not_served": {model: why
    it could not serve it as last asked}, "device": ..., "evidence": its rollout evidence}; ``on_report`` runs after
    each report (what this worker serves may have changed).
    """

    def __init__(self, desired: DesiredState, describe: Callable[[], dict[str, Any]], sync_timeout_s: float,
                 on_report: Callable[[], None] = lambda: None) -> None:
        self.desired, self._describe, self._sync_timeout_s = desired, describe, sync_timeout_s
        self._on_report = on_report
        self.applied = 0  # the desired generation this worker serves

    def read(self) -> tuple[int, dict[str, ModelEntry]]:
        """The newest generation and its models."""
        return self.desired.read()

    def is_behind(self) -> bool:
        """Whether another worker wrote a generation this worker does not serve yet."""
        return self.desired.read()[0] > self.applied

    def write(self, changes: dict[str, ModelEntry | None],
              read: dict[str, ModelEntry] | None = None) -> tuple[int, bool]:
        """A change already applied here, into the desired state; returns its generation and whether every change
        was written. With ``read`` (the poll's view), a model another worker's call changed since keeps the call's
        entry: this worker applies it with the rest of that newer generation when it follows."""
        complete = True
        if read is None:
            generation, wrote = self.desired.write(changes)
        else:
            generation, wrote, complete = self.desired.write_unless_changed(changes, read)
        if wrote and complete and generation == self.applied + 1:  # nothing written meanwhile: this worker serves it
            self.applied = generation
        # else another worker's change came first (or this call changed nothing, and the newest generation is
        # another's): following applies the whole generation, this one included
        self.report()
        return generation, complete

    def seed(self, models: dict[str, ModelEntry]) -> None:
        """The first generation, unless a worker that started at the same time wrote one already."""
        self.desired.seed(models)

    def served(self, generation: int) -> None:
        """This worker now serves ``generation`` (as far as it could: its report says what it could not)."""
        self.applied = max(self.applied, generation)
        self.report()

    def report(self) -> None:
        """Write this worker's report as it is now."""
        self._on_report()
        body = self._describe()
        self.desired.report(self.applied, body["models"], body["not_served"], body["device"], body["evidence"])

    def workers(self) -> list[dict[str, Any]]:
        """What each worker of the server serves (its last report)."""
        return self.desired.workers()

    def served_elsewhere(self, name: str) -> set[str]:
        """The versions of model ``name`` the other live workers serve (their last reports)."""
        return {version for report in self.desired.workers() if report.get("pid") != self.desired.pid
                for version in ((report.get("models") or {}).get(name) or {}).get("versions", [])}

    def current_workers(self, newest: int | None = None) -> list[dict[str, Any]]:
        """The reports of the workers that serve the newest generation (``newest``, when the caller has just read
        it): the rollout evidence gathered under the roles it gives (a worker still behind counts its traffic under
        the roles before, e.g. a candidate's canary requests as though the new default had served them)."""
        newest = self.desired.read()[0] if newest is None else newest
        return [report for report in self.desired.workers() if report.get("generation", 0) >= newest]

    def wait_for_workers(self, generation: int, name: str) -> None:
        """Return once every live worker serves ``generation``, a call's change of model ``name``; LoadFailed when
        one could not serve ``name`` as it says (another model's trouble is not the call's), LoadTimeout when one
        has not applied it within REPOSITORY_SYNC_TIMEOUT_S (it goes on trying)."""
        timeout_s = self._sync_timeout_s
        reports, behind = self.desired.wait_applied(generation, timeout_s)
        failed = [f"worker {r['pid']}: {r['not_served'][name]}" for r in reports
                  if r.get("generation", 0) >= generation and name in (r.get("not_served") or {})]
        if failed:
            raise LoadFailed("applied here, refused by other workers (they serve what they did): " + "; ".join(failed),
                             details={"workers": reports})
        if behind:
            raise LoadTimeout(f"workers {', '.join(map(str, behind))} have not applied it within {timeout_s:g}s; "
                              "they go on trying", details={"workers": reports})
