"""The apply step: the one place that changes what a worker serves, ``Applier.apply`` (one model to exactly its
entry's versions and default), under the change lock (one change at a time per worker):

1. the versions wanted and not yet loaded are loaded beside the ones serving: the memory check, then verified
   (checksums, strict keys, output shape), warmed up and canaried on their own batcher thread;
2. if any fails, the fresh ones are stopped and what served keeps serving alone (all or nothing), and the refused
   version is remembered (``VersionStates``) until its files change;
3. the routing table sends the model's new requests to the wanted versions, its default and its rollout candidate,
   in one step (a changed default or candidate restarts the rollout evidence about them);
4. the versions no longer wanted leave the table at that moment, finish the requests holding them and what is
   queued, and are freed.

Who asks for a change (start-up, the poll, calls, the rules) is app/engine/versions/writers.py and
rollout_changes.py; how the other workers hear of it is app/engine/versions/sync.py.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import threading
from typing import Iterator

import torch

from app.config import Settings
from app.engine.loaded.graphs import release_cached_memory
from app.engine.loaded.predictor import device_memory_stats
from app.engine.loaded.version import LoadedVersion, start_version
from app.engine.rollouts.entry import UNLOADED, ModelEntry
from app.engine.rollouts.evidence import Evidence
from app.engine.rollouts.policy import order_key
from app.engine.rollouts.rules import roles_of
from app.engine.versions.memory import check_fits, device_bytes_taken, loading_onto
from app.engine.versions.routing import Candidate, RoutingTable
from app.engine.versions.sources import Source
from app.engine.contract import VersionState
from app.engine.versions.states import VersionStates
from app.errors import InsufficientMemory, LoadFailed, LoadTimeout, ServiceError
from app.metrics import ROLLOUT_CANDIDATE_REFUSED, ROLLOUT_ROLE, show_gpu_memory
from models.export.checks import ModelLoadError, resolve_device

log = logging.getLogger(__name__)
RETIRE_GRACE_S = 5.0  # beyond the request timeout, how long a retiring version waits for the requests holding it
ROLES = ("live", "canary", "shadow", "previous")
LEFT_THE_REPOSITORY = "it has no version in the repository any more"  # why a model the poll unloaded serves nothing


def unloaded_by_call(name: str) -> str:
    """Why a model an unload call unloaded serves nothing, and what serves it again."""
    return f"unloaded by a call (POST /v2/repository/models/{name}/load serves it again)"


def _show_roles(name: str, versions: set[str], roles: dict[str, str]) -> None:
    """visionserve_rollout_role of model ``name``'s ``versions``: 1 for the role each holds in ``roles``, 0 for the
    others (a version not in ``roles``, unloaded, 0 for all)."""
    for version in versions:
        for role in ROLES:
            ROLLOUT_ROLE.labels(name, version, role).set(int(roles.get(version) == role))


class Applier:
    """What this worker serves (``routes``) and the one step that changes it: load, route, retire."""

    def __init__(self, settings: Settings, source: Source) -> None:
        self.settings, self.source = settings, source
        self.states = VersionStates()  # versions loading, retiring, refused; models that cannot be served
        self.routes = RoutingTable(self._why_not_served)
        # model -> why it was unloaded (a call, or its folder left the repository), while it is: its requests' 404
        # says so (before: word for word a misspelt name's; a multi-model operator's trial)
        self.unloaded_why: dict[str, str] = {}
        self.evidence = Evidence()  # this worker's rollout comparisons and traffic per version
        self._refused_candidates: dict[str, str] = {}  # model -> the refused candidate its rollout goes on without
        # model -> why this worker could not serve it as last asked (an apply refused, a policy unreadable), until it
        # is applied: what its report says, and what a call waiting for the other workers reads of theirs
        self.not_served: dict[str, str] = {}
        self._lock = threading.Lock()  # one change at a time: a call, the poll, the rules or another worker's

    @property
    def device(self) -> torch.device:
        """Where this worker's models live (a missing CUDA device raises ModelLoadError at the first load)."""
        return resolve_device(self.settings.device)

    @contextlib.contextmanager
    def changing(self, within_s: float | None = None) -> Iterator[None]:
        """Hold the change lock: every writer applies its change under it. Start, the poll, following and the rules
        wait for it as long as another change takes; a call waits ``within_s`` at most, then is LoadTimeout (504),
        nothing changed."""
        if not self._lock.acquire(timeout=-1 if within_s is None else max(0.0, within_s)):
            raise LoadTimeout(
                "another change of the models is under way in this worker (a load, unload, promote or rollback, or "
                "a new version the poll loads) and did not end within REPOSITORY_SYNC_TIMEOUT_S "
                f"({self.settings.repository_sync_timeout_s:g}s); nothing was changed: try again once it ends (the "
                "repository index shows the versions loading or unloading)")
        try:
            yield
        finally:
            self._lock.release()

    def apply_all(self, desired: dict[str, ModelEntry]) -> list[ServiceError]:
        """Every model as ``desired`` says, and none it does not name; returns the refusals."""
        errors = []
        for name in sorted(set(desired) | set(self.routes.routes())):
            try:
                self.apply(name, desired.get(name, UNLOADED))
            except ServiceError as exc:
                errors.append(exc)
                continue
            if name not in desired:  # (the poll of the worker that wrote it found no version left)
                self.unloaded_why.setdefault(name, LEFT_THE_REPOSITORY)
            elif not desired[name]["versions"]:
                self.unloaded_why[name] = unloaded_by_call(name)
        return errors

    def _why_not_served(self, name: str) -> str | None:
        """Why a model a request names serves no version here, where that is known: its policy cannot be read, or
        it was unloaded."""
        return self.states.why_unservable(name) or self.unloaded_why.get(name)

    def apply(self, name: str, entry: ModelEntry) -> None:
        """Serve exactly ``entry``'s versions of ``name`` with its default (load, route, retire); all or nothing.
        The caller holds the change lock. A refusal is held in ``not_served`` until ``name`` is applied."""
        try:
            self._apply(name, entry)
        except ServiceError as exc:
            self.not_served[name] = exc.message
            raise
        self.not_served.pop(name, None)

    def _apply(self, name: str, entry: ModelEntry) -> None:
        serving, default = self.routes.routes().get(name, ([], None))
        current = {loaded.version: loaded for loaded in serving}
        wanted = [str(v) for v in entry["versions"]]
        if set(wanted) == set(current) and entry["default"] == default:
            if wanted:
                self._route(name, entry, current)
            return
        fresh: list[LoadedVersion] = []
        try:
            for version in sorted(set(wanted) - set(current), key=order_key):
                fresh.append(self._load(name, version, fresh))
        except BaseException:
            self._retire(fresh, wait=True)
            raise
        if wanted:
            self.unloaded_why.pop(name, None)
            chosen = {**{v: current[v] for v in wanted if v in current}, **{f.version: f for f in fresh}}
            replaced = self._route(name, entry, chosen)
            self.states.servable(name)  # served as the writer of ``entry`` found it: no reason held from before
            log.info("%s serves versions %s (default %s)", name, ", ".join(sorted(wanted, key=order_key)),
                     entry["default"])
            _warn_of_other_classes(current.get(default), fresh)
        else:
            replaced = self.routes.remove(name)
            _show_roles(name, {v.version for v in replaced}, {})  # before: an unloaded version read live still
            self.evidence.forget(name)  # a later load is new evidence, whatever its versions' names
            self._show_refused_candidate(name, entry)
        unloaded = not wanted and bool(replaced)
        del serving, current  # this frame holds no version that goes: their collection frees them
        self._retire(replaced, wait=not wanted)  # an unload returns once they are freed
        if unloaded:
            log.info("unloaded %s", name)

    def _route(self, name: str, entry: ModelEntry, chosen: dict[str, LoadedVersion]) -> list[LoadedVersion]:
        """Route ``name`` to ``chosen`` with ``entry``'s default and candidate; when the default or the candidate
        changes (another version, or the same one loaded afresh: unloaded and loaded again), the evidence about
        the old pair ends, and a new default's or candidate's traffic is counted afresh (what it served before in
        another role, or as another load, is no evidence of this one)."""
        serving, default_before = self.routes.routes().get(name, ([], None))
        loaded_before = {loaded.version: loaded for loaded in serving}
        candidate_before = self.routes.candidate(name)
        replaced = self.routes.route(name, chosen, entry["default"], Candidate.from_entry(entry))
        after = self.routes.candidate(name), entry["default"]
        kept = {v for v, loaded in chosen.items() if loaded is loaded_before.get(v)}  # the same load serves on
        fresh = set() if after[1] == default_before and after[1] in kept else {after[1]}
        if after[0] is not None and (candidate_before is None or candidate_before.version != after[0].version
                                     or after[0].version not in kept):
            fresh.add(after[0].version)
        if fresh or after[0] != candidate_before:  # a share changed alone: the pair's comparison goes on
            pair = {(after[0].version, after[1])} if after[0] is not None and not fresh else set()
            self.evidence.restart(name, pair, fresh)
        self.evidence.keep_only(name, set(chosen))
        roles = roles_of(entry, after[0] and after[0].version, bool(after[0] and after[0].canary_percent))
        _show_roles(name, {*chosen, *(v.version for v in replaced)}, roles)
        self._show_refused_candidate(name, entry)
        return replaced

    def _show_refused_candidate(self, name: str, entry: ModelEntry) -> None:
        """visionserve_rollout_candidate_refused: 1 for the candidate ``name``'s rollout goes on without (it cannot
        load: ``plan`` left it out), 0 for the one before."""
        refused = ((entry.get("rollout") or {}).get("candidate_refused") or {}).get("version")
        before = self._refused_candidates.pop(name, None)
        if before is not None and before != refused:
            ROLLOUT_CANDIDATE_REFUSED.labels(name, before).set(0)
        if refused is not None:
            self._refused_candidates[name] = refused
            ROLLOUT_CANDIDATE_REFUSED.labels(name, refused).set(1)

    def _load(self, name: str, version: str, fresh: list[LoadedVersion]) -> LoadedVersion:
        stamp = None  # the files as this load reads them: a fix written while it fails is a change, tried again
        with contextlib.suppress(OSError):
            stamp = self.source.stamp(name, version)
        try:
            device = self.device
            with self.states.loading((name, version)), loading_onto(device, self.settings.control_dir):
                self._check_memory(name, version, fresh)
                before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
                loaded = start_version(self.settings, self.source.load(name, version))
                if device.type == "cuda":
                    loaded.device_memory_bytes = device_bytes_taken(before, torch.cuda.memory_allocated(device),
                                                                    loaded.predictor.weights_bytes)
                return loaded
        except Exception as exc:
            error = exc if isinstance(exc, ServiceError) else LoadFailed(
                f"{name} version {version} cannot be served: {exc if isinstance(exc, ModelLoadError) else repr(exc)}")
            if isinstance(error, InsufficientMemory):  # memory may be freed: a later call or poll tries it again
                # the index says why it does not serve, meanwhile
                first = self.states.short_of_memory((name, version), f"short of memory (tried again at each poll and "
                                                                     f"load call): {error.message}")
                log.log(logging.WARNING if first else logging.DEBUG, "refused %s version %s: %s (tried again at "
                        "each poll and load call; warned of again once it has loaded)", name, version, error.message)
            else:
                log.warning("refused %s version %s: %s", name, version, error.message)
                with contextlib.suppress(OSError):
                    self.states.refuse((name, version), stamp or self.source.stamp(name, version), error.message)
                log.debug("%s version %s: the load's error", name, version, exc_info=exc)
                _free_failed_load(exc, self.device)  # not for a version refused before it loaded (short of memory)
            raise error from exc

    def known_refused(self, name: str, version: str) -> bool:
        """Whether ``version`` was refused and its files have not changed since (so it is left out)."""
        return self.refusal(name, version) is not None

    def refusal(self, name: str, version: str) -> str | None:
        """Why ``version`` was refused, while its files have not changed since (None: not refused, or changed)."""
        refusal = self.states.refusal((name, version))
        if refusal is None:
            return None
        try:
            return refusal[1] if refusal[0] == self.source.stamp(name, version) else None
        except OSError:  # its files are gone or unreadable: still left out
            return refusal[1]

    def _check_memory(self, name: str, version: str, fresh: list[LoadedVersion]) -> None:
        # Twice the weights file: the loaded weights, and as much again for the load's copy and warm-up activations;
        # on CUDA with EXPLAIN_AT_START, its explanations' copy as much again (made in the load, measured with it:
        # start_version; a CPU's versions are counted by their weights alone). What is held: the routed versions,
        # the retiring ones, and those this apply loaded before (not routed yet).
        copies = 3 if self.settings.explain_at_start and self.device.type == "cuda" else 2
        need = copies * self.source.size_bytes(name, version)
        held = self.routes.all_versions() + self.states.retiring_versions() + fresh
        loaded = sum(v.device_memory_bytes or v.predictor.weights_bytes for v in held)
        check_fits(f"{name} version {version}", need, self.device, loaded, self.settings.model_memory_limit_mb,
                   self.settings.memory_reserve_mb)

    def _retire(self, versions: list[LoadedVersion], wait: bool) -> None:
        """Stop ``versions`` (emptied: nothing here holds them once stopped), each on a thread of its own; ``wait``:
        return once they are stopped and freed."""
        stopping = []
        while versions:
            held = [versions.pop()]
            self.states.retiring(held[0])
            stopping.append(threading.Thread(target=self._stop_retired, args=(held,), daemon=True,
                                             name=f"retire-{held[0].name}-{held[0].version}"))
            stopping[-1].start()
        if wait:
            for thread in stopping:
                thread.join()

    def _stop_retired(self, held: list[LoadedVersion]) -> None:
        """On its thread: the version in ``held`` (taken out) finishes its requests and stops; with the last
        reference dropped here, a collection frees it (and a GPU's cache gives its blocks back for the next load)."""
        loaded = held.pop()
        key, device = (loaded.name, loaded.version), loaded.predictor.device
        drained = loaded.retire(self.settings.request_timeout_s + RETIRE_GRACE_S)
        self.states.retired(loaded)
        del loaded
        _collect_retired()
        if device.type == "cuda":
            release_cached_memory(wait=True)  # hand the freed blocks back, so the next load sees them as free
            show_gpu_memory(device_memory_stats(device))
        log.info("%s version %s stopped%s", *key, "" if drained else " (some requests were still holding it)")

    def serving(self) -> dict[str, ModelEntry]:
        """What this worker serves: {name: {"versions": [...], "default": v}}."""
        return {name: {"versions": [v.version for v in versions], "default": default}
                for name, (versions, default) in self.routes.routes().items()}

    def index(self, desired: dict[str, ModelEntry]) -> list[VersionState]:
        """Every version in the repository or in memory, with this worker's state of it (a model whose folder
        cannot be read now: the versions held in memory); ``desired`` (the desired state's models) says why a
        version the repository holds is not served."""
        routed = self.routes.routes()
        rows = []
        for name in sorted(set(self.source.models()) | set(routed)):
            try:
                available, strays = self.source.versions(name), self.source.strays(name)
            except (OSError, ModelLoadError):  # the poll says why (its report); the index still answers
                available, strays = [], []
            rows += self.states.rows(name, available, {v.version for v in routed.get(name, ([], None))[0]},
                                     desired.get(name), strays)
        return rows


