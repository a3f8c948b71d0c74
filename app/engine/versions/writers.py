"""What writes the desired state, besides promotions and rollbacks (app/engine/versions/rollout_changes.py):
start-up (what the settings and the repository name), the repository poll (what each model's policy picks now), a
V2 load or unload call; and the follow thread, which applies what another worker wrote, polls, and shares this
worker's rollout evidence every second so the rules are judged on everyone's.

Every writer applies its change here first (``Applier.apply``), so a refusal changes nothing anywhere; only then
does it write it (``WorkerSync.write``); a call then waits for the other workers. A call's change that cannot be
written (CONTROL_DIR read-only or full) is undone here and answered 503: it too changes nothing anywhere. A
refused version is remembered and left out (by the poll and by calls) until its files change; at start and by the
poll the policy then picks among the rest; a version this worker refused that another worker serves keeps its entry
(this worker serves what it can and its report says why, so the workers never undo each other's picks). A load
call's config (a rollback) stays in the desired state and the poll keeps applying it until another call or a change
of the model's policy.json.
A policy.json (or a single export's manifest) that cannot be read keeps its model from being served (or from
changing, while it serves): logged once per reason, and shown by the index, until it can be read.
One change runs at a time (``Applier.changing``): a second load call for the same model waits, then finds the model
already as wanted. A call waits REPOSITORY_SYNC_TIMEOUT_S at most for another change to end (then 504, nothing
changed); start, the poll and following wait as long as it takes.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, cast

from app.config import Settings
from app.engine.rollouts.entry import UNLOADED, ModelEntry, is_unloaded, unloaded
from app.engine.rollouts.evidence import traffic_p99_ms
from app.engine.rollouts.plan import RolloutPolicy, plan
from app.engine.rollouts.policy import PolicyError, VersionPolicy, VersionsMissing, order_key, parsed_config
from app.engine.versions.apply import LEFT_THE_REPOSITORY, Applier, unloaded_by_call
from app.engine.versions.change_write import apply_and_write
from app.engine.versions.desired import WATCH_S
from app.engine.versions.rollout_changes import RolloutChanges
from app.engine.versions.sources import REPOSITORY_FILE, Source
from app.engine.versions.sync import WorkerSync
from app.errors import BadRequest, InsufficientMemory, LoadFailed, NotFound, ServiceError
from models.export.checks import ModelLoadError

log = logging.getLogger(__name__)
EVIDENCE_S = 1.0  # how often a worker shares its rollout evidence and the rules are judged on everyone's


class Writers:
    """Start-up, the poll, the load and unload calls, and following the other workers' changes."""

    def __init__(self, settings: Settings, source: Source, applier: Applier, sync: WorkerSync,
                 rollouts: RolloutChanges) -> None:
        self.settings, self.source = settings, source
        self.applier, self.sync, self.rollouts = applier, sync, rollouts
        self._stop = threading.Event()
        self._refused_default: str | None = None  # the default model last refused (said once)

    def boot(self) -> None:
        """Serve the desired state a running server already has, else write it from the settings and the
        repository: each model as its policy picks among the versions that load (a refused one is skipped, its
        reason in the log and the index). Then follow it (and poll) on a thread. Raises only when nothing at all
        can be served."""
        with self.applier.changing():
            generation, desired = self.sync.read()
            self._name_default_model(starting=not generation)  # (joining a running server: as its poll does)
            if generation:
                errors = self._apply_desired(desired)
                self._check_unserved(desired)
            else:
                names = self.settings.model_names() or self.source.models()
                if not names:
                    raise self.source.missing()
                wanted, errors = self._first_load(names)
                self.sync.seed(wanted)
                generation, desired = self.sync.read()
                errors += self.applier.apply_all(desired)
            if not self.applier.routes.routes():
                raise errors[0] if errors else LoadFailed(
                    "nothing can be served: every version was refused: "
                    + "; ".join(self.applier.states.reasons_refused() or ["(the reasons are logged above)"]))
            self.sync.served(generation)
            self._say_default_model()
        threading.Thread(target=self._follow, name="models-follow", daemon=True).start()

    def _say_default_model(self) -> None:
        """At start, where several models serve: which one requests naming none get, or that none does (before:
        only the first such request said so, with its 400; a multi-model operator's trial)."""
        served = list(self.applier.routes.routes())
        if len(served) < 2:
            return
        default = self.applier.routes.default_model()
        if default is None:
            log.warning("serving %d models (%s) and none is the default: a request that names no model is answered "
                        "400; name one with DEFAULT_MODEL or the repository's %s", len(served), ", ".join(served),
                        REPOSITORY_FILE)
        else:
            log.info("serving %d models (%s); requests that name none get %s", len(served), ", ".join(served),
                     default)

    def _first_load(self, names: list[str]) -> tuple[dict[str, ModelEntry], list[ServiceError]]:
        wanted, errors = {}, []
        for name in names:
            try:
                entry = self._serve_loadable(name)
            except ServiceError as exc:  # not a version's fault (no such model, a bad policy): said once here
                self._not_served(name, exc, "%s is not served: %s")
                errors.append(exc)
                continue
            if entry is not None:
                wanted[name] = entry
        return wanted, errors

    def load(self, name: str, config: Any = None, start_within_s: float | None = None) -> None:
        """A load call: ``name`` as its policy (and ``config``) picks from the repository now, here, then in every
        worker. A ``config`` (a rollback: ``default_version``) holds until another call or a change of the model's
        policy.json: the poll keeps applying it. Another change under way past ``start_within_s`` is LoadTimeout,
        nothing changed (``Applier.changing``). Raises NotFound, BadRequest, LoadFailed, InsufficientMemory or
        LoadTimeout."""
        with self.applier.changing(start_within_s):
            self._refuse_naming_a_refused_version(name, config)
            self._name_default_model()
            now = self.sync.read()[1].get(name)
            # A version refused before is tried again once its files change; a rollout keeps the default it has,
            # and a version rolled back stays out until a promotion names it (docs/models.md).
            kept = None if now is None else {"versions": [], "default": now["default"],
                                             "rolled_back": now.get("rolled_back", [])}
            try:
                entry, generation = self._applied_for_call(name, config, kept)
            except LoadFailed:
                self._write_refusals(name, now)
                raise
            _say_candidate_refused(name, entry, now)
        self.sync.wait_for_workers(generation, name)

    def _write_refusals(self, name: str, now: ModelEntry | None) -> None:
        """After a load call refused for a version that cannot load (its 422: nothing changed), the entry the poll
        would write now, while it serves what serves now (the same versions, default and candidate: only its
        ``refused`` and its rollout's ``candidate_refused`` new), applied and written, so that every worker's index
        and metrics say why at once (before: this worker's alone, the others' "not chosen by the model's version
        policy" until a poll or another call; a trial)."""
        if now is None or is_unloaded(now):
            return
        try:
            entry = self._wanted(name, self._calls_config(name, now), now)
        except ServiceError:  # (its policy unreadable now: the poll says so)
            return
        if entry == now or _served_part(entry) != _served_part(now):
            return
        try:
            apply_and_write(self.applier, self.sync, name, entry)
        except ServiceError as exc:  # CONTROL_DIR unwritable: the call's own refusal is its answer
            log.warning("%s: the refusal could not be written for the other workers: %s", name, exc.message)
            return
        _say_candidate_refused(name, entry, now)

    def _applied_for_call(self, name: str, config: Any, kept: ModelEntry | None) -> tuple[ModelEntry, int]:
        """A load call's entry (``_wanted``) applied here and written, and its generation. Under a config, a version
        refused on the way that the config does not name (as its default, candidate or one of its specific
        versions) is left out and the policy picks again, as the poll does: a rollback is not blocked by a broken
        newer version, whichever worker takes the call first; one it names is the call's 422. Without a config the
        refusal is the call's answer (the version it was to pick up cannot be served)."""
        while True:
            entry = self._wanted(name, config, kept)
            if not entry["versions"]:  # every version refused: applied, this entry would unload the model
                raise self._nothing_loadable(name)
            try:
                return entry, apply_and_write(self.applier, self.sync, name, entry)[0]
            except ServiceError:
                if config is None or not any(self.applier.known_refused(name, v) for v in entry["versions"]):
                    raise
                self._refuse_naming_a_refused_version(name, config)

    def _nothing_loadable(self, name: str) -> LoadFailed:
        """The 422 of a load call none of whose versions can load (each refused, its files unchanged since): what
        serves keeps serving, and the poll goes on as before."""
        reasons = {v: why for v in self.source.versions(name) if (why := self.applier.refusal(name, v))}
        said = "; ".join(f"version {v}: {why}" for v, why in reasons.items()) or "none is left to pick"
        return LoadFailed(f"no version of {name!r} can be served ({said}); nothing was changed (fix its files, or "
                          "add a version)", details={"model": name, "refused": reasons})

    def _refuse_naming_a_refused_version(self, name: str, config: Any) -> None:
        """A load call whose config names a version refused before (its rollout's candidate, its default, or one of
        its specific versions) and unchanged since is answered with why (LoadFailed, 422), changing nothing: left
        out silently, the policy would pick something the caller did not ask for."""
        try:
            parsed = parsed_config(config)
        except PolicyError:
            return  # not JSON: the policy says so with its own error
        if not isinstance(parsed, dict):
            return
        rollout = parsed.get("rollout") if isinstance(parsed.get("rollout"), dict) else {}
        policy = parsed.get("version_policy") if isinstance(parsed.get("version_policy"), dict) else {}
        specific = policy.get("specific") if isinstance(policy.get("specific"), dict) else {}
        named = specific.get("versions") if isinstance(specific.get("versions"), list) else []
        for role, version in (("rollout candidate", rollout.get("candidate")),
                              ("default version", parsed.get("default_version")),
                              *(("specific version", v) for v in named)):
            why = None if version is None else self.applier.refusal(name, str(version))
            if why is not None:
                raise LoadFailed(f"{name} version {version} (the config's {role}) was refused and its files have not "
                                 f"changed since: {why}; nothing was changed (fix its files, or name another version)",
                                 details={"model": name, "version": str(version), "reason": why})

    def unload(self, name: str, start_within_s: float | None = None) -> None:
        """An unload call: ``name`` served nowhere, until a load call; returns once its versions are freed here.
        Another change under way past ``start_within_s`` is LoadTimeout, nothing changed (``Applier.changing``)."""
        with self.applier.changing(start_within_s):
            if name not in self.applier.routes.routes() and name not in self.source.models():
                raise NotFound(f"no model {name!r} is loaded or in the repository")
            entry = unloaded(self.sync.read()[1].get(name))  # its rolled-back versions stay so through a load call
            generation, _ = apply_and_write(self.applier, self.sync, name, entry)
            self.applier.unloaded_why[name] = unloaded_by_call(name)
        self.sync.wait_for_workers(generation, name)

    def poll(self) -> None:
        """The repository poll: each followed model as its policy (and a load call's config, until its policy.json
        is seen to differ from what the call found) picks among the versions that load now (a refused one is skipped
        until its manifest changes; a model that left the repository is no longer wanted), applied here, then
        written for the other workers. Refusals are logged once and remembered, never raised or written."""
        with self.applier.changing():
            self._name_default_model()
            _, desired = self.sync.read()
            changes: dict[str, ModelEntry | None] = {}
            for name in sorted(set(self.settings.model_names() or self.source.models()) | set(desired)):
                current = desired.get(name)
                if is_unloaded(current):
                    continue  # unloaded by a call: stays so until a load call
                try:
                    if (ended := self._call_hold_ended(name, current)) is not None:
                        changes[name] = current = ended  # (what it serves unchanged: nothing to apply here)
                    if not (available := self.source.versions(name)):
                        if name in self.applier.routes.routes():  # (the apply's own line says only "unloaded")
                            log.warning("%s has no version in the repository any more (its folder was removed, or "
                                        "holds no export): unloading it", name)
                        self.applier.apply(name, UNLOADED)
                        self.applier.unloaded_why[name] = LEFT_THE_REPOSITORY
                        changes[name] = None
                    elif (why := self._refused_here(name, current, available)) is not None:
                        # Another worker serves it: a pick without it would undo that worker's, which would then
                        # undo this one's at its next poll. The entry stays; this worker's report says why not here.
                        self.applier.not_served[name] = why
                    # (a call's config left on the entry holds: _call_hold_ended read its policy.json above)
                    elif entry := self._serve_loadable(name, (current or {}).get("config"), current):
                        changes[name] = entry
                except ServiceError as exc:
                    self._not_served(name, exc, "poll: %s: %s")
                except (OSError, ModelLoadError) as exc:  # its files could not be read: the other models are polled
                    self._not_served(name, LoadFailed(f"model {name!r}: {exc}"), "poll: %s: %s")
            self.sync.write(changes, read=desired)

    def _refused_here(self, name: str, entry: ModelEntry | None, available: list[str]) -> str | None:
        """Why this worker cannot serve ``entry``, a version of ``name`` it names being refused here (its files
        unchanged since) while another live worker serves it (a failure of this worker's own: less memory on its
        device); None otherwise (no worker serves it: the poll picks without it)."""
        if entry is None:
            return None
        refused = {v: why for v in entry["versions"] if v in available and (why := self.applier.refusal(name, v))}
        served_elsewhere = self.sync.served_elsewhere(name) if refused else set()
        return next((why for v, why in refused.items() if v in served_elsewhere), None)

    def follow_newest(self) -> None:
        """Serve the desired state's newest generation if this worker does not yet (another worker wrote it), and
        report."""
        with self.applier.changing():
            if self.sync.is_behind():
                generation, desired = self.sync.read()
                self._apply_desired(desired)
                self.sync.served(generation)

    def _apply_desired(self, desired: dict[str, ModelEntry]) -> list[ServiceError]:
        """Every model as ``desired`` says (``Applier.apply_all``); returns the refusals. A model this worker serves
        no version of and cannot serve as desired (a failure of its own: less memory on its device, a warm-up that
        fails here) serves the newest version that loads here, as its policy picks, rather than nothing; the shared
        entry stays as the worker that applied it wrote it, and this worker's report says why it differs."""
        errors = self.applier.apply_all(desired)
        for name, entry in sorted(desired.items()):
            why = self.applier.not_served.get(name)
            if why is None or not entry["versions"] or name in self.applier.routes.routes():
                continue
            try:
                served = self._serve_loadable(name, self._calls_config(name, entry), entry, around_memory=True)
            except ServiceError as exc:
                served, why = None, f"{why}; no other version loads here either: {exc.message}"
            if served is not None:
                log.warning("%s: this worker cannot serve versions %s (%s); it serves %s until they load here", name,
                            ", ".join(entry["versions"]), why, ", ".join(served["versions"]))
            self.applier.not_served[name] = why  # still not the desired entry: a call waiting for this worker hears so
        return errors

    def share_evidence(self) -> None:
        """Write this worker's rollout evidence into its report, then apply what the rules decide on every
        worker's (app/engine/versions/rollout_changes.py)."""
        with self.applier.changing():
            self.sync.report()
            self.rollouts.judge_evidence()

    def close(self) -> None:
        """Stop following and polling."""
        self._stop.set()

    def _follow(self) -> None:
        """Reconcile whenever another worker writes a generation, poll the repository when asked to, and share
        the evidence."""
        poll_s = self.settings.repository_poll_s
        next_poll = next_evidence = time.monotonic() + poll_s
        unwritable: str | None = None  # CONTROL_DIR's error last said (read-only, full): said once, not every round
        while not self._stop.wait(WATCH_S):
            try:
                self.follow_newest()  # every round, before a poll: a poll as often as the rounds must not starve it
                if poll_s > 0 and time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + poll_s
                    self.poll()
                if time.monotonic() >= next_evidence:
                    next_evidence = time.monotonic() + EVIDENCE_S
                    self.share_evidence()
                if unwritable is not None:
                    unwritable = None
                    log.info("CONTROL_DIR %s can be written again", self.settings.control_dir)
            except OSError as exc:  # the same error every round until it is fixed: once in the log, not a traceback
                if str(exc) != unwritable:
                    unwritable = str(exc)
                    log.warning("following the other workers failed: CONTROL_DIR %s cannot be read or written (%s); "
                                "this worker serves on as it is and tries again every round", self.settings.control_dir,
                                exc)
            except Exception:  # noqa: BLE001 - a failed round must not end following
                log.exception("reconciling the models failed")

    def _not_served(self, name: str, exc: ServiceError, message: str) -> None:
        """Log why start or the poll cannot serve ``name`` (``message`` with the name and the reason). A policy (or a
        single export's manifest) that cannot be read (BadRequest), or that names only versions refused
        (``_named_refused``), is said once per reason, not again by every poll while it stands, and the index shows
        it for the model's versions that do not serve (``VersionStates.unservable``). A version short of memory was
        warned of by the apply step the first time, and the index says so: the tries after it are at debug."""
        self.applier.not_served[name] = exc.message
        if isinstance(exc, InsufficientMemory):
            log.debug(message, name, exc.message)
        elif not _about_the_model(exc) or self.applier.states.unservable(name, exc.message):
            log.warning(message, name, exc.message)

    def _check_unserved(self, desired: dict[str, ModelEntry]) -> None:
        """A worker joining a running server: why the models it would serve that the desired state lacks cannot be
        (their policy), as start found in the worker that wrote it, so its index says so before any poll."""
        for name in self.settings.model_names() or self.source.models():
            if name not in desired:
                try:
                    self._wanted(name)
                except BadRequest as exc:
                    self._not_served(name, exc, "%s is not served: %s")
                except ServiceError:  # no such model: nothing to show
                    continue

    def _calls_config(self, name: str, entry: ModelEntry | None) -> Any:
        """The config a load call gave ``name``, while the model's policy.json is still what the call found."""
        if entry is None or entry.get("config") is None:
            return None
        return entry["config"] if entry.get("policy_file") == self._policy_file(name) else None

    def _call_hold_ended(self, name: str, entry: ModelEntry | None) -> ModelEntry | None:
        """``entry`` without its load call's config once the model's policy.json is no longer what the call found
        (another file, or one that cannot be read): a change ends the call's hold for good, even where the new file
        cannot be served (before: an edit's mistake, then the file put back as it was, brought the call's default
        back over the file the operator had just fixed; a multi-model operator's trial). None while it holds."""
        if entry is None or entry.get("config") is None:
            return None
        try:
            if entry.get("policy_file") == self.source.policy(name):
                return None
        except (PolicyError, OSError, ModelLoadError):
            pass  # being edited, or broken: changed all the same
        return cast(ModelEntry, {key: value for key, value in entry.items() if key not in ("config", "policy_file")})

    def _policy_file(self, name: str) -> dict[str, Any] | None:
        """``name``'s policy.json; BadRequest when it (or a single export's manifest) cannot be read (the poll says
        so and goes on to the others; what serves keeps serving)."""
        try:
            return self.source.policy(name)
        except (PolicyError, OSError, ModelLoadError) as exc:
            raise BadRequest(f"model {name!r}: {exc}") from None

    def _serve_loadable(self, name: str, config: Any = None, current: ModelEntry | None = None,
                        around_memory: bool = False) -> ModelEntry | None:
        """``name`` as its policy picks among the versions not refused, applied here; a version refused on the way
        is left out and the policy picks again (a rollout candidate refused: the live version serves without one;
        ``around_memory``: a version short of memory too, this time). None when no version is left (what serves
        keeps serving)."""
        left_out: dict[str, str] = {}  # a candidate that failed for a reason not remembered (memory): this time
        while True:
            entry = self._wanted(name, config, current, left_out)
            if not entry["versions"]:
                return None
            try:
                self.applier.apply(name, entry)
            except ServiceError as exc:
                if any(self.applier.known_refused(name, v) for v in entry["versions"]):
                    continue  # the policy picks again without it
                short = {v: exc.message for v in entry["versions"] if v not in left_out
                         and self.applier.states.is_short_of_memory((name, v))}
                if around_memory and isinstance(exc, InsufficientMemory) and short:
                    left_out.update(short)
                    continue
                candidate = (entry.get("rollout") or {}).get("candidate")
                if candidate is None or candidate in left_out:
                    raise  # no version was refused and no candidate is left to blame: it would fail the same way
                left_out[candidate] = exc.message  # the live version serves without it
                continue
            _say_candidate_refused(name, entry, current)
            return entry

    def _name_default_model(self, starting: bool = False) -> None:
        """The model requests naming none get: DEFAULT_MODEL, else the one the repository names. One that names a
        model the server does not follow (not in the repository, or left out by MODELS) is refused: ``starting``,
        the server does not start (NotFound: every request naming no model would be 404); later (repository.json
        changed, a poll), the default stays as it was and the log says why, once."""
        try:
            named = self.settings.default_model or self.source.default_model()
        except PolicyError as exc:
            log.warning("no default model: %s", exc)
            self.applier.routes.named_default = None
            return
        chosen = self.settings.model_names()
        followed = [model for model in self.source.models() if not chosen or model in chosen]
        if named is None or named in followed:
            self.applier.routes.named_default, self._refused_default = named, None
            return
        where = "DEFAULT_MODEL" if self.settings.default_model else f"the repository's {REPOSITORY_FILE}"
        held = "MODELS leaves it out" if named in self.source.models() else "the repository has no such model"
        missing = [model for model in chosen if model not in self.source.models()]
        if missing:  # what MODELS got wrong, said first (before: only that the default was left out)
            held += (f" (MODELS names {', '.join(map(repr, missing))}, which the repository has not; it has: "
                     f"{', '.join(self.source.models()) or 'none'})")
        # (a model named but refused at start stays the default: its requests' 404 says why)
        said = f"{where} names {named!r} as the default model, but {held}; it serves: {', '.join(followed) or 'none'}"
        if starting:
            raise NotFound(f"{said}: name one of them, or none", details={"models": followed})
        if named != self._refused_default:
            self._refused_default = named
            log.warning("%s: the default model stays %s", said, self.applier.routes.named_default or "unnamed")

    def _wanted(self, name: str, config: Any = None, current: ModelEntry | None = None,
                left_out: dict[str, str] | None = None) -> ModelEntry:
        """What ``name``'s policy and rollout (under a load call's ``config``) pick from the repository now, given
        its entry now (``current``): its versions, default and candidate, and the call's config with the
        policy.json it was given over (the pure step: app/engine/rollouts/plan.plan). The versions refused before
        (and unchanged since) and those ``left_out`` (version -> why) are not picked."""
        available = self.source.versions(name)
        if not available:
            raise NotFound(f"the repository has no model {name!r}; it has: {', '.join(self.source.models()) or 'none'}",
                           details={"models": self.source.models()})
        refused = {v: why for v in available
                   if (why := self.applier.refusal(name, v) or (left_out or {}).get(v)) is not None}
        available = [v for v in available if v not in refused]  # until their files change
        own = self._policy_file(name)
        try:
            config = parsed_config(config)
            policy = VersionPolicy.layered(self.settings.version_policy, own, config)
            entry = plan(policy, RolloutPolicy.layered(self.settings, own, config), available, current, refused)
        except VersionsMissing as exc:
            named = {v: refused[v] for v in exc.versions if v in refused}
            if named:  # there, but refused: why, not "no version 2"
                raise _named_refused(name, named) from None
            back = [v for v in exc.versions if v in (current or {}).get("rolled_back", [])]
            if back:  # there, but rolled back: how it serves again, not "not in the repository"
                raise BadRequest(f"model {name!r}: version {back[0]} was rolled back, and serves again once a "
                                 f"promotion names it: POST /v1/models/{name}/promote with {{\"version\": "
                                 f"\"{back[0]}\"}}", details={"model": name, "rolled_back": back}) from None
            raise BadRequest(f"model {name!r}: {exc}") from None
        except PolicyError as exc:
            raise BadRequest(f"model {name!r}: {exc}") from None
        self.applier.states.servable(name)  # its policy can be read (again)
        watch = entry.get("watch")
        if watch and watch.get("baseline_p99_ms") is None:
            baseline_p99_ms = traffic_p99_ms(self.sync.current_workers(), name, watch["previous"])
            entry["watch"] = {**watch, "baseline_p99_ms": baseline_p99_ms}
        if config is None:
            return entry
        return {**entry, "config": config, "policy_file": own}


