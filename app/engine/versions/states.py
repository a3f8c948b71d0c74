"""What a worker is doing with the versions that take no traffic: loading, retiring (finishing their requests) or
refused (and why), kept under one lock for the apply step, its retiring threads and the repository index."""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from app.engine.contract import VersionState
from app.engine.loaded.version import LoadedVersion
from app.engine.rollouts.policy import order_key

Key = tuple[str, str]  # (model, version)
Stamp = tuple[int, int]  # changes when the version's manifest is rewritten


class VersionStates:
    """Versions loading, retiring and refused, by (model, version)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loading: set[Key] = set()
        self._retiring: dict[Key, LoadedVersion] = {}
        self._refused: dict[Key, tuple[Stamp, str]] = {}  # the version's stamp when refused, and why

    @contextlib.contextmanager
    def loading(self, key: Key) -> Iterator[None]:
        """While ``key`` loads; once loaded it is no longer refused."""
        with self._lock:
            self._loading.add(key)
        try:
            yield
            with self._lock:
                self._refused.pop(key, None)
        finally:
            with self._lock:
                self._loading.discard(key)

    def refuse(self, key: Key, stamp: Stamp, reason: str) -> None:
        """``key`` could not be served, as its files stood at ``stamp``."""
        with self._lock:
            self._refused[key] = (stamp, reason)

    def refusal(self, key: Key) -> tuple[Stamp, str] | None:
        """The stamp ``key`` was refused at and why, if it was."""
        with self._lock:
            return self._refused.get(key)

    def retiring(self, loaded: LoadedVersion) -> None:
        """``loaded`` left the routing table and finishes its requests."""
        with self._lock:
            self._retiring[(loaded.name, loaded.version)] = loaded

    def retired(self, loaded: LoadedVersion) -> None:
        """``loaded`` is stopped and freed."""
        with self._lock:
            self._retiring.pop((loaded.name, loaded.version), None)

    def retiring_versions(self) -> list[LoadedVersion]:
        """The versions still holding memory after leaving the table."""
        with self._lock:
            return list(self._retiring.values())

    def rows(self, name: str, available: list[str], serving: set[str]) -> list[VersionState]:
        """The index rows of model ``name``: the repository's versions, the serving ones and those in between."""
        with self._lock:
            loading, retiring, refused = set(self._loading), set(self._retiring), dict(self._refused)
        held = set(available) | serving | {v for n, v in loading | retiring if n == name}
        rows = []
        for version in sorted(held, key=order_key):
            key = (name, version)
            if version in serving:
                rows.append(VersionState(name, version, "READY"))
            elif key in loading:
                rows.append(VersionState(name, version, "LOADING"))
            elif key in retiring:
                rows.append(VersionState(name, version, "UNLOADING"))
            else:
                rows.append(VersionState(name, version, "UNAVAILABLE", refused[key][1] if key in refused else
                                         "unloaded"))
        return rows
