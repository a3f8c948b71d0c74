"""A model repository: ``<repository>/<model>/<version>/`` each holding one export (manifest.json and its files).

``python -m models.export --repository DIR`` writes the next version of a model into it; the server serves its
models from it (``VISIONSERVE_WEIGHTS_DIR`` pointing at the repository; ``MODELS`` and ``VERSION_POLICY`` choose;
the server's reconcile, app/engine/versions/, swaps versions while serving). A directory with a manifest.json of
its own (today's ``weights/``) is a single export and is served as it is. Standard library only: the server's
loader imports it.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from models.export.manifest import MANIFEST_NAME

_NUMBER = re.compile(r"[0-9]+")  # whole names only (fullmatch): "$" would take "1\n"
# What a model or version may be called: a folder name of the repository and nothing else (no separator, no "..",
# no hidden file), whether it comes from a URL, a request body, a policy file or a folder.
NAME_PATTERN = "[A-Za-z0-9][A-Za-z0-9_.-]{0,127}"
_NAME = re.compile(NAME_PATTERN)  # fullmatch, as _NUMBER


class InvalidName(ValueError):
    """A model or version name outside NAME_PATTERN; the message names the pattern."""


def check_name(kind: str, value: str) -> str:
    """``value`` when it is a valid ``kind`` name ("model", "version"), else InvalidName."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise InvalidName(f"{kind} name {value!r} is not one this server serves: names match {NAME_PATTERN} "
                          "(letters, digits, '_', '.' and '-', starting with a letter or digit, at most 128)")
    return value


def name_from(text: str) -> str:
    """A valid model name made of ``text`` (a run folder's name): each run of other characters one '-', leading
    '_', '.' and '-' dropped, at most 128 characters; "model" when nothing is left. A valid name stays as it is."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).lstrip("_.-")[:128] or "model"


class RepositoryError(LookupError):
    """The repository has no such model or version, or cannot say which one is meant; the message names the
    available ones."""


def is_export(path: Path) -> bool:
    """A directory holding one export."""
    return (path / MANIFEST_NAME).is_file()


def models(repository: Path) -> list[str]:
    """The models with at least one version, by name."""
    if not repository.is_dir():
        return []
    return sorted(p.name for p in repository.iterdir()
                  if p.is_dir() and _NAME.fullmatch(p.name) and versions(repository, p.name))


def version_order(version: str) -> tuple[int, int, str]:
    """Sort key: numbered versions in numeric order (2 < 10), after them any named ones by name."""
    return (0, int(version), "") if _NUMBER.fullmatch(version) else (1, 0, version)


def versions(repository: Path, model: str) -> list[str]:
    """The versions of ``model``, oldest first (numbered ones numerically, then named ones); none for a name outside
    NAME_PATTERN (nothing outside the repository is read)."""
    folder = repository / model
    if not _NAME.fullmatch(model) or not folder.is_dir():
        return []
    return sorted((p.name for p in folder.iterdir() if p.is_dir() and _NAME.fullmatch(p.name) and is_export(p)),
                  key=version_order)


def stray_folders(repository: Path, model: str) -> list[str]:
    """The folders of ``model`` named as versions are that hold files but no manifest: no export, so never served (a
    model file copied in by hand, an export still being copied), oldest first."""
    folder = repository / model
    if not _NAME.fullmatch(model) or not folder.is_dir():
        return []
    return sorted((p.name for p in folder.iterdir() if p.is_dir() and _NAME.fullmatch(p.name) and not is_export(p)
                   and any(child.is_file() for child in p.iterdir())), key=version_order)


def next_version(repository: Path, model: str) -> str:
    """One more than the highest numbered version of ``model`` ("1" for a new model)."""
    numbered = [int(v) for v in versions(repository, model) if _NUMBER.fullmatch(v)]
    return str(max(numbered, default=0) + 1)


def newest(repository: Path, model: str) -> str:
    """The highest numbered version (or, without numbers, the last by name)."""
    found = versions(repository, model)
    if not found:
        raise RepositoryError(f"{repository} has no model {model!r}; it has: {', '.join(models(repository)) or 'none'}")
    numbered = [v for v in found if _NUMBER.fullmatch(v)]
    return numbered[-1] if numbered else found[-1]


def named_default(repository: Path) -> str | None:
    """The model the repository's ``repository.json`` (``{"default_model": NAME}``, what the server serves when a
    request names none) names; None without one, or one that names no model of the repository (the server says
    why)."""
    try:
        config = json.loads((repository / "repository.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    named = config.get("default_model") if isinstance(config, dict) else None
    return named if isinstance(named, str) and named in models(repository) else None