def _served_part(entry: ModelEntry) -> tuple[list[str], str | None, str | None]:
    """What an entry serves: its versions (sorted), its default and its rollout's candidate."""
    return (sorted(entry["versions"], key=order_key), entry["default"],
            (entry.get("rollout") or {}).get("candidate"))


def _say_candidate_refused(name: str, entry: ModelEntry, before: ModelEntry | None) -> None:
    """A rollout candidate that cannot load, said once (while ``before`` did not say it already), with what serves
    in its place: the next newest as the candidate, or the live version alone."""
    refused = (entry.get("rollout") or {}).get("candidate_refused")
    if not refused or refused == ((before or {}).get("rollout") or {}).get("candidate_refused"):
        return
    candidate = (entry.get("rollout") or {}).get("candidate")
    instead = (f"version {candidate} is the candidate in its place, version {entry['default']} live" if candidate
               else f"version {entry['default']} serves without a candidate")
    log.warning("%s: rollout candidate %s refused (%s); %s", name, refused["version"], refused["reason"], instead)


def _named_refused(name: str, refused: dict[str, str]) -> LoadFailed:
    """The 422 of a policy (the setting, policy.json or a call's config) naming versions that are there but were
    refused (version -> why), their files unchanged since: why, rather than that the repository lacks them."""
    said = "; ".join(f"version {v}: {why}" for v, why in refused.items())
    return LoadFailed(f"model {name!r}: its policy names {'versions' if len(refused) > 1 else 'version'} "
                      f"{', '.join(refused)}, refused ({said}); fix its files, or name another version",
                      details={"model": name, "refused": refused})


def _about_the_model(exc: ServiceError) -> bool:
    """Whether ``exc`` says why a model cannot be served at all, not why one try failed: its policy (or a single
    export's manifest) cannot be read (BadRequest), or its policy names only versions refused (``_named_refused``)."""
    return isinstance(exc, BadRequest) or (isinstance(exc, LoadFailed) and isinstance(exc.details, dict)
                                           and "refused" in exc.details)
