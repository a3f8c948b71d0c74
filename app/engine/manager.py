"""Loading, swapping and unloading model versions in a running worker, with no failed request.

A version loads beside the ones serving: verified (checksums, strict keys, output shape), checked to fit in memory,
warmed up and canaried on its own batcher thread; only then does the routing table (``Registry``) send new requests
to it. The versions it replaces leave the table at that moment, finish the requests that hold them and what is
queued, and are freed. A version that fails any step is refused with the reason and nothing else changes; a failed
version is not tried again by the poll until its manifest changes. One load or unload runs per model at a time, and
a load call arriving while the same model loads waits for that load instead of starting another.
"""
from __future__ import annotations

import gc
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from app.config import Settings
from app.engine.memory import check_fits
from app.engine.model import Model, start_model
from app.engine.policy import PolicyError, VersionPolicy, order_key
from app.engine.registry import Registry
from app.engine.sources import Source
from app.engine.weights import ModelLoadError, resolve_device
from app.errors import BadRequest, InsufficientMemory, LoadFailed, NotFound, ServiceError

log = logging.getLogger(__name__)
RETIRE_GRACE_S = 5.0  # beyond the request timeout, how long a retiring version waits for the requests holding it


@dataclass(frozen=True)
class VersionState:
    """One row of the repository index: a version and what this worker does with it."""

    name: str
    version: str
    state: str  # READY, LOADING, UNLOADING, UNAVAILABLE (Triton's words)
    reason: str = ""


