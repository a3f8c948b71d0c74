"""The routing table: the versions taking traffic, by model, and each model's default version.

A request takes its LoadedVersion from here once (``acquire``) and keeps it to its answer, counted in its
``in_use``: a version taken out of the table (``route``, ``remove``) receives no new request, and the one
retiring it waits for the count to reach 0 before stopping its batcher. Routing and counting happen under one lock,
so no request can pick a version after the table has let it go.
"""
from __future__ import annotations

import contextlib
import random
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from app.engine.loaded.version import LoadedVersion
from app.engine.rollouts.policy import order_key
from app.engine.rollouts.plan import takes_canary
from app.errors import BadRequest, NotFound, NotReady
from models.export.repository import NAME_PATTERN, InvalidName, check_name


def check_names(name: str | None, version: str | None = None) -> None:
    """BadRequest (400, naming the pattern) for a model or version name outside NAME_PATTERN, wherever it came
    from (a URL, a request body): such a name is never looked up, and nothing outside the repository is read."""
    try:
        if name is not None:
            check_name("model", name)
        if version is not None:
            check_name("version", version)
    except InvalidName as exc:
        raise BadRequest(str(exc), details={"pattern": NAME_PATTERN}) from None


NOTHING_LOADED = ("no model is loaded: each was unloaded by a call, and none loads again by itself; a load call loads "
                  "one (POST /v2/repository/models/NAME/load; POST /v2/repository/index lists the repository)")


@dataclass(slots=True)
class Route:
    """Where one request goes: the version that answers it, its role there, and the candidate that also runs it
    off the response path (a shadow), if any. Never changed once made; not frozen, as it is made for every request
    (app/link/wire.py ``_Message``)."""

    version: LoadedVersion
    role: str  # live (the default), canary (the rollout's candidate, its share), or named (the request named it)
    shadow: LoadedVersion | None = None
    takes_pixels: bool = True  # False: a canary whose input differs from the default's, whose pixels a request
    # naming no version is shaped for (what the model's metadata shows): such a request goes to the default
    drawn: bool = False  # a canary share's draw chose between two versions: another such request may go elsewhere


@dataclass(frozen=True)
class Candidate:
    """A model's rollout as routing needs it: the candidate's shares of the requests that name no version."""

    version: str
    canary_percent: float
    shadow_percent: float

    @classmethod
    def from_entry(cls, entry: dict[str, Any]) -> "Candidate | None":
        rollout = entry.get("rollout") or {}
        if not rollout.get("candidate"):
            return None
        return cls(str(rollout["candidate"]), float(rollout.get("canary_percent", 0)),
                   float(rollout.get("shadow_percent", 0)))


