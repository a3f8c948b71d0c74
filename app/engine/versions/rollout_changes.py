"""A model's default version changed on purpose: a promote or rollback call, or the rollout rules judged on every
worker's evidence (app/engine/rollouts/rules.py decides; this applies), and what the rollouts look like now.

Each change takes the change lock (a call waits REPOSITORY_SYNC_TIMEOUT_S at most for it), is served here first
(``Applier.apply``: a refusal changes nothing anywhere), then written into the desired state for the other workers
(``WorkerSync.write``), as every other writer does (app/engine/versions/writers.py). A call then waits for the other
workers; the rules' changes, made on the follow thread of whichever worker judges first, do not.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from app.engine.rollouts.entry import ModelEntry
from app.engine.rollouts.evidence import merged, traffic_p99_ms
from app.engine.rollouts.plan import promoted, rolled_back, withdrawn
from app.engine.rollouts.policy import PolicyError, order_key, parsed_config
from app.engine.rollouts.rules import has_rules, judge, roles_of, summary
from app.engine.versions.apply import Applier
from app.engine.versions.change_write import apply_and_write
from app.engine.versions.sync import WorkerSync
from app.errors import Conflict, NotFound, ServiceError
from app.metrics import ROLLOUT_CHANGES
from models.export.checks import ModelLoadError

log = logging.getLogger(__name__)


# A call naming no version: the version it means, and what the error calls it when there is none.
_UNNAMED: dict[str, tuple[Callable[[ModelEntry], str | None], str]] = {
    "promote": (lambda entry: (entry.get("rollout") or {}).get("candidate"), "rollout candidate to promote"),
    "rollback": (lambda entry: entry.get("previous_default"), "previous default to roll back to"),
}


class RolloutChanges:
    """Promotions and rollbacks of one worker's models, by a call or by the rules, and the rollouts' reports."""

    def __init__(self, applier: Applier, sync: WorkerSync) -> None:
        self.applier, self.sync = applier, sync

    def promote(self, name: str, version: str | None = None, start_within_s: float | None = None) -> ModelEntry:
        """A promote call: ``version`` (None: the rollout's candidate) becomes the default here, then in every
        worker; the old default stays loaded as the previous one and the new one is watched by the rollback rule.
        Raises NotFound, Conflict (nothing to promote), LoadTimeout (another change under way past
        ``start_within_s``: nothing changed), or what a load raises."""
        return self._by_call(name, "promote", version, start_within_s)

    def rollback(self, name: str, version: str | None = None, start_within_s: float | None = None) -> ModelEntry:
        """A rollback call: ``version`` (None: the previous default) serves again here, then in every worker; the
        default it replaces is rolled back (left out until a promotion names it). Raises NotFound, Conflict,
        LoadTimeout (as ``promote``)."""
        return self._by_call(name, "rollback", version, start_within_s)

    def _by_call(self, name: str, action: str, version: str | None, start_within_s: float | None) -> ModelEntry:
        with self.applier.changing(start_within_s):
            entry = self._entry_of(name)
            meant, missing = _UNNAMED[action]
            target = version or meant(entry)
            if target is None:
                raise self._nothing_meant(name, entry, action, missing)
            if target not in self.applier.source.versions(name):
                raise NotFound(f"model {name!r} has no version {target!r} in the repository")
            if action == "rollback" and target == entry["default"]:  # it would roll back the version it serves
                raise Conflict(f"model {name!r} version {target!r} is the live version already; a rollback names "
                               "the version to serve instead of it", details={"model": name, "live": target})
            generation, changed = self._change(name, entry, action, target, "by a call")
        self.sync.wait_for_workers(generation, name)
        return changed

    def _nothing_meant(self, name: str, entry: ModelEntry, action: str, missing: str) -> Conflict:
        """The 409 of a call naming no version when the model has none it means: the versions the call could name
        instead (promote: any other that can load; rollback: older ones that can load; rolled-back ones said so),
        newest first, the first not rolled back as the example; or that there is none. A version refused here, or
        whose manifest says it cannot serve (one another worker refused: a folder copied by hand), is left out."""
        live, rolled, source = entry["default"], entry.get("rolled_back", []), self.applier.source
        others = [v for v in sorted(source.versions(name), key=order_key, reverse=True)
                  if v != live and not self.applier.known_refused(name, v) and source.unservable(name, v) is None]
        if action == "rollback":  # (a rolled-back one too: a call may name it, as the version a rollback replaced)
            others = [v for v in others if order_key(v) < order_key(live)]
        if not others:
            which = "but" if action == "promote" else "older than"
            return Conflict(f"model {name!r} has no {missing}, and no version {which} the live {live} that could "
                            "serve", details={"versions": []})
        listed = ", ".join(f"{v} (rolled back)" if v in rolled else v for v in others)
        example = next((v for v in others if v not in rolled), others[0])
        return Conflict(f"model {name!r} has no {missing}; name one of its versions {listed} "
                        f"({{\"version\": \"{example}\"}})", details={"versions": others})

    def _entry_of(self, name: str) -> ModelEntry:
        entry = self.sync.read()[1].get(name)
        if not entry or not entry.get("versions"):
            raise NotFound(f"no model {name!r} is loaded", details={"models": self.applier.routes.available()})
        return entry

    def _change(self, name: str, entry: ModelEntry, action: str, version: str, why: str,
                read: dict[str, ModelEntry] | None = None) -> tuple[int, ModelEntry]:
        """A promotion, rollback or settled watch of ``name``: applied here, written (``apply_and_write``: put back,
        503, where CONTROL_DIR cannot be written), logged as one JSON line. The caller holds the change lock."""
        new = self._changed_entry(name, entry, action, version)
        generation, complete = apply_and_write(self.applier, self.sync, name, new, read=read)
        if complete:
            ROLLOUT_CHANGES.labels(name, action).inc()
            moved = (version, new["default"]) if action == "abort" else (entry["default"], new["default"])
            said = "candidate %s taken out, version %s serves without it" if action == "abort" else "version %s -> %s"
            log.info(f"%s %s: {said}, %s", name, action, *moved, why,
                     extra={"event": "rollout", "model": name, "action": action, "from_version": moved[0],
                            "to_version": moved[1], "reason": why, "generation": generation})
        return generation, new

    def _changed_entry(self, name: str, entry: ModelEntry, action: str, version: str) -> ModelEntry:
        if action == "promote":  # the old default's p99 becomes the watch's baseline
            return self._held(name, promoted(entry, version, traffic_p99_ms(self.sync.current_workers(), name,
                                                                            entry["default"])))
        if action == "rollback":
            return self._held(name, rolled_back(entry, version))
        if action == "abort":
            return withdrawn(entry, version)
        return {k: v for k, v in entry.items() if k != "watch"}  # "settle": the rules found the new default good

    def _held(self, name: str, entry: ModelEntry) -> ModelEntry:
        """``entry``, its new default held through the poll as a load call's ``default_version`` is: written into
        the calls' config it carries (that config kept while the model's policy.json is what it was given over), so
        that neither an earlier call's default_version nor policy.json's own, re-read by the poll, undoes it before
        another call or a change of policy.json (before: a promotion after a load call naming version 1 answered
        200, and the next poll served 1 again). A policy.json that cannot be read now: the entry as it is."""
        try:
            own = self.applier.source.policy(name)
            config = parsed_config(entry.get("config")) if entry.get("policy_file") == own else None
        except (PolicyError, OSError, ModelLoadError):
            return entry
        config = {**(config if isinstance(config, dict) else {}), "default_version": entry["default"]}
        return {**entry, "config": config, "policy_file": own}

    def judge_evidence(self) -> None:
        """Apply what the rules decide on every worker's evidence (a promotion, a rollback, a watch settled), as a
        call would. The caller holds the change lock, having shared this worker's evidence."""
        generation, desired = self.sync.read()
        judged = {name: entry for name, entry in desired.items() if entry.get("versions") and has_rules(entry)}
        evidence = merged(self.sync.current_workers(generation)) if judged else {}
        for name, entry in sorted(judged.items()):
            verdict = judge(name, entry, evidence)
            if verdict is None:
                continue
            action, version, why = verdict
            try:
                self._change(name, entry, action, version, f"by the rules: {why}", read=desired)
            except ServiceError as exc:
                log.warning("%s: the rules' %s of version %s failed: %s", name, action, version, exc.message)

    def roles(self) -> dict[tuple[str, str], str]:
        """(model, version) -> its role now: live, canary, shadow or previous."""
        routes = self.applier.routes
        _, desired = self.sync.read()
        roles = {}
        for name, (_, default) in routes.routes().items():
            candidate = routes.candidate(name)
            entry = {**(desired.get(name) or {}), "default": default}
            roles.update({(name, v): role for v, role in roles_of(
                entry, candidate and candidate.version, bool(candidate and candidate.canary_percent)).items()})
        return roles

    def summaries(self) -> dict[str, dict[str, Any]]:
        """Every model with a rollout, a previous default or a watch: its entry's rollout, the evidence over every
        worker, and what the automatic promotion waits for (app/engine/rollouts/rules.summary)."""
        _, desired = self.sync.read()
        shown = {name: entry for name, entry in sorted(desired.items()) if entry.get("versions") and (
            entry.get("rollout") or entry.get("watch") or entry.get("previous_default"))}
        evidence = merged(self.sync.workers()) if shown else {}
        return {name: summary(name, entry, evidence) for name, entry in shown.items()}
