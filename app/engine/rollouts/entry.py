"""A model's entry in the desired state: the one definition of what the writers write, ``plan`` produces, the rules
judge and every worker applies. Plain JSON (``desired.json`` holds it), so it is typed as a ``TypedDict``. Standard
library only: the gunicorn master reads the desired state.
"""
from __future__ import annotations

from typing import Any, TypedDict


class _Required(TypedDict):
    versions: list[str]  # the versions to keep loaded
    default: str | None  # what requests naming no version get (None: unloaded)


class RolloutEntry(TypedDict, total=False):
    """A rollout as the desired state records it (``RolloutPolicy.as_entry``): the candidate it resolved to."""

    candidate: str | None
    canary_percent: float
    shadow_percent: float
    promote: dict[str, Any] | None  # a PromoteRule's fields, or None: by call only
    rollback: dict[str, Any] | None  # a RollbackRule's fields, or None: by call only
    candidate_refused: dict[str, str]  # the named candidate that cannot load (version, reason): live serves alone


class Watch(TypedDict):
    """A newly promoted default watched by the rollback rule over its first requests."""

    version: str
    previous: str  # the default it replaced: what a rollback restores
    baseline_p99_ms: float | None  # the previous default's p99 over every worker, when it replaced it


class ModelEntry(_Required, total=False):
    """One model's entry: its versions and default, and what the calls and the rollout recorded."""

    rollout: RolloutEntry  # set while a rollout is (a candidate, its shares and rules)
    previous_default: str  # kept loaded, so a rollback needs no load
    rolled_back: list[str]  # left out until a promotion names them
    refused: dict[str, str]  # versions left out as they could not be served (their files unchanged since), and why
    held: bool  # the default was chosen by a call: a newer version arrives as the candidate, not the default
    watch: Watch
    config: Any  # a load call's config: the poll keeps applying it ...
    policy_file: Any  # ... while the model's policy.json is still this one


UNLOADED: ModelEntry = {"versions": [], "default": None}  # unloaded by a call: served nowhere, and the poll leaves it


def unloaded(entry: ModelEntry | None) -> ModelEntry:
    """The entry of a model an unload call leaves (UNLOADED), its rolled-back versions (``entry``'s) still marked:
    a load call after it leaves them out as one before it would, until a promotion names them."""
    rolled_back = (entry or {}).get("rolled_back")
    return {**UNLOADED, "rolled_back": list(rolled_back)} if rolled_back else UNLOADED


def is_unloaded(entry: ModelEntry | None) -> bool:
    """Whether ``entry`` is an unload call's: a model served nowhere that the poll leaves so until a load call."""
    return entry is not None and not entry["versions"]