class RoutingTable:
    """Model name -> {version -> LoadedVersion} taking traffic, the default version of each model, and the model
    that requests naming none get (``default_model``: the named one, else the only one). ``why_unservable`` says why
    a model cannot be served (its policy), for the 404 of a request for it."""

    def __init__(self, why_unservable: Callable[[str], str | None] = lambda name: None) -> None:
        self._why_unservable = why_unservable
        self._lock = threading.Lock()
        self._routes: dict[str, dict[str, LoadedVersion]] = {}
        self._defaults: dict[str, str] = {}
        self._candidates: dict[str, Candidate] = {}
        self._draw = random.Random()
        self._named_default: str | None = None
        self.generation = 0  # grows with every change of what serves (a cache of it knows when it is stale)

    @property
    def named_default(self) -> str | None:
        """DEFAULT_MODEL, or the repository's repository.json."""
        return self._named_default

    @named_default.setter
    def named_default(self, name: str | None) -> None:
        with self._lock:
            self._named_default = name
            self.generation += 1

    def default_model(self) -> str | None:
        """The model requests naming none get now, if one does."""
        with self._lock:
            return self._default_model()

    def _default_model(self) -> str | None:
        if self._named_default is not None:
            return self._named_default
        return next(iter(self._routes)) if len(self._routes) == 1 else None

    def routes(self) -> dict[str, tuple[list[LoadedVersion], str]]:
        """Every model's routed versions (oldest first) and its default version."""
        with self._lock:
            return {name: (sorted(versions.values(), key=lambda m: order_key(m.version)), self._defaults[name])
                    for name, versions in sorted(self._routes.items())}

    def all_versions(self) -> list[LoadedVersion]:
        """Every version taking traffic."""
        with self._lock:
            return [loaded for versions in self._routes.values() for loaded in versions.values()]

    def candidate(self, name: str) -> Candidate | None:
        """``name``'s rollout candidate, if it has one."""
        with self._lock:
            return self._candidates.get(name)

    def find(self, name: str | None, version: str | None) -> LoadedVersion:
        """The version a request for ``name`` (None: the default model) and ``version`` (None: its default) gets."""
        with self._lock:
            return self._find(name, version)

    def _pick(self, name: str | None, version: str | None, client_key: str | None, pixels: bool) -> Route:
        """The version a request gets, with a rollout: a canary share of the unversioned requests goes to the
        candidate (not one of ``pixels``, shaped for the default, when the candidate's input differs), and a shadow
        share of those the default answers also runs on it."""
        loaded = self._find(name, version)
        candidate = self._drawing(loaded, version)
        if candidate is None:
            return Route(loaded, "live" if version is None else "named")
        return self._draw_route(loaded, candidate, client_key, pixels)

    def _drawing(self, loaded: LoadedVersion, version: str | None) -> Candidate | None:
        """The rollout whose shares a request for ``loaded`` (naming ``version``) is drawn for, if any: else its
        route is plain, the same for every such request."""
        candidate = self._candidates.get(loaded.name)
        if version is not None or candidate is None or candidate.version not in self._routes[loaded.name]:
            return None
        return candidate

    def _draw_route(self, loaded: LoadedVersion, candidate: Candidate, client_key: str | None,
                    pixels: bool) -> Route:
        """A request's draw among ``candidate``'s shares (canary, shadow) of those ``loaded`` would answer."""
        other = self._routes[loaded.name][candidate.version]
        alike = other.signature.input_shape == loaded.signature.input_shape
        if (alike or not pixels) and takes_canary(candidate.canary_percent, loaded.name, client_key,
                                                  self._draw.random()):
            return Route(other, "canary", takes_pixels=alike, drawn=True)
        shadow = candidate.shadow_percent > 0 and self._draw.random() * 100 < candidate.shadow_percent
        return Route(loaded, "live", other if shadow else None, drawn=candidate.canary_percent > 0)

    def _find(self, name: str | None, version: str | None) -> LoadedVersion:
        versions = self._routes.get(name) if isinstance(name, str) else None
        if versions is not None:  # a name routed is a valid one, as is a version it holds: no pattern to match
            loaded = versions.get(version if isinstance(version, str) else self._defaults[name])
            if loaded is not None:
                return loaded
        check_names(name, version)
        if name is None:
            if not self._routes:
                raise NotReady(NOTHING_LOADED)  # no Retry-After: nothing loads by itself
            name = self._default_model()
            if name is None:
                raise BadRequest(f"this server serves {len(self._routes)} models ({', '.join(sorted(self._routes))})"
                                 " and none is the default (DEFAULT_MODEL, or repository.json): name one "
                                 "(?model=NAME, or /v2/models/NAME/...)", details={"models": sorted(self._routes)})
        versions = self._routes.get(name)
        loaded = None if versions is None else versions.get(version or self._defaults[name])
        if loaded is None:
            wanted = f"{name!r}" + ("" if version is None else f" version {version!r}")
            wanted += " (the default model)" if name == self._named_default and versions is None else ""
            why = self._why_unservable(name)  # its policy cannot be read, or it was unloaded
            raise NotFound(f"no model {wanted} is loaded{f': {why}' if why else ''}; this server serves "
                           f"{self._describe()}",
                           details={"models": self.available()})
        return loaded

    def available(self) -> list[dict[str, object]]:
        """Every model served, each with its versions and default: what a 404 ``not_found`` names (details.models)."""
        return [{"name": n, "versions": sorted(v, key=order_key), "default": self._defaults[n]}
                for n, v in sorted(self._routes.items())]

    def _describe(self) -> str:
        def one(name: str, versions: list[str]) -> str:
            if len(versions) == 1:
                return f"{name!r} version {versions[0]!r}"
            return f"{name!r} versions {', '.join(map(repr, versions))} (default {self._defaults[name]!r})"

        return ", ".join(one(n, sorted(v, key=order_key)) for n, v in sorted(self._routes.items())) or "nothing"

    @contextlib.contextmanager
    def acquire(self, name: str | None, version: str | None, client_key: str | None = None) -> Iterator[Route]:
        """The route of this request; its version (and shadow) counted as in use until the block ends."""
        route = self.hold(name, version, client_key)
        try:
            yield route
        finally:
            self.release(route)

    def hold(self, name: str | None, version: str | None, client_key: str | None = None,
             pixels: bool = False) -> Route:
        """The route of this request (``pixels``: it sends pixels, not images), its version (and shadow) counted as
        in use until ``release``."""
        with self._lock:
            route = self._pick(name, version, client_key, pixels)
            route.version.in_use.enter()
            if route.shadow is not None:
                route.shadow.in_use.enter()
        return route

    def hold_many(self, name: str | None, version: str | None, client_key: str | None, pixels: bool,
                  count: int) -> list[Route]:
        """``hold`` for ``count`` requests alike (one loop turn's for one model, version and client key), in one
        look at the table: one route for all of them, unless a rollout draws each its own."""
        with self._lock:
            loaded = self._find(name, version)
            candidate = self._drawing(loaded, version)
            if candidate is None:
                loaded.in_use.add(count)
                return [Route(loaded, "live" if version is None else "named")] * count
            routes = [self._draw_route(loaded, candidate, client_key, pixels) for _ in range(count)]
            for route in routes:
                route.version.in_use.enter()
                if route.shadow is not None:
                    route.shadow.in_use.enter()
        return routes

    @staticmethod
    def release(route: Route, count: int = 1) -> None:
        """What ``hold`` counted as in use (for ``count`` requests of this route), no longer."""
        route.version.in_use.add(-count)
        if route.shadow is not None:
            route.shadow.in_use.add(-count)

    def route(self, name: str, versions: dict[str, LoadedVersion], default: str,
              candidate: Candidate | None = None) -> list[LoadedVersion]:
        """Route ``name``'s requests to ``versions`` from now on, ``candidate`` taking its shares; returns the
        versions no longer routed."""
        if default not in versions:
            raise ValueError(f"default version {default!r} is not among {sorted(versions)}")
        with self._lock:
            before = self._routes.get(name, {})
            self._routes[name], self._defaults[name] = dict(versions), default
            if candidate is not None and candidate.version in versions and candidate.version != default:
                self._candidates[name] = candidate
            else:
                self._candidates.pop(name, None)
            self.generation += 1
        return [loaded for v, loaded in before.items() if versions.get(v) is not loaded]

    def remove(self, name: str) -> list[LoadedVersion]:
        """Stop routing to ``name``; returns its versions."""
        with self._lock:
            self._defaults.pop(name, None)
            self._candidates.pop(name, None)
            self.generation += 1
            return list(self._routes.pop(name, {}).values())
