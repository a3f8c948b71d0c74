"""What a worker is doing with the versions that take no traffic: loading, retiring (finishing their requests),
refused (and why), or short of memory (and by how much), and the models that cannot be served at all (a policy.json
that cannot be read, and why), kept under one lock for the apply step, its retiring threads, the writers and the
repository index."""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence

from app.engine.contract import VersionState
from app.engine.loaded.version import LoadedVersion
from app.engine.rollouts.entry import ModelEntry, is_unloaded
from app.engine.rollouts.policy import order_key

Key = tuple[str, str]  # (model, version)
NOT_AN_EXPORT = ("not an export: the folder holds no manifest.json, so it is never served (models.export writes one "
                 "with the model's labels and preprocessing: docs/models.md)")
Stamp = tuple[int, int]  # changes when the version's manifest is rewritten


class VersionStates:
    """Versions loading, retiring and refused, by (model, version)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loading: set[Key] = set()
        self._retiring: dict[Key, list[LoadedVersion]] = {}  # a version unloaded, loaded and unloaded again while
        # its first copy still finishes its requests is held twice
        self._refused: dict[Key, tuple[Stamp, str]] = {}  # the version's stamp when refused, and why
        # versions refused for memory since they last loaded, and why: tried again by every call and poll (memory may
        # be freed), so not left out as a refusal is, but the index says why they do not serve
        self._short_of_memory: dict[Key, str] = {}
        self._unservable: dict[str, str] = {}  # model -> why its policy cannot be read (start and the poll)

    @contextlib.contextmanager
    def loading(self, key: Key) -> Iterator[None]:
        """While ``key`` loads; once loaded it is no longer refused, nor short of memory."""
        with self._lock:
            self._loading.add(key)
        try:
            yield
            with self._lock:
                self._refused.pop(key, None)
                self._short_of_memory.pop(key, None)
        finally:
            with self._lock:
                self._loading.discard(key)

    def refuse(self, key: Key, stamp: Stamp, reason: str) -> None:
        """``key`` could not be served, as its files stood at ``stamp`` (what it said before of memory is older)."""
        with self._lock:
            self._refused[key] = (stamp, reason)
            self._short_of_memory.pop(key, None)

    def short_of_memory(self, key: Key, reason: str) -> bool:
        """``key`` would not fit (``reason``: how much it needs, of what): the index says so until it loads or is
        refused for another reason. Whether it is new: not already short of memory since it last loaded."""
        with self._lock:
            new = key not in self._short_of_memory
            self._short_of_memory[key] = reason
            return new

    def is_short_of_memory(self, key: Key) -> bool:
        """Whether ``key`` was refused for memory since it last loaded."""
        with self._lock:
            return key in self._short_of_memory

    def reasons_refused(self) -> list[str]:
        """Each version refused or short of memory, and why: what a start that serves nothing says."""
        with self._lock:
            said = {**{key: reason for key, (_, reason) in self._refused.items()}, **self._short_of_memory}
        return [reason for _, reason in sorted(said.items())]

    def refusal(self, key: Key) -> tuple[Stamp, str] | None:
        """The stamp ``key`` was refused at and why, if it was."""
        with self._lock:
            return self._refused.get(key)

    def unservable(self, name: str, reason: str) -> bool:
        """``name`` cannot be served at all (its policy cannot be read): its versions that do not serve show
        ``reason`` until ``servable``. Whether ``reason`` is new (not the one already held for it)."""
        with self._lock:
            new = self._unservable.get(name) != reason
            self._unservable[name] = reason
            return new

    def servable(self, name: str) -> None:
        """``name``'s policy can be read again (or another worker serves it): its versions show their own state."""
        with self._lock:
            self._unservable.pop(name, None)

    def why_unservable(self, name: str) -> str | None:
        """Why ``name`` cannot be served at all, if it cannot."""
        with self._lock:
            return self._unservable.get(name)

    def retiring(self, loaded: LoadedVersion) -> None:
        """``loaded`` left the routing table and finishes its requests."""
        with self._lock:
            self._retiring.setdefault((loaded.name, loaded.version), []).append(loaded)

    def retired(self, loaded: LoadedVersion) -> None:
        """``loaded`` is stopped and freed."""
        key = (loaded.name, loaded.version)
        with self._lock:
            held = [other for other in self._retiring.get(key, []) if other is not loaded]
            if held:
                self._retiring[key] = held
            else:
                self._retiring.pop(key, None)

    def retiring_versions(self) -> list[LoadedVersion]:
        """The versions still holding memory after leaving the table."""
        with self._lock:
            return [loaded for held in self._retiring.values() for loaded in held]

    def rows(self, name: str, available: list[str], serving: set[str],
             entry: ModelEntry | None = None, strays: Sequence[str] = ()) -> list[VersionState]:
        """The index rows of model ``name``: the repository's versions, the serving ones and those in between, and
        its folders that hold no export (``strays``: UNAVAILABLE, NOT_AN_EXPORT). A version that does not serve says
        why: that it would not fit in memory (its latest try), else its own refusal, else why its model cannot be
        served, else why its model's desired ``entry`` leaves it out."""
        with self._lock:
            loading, retiring, refused = set(self._loading), set(self._retiring), dict(self._refused)
            short_of_memory = dict(self._short_of_memory)
            unservable = self._unservable.get(name)
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
                why = short_of_memory.get(key) or (refused[key][1] if key in refused else unservable
                                                   or _left_out(version, entry))
                rows.append(VersionState(name, version, "UNAVAILABLE", why))
        rows += [VersionState(name, stray, "UNAVAILABLE", NOT_AN_EXPORT) for stray in strays if stray not in held]
        return sorted(rows, key=lambda row: order_key(row.version)) if strays else rows


def _left_out(version: str, entry: ModelEntry | None) -> str:
    """Why a model's desired ``entry`` (None: none yet) does not name ``version``, a version in its repository."""
    if entry is None:  # a model of the repository not followed (MODELS leaves it out), or no desired state to read
        return "not loaded (its load call loads it)"
    if is_unloaded(entry):
        return "unloaded"
    if version in entry.get("refused", {}):  # by the worker that tried it (this one may not have)
        return entry["refused"][version]
    if version in entry["versions"]:  # this worker has yet to follow the change that names it
        return "not loaded here yet"
    if version in entry.get("rolled_back", []):
        return "rolled back (it serves again once a promotion names it)"
    # (or new in the repository since the model last loaded: a VERSION_POLICY of all found it unloaded, "not
    # chosen", before a poll or a load call picked it up)
    return "not chosen by the model's version policy when it last loaded (a load call, or a poll, loads it if chosen)"
