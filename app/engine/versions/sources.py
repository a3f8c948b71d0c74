"""Where models come from: a directory (one export, or a repository ``<dir>/<model>/<version>/``), or a predictor
handed over already loaded (tests, benchmarks). The server's reconcile (app/engine/versions/) reads a source: its
writers (start-up, the poll, calls) ask what exists, and its apply step loads versions from it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from app.config import Settings
from app.engine.rollouts.policy import POLICY_FILE, PolicyError
from app.engine.loaded.predictor import Predictor
from app.engine.batching.tuning import forward_threads
from models.export.checks import ModelLoadError, read_checked_manifest, resolve_device
from models.export.manifest import MANIFEST_NAME
from models.export.repository import check_name, models, stray_folders, versions


REPOSITORY_FILE = "repository.json"  # {"default_model": NAME}, at the repository's root


class Source(Protocol):
    """What the reconcile (its writers and apply step) needs of a place holding models."""

    def models(self) -> list[str]: ...
    def default_model(self) -> str | None: ...
    def versions(self, name: str) -> list[str]: ...
    def policy(self, name: str) -> dict[str, Any] | None: ...
    def stamp(self, name: str, version: str) -> tuple[int, int]: ...
    def size_bytes(self, name: str, version: str) -> int: ...
    def load(self, name: str, version: str) -> Predictor: ...
    def unservable(self, name: str, version: str) -> str | None: ...
    def strays(self, name: str) -> list[str]: ...


class DirectorySource:
    """``settings.weights_dir``: a single export (today's ``weights/``: a repository of one model) or a repository."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.root = settings.resolved_weights_dir()
        self._seen: tuple[tuple[int, int], tuple[str, str]] | None = None  # the single export's (stamp, identity)
        # the single export's manifest as it stands, when it does not validate since it did: (stamp, why)
        self._invalid: tuple[tuple[int, int], str] | None = None

    def _single(self) -> tuple[str, str] | None:
        # Asked on every poll, index and readiness call: the manifest is parsed again only when it changed. One that
        # no longer validates (a hand edit, a newer schema) keeps the identity it had: the version loaded from it
        # serves on, and policy() says why it cannot change (ModelLoadError) until the manifest is fixed.
        try:
            stat = (self.root / MANIFEST_NAME).stat()
        except OSError:
            return None
        stamp = (stat.st_mtime_ns, stat.st_size)
        if self._seen is not None and self._seen[0] == stamp:
            self._invalid = None  # as it was (put back as it stood)
        elif self._invalid is None or self._invalid[0] != stamp:
            try:
                manifest = read_checked_manifest(self.root)
            except ModelLoadError as exc:
                if self._seen is None:
                    raise  # never valid: nothing to keep (start-up says why)
                self._invalid = (stamp, str(exc))
                return self._seen[1]
            self._seen, self._invalid = (stamp, (manifest.name, manifest.version)), None
        return self._seen[1]

    def models(self) -> list[str]:
        """The models with at least one version."""
        single = self._single()
        return [single[0]] if single else models(self.root)

    def default_model(self) -> str | None:
        """The model ``repository.json`` names as the default, if any (PolicyError when it cannot be read)."""
        config = None if self._single() else _json_object(self.root / REPOSITORY_FILE)
        if config is None:
            return None
        if set(config) - {"default_model"} or not isinstance(config.get("default_model"), str):
            raise PolicyError(f"{self.root / REPOSITORY_FILE} must be {{\"default_model\": \"NAME\"}}")
        return config["default_model"]

    def versions(self, name: str) -> list[str]:
        """``name``'s versions, oldest first."""
        single = self._single()
        if single:
            return [single[1]] if single[0] == name else []
        return versions(self.root, name)

    def path(self, name: str, version: str) -> Path:
        """The export folder of one version (InvalidName: a name that could lead outside the repository)."""
        if self._single():
            return self.root
        return self.root / check_name("model", name) / check_name("version", version)

    def strays(self, name: str) -> list[str]:
        """``name``'s folders that hold files but no manifest (no export, never served); none for a single export."""
        return [] if self._single() else stray_folders(self.root, name)

    def policy(self, name: str) -> dict[str, Any] | None:
        """``<repository>/<name>/policy.json``, when there is one; a single export has none, and raises ModelLoadError
        while its manifest does not validate (its model keeps the version it serves, as with a policy.json that
        cannot be read)."""
        if not self._single():
            return _json_object(self.root / check_name("model", name) / POLICY_FILE)
        if self._invalid is not None:
            raise ModelLoadError(self._invalid[1])
        return None

    def stamp(self, name: str, version: str) -> tuple[int, int]:
        """Changes when any file of the version is rewritten: a version refused before is tried again then."""
        stats = [path.stat() for path in self.path(name, version).iterdir() if path.is_file()]
        if not stats:
            raise FileNotFoundError(f"{self.path(name, version)} holds no files")
        return max(s.st_mtime_ns for s in stats), sum(s.st_size for s in stats)

    def size_bytes(self, name: str, version: str) -> int:
        """The size of the weights file the server would load (for the memory check)."""
        folder = self.path(name, version)
        manifest = read_checked_manifest(folder)
        setting = self.settings.weights_format  # a package holds the same weights: the default file measures it
        fmt = manifest.default_format if setting in ("auto", "aoti", "int8", "onnx") else setting
        entry = manifest.files.get(fmt)  # type: ignore[call-overload]
        return (folder / entry.path).stat().st_size if entry and (folder / entry.path).is_file() else 0

    def load(self, name: str, version: str) -> Predictor:
        """Load and verify one version (manifest, checksum, keys, output shape) or raise ModelLoadError."""
        folder, device = self.path(name, version), resolve_device(self.settings.device)
        predictor = Predictor.load(folder, weights_format=self.settings.weights_format, device=self.settings.device,
                                   dtype=self.settings.dtype, jit_optimize=self.settings.jit_optimize,
                                   max_batch_size=self.settings.batch_ceiling(device.type),
                                   cuda_graphs=self.settings.cuda_graphs, memory_format=self.settings.memory_format,
                                   threads=forward_threads(self.settings.torch_threads, device,
                                                           workers=self.settings.model_processes()) or 1)
        misplaced = _misplaced(folder, (predictor.manifest.name, predictor.manifest.version), name, version)
        if misplaced:
            raise ModelLoadError(misplaced)
        return predictor

    def unservable(self, name: str, version: str) -> str | None:
        """Why ``version`` cannot load, as its manifest tells without loading it (unreadable or invalid, or naming
        another model or version: a folder copied by hand); None when it does not say (its load may still fail)."""
        folder = self.path(name, version)
        try:
            manifest = read_checked_manifest(folder)
        except (ModelLoadError, OSError) as exc:
            return str(exc)
        return _misplaced(folder, (manifest.name, manifest.version), name, version)

    def missing(self) -> ModelLoadError:
        """Why there is nothing to serve, saying how to make something."""
        try:
            read_checked_manifest(self.root)
        except ModelLoadError as exc:
            return exc
        return ModelLoadError(f"{self.root} holds no model")


def _misplaced(folder: Path, found: tuple[str, str], name: str, version: str) -> str | None:
    """Why a version whose manifest says ``found`` cannot serve as ``name`` ``version``, or None where it can."""
    if found == (name, version):
        return None
    return (f"{folder}/manifest.json says {found[0]} version {found[1]}, but the repository holds it as {name} "
            f"version {version}: export it again with --repository, or move it to {found[0]}/{found[1]}")


def _json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, None when there is no such file; PolicyError when it is not one."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise PolicyError(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise PolicyError(f"{path} must hold a JSON object")
    return data


class GivenSource:
    """One predictor, already loaded: the only model and version there is."""

    def __init__(self, predictor: Predictor) -> None:
        self.predictor = predictor
        self._key = (predictor.manifest.name, predictor.manifest.version)

    def models(self) -> list[str]:
        """The predictor's model."""
        return [self._key[0]]

    def default_model(self) -> str | None:
        """None: the only model is the default."""
        return None

    def versions(self, name: str) -> list[str]:
        """Its version."""
        return [self._key[1]] if name == self._key[0] else []

    def policy(self, name: str) -> dict[str, Any] | None:
        """None: the settings' policy applies."""
        return None

    def stamp(self, name: str, version: str) -> tuple[int, int]:
        """Never changes."""
        return (0, 0)

    def size_bytes(self, name: str, version: str) -> int:
        """The predictor's weights."""
        return self.predictor.weights_bytes

    def load(self, name: str, version: str) -> Predictor:
        """The predictor itself."""
        return self.predictor

    def unservable(self, name: str, version: str) -> str | None:
        """None: its predictor serves."""
        return None

    def strays(self, name: str) -> list[str]:
        """None: it holds no folders."""
        return []

    def missing(self) -> ModelLoadError:
        """Never: it always holds its predictor."""
        return ModelLoadError("no model")
