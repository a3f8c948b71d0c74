"""A worker's model versions, made to match the desired state (app/engine/versions/desired.py) with no failed request.

Everything that wants a change writes the desired state: start-up (what the settings and the repository name), the
repository poll (what each model's policy picks now), a V2 load or unload call, a promotion or rollback (by a call
or by the rules: app/engine/versions/rollout_changes.py, through ``changing``, ``write`` and ``wait_for_workers``), another
worker. One step alone changes what this worker serves, ``reconcile_model`` (run for every model by ``reconcile``
when another worker wrote a newer generation), in five steps:

1. the versions wanted and not yet loaded are loaded beside the ones serving: the memory check, then verified
   (checksums, strict keys, output shape), warmed up and canaried on their own batcher thread;
2. if any fails, the fresh ones are stopped and what served keeps serving alone (all or nothing);
3. the routing table sends the model's new requests to the wanted versions and its default, in one step;
4. the versions no longer wanted leave the table at that moment, finish the requests that hold them and what is
   queued, and are freed;
5. this worker reports what it serves (``/v1/models`` shows each worker's report).

Every writer in a worker (start-up, a call, the poll) reconciles its change there first, so a refusal changes
nothing anywhere; only then does it write the desired state (a call then waits for the other workers). A refused
version is remembered and left out (by the poll and by calls) until its files change; at start and by the poll
the policy then picks among the rest. A load call's config (a rollback) stays in the desired state and the poll
keeps applying it until another call or a change of the model's policy.json. One change runs at a time: a second
load call for the same model waits, then finds the model already as wanted.
"""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import threading
import time
from typing import Any, Callable, Iterator

import torch

from app.config import Settings
from app.engine.versions.desired import UNLOADED, WATCH_S, Entry, desired_state
from app.engine.rollouts.evidence import Evidence, traffic_p99_ms
from app.engine.loaded.version import LoadedVersion, start_version
from app.engine.versions.memory import check_fits
from app.engine.rollouts.policy import PolicyError, VersionPolicy, order_key
from app.engine.rollouts.plan import RolloutPolicy, plan, roles_of
from app.engine.versions.rollout_changes import RolloutChanges
from app.engine.versions.routing import Candidate, RoutingTable
from app.engine.versions.sources import Source
from app.engine.versions.states import VersionState, VersionStates
from app.errors import (
    BadRequest,
    InsufficientMemory,
    LoadFailed,
    LoadTimeout,
    NotFound,
    ServiceError,
)
from app.metrics import ROLLOUT_ROLE
from models.export.checks import ModelLoadError, resolve_device

log = logging.getLogger(__name__)
RETIRE_GRACE_S = 5.0  # beyond the request timeout, how long a retiring version waits for the requests holding it
EVIDENCE_S = 1.0  # how often a worker shares its rollout evidence and the rules are judged on everyone's


