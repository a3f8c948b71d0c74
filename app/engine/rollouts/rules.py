"""The rollout rules judged on the evidence of every worker (app/engine/rollouts/evidence.merged): promote a
candidate, roll a watched new default back or settle it; and what the rollouts look like (each version's role, a
model's summary for /v1/models). Pure functions of an entry and the evidence.
"""
from __future__ import annotations

from typing import Any

from app.engine.rollouts.entry import ModelEntry, RolloutEntry, Watch
from app.engine.rollouts.plan import PromoteRule, RollbackRule, rule_from_entry

def judge(model: str, entry: ModelEntry, evidence: dict[str, Any]) -> tuple[str, str, str] | None:
    """What the rules decide for ``model`` on the evidence of every worker (app/engine/rollouts/evidence.merged):
    ("promote", candidate, why), ("rollback", previous default, why), ("settle", default, why) when a watched
    default served its first requests within bounds, ("abort", candidate, why) for a canary whose own requests
    cross the rollback rule's bounds, or None."""
    rollout = entry.get("rollout") or {}
    watch, rule = entry.get("watch"), rule_from_entry(RollbackRule, rollout.get("rollback"))
    if watch and rule is not None and watch.get("version") == entry["default"]:
        verdict = rollback_verdict(rule, watch, evidence["traffic"].get((model, entry["default"])))
        if verdict is not None:
            return verdict
    candidate, promote = rollout.get("candidate"), rule_from_entry(PromoteRule, rollout.get("promote"))
    if candidate and rule is not None and rollout.get("canary_percent"):
        verdict = abort_verdict(rule, candidate, evidence["traffic"].get((model, candidate)),
                                (evidence["traffic"].get((model, entry["default"])) or {}).get("p99"))
        if verdict is not None:
            return verdict
    if candidate and promote is not None:
        ready, why = promotion_status(promote, rollout, model, candidate, entry["default"], evidence)
        if ready:
            return "promote", candidate, why
    return None

def rollback_verdict(rule: RollbackRule, watch: Watch,
                     traffic: dict[str, Any] | None) -> tuple[str, str, str] | None:
    """A watched new default: rolled back once a bound is crossed within its first ``within`` requests, settled
    after them. The error bound is on the share of those ``within``: judged early only once more have failed than
    it allows of them all (the bound is broken whatever follows), else once they are in; one failure among the
    first few requests (a cold start's 504) is no ratio."""
    if not traffic or not traffic["requests"]:
        return None
    requests, failures = traffic["requests"], traffic["failures"]
    if _too_many_failed(rule, requests, failures):
        return "rollback", watch["previous"], (f"{failures} of its first {requests} requests failed "
                                               f"(more than {rule.max_error_ratio:.1%} of {rule.within})")
    baseline, p99 = watch.get("baseline_p99_ms"), traffic.get("p99")
    if baseline and p99 is not None and requests >= rule.min_requests and p99 > rule.max_p99_ratio * baseline:
        return "rollback", watch["previous"], (f"p99 {p99:.1f} ms over its first {requests} requests, more than "
                                               f"{rule.max_p99_ratio:g}x the previous default's {baseline:.1f} ms")
    if requests >= rule.within:
        return "settle", watch["version"], f"{requests} requests within bounds"
    return None

def abort_verdict(rule: RollbackRule, candidate: str, traffic: dict[str, Any] | None,
                  live_p99_ms: float | None) -> tuple[str, str, str] | None:
    """A canary (the candidate served to a share of the clients) taken out of its rollout once its own requests
    cross the rollback rule's bounds, as a promoted default's first requests would roll it back: its error ratio
    (judged as ``rollback_verdict`` judges it, over all its requests so far), or its p99 against the live
    version's of the same minutes. Its clients' failures stop there instead of lasting until someone acts."""
    if not traffic or not traffic["requests"]:
        return None
    requests, failures, p99 = traffic["requests"], traffic["failures"], traffic.get("p99")
    if _too_many_failed(rule, requests, failures):
        return "abort", candidate, (f"{failures} of its {requests} canary requests failed (more than "
                                    f"{rule.max_error_ratio:.1%} of {max(requests, rule.within)})")
    if live_p99_ms and p99 is not None and requests >= rule.min_requests and p99 > rule.max_p99_ratio * live_p99_ms:
        return "abort", candidate, (f"p99 {p99:.1f} ms over its {requests} canary requests, more than "
                                    f"{rule.max_p99_ratio:g}x the live version's {live_p99_ms:.1f} ms")
    return None

