"""The routing table: the versions taking traffic, by model, and each model's default version.

A request takes its Model from here once (``acquire``) and keeps it to its answer, counted in the Model's
``in_use``: a version taken out of the table (``publish``, ``remove``) receives no new request, and the one
retiring it waits for the count to reach 0 before stopping its batcher. Routing and counting happen under one lock,
so no request can pick a version after the table has let it go.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from app.engine.model import Model
from app.engine.policy import order_key
from app.errors import BadRequest, NotFound, NotReady


class Registry:
    """Model name -> {version -> Model} taking traffic, and the default version of each model."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._routes: dict[str, dict[str, Model]] = {}
        self._defaults: dict[str, str] = {}

    def snapshot(self) -> dict[str, tuple[list[Model], str]]:
        """Every model's routed versions (oldest first) and its default version."""
        with self._lock:
            return {name: (sorted(versions.values(), key=lambda m: order_key(m.version)), self._defaults[name])
                    for name, versions in sorted(self._routes.items())}

    def find(self, name: str | None, version: str | None) -> Model:
        """The version a request for ``name`` (None: the only model) and ``version`` (None: the default) gets."""
        with self._lock:
            return self._find(name, version)

    def _find(self, name: str | None, version: str | None) -> Model:
        if name is None:
            if not self._routes:
                raise NotReady("no model is loaded", headers={"Retry-After": "5"})
            if len(self._routes) > 1:
                raise BadRequest(f"this server serves {len(self._routes)} models ({', '.join(sorted(self._routes))}):"
                                 " name one (?model=NAME, or /v2/models/NAME/...)",
                                 details={"models": sorted(self._routes)})
            name = next(iter(self._routes))
        versions = self._routes.get(name)
        model = None if versions is None else versions.get(version or self._defaults[name])
        if model is None:
            wanted = f"{name!r}" + ("" if version is None else f" version {version!r}")
            raise NotFound(f"no model {wanted} is loaded; this server serves {self._describe()}",
                           details={"models": self._available()})
        return model

    def _available(self) -> list[dict[str, object]]:
        return [{"name": n, "versions": sorted(v, key=order_key), "default": self._defaults[n]}
                for n, v in sorted(self._routes.items())]

    def _describe(self) -> str:
        def one(name: str, versions: list[str]) -> str:
            if len(versions) == 1:
                return f"{name!r} version {versions[0]!r}"
            return f"{name!r} versions {', '.join(map(repr, versions))} (default {self._defaults[name]!r})"

        return ", ".join(one(n, sorted(v, key=order_key)) for n, v in sorted(self._routes.items())) or "nothing"

    @contextlib.contextmanager
    def acquire(self, name: str | None, version: str | None) -> Iterator[Model]:
        """The version for this request, counted as in use until the block ends."""
        with self._lock:
            model = self._find(name, version)
            model.in_use.enter()
        try:
            yield model
        finally:
            model.in_use.leave()

    def publish(self, name: str, versions: dict[str, Model], default: str) -> list[Model]:
        """Route ``name``'s requests to ``versions`` from now on; returns the versions no longer routed."""
        if default not in versions:
            raise ValueError(f"default version {default!r} is not among {sorted(versions)}")
        with self._lock:
            before = self._routes.get(name, {})
            self._routes[name], self._defaults[name] = dict(versions), default
        return [model for v, model in before.items() if versions.get(v) is not model]

    def remove(self, name: str) -> list[Model]:
        """Stop routing to ``name``; returns its versions."""
        with self._lock:
            self._defaults.pop(name, None)
            return list(self._routes.pop(name, {}).values())