class Reconciler:
    """What this worker serves (``routes``), and the one path that changes it to match the desired state."""

    def __init__(self, settings: Settings, source: Source, on_change: Callable[[], None] = lambda: None) -> None:
        self.settings, self.source, self.on_change = settings, source, on_change
        self.routes = RoutingTable()
        self.desired = desired_state(settings.control_dir)
        self._lock = threading.Lock()  # one change at a time: a call, the poll, or another worker's
        self._applied = 0  # the desired generation this worker serves
        self.states = VersionStates()  # versions loading, retiring, refused
        self.evidence = Evidence()  # this worker's rollout comparisons and traffic per version
        self._last_error: str | None = None  # why this worker could not apply the desired state, as reported
        self._stop = threading.Event()
        self.rollouts = RolloutChanges(self)  # promotions and rollbacks, by a call or by the rules

    @property
    def device(self) -> torch.device:
        """Where this worker's models live (a missing CUDA device raises ModelLoadError at the first load)."""
        return resolve_device(self.settings.device)

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """Hold the change lock: one change at a time in this worker (a call, the poll, the rules, another
        worker's generation)."""
        with self._lock:
            yield

    # -- what writes the desired state ---------------------------------------------------------------------------

    def boot(self) -> None:
        """Serve the desired state a running server already has, else write it from the settings and the
        repository: each model as its policy picks among the versions that load (a refused one is skipped, its
        reason in the log and the index). Then follow it (and poll) on a thread. Raises only when nothing at all
        can be served."""
        with self._lock:
            self._name_default_model()
            generation, desired = self.desired.read()
            if generation:
                errors = self._reconcile(desired)
            else:
                names = self.settings.model_names() or self.source.models()
                if not names:
                    raise self.source.missing()
                wanted, errors = self._first_load(names)
                self.desired.seed(wanted)  # a worker that started at the same time may have seeded it first
                generation, desired = self.desired.read()
                errors += self._reconcile(desired)
            if not self.routes.routes():
                raise errors[0] if errors else LoadFailed(
                    "nothing can be served: every version was refused (the reasons are logged above and listed "
                    "by the repository index)")
            self._applied = generation
            self._report("; ".join(e.message for e in errors) or None)
        threading.Thread(target=self._follow, name="models-follow", daemon=True).start()

    def _first_load(self, names: list[str]) -> tuple[dict[str, Entry], list[ServiceError]]:
        wanted, errors = {}, []
        for name in names:
            try:
                entry = self._serve_loadable(name)
            except ServiceError as exc:  # not a version's fault (no such model, a bad policy): said once here
                log.warning("%s is not served: %s", name, exc.message)
                errors.append(exc)
                continue
            if entry is not None:
                wanted[name] = entry
        return wanted, errors

    def load(self, name: str, config: Any = None) -> None:
        """A load call: ``name`` as its policy (and ``config``) picks from the repository now, here, then in every
        worker. A ``config`` (a rollback: ``default_version``) holds until another call or a change of the model's
        policy.json: the poll keeps applying it. Raises NotFound, BadRequest, LoadFailed, InsufficientMemory or
        LoadTimeout."""
        with self._lock:
            self._name_default_model()
            now = self.desired.read()[1].get(name)
            # A version refused before is tried again once its files change; a rollout keeps the default it has.
            entry = self._wanted(name, config, {"default": now["default"]} if now else None)
            self.reconcile_model(name, entry)
            generation, _ = self.write({name: entry})
        self.wait_for_workers(generation)

    def unload(self, name: str) -> None:
        """An unload call: ``name`` served nowhere, until a load call; returns once its versions are freed here."""
        with self._lock:
            if name not in self.routes.routes() and name not in self.source.models():
                raise NotFound(f"no model {name!r} is loaded or in the repository")
            self.reconcile_model(name, UNLOADED)
            generation, _ = self.write({name: UNLOADED})
        self.wait_for_workers(generation)

    def poll(self) -> None:
        """The repository poll: each followed model as its policy (and a load call's config, while its policy.json
        is as the call found it) picks among the versions that load now (a refused one is skipped until its
        manifest changes; a model that left the repository is no longer wanted), applied here, then written for
        the other workers. Refusals are logged once and remembered, never raised or written."""
        with self._lock:
            self._name_default_model()
            _, desired = self.desired.read()
            changes: dict[str, Entry | None] = {}
            for name in sorted(set(self.settings.model_names() or self.source.models()) | set(desired)):
                if desired.get(name) == UNLOADED:
                    continue  # unloaded by a call: stays so until a load call
                try:
                    if not self.source.versions(name):
                        self.reconcile_model(name, UNLOADED)
                        changes[name] = None
                    elif (entry := self._serve_loadable(name, self._calls_config(name, desired.get(name)),
                                                        desired.get(name))):
                        changes[name] = entry
                except ServiceError as exc:
                    log.warning("poll: %s: %s", name, exc.message)
            self.write(changes, read=desired)

    def _calls_config(self, name: str, entry: Entry | None) -> Any:
        """The config a load call gave ``name``, while the model's policy.json is still what the call found."""
        if entry is None or entry.get("config") is None:
            return None
        return entry["config"] if entry.get("policy_file") == self.source.policy(name) else None

    def _serve_loadable(self, name: str, config: Any = None, current: Entry | None = None) -> Entry | None:
        """``name`` as its policy picks among the versions not refused, applied here; a version refused on the way
        is left out and the policy picks again. None when no version is left (what serves keeps serving)."""
        while True:
            entry = self._wanted(name, config, current)
            if not entry["versions"]:
                return None
            try:
                self.reconcile_model(name, entry)
                return entry
            except ServiceError:
                if not any(self._known_refused(name, v) for v in entry["versions"]):
                    raise  # no version was refused: trying again would fail the same way

    def _name_default_model(self) -> None:
        """The model requests naming none get: DEFAULT_MODEL, else the one the repository names."""
        try:
            self.routes.named_default = self.settings.default_model or self.source.default_model()
        except PolicyError as exc:
            log.warning("no default model: %s", exc)
            self.routes.named_default = None

    # -- the one path that changes what this worker serves -------------------------------------------------------

    def reconcile(self) -> None:
        """Serve the desired state's newest generation if this worker does not yet, and report."""
        with self._lock:
            if self.desired.read()[0] > self._applied:
                self._apply_newest()

    def _apply_newest(self) -> None:
        generation, desired = self.desired.read()
        errors = self._reconcile(desired)
        self._applied = max(self._applied, generation)
        self._report("; ".join(e.message for e in errors) or None)

    def _reconcile(self, desired: dict[str, Entry]) -> list[ServiceError]:
        """Every model as ``desired`` says, and none it does not name; returns the refusals."""
        errors = []
        for name in sorted(set(desired) | set(self.routes.routes())):
            try:
                self.reconcile_model(name, desired.get(name, UNLOADED))
            except ServiceError as exc:
                errors.append(exc)
        return errors

    def reconcile_model(self, name: str, entry: Entry) -> None:
        """Serve exactly ``entry``'s versions of ``name`` with its default (load, route, retire); all or nothing.
        The caller holds the change lock."""
        serving, default = self.routes.routes().get(name, ([], None))
        current = {loaded.version: loaded for loaded in serving}
        wanted = [str(v) for v in entry["versions"]]
        if set(wanted) == set(current) and entry["default"] == default:
            if wanted:
                self._set_roles(name, entry, current)
            return
        fresh: list[LoadedVersion] = []
        try:
            for version in sorted(set(wanted) - set(current), key=order_key):
                fresh.append(self._load_version(name, version))
        except BaseException:
            for loaded in fresh:
                self._retire(loaded, wait=True)
            raise
        if wanted:
            chosen = {**{v: current[v] for v in wanted if v in current}, **{f.version: f for f in fresh}}
            replaced = self._set_roles(name, entry, chosen)
            log.info("%s serves versions %s (default %s)", name, ", ".join(sorted(wanted, key=order_key)),
                     entry["default"])
        else:
            replaced = self.routes.remove(name)
        for loaded in replaced:
            self._retire(loaded, wait=not wanted)  # an unload returns once they are freed
        if not wanted and replaced:
            log.info("unloaded %s", name)

    def _set_roles(self, name: str, entry: Entry, chosen: dict[str, LoadedVersion]) -> list[LoadedVersion]:
        """Route ``name`` to ``chosen`` with ``entry``'s default and candidate; when the default or the candidate
        changes, the evidence about the old pair ends and the new default's traffic is counted afresh."""
        before = self.routes.candidate(name), self.routes.routes().get(name, ([], None))[1]
        candidate = Candidate.from_entry(entry)
        replaced = self.routes.route(name, chosen, entry["default"], candidate)
        after = self.routes.candidate(name), entry["default"]
        if after != before:
            pair = {(after[0].version, after[1])} if after[0] is not None else set()
            self.evidence.restart(name, pair, {after[1]} if after[1] != before[1] else set())
        roles = roles_of(entry, after[0] and after[0].version, bool(after[0] and after[0].canary_percent))
        for version in {*chosen, *(v.version for v in replaced)}:
            for role in ("live", "canary", "shadow", "previous"):
                ROLLOUT_ROLE.labels(name, version, role).set(int(roles.get(version) == role))
        return replaced

    # -- the steps ------------------------------------------------------------------------------------------------

    def _wanted(self, name: str, config: Any = None, current: Entry | None = None) -> Entry:
        """What ``name``'s policy and rollout (under a load call's ``config``) pick from the repository now, given
        its entry now (``current``): its versions, default and candidate, and the call's config with the
        policy.json it was given over (the pure step: app/engine/rollout.plan)."""
        available = self.source.versions(name)
        if not available:
            raise NotFound(f"the repository has no model {name!r}; it has: {', '.join(self.source.models()) or 'none'}",
                           details={"models": self.source.models()})
        available = [v for v in available if not self._known_refused(name, v)]  # until their files change
        try:
            own = self.source.policy(name)
            if isinstance(config, (str, bytes)):
                try:
                    config = json.loads(config)
                except ValueError as exc:
                    raise PolicyError(f"the config is not JSON: {exc}") from None
            policy = VersionPolicy.layered(self.settings.version_policy, own, config)
            entry = plan(policy, RolloutPolicy.layered(self.settings, own, config), available, current)
        except PolicyError as exc:
            raise BadRequest(f"model {name!r}: {exc}") from None
        watch = entry.get("watch")
        if watch and watch.get("baseline_p99_ms") is None:
            entry["watch"] = {**watch, "baseline_p99_ms": traffic_p99_ms(self.workers(), name, watch["previous"])}
        if config is None:
            return entry
        return {**entry, "config": config, "policy_file": own}

    def _load_version(self, name: str, version: str) -> LoadedVersion:
        try:
            with self.states.loading((name, version)):
                self._check_memory(name, version)
                device = self.device
                before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
                loaded = start_version(self.settings, self.source.load(name, version))
                if device.type == "cuda":
                    loaded.device_memory_bytes = torch.cuda.memory_allocated(device) - before
                return loaded
        except Exception as exc:
            error = exc if isinstance(exc, ServiceError) else LoadFailed(
                f"{name} version {version} cannot be served: {exc if isinstance(exc, ModelLoadError) else repr(exc)}")
            log.warning("refused %s version %s: %s", name, version, error.message)
            if not isinstance(error, InsufficientMemory):  # memory may be freed: a later call tries it again
                with contextlib.suppress(OSError):
                    self.states.refuse((name, version), self.source.stamp(name, version), error.message)
            raise error from exc

    def _known_refused(self, name: str, version: str) -> bool:
        stamp = self.states.refused_at((name, version))
        try:
            return stamp is not None and stamp == self.source.stamp(name, version)
        except OSError:
            return True

    def _check_memory(self, name: str, version: str) -> None:
        # Twice the weights file: the loaded weights, and as much again for the load's copy and warm-up activations.
        need = 2 * self.source.size_bytes(name, version)
        held = self.routes.all_versions() + self.states.retiring_versions()
        loaded = sum(v.device_memory_bytes or v.predictor.weights_bytes for v in held)
        check_fits(f"{name} version {version}", need, self.device, loaded, self.settings.model_memory_limit_mb,
                   self.settings.memory_reserve_mb)

    def _retire(self, loaded: LoadedVersion, wait: bool) -> None:
        key = (loaded.name, loaded.version)
        self.states.retiring(loaded)

        def run() -> None:
            drained = loaded.retire(self.settings.request_timeout_s + RETIRE_GRACE_S)
            self.states.retired(loaded)
            if loaded.predictor.device.type == "cuda":
                gc.collect()
                torch.cuda.empty_cache()  # hand the freed blocks back, so the next load sees them as free
            log.info("%s version %s stopped%s", *key, "" if drained else " (some requests were still holding it)")

        if wait:
            run()
        else:
            threading.Thread(target=run, name=f"retire-{key[0]}-{key[1]}", daemon=True).start()

    def write(self, changes: dict[str, Entry | None], read: dict[str, Entry] | None = None) -> tuple[int, bool]:
        """A change already applied here, into the desired state; returns its generation and whether every change
        was written. With ``read`` (the poll's view), a model another worker's call changed since keeps the call's
        entry: this worker applies it with the rest of that newer generation in reconcile()."""
        complete = True
        if read is None:
            generation = self.desired.write(changes)
        else:
            generation, complete = self.desired.write_unless_changed(changes, read)
        if complete and generation == self._applied + 1:  # nothing written meanwhile: this worker serves it
            self._applied = generation
        # else another worker's change came first: reconcile() applies the whole generation, this one included
        self._report()
        return generation, complete

    def _report(self, error: str | None = None) -> None:
        self._last_error = error
        self.on_change()
        self.desired.report(self._applied, self.serving(), error, str(self.device), self.evidence.dump())

    def wait_for_workers(self, generation: int) -> None:
        timeout_s = self.settings.repository_sync_timeout_s
        reports, behind = self.desired.wait_applied(generation, timeout_s)
        failed = [f"worker {r['pid']}: {r['error']}" for r in reports
                  if r.get("error") and r.get("generation", 0) >= generation]
        if failed:
            raise LoadFailed("applied here, refused by other workers (they serve what they did): " + "; ".join(failed),
                             details={"workers": reports})
        if behind:
            raise LoadTimeout(f"workers {', '.join(map(str, behind))} have not applied it within {timeout_s:g}s; "
                              "they go on trying", details={"workers": reports})

    def _follow(self) -> None:
        """Reconcile whenever another worker writes a generation, and poll the repository when asked to."""
        poll_s = self.settings.repository_poll_s
        next_poll = next_evidence = time.monotonic() + poll_s
        while not self._stop.wait(WATCH_S):
            try:
                if poll_s > 0 and time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + poll_s
                    self.poll()
                else:
                    self.reconcile()
                if time.monotonic() >= next_evidence:
                    next_evidence = time.monotonic() + EVIDENCE_S
                    self.share_evidence()
            except Exception:  # noqa: BLE001 - a failed round must not end following
                log.exception("reconciling the models failed")

    def share_evidence(self) -> None:
        """Write this worker's rollout evidence into its report, then apply what the rules decide on every
        worker's (app/engine/versions/rollout_changes.py)."""
        with self._lock:
            self._report(self._last_error)
            self.rollouts.judge_evidence()

    # -- what this worker serves ------------------------------------------------------------------------------------

    def serving(self) -> dict[str, Entry]:
        """What this worker serves: {name: {"versions": [...], "default": v}}."""
        return {name: {"versions": [v.version for v in versions], "default": default}
                for name, (versions, default) in self.routes.routes().items()}

    def index(self) -> list[VersionState]:
        """Every version in the repository or in memory, with this worker's state of it."""
        routed = self.routes.routes()
        return [row for name in sorted(set(self.source.models()) | set(routed))
                for row in self.states.rows(name, self.source.versions(name),
                                            {v.version for v in routed.get(name, ([], None))[0]})]

    def workers(self) -> list[dict[str, Any]]:
        """What each worker of the server serves (its last report)."""
        return self.desired.workers()

    def close(self) -> None:
        """Stop following and polling."""
        self._stop.set()