def _too_many_failed(rule: RollbackRule, requests: int, failures: int) -> bool:
    """Before ``within`` requests, more failures than the rule allows of them all (the bound is broken whatever
    follows); from then on, a ratio of those counted over its bound."""
    if requests < rule.within:
        return failures > rule.max_error_ratio * rule.within
    return failures / requests > rule.max_error_ratio

def promotion_status(rule: PromoteRule, rollout: RolloutEntry, model: str, candidate: str, live: str,
                     evidence: dict[str, Any]) -> tuple[bool, str]:
    """Whether the candidate meets the promotion rule, and what it waits for or fell short of."""
    traffic = evidence["traffic"].get((model, candidate)) or {"requests": 0, "failures": 0, "p99": None}
    baseline = evidence["traffic"].get((model, live)) or {"p99": None}
    if rollout.get("shadow_percent"):
        comparison = evidence["comparisons"].get((model, candidate, live)) or {}
        count, agreement = comparison.get("compared", 0), comparison.get("top1_agreement")
        errors = comparison.get("errors", 0) + traffic["failures"]
        ours = (comparison.get("candidate_forward_ms") or {}).get("p99")
        theirs = (comparison.get("live_forward_ms") or {}).get("p99")
        unit = "comparisons"
    else:
        count, agreement, errors, unit = traffic["requests"], None, traffic["failures"], "canary requests"
        ours, theirs = traffic.get("p99"), baseline.get("p99")
    if errors:  # they hold it whatever comes (before: "waiting" for comparisons a failing candidate never makes)
        so_far = f" ({count} of {rule.after} {unit})" if count < rule.after else ""
        return False, f"held: {errors} errors{so_far}"
    if count < rule.after:
        return False, f"waiting: {count} of {rule.after} {unit}"
    if agreement is not None and agreement < rule.min_agreement:
        return False, f"held: top-1 agreement {agreement:.4f} below {rule.min_agreement:g}"
    if ours is not None and theirs and ours > rule.max_latency_ratio * theirs:
        return False, f"held: p99 {ours:.1f} ms over {rule.max_latency_ratio:g}x the live {theirs:.1f} ms"
    agreed = "" if agreement is None else f", top-1 agreement {agreement:.4f}"
    return True, f"{count} {unit}{agreed}, no errors, p99 within {rule.max_latency_ratio:g}x"

def has_rules(entry: ModelEntry) -> bool:
    """Whether ``judge`` has anything to decide for this entry: a promotion rule with a candidate, a canary with a
    rollback rule, or a watch."""
    rollout = entry.get("rollout") or {}
    return bool(((rollout.get("promote") or (rollout.get("rollback") and rollout.get("canary_percent")))
                 and rollout.get("candidate")) or entry.get("watch"))

def roles_of(entry: ModelEntry, candidate: str | None, canary: bool) -> dict[str, str]:
    """Each version's role in its model's rollout: live (the default), canary or shadow (the candidate),
    previous (kept loaded for a rollback)."""
    roles = {entry["default"]: "live"}
    if entry.get("previous_default"):
        roles.setdefault(entry["previous_default"], "previous")
    if candidate is not None:
        roles[candidate] = "canary" if canary else "shadow"
    return roles

def summary(model: str, entry: ModelEntry, evidence: dict[str, Any]) -> dict[str, Any]:
    """A model's rollout as /v1/models shows it: the entry's rollout and rules, the candidate it goes on without
    (refused: it cannot load), the evidence of every worker (app/engine/rollouts/evidence.merged), and what the
    automatic promotion waits for."""
    rollout = entry.get("rollout") or {}
    candidate, live = rollout.get("candidate"), entry["default"]
    promote = rule_from_entry(PromoteRule, rollout.get("promote"))
    return {
        "live": live, "candidate": candidate, "canary_percent": rollout.get("canary_percent", 0.0),
        "shadow_percent": rollout.get("shadow_percent", 0.0), "previous": entry.get("previous_default"),
        "rolled_back": entry.get("rolled_back", []), "candidate_refused": rollout.get("candidate_refused"),
        "watch": entry.get("watch"),
        "promote": rollout.get("promote"), "rollback": rollout.get("rollback"),
        "promotion": None if candidate is None or promote is None else
        promotion_status(promote, rollout, model, candidate, live, evidence)[1],
        "comparison": evidence["comparisons"].get((model, candidate, live)) if candidate else None,
        "traffic": {v: t for (m, v), t in evidence["traffic"].items() if m == model and v in entry["versions"]}}