class ModelManager:
    """The versions of every model this worker serves, moved by load, unload, apply (another worker's) and poll."""

    def __init__(self, settings: Settings, source: Source, registry: Registry) -> None:
        self.settings, self.source, self.registry = settings, source, registry
        self._lock = threading.Lock()
        self._model_locks: dict[str, threading.Lock] = {}
        self._pending: dict[str, Future[None]] = {}  # load calls running, by model: a second one waits for it
        self._loading: set[tuple[str, str]] = set()
        self._retiring: dict[tuple[str, str], Model] = {}
        self._failed: dict[tuple[str, str], tuple[tuple[int, int], str]] = {}  # (stamp, reason)
        self.unloaded: set[str] = set()  # unloaded by a call: the poll leaves them alone

    def policy(self, name: str, config: Any = None) -> VersionPolicy:
        """The setting's policy, under the model's policy.json, under a load call's config; BadRequest if bad."""
        try:
            policy = VersionPolicy.parse(self.settings.version_policy)
            own = self.source.policy(name)
            policy = VersionPolicy.from_config(own, policy) if own is not None else policy
            return VersionPolicy.from_config(config, policy) if config is not None else policy
        except PolicyError as exc:
            raise BadRequest(f"model {name!r}: {exc}") from None

    def _model_lock(self, name: str) -> threading.Lock:
        with self._lock:
            return self._model_locks.setdefault(name, threading.Lock())

    def load(self, name: str, config: Any = None) -> None:
        """Load (or reload) ``name`` as its policy says, from what the repository holds now; joins a load of the
        same model already running. Raises NotFound, BadRequest, LoadFailed or InsufficientMemory."""
        with self._lock:
            pending = self._pending.get(name)
            if pending is None:
                pending = self._pending[name] = Future()
                pending.set_running_or_notify_cancel()
                owner = True
            else:
                owner = False
        if not owner:
            return pending.result()
        try:
            self._load(name, self.policy(name, config), retry_failed=True)
            pending.set_result(None)
        except BaseException as exc:
            pending.set_exception(exc)
            raise
        finally:
            with self._lock:
                self._pending.pop(name, None)

    def _load(self, name: str, policy: VersionPolicy, retry_failed: bool) -> bool:
        available = self.source.versions(name)
        if not available:
            raise NotFound(f"the repository has no model {name!r}; it has: {', '.join(self.source.models()) or 'none'}",
                           details={"models": self.source.models()})
        if not retry_failed:
            available = [v for v in available if not self._known_bad(name, v)]
        try:
            wanted = policy.choose(available)
        except PolicyError as exc:
            raise BadRequest(f"model {name!r}: {exc}") from None
        return bool(wanted) and self.apply(name, wanted, policy)  # none left to try: keep what serves

    def apply(self, name: str, wanted: list[str], policy: VersionPolicy) -> bool:
        """Serve exactly ``wanted`` of ``name`` (loading the missing ones first), the default as ``policy`` says;
        all or nothing. Returns whether anything changed."""
        with self._model_lock(name):
            routed, default = self.registry.snapshot().get(name, ([], None))
            current = {m.version: m for m in routed}
            fresh: list[Model] = []
            try:
                for version in sorted(set(wanted) - set(current), key=order_key):
                    fresh.append(self._load_version(name, version))
            except BaseException:
                for model in fresh:  # all or nothing: what was serving keeps serving alone
                    self._retire(model, wait=True)
                raise
            chosen = {**{v: current[v] for v in wanted if v in current}, **{m.version: m for m in fresh}}
            new_default = policy.default_of(list(chosen))
            if not fresh and set(chosen) == set(current) and new_default == default:
                return False
            for model in self.registry.publish(name, chosen, new_default):
                self._retire(model, wait=False)
            self.unloaded.discard(name)
            log.info("%s serves versions %s (default %s)", name, ", ".join(sorted(chosen, key=order_key)), new_default)
            return True

    def unload(self, name: str) -> None:
        """Stop routing to every version of ``name``; returns once they finished their requests and are freed."""
        with self._model_lock(name):
            gone = self.registry.remove(name)
            if not gone and name not in self.source.models():
                raise NotFound(f"no model {name!r} is loaded or in the repository")
            self.unloaded.add(name)
            for model in gone:
                self._retire(model, wait=True)
            log.info("unloaded %s", name)

    def _load_version(self, name: str, version: str) -> Model:
        key = (name, version)
        with self._lock:
            self._loading.add(key)
        try:
            self._check_memory(name, version)
            device = resolve_device(self.settings.device)
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            model = start_model(self.settings, self.source.load(name, version))
            if device.type == "cuda":
                model.device_memory_bytes = torch.cuda.memory_allocated(device) - before
            self._failed.pop(key, None)
            return model
        except (ServiceError, ModelLoadError, Exception) as exc:
            error = exc if isinstance(exc, ServiceError) else LoadFailed(
                f"{name} version {version} cannot be served: {exc if isinstance(exc, ModelLoadError) else repr(exc)}")
            self._remember_failure(name, version, error.message)
            raise error from exc
        finally:
            with self._lock:
                self._loading.discard(key)

    def _remember_failure(self, name: str, version: str, reason: str) -> None:
        log.warning("refused %s version %s: %s", name, version, reason)
        try:
            self._failed[(name, version)] = (self.source.stamp(name, version), reason)
        except OSError:
            pass

    def _known_bad(self, name: str, version: str) -> bool:
        failed = self._failed.get((name, version))
        try:
            return failed is not None and failed[0] == self.source.stamp(name, version)
        except OSError:
            return True

    def _check_memory(self, name: str, version: str) -> None:
        # Twice the weights file: the loaded weights, and as much again for the load's copy and warm-up activations.
        need = 2 * self.source.size_bytes(name, version)
        with self._lock:
            retiring = list(self._retiring.values())
        held = [m for models, _ in self.registry.snapshot().values() for m in models] + retiring
        loaded = sum(m.device_memory_bytes or m.predictor.weights_bytes for m in held)
        check_fits(f"{name} version {version}", need, resolve_device(self.settings.device), loaded,
                   self.settings.model_memory_limit_mb, self.settings.memory_reserve_mb)

    def _retire(self, model: Model, wait: bool) -> None:
        key = (model.name, model.version)
        with self._lock:
            self._retiring[key] = model

        def run() -> None:
            drained = model.retire(self.settings.request_timeout_s + RETIRE_GRACE_S)
            with self._lock:
                self._retiring.pop(key, None)
            if model.predictor.device.type == "cuda":
                gc.collect()
                torch.cuda.empty_cache()  # hand the freed blocks back, so the next load sees them as free
            log.info("%s version %s stopped%s", *key, "" if drained else " (some requests were still holding it)")

        if wait:
            run()
        else:
            threading.Thread(target=run, name=f"retire-{key[0]}-{key[1]}", daemon=True).start()

    def poll(self, followed: list[str]) -> None:
        """Bring each of ``followed`` to what its policy picks from the repository now; failures are logged and
        remembered (not tried again until the version's manifest changes), never raised."""
        for name in followed:
            if name in self.unloaded:
                continue
            try:
                if self.source.versions(name):
                    self._load(name, self.policy(name), retry_failed=False)
                elif name in self.registry.snapshot():
                    self.unload(name)  # the model left the repository
            except InsufficientMemory as exc:
                log.warning("poll: %s", exc.message)
            except ServiceError as exc:
                log.warning("poll: %s: %s", name, exc.message)

    def index(self) -> list[VersionState]:
        """Every version in the repository or in memory, with this worker's state of it."""
        routed = self.registry.snapshot()
        with self._lock:
            loading, retiring, failed = set(self._loading), set(self._retiring), dict(self._failed)
        rows = []
        for name in sorted(set(self.source.models()) | set(routed)):
            serving = {m.version for m in routed.get(name, ([], None))[0]}
            held = set(self.source.versions(name)) | serving | {v for n, v in loading | retiring if n == name}
            for version in sorted(held, key=order_key):
                key = (name, version)
                if version in serving:
                    rows.append(VersionState(name, version, "READY"))
                elif key in loading:
                    rows.append(VersionState(name, version, "LOADING"))
                elif key in retiring:
                    rows.append(VersionState(name, version, "UNLOADING"))
                else:
                    rows.append(VersionState(name, version, "UNAVAILABLE", failed[key][1] if key in failed
                                             else "unloaded"))
        return rows
