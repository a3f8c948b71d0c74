"""Rollouts: a candidate version beside a model's live default, taking a share of its traffic (canary) or running
off the response path on a share of it (shadow), until it is promoted or rolled back.

What a rollout is (``RolloutPolicy``) is spelt like the version policy: settings (``CANARY_PERCENT``,
``SHADOW_PERCENT``, ``PROMOTE_AFTER``, ``ROLLBACK_WITHIN`` ...) under a model's ``policy.json`` under a V2 load
call's config, each as ``{"rollout": {"candidate": "3", "canary_percent": 10, "shadow_percent": 100,
"promote": {"after": 500, "min_agreement": 0.99, "max_latency_ratio": 1.5},
"rollback": {"within": 200, "max_error_ratio": 0.01, "max_p99_ratio": 2.0}}}``.

``plan`` is the pure step from what the repository holds, the version policy, the rollout and the model's entry in
the desired state now to its next entry. While a rollout is set a model keeps its current default: a new version
arrives as the candidate (the newest version newer than the default that was not rolled back, unless one is named)
and takes all the traffic only when promoted. Promotion and rollback (``promoted``, ``rolled_back``) are entries
too, written to the desired state like any change, so every worker follows them and the poll keeps them.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Callable, Mapping

from app.engine.rollouts.entry import ModelEntry, RolloutEntry
from app.engine.rollouts.policy import PolicyError, VersionPolicy, order_key, version_name


@dataclass(frozen=True)
class PromoteRule:
    """Promote the candidate by itself once ``after`` comparisons (shadow) or canary requests agree and are fast
    enough, with no error."""

    after: int
    min_agreement: float = 0.99  # top-1 agreement with the live version, over the shadow's comparisons
    max_latency_ratio: float = 1.5  # the candidate's p99 over the live version's, at most

@dataclass(frozen=True)
class RollbackRule:
    """Roll a newly promoted default back by itself when, within its first ``within`` requests, its error ratio or
    its p99 (against the previous default's) crosses a bound."""

    within: int
    max_error_ratio: float = 0.01
    max_p99_ratio: float = 2.0
    min_requests: int = 20  # no p99 judged on fewer

@dataclass(frozen=True)
class RolloutPolicy:
    """A model's rollout: the candidate (None: the newest newer than the default), its shares of the unversioned
    requests, and the automatic promotion and rollback rules (None: by call only)."""

    candidate: str | None = None
    canary_percent: float = 0.0
    shadow_percent: float = 0.0
    promote: PromoteRule | None = None
    rollback: RollbackRule | None = None

    def __post_init__(self) -> None:
        for name in ("canary_percent", "shadow_percent"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 100:
                raise PolicyError(f"rollout {name} must be between 0 and 100, got {value!r}")
        for name, rule in (("promote", self.promote), ("rollback", self.rollback)):
            if rule is not None:
                _check_rule(name, rule)

    @property
    def active(self) -> bool:
        """Whether new versions arrive as candidates (the model keeps its default until a promotion)."""
        return bool(self.candidate or self.canary_percent or self.shadow_percent or self.promote)

    @classmethod
    def from_settings(cls, settings: Any) -> "RolloutPolicy":
        """The settings' rollout, for every model (percentages 0 and rules off by default)."""
        promote = PromoteRule(settings.promote_after, settings.promote_min_agreement,
                              settings.promote_max_latency_ratio) if settings.promote_after else None
        rollback = RollbackRule(settings.rollback_within, settings.rollback_max_error_ratio,
                                settings.rollback_max_p99_ratio) if settings.rollback_within else None
        return cls(None, settings.canary_percent, settings.shadow_percent, promote, rollback)

    def over(self, config: Any) -> "RolloutPolicy":
        """This rollout under a model config's ``rollout`` object (policy.json or a load call's config)."""
        spec = config.get("rollout") if isinstance(config, dict) else None
        if spec is None:
            return self
        if not isinstance(spec, dict):
            raise PolicyError("rollout must be a JSON object")
        known = {"candidate", "canary_percent", "shadow_percent", "promote", "rollback"}
        if unknown := set(spec) - known:
            raise PolicyError(f"unsupported rollout keys {sorted(unknown)}; it takes {', '.join(sorted(known))}")
        try:
            changes: dict[str, Any] = {k: _number(k, spec[k], whole=False)
                                       for k in ("canary_percent", "shadow_percent") if k in spec}
            if "candidate" in spec:
                changes["candidate"] = None if spec["candidate"] is None else version_name(spec["candidate"])
            for key, rule in (("promote", PromoteRule), ("rollback", RollbackRule)):
                if key in spec:
                    changes[key] = _rule(key, rule, spec[key], getattr(self, key))
        except (TypeError, ValueError, OverflowError) as exc:  # OverflowError: a JSON integer past any float
            raise PolicyError(f"rollout: {exc}") from None
        return replace(self, **changes)  # its bounds checked (__post_init__), said as "rollout <field> ..."

    @classmethod
    def layered(cls, settings: Any, *configs: Any) -> "RolloutPolicy":
        """The settings' rollout under each config given (a model's policy.json, a load call's config). A promote
        rule needs a share of the traffic once every layer is read (a layer may set the rule, the next its share)."""
        policy = cls.from_settings(settings)
        for config in configs:
            policy = policy.over(config)
        if policy.promote is not None and not (policy.canary_percent or policy.shadow_percent):
            raise PolicyError("rollout promote needs canary_percent or shadow_percent above 0: a candidate that "
                              "takes no share of the traffic gathers no evidence (requests naming it are none), so "
                              "the rule would never fire; set promote to null (or after 0) to promote by a call "
                              "(VISIONSERVE_PROMOTE_AFTER=0 where the rule is the settings' default), or give the "
                              "candidate a share (canary_percent or shadow_percent, VISIONSERVE_CANARY_PERCENT or "
                              "VISIONSERVE_SHADOW_PERCENT)")
        return policy

    def as_entry(self, candidate: str | None) -> RolloutEntry:
        """What the desired state records of it, with the candidate it resolved to."""
        return {**asdict(self), "candidate": candidate}

def _rule(name: str, kind: type, spec: Any, fallback: Any) -> Any:
    """Rule ``name`` (promote, rollback) from its JSON (None or after/within 0: off); unset fields from
    ``fallback`` or the defaults."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ValueError(f"{name} must be a JSON object")
    names = {f.name for f in fields(kind)}
    if unknown := set(spec) - names:
        raise ValueError(f"unsupported {name} keys {sorted(unknown)}; it takes {', '.join(sorted(names))}")
    whole = {f.name: f.type == "int" for f in fields(kind)}
    base = asdict(fallback) if fallback is not None else {}
    values = {**base, **{key: _number(f"{name} {key}", value, whole[key]) for key, value in spec.items()}}
    first = fields(kind)[0].name  # after / within: 0 turns the rule off
    return None if not values.get(first) else kind(**values)

def _number(name: str, value: Any, whole: bool) -> int | float:
    """A setting's JSON number as the policy holds it: ValueError naming ``name`` for JSON's true and false (no
    numbers, though Python's int takes them), a value that is not finite (1e999 reads as infinity, NaN passes
    every comparison), and, where a count is asked for (``whole``), a fraction (0.5 was cut to 0: the rule off)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {str(value).lower()}")
    if whole and isinstance(value, int):
        return value  # as it is: a float would round a large one
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    except OverflowError:  # a JSON integer past any float
        raise ValueError(f"{name} must be a finite number, got one past any float") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if whole and not number.is_integer():
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return int(number) if whole else number

# What each rule's field takes (checked once the rule is made, whatever made it): a whole number for the counts.
_RULE_BOUNDS: dict[str, tuple[Callable[[float], bool], str]] = {
    "after": (lambda v: v >= 1, "a whole number, at least 1"),
    "within": (lambda v: v >= 1, "a whole number, at least 1"),
    "min_requests": (lambda v: v >= 0, "a whole number, at least 0"),
    "min_agreement": (lambda v: 0 <= v <= 1, "a number between 0 and 1"),
    "max_error_ratio": (lambda v: 0 <= v <= 1, "a number between 0 and 1"),
    "max_latency_ratio": (lambda v: v > 0, "a finite number above 0"),
    "max_p99_ratio": (lambda v: v > 0, "a finite number above 0"),
}

def _check_rule(name: str, rule: PromoteRule | RollbackRule) -> None:
    """PolicyError naming the first field of rule ``name`` (promote, rollback) out of its bounds (_RULE_BOUNDS)."""
    for field in fields(rule):
        value, (within_bounds, takes) = getattr(rule, field.name), _RULE_BOUNDS[field.name]
        kind = int if field.type == "int" else (int, float)
        if isinstance(value, bool) or not isinstance(value, kind) or not within_bounds(value) \
                or (isinstance(value, float) and not math.isfinite(value)):  # an int is finite, however large
            raise PolicyError(f"rollout {name} {field.name} must be {takes}, got {value!r}")

def rule_from_entry(kind: type, data: Any) -> Any:
    """A rule as the desired state recorded it."""
    return None if not data else kind(**data)

def plan(policy: VersionPolicy, rollout: RolloutPolicy, available: list[str], current: ModelEntry | None,
         refused: Mapping[str, str] | None = None) -> ModelEntry:
    """The model's next entry: its versions, default, candidate and rollout, from what the repository holds
    (``available``, refused versions already left out: ``refused`` says which and why) and its entry now (None: a
    first load, or a load call). Rolled-back versions are left out unless nothing else is left; the previous default
    stays loaded (a rollback needs no load). A candidate that cannot load (refused) is left out and the rollout goes
    on without it, recorded as ``candidate_refused``: the rollout protects the live version, never takes it down."""
    current = current or {}
    refused = {v: why for v, why in (refused or {}).items() if v not in current.get("rolled_back", [])}
    rolled_back = [v for v in current.get("rolled_back", []) if v in available]
    usable = [v for v in available if v not in rolled_back] or available
    held = current.get("default") if (rollout.active or current.get("held")) else None
    if held not in usable:
        held = None
    versions = policy.choose(usable)
    default = policy.default or held
    if not rollout.active:
        default = default or policy.default_of(versions)
        entry: ModelEntry = {"versions": _with(versions, default), "default": default}
        if rollout.rollback is None:
            return _carry(entry, current, rolled_back, usable, refused)
        entry["rollout"] = rollout.as_entry(None)
        entry = _carry(entry, current, rolled_back, usable, refused)
        old = current.get("default")
        if old in usable and old != default and "watch" not in entry:  # a new default by the poll: watched too
            entry.update(previous_default=old, versions=_with(entry["versions"], old),
                         watch={"version": default, "previous": old, "baseline_p99_ms": None})
        return entry
    entry = _rolled_out(policy, rollout, versions, usable, default, refused)
    return _carry(entry, current, rolled_back, usable, refused)

def _rolled_out(policy: VersionPolicy, rollout: RolloutPolicy, versions: list[str], usable: list[str],
                default: str | None, refused: Mapping[str, str]) -> ModelEntry:
    """The entry of a model with a rollout: the default it holds (a first load: the version below the newest), the
    candidate (named, or the newest newer than the default) unless it was refused, and the rollout."""
    candidate = named = rollout.candidate
    if named is not None and named not in usable:
        if named not in refused:
            raise PolicyError(f"rollout candidate {named!r} is not in the repository (or was rolled back)")
        candidate = None  # it cannot load: the rollout goes on without it, and picks no other in its place
    if default is None:  # a first load: the newest is the candidate, the version before it the default
        top = named if named in refused else candidate or policy.default_of(versions)
        below = [v for v in sorted(usable, key=order_key) if order_key(v) < order_key(top)]
        default = below[-1] if below else top if top not in refused else policy.default_of(versions)
    if candidate is None and named is None:
        newer = [v for v in versions if order_key(v) > order_key(default)]
        candidate = max(newer, key=order_key) if newer else None
    candidate = None if candidate == default else candidate
    entry: ModelEntry = {"versions": _with(_with(versions, default), candidate), "default": default,
                         "rollout": rollout.as_entry(candidate)}
    left_out = named if named is not None and named in refused else _refused_newer(policy, usable, refused,
                                                                                   [default, candidate])
    if left_out is not None:
        entry["rollout"]["candidate_refused"] = {"version": left_out, "reason": refused[left_out]}
    return entry

def _refused_newer(policy: VersionPolicy, usable: list[str], refused: Mapping[str, str],
                   chosen: list[str | None]) -> str | None:
    """The refused version that would be the candidate were it not refused: the newest the policy would choose,
    newer than the default and the candidate picked."""
    served = [v for v in chosen if v is not None]
    if not refused or not served:
        return None
    try:
        wanted = policy.choose(sorted({*usable, *refused}, key=order_key))
    except PolicyError:
        return None
    floor = max(served, key=order_key)
    newer = [v for v in wanted if v in refused and order_key(v) > order_key(floor)]
    return max(newer, key=order_key) if newer else None

def _with(versions: list[str], version: str | None) -> list[str]:
    return versions if version is None or version in versions else sorted([*versions, version], key=order_key)

def _carry(entry: ModelEntry, current: ModelEntry, rolled_back: list[str], usable: list[str],
           refused: Mapping[str, str]) -> ModelEntry:
    """What the calls recorded and the poll keeps: the held default, the previous default (kept loaded), the
    rolled-back versions, the watch on a new default; and the versions left out as refused, with why (every worker's
    index then says it, not only the one that tried them)."""
    previous = current.get("previous_default")
    if previous in usable and previous != entry["default"]:
        entry["previous_default"] = previous
        entry["versions"] = _with(entry["versions"], previous)
    if rolled_back:
        entry["rolled_back"] = rolled_back
    if current.get("held") and entry["default"] == current.get("default"):
        entry["held"] = True
    watch = current.get("watch")
    if watch and watch.get("version") == entry["default"]:
        entry["watch"] = watch
    if refused:
        entry["refused"] = {version: refused[version] for version in sorted(refused, key=order_key)}
    return entry

def promoted(entry: ModelEntry, version: str, baseline_p99_ms: float | None) -> ModelEntry:
    """``entry`` with ``version`` as its default: the old default kept loaded as the previous one, the new default
    watched when the rollout has a rollback rule (a watch nothing judges would never settle), the version no longer
    rolled back."""
    if version == entry["default"]:
        return entry
    changed = {k: v for k, v in entry.items() if k not in ("watch", "previous_default")}
    changed.update(default=version, previous_default=entry["default"], held=True,
                   versions=_with(list(entry["versions"]), version))
    if (entry.get("rollout") or {}).get("rollback"):
        changed["watch"] = {"version": version, "previous": entry["default"], "baseline_p99_ms": baseline_p99_ms}
    if version in changed.get("rolled_back", []):
        changed["rolled_back"] = [v for v in changed["rolled_back"] if v != version]
    if not changed.get("rolled_back"):
        changed.pop("rolled_back", None)
    if "rollout" in changed:
        changed["rollout"] = {**changed["rollout"], "candidate": None}
    return changed

def rolled_back(entry: ModelEntry, to: str) -> ModelEntry:
    """``entry`` served by ``to`` again: the default it replaces is rolled back (no candidate again until a newer
    version arrives or a promotion names it)."""
    bad = entry["default"]
    changed = {k: v for k, v in entry.items() if k not in ("watch", "previous_default")}
    changed.update(default=to, held=True, versions=[v for v in _with(list(entry["versions"]), to) if v != bad],
                   rolled_back=sorted({*entry.get("rolled_back", []), bad} - {to}, key=order_key))
    if "rollout" in changed:
        changed["rollout"] = {**changed["rollout"], "candidate": None}
    return changed

def withdrawn(entry: ModelEntry, candidate: str) -> ModelEntry:
    """``entry`` without its ``candidate``, which the rules took out of the rollout (its canary failing): unloaded
    and rolled back, so that the poll does not pick it again until a promotion names it; the live version serves
    without it (a newer version becomes the candidate when one arrives)."""
    changed = {**entry, "versions": [v for v in entry["versions"] if v != candidate],
               "rolled_back": sorted({*entry.get("rolled_back", []), candidate}, key=order_key)}
    changed["rollout"] = {**(entry.get("rollout") or {}), "candidate": None}
    return changed

def takes_canary(percent: float, model: str, client_key: str | None, draw: float) -> bool:
    """Whether a request goes to the canary: by the client key's hash when it carries one (the same client always
    meets the same version), else by ``draw`` (uniform in [0, 1))."""
    if percent <= 0:
        return False
    if client_key:
        return zlib.crc32(f"{model}\0{client_key}".encode()) % 10_000 < percent * 100
    return draw * 100 < percent