def _warn_of_other_classes(served: LoadedVersion | None, fresh: list[LoadedVersion]) -> None:
    """A warning for each new version whose classes are not those of ``served``, the version its model served by
    default until now: its clients' answers change their labels (another model's export given the name by mistake,
    or classes added on purpose)."""
    if served is None:
        return
    for loaded in fresh:
        before, now = served.signature.labels, loaded.signature.labels
        if list(now) != list(before):
            had, has = set(before), set(now)
            added, gone = [c for c in now if c not in had], [c for c in before if c not in has]
            change = (f"{len(added)} new: {_few(added)}; {len(gone)} gone: {_few(gone)}" if added or gone
                      else "the same classes in another order: their indices change")
            log.warning("%s version %s has %d classes where version %s has %d (%s): the answers of the requests it "
                        "serves name other classes", loaded.name, loaded.version, len(now), served.version,
                        len(before), change)


def _few(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "") if names else "none"


def _free_failed_load(exc: BaseException, device: torch.device) -> None:
    """What a load that failed took, freed now. Its version, predictor and batcher are a reference cycle, held too by
    the frames of the error's traceback (a frame keeps its function, and a closure its cells, even once cleared): the
    tracebacks of the error and of those it came from are dropped (logged first, at debug), then a collection frees
    the cycle and on a GPU the cache gives its blocks back, for the versions serving and the next load. Left to the
    collector, whose next full collection may be far off (the engine's start-up is frozen out of it), they would
    keep their device memory."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.__traceback__ = None
        error = error.__cause__ or error.__context__
    _collect_retired()
    if device.type == "cuda":
        release_cached_memory(wait=True)


def _collect_retired() -> None:
    """Free a retired version now (a version is a reference cycle: its batcher runs its bound run_batch). An engine
    freezes what its start-up imported before its models load (app/link/server.py), so no version is frozen and
    the collection walks what came after start-up alone: under 1 ms on the 2-core VM with the bundled model,
    where thawing the start-up's ~200,000 objects for it took about 100 ms of the interpreter lock (every request
    of the engine waited)."""
    gc.collect()
