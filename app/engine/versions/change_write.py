"""A change of one model applied in this worker, then written into the desired state for the others (a call's load,
unload, promotion or rollback, and the rules'): a CONTROL_DIR that cannot be written (read-only, full) puts back what
this worker served, so that, as after a refusal, no worker changed (503 naming the directory)."""
from __future__ import annotations

import logging
from pathlib import Path

from app.engine.lifecycle import not_ready
from app.engine.rollouts.entry import UNLOADED, ModelEntry
from app.engine.versions.apply import Applier
from app.engine.versions.routing import Candidate
from app.engine.versions.sync import WorkerSync
from app.errors import NotReady, ServiceError

log = logging.getLogger(__name__)


def apply_and_write(applier: Applier, sync: WorkerSync, name: str, entry: ModelEntry,
                    read: dict[str, ModelEntry] | None = None) -> tuple[int, bool]:
    """``name`` changed to ``entry``: applied here, then written for the other workers (``read``: as
    ``WorkerSync.write`` takes it); returns its generation and whether it was written whole. A CONTROL_DIR that
    cannot be written puts back what this worker served of ``name`` and is NotReady (503 with Retry-After) naming
    the directory and the error; a change written whose report alone failed stays (the other workers follow it).
    The caller holds the change lock."""
    generation_before, desired_before = sync.read()
    served_before = served_entry(applier, name, desired_before.get(name))
    why_before = applier.not_served.get(name)
    applier.apply(name, entry)
    try:
        return sync.write({name: entry}, read=read)
    except OSError as exc:
        generation_after, desired_after = sync.read()
        written = generation_after > generation_before and desired_after.get(name) != desired_before.get(name)
        if not written:
            _put_back(applier, name, served_before, why_before)
        raise _control_dir_unwritable(applier.settings.control_dir, exc, written) from None


def served_entry(applier: Applier, name: str, desired: ModelEntry | None) -> ModelEntry:
    """What this worker serves of ``name`` as an entry to apply: ``desired`` (its entry in the desired state) when
    the routing table serves exactly that, else the table's versions, default and candidate."""
    versions, default = applier.routes.routes().get(name, ([], None))
    if not versions:
        return UNLOADED
    candidate = applier.routes.candidate(name)
    served: ModelEntry = {"versions": [loaded.version for loaded in versions], "default": default}
    if candidate is not None:
        served["rollout"] = {"candidate": candidate.version, "canary_percent": candidate.canary_percent,
                             "shadow_percent": candidate.shadow_percent}
    if desired is not None and set(desired["versions"]) == set(served["versions"]) \
            and desired["default"] == default and Candidate.from_entry(desired) == candidate:
        return desired
    return served


def _put_back(applier: Applier, name: str, served_before: ModelEntry, why_before: str | None) -> None:
    """``name`` served here as before a change that could not be written (``served_entry``), with the reason this
    worker's report gave for it, if any."""
    try:
        applier.apply(name, served_before)
    except ServiceError as exc:
        log.error("%s: the change could not be written and what served before cannot serve again: %s; this worker "
                  "serves versions %s", name, exc.message,
                  ", ".join(applier.serving().get(name, UNLOADED)["versions"]) or "none")
        return
    if why_before is not None:
        applier.not_served[name] = why_before


def _control_dir_unwritable(control_dir: Path | None, exc: OSError, written: bool) -> NotReady:
    """The 503 (with Retry-After) of a change that could not be written into ``control_dir`` (``exc``: it is
    read-only, full); ``written``: the change was written, this worker's report of it was not."""
    what = ("the change was written for the other workers, but not this worker's report of it" if written
            else "nothing was changed in any worker")
    return not_ready(f"the control directory {control_dir} cannot be written ({exc.strerror or exc}): {what}; try "
                     "again once it is writable and has room")
