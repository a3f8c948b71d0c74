"""Version policies: which versions of a model stay loaded, and which one answers requests that name none.

Spelt as a setting (``VERSION_POLICY``: ``latest:N``, ``all``, ``specific:V[,V...]``) or, per model, as Triton
spells it in a model config: ``{"version_policy": {"latest": {"num_versions": 2}}, "default_version": "3"}``
(``<repository>/<model>/policy.json``, or the ``config`` parameter of a repository load call). """
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any, Literal

from models.export.repository import InvalidName, check_name
from models.export.repository import version_order as order_key

POLICY_FILE = "policy.json"  # beside a model's version folders
_NUMBER = re.compile(r"[0-9]+")  # whole names only (fullmatch): "$" would take "1\n"
_KINDS = ("latest", "all", "specific")


def version_name(value: Any) -> str:
    """A version a config names (a number is its name), or PolicyError naming the pattern names follow."""
    try:
        return check_name("version", str(value) if isinstance(value, int) and not isinstance(value, bool) else value)
    except InvalidName as exc:
        raise PolicyError(str(exc)) from None


class PolicyError(ValueError):
    """A policy that cannot be read; the message says what is accepted."""


class VersionsMissing(PolicyError):
    """A policy naming versions (``versions``) the repository does not hold: absent, or left out as refused (the
    caller, which knows why, says so)."""

    def __init__(self, message: str, versions: tuple[str, ...]) -> None:
        super().__init__(message)
        self.versions = versions


def parsed_config(config: Any) -> Any:
    """A load call's config: as it is, or its JSON text parsed; PolicyError for text that is no JSON, or nested
    too deeply to parse (a RecursionError, before: a 500)."""
    if not isinstance(config, (str, bytes)):
        return config
    try:
        return json.loads(config)
    except ValueError as exc:
        raise PolicyError(f"the config is not JSON: {exc}") from None
    except RecursionError:
        raise PolicyError("the config is not JSON this server reads: it is nested too deeply") from None


@dataclass(frozen=True)
class VersionPolicy:
    """What to keep loaded out of a model's versions, and the version requests without one get."""

    kind: Literal["latest", "all", "specific"] = "latest"
    count: int = 1  # latest: how many of the newest
    versions: tuple[str, ...] = ()  # specific: these
    default: str | None = None  # None: the newest loaded version

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise PolicyError(f"version policy kind must be one of {', '.join(_KINDS)}, got {self.kind!r}")
        if self.kind == "latest" and self.count < 1:
            raise PolicyError(f"latest needs at least 1 version, got {self.count}")
        if self.kind == "specific" and not self.versions:
            raise PolicyError("specific needs at least one version")
        if self.default is not None and self.kind == "specific" and self.default not in self.versions:
            raise PolicyError(f"default version {self.default!r} is not among the specific ones "
                              f"({', '.join(self.versions)})")

    @classmethod
    def parse(cls, text: str) -> "VersionPolicy":
        """``latest:N`` (``latest`` = ``latest:1``), ``all``, or ``specific:V[,V...]``."""
        kind, _, arg = text.strip().partition(":")
        if kind == "latest" and (not arg or _NUMBER.fullmatch(arg)):
            return cls("latest", count=int(arg or 1))
        if kind == "all" and not arg:
            return cls("all")
        if kind == "specific" and arg:
            return cls("specific", versions=tuple(v.strip() for v in arg.split(",") if v.strip()))
        raise PolicyError(f"version policy must be latest:N, all or specific:V[,V...], got {text!r}")

    @classmethod
    def from_config(cls, config: Any, fallback: "VersionPolicy") -> "VersionPolicy":
        """A Triton-style model config (a dict, or its JSON text) over ``fallback``; unknown keys are refused."""
        config = parsed_config(config)
        if not isinstance(config, dict):
            raise PolicyError("the config must be a JSON object")
        unknown = set(config) - {"version_policy", "default_version", "name", "rollout"}
        if unknown:
            raise PolicyError(f"unsupported config keys {sorted(unknown)}: this server reads version_policy, "
                              "default_version and rollout")
        policy = _from_triton(config["version_policy"]) if "version_policy" in config else fallback
        default = config.get("default_version", policy.default)
        return replace(policy, default=None if default is None else version_name(default))

    @classmethod
    def layered(cls, setting: str, *configs: Any) -> "VersionPolicy":
        """The ``VERSION_POLICY`` setting under each config given (a model's policy.json, a load call's config)."""
        policy = cls.parse(setting)
        for config in configs:
            if config is not None:
                policy = cls.from_config(config, policy)
        return policy

    def wanted(self, available: list[str]) -> dict[str, Any]:
        """What to serve out of ``available``: {"versions": [...], "default": v} (the desired state's entry)."""
        versions = self.choose(available)
        return {"versions": versions, "default": self.default_of(versions)}

    def choose(self, available: list[str]) -> list[str]:
        """The versions to keep loaded out of ``available``, oldest first; VersionsMissing when one it names is not
        there."""
        ordered = sorted(available, key=order_key)
        if self.kind == "all":
            chosen = ordered
        elif self.kind == "latest":
            numbered = [v for v in ordered if _NUMBER.fullmatch(v)] or ordered
            chosen = numbered[-self.count:]
        else:
            missing = [v for v in self.versions if v not in available]
            if missing:
                has = ", ".join(ordered) or "none"
                raise VersionsMissing(f"no version {', '.join(missing)}; the repository has {has}", tuple(missing))
            chosen = sorted(self.versions, key=order_key)
        if self.default is not None and self.default not in chosen:
            if self.default not in available:
                raise VersionsMissing(f"default version {self.default!r} is not in the repository", (self.default,))
            chosen = sorted([*chosen, self.default], key=order_key)
        return chosen

    def default_of(self, loaded: list[str]) -> str | None:
        """The version unversioned requests get: the named default when loaded, else the newest loaded."""
        if self.default is not None and self.default in loaded:
            return self.default
        ordered = sorted(loaded, key=order_key)
        numbered = [v for v in ordered if _NUMBER.fullmatch(v)]
        return (numbered or ordered or [None])[-1]


def _from_triton(spec: Any) -> VersionPolicy:
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in _KINDS:
        raise PolicyError('version_policy must be {"latest": {"num_versions": N}}, {"all": {}} or '
                          '{"specific": {"versions": [...]}}')
    kind, args = next(iter(spec.items()))
    args = args or {}
    if not isinstance(args, dict):
        raise PolicyError(f"version_policy's {kind!r} takes an object, got {args!r}")
    if kind == "latest":
        count = args.get("num_versions", 1)
        if isinstance(count, str) and _NUMBER.fullmatch(count):  # protobuf's JSON may write a count as a string
            # (ASCII digits only: str.isdigit takes "²", which int() refuses with a ValueError, a 500)
            count = int(count)
        if isinstance(count, bool) or not isinstance(count, int):  # "two", 2.5: not a count (JSON's true is no 1)
            raise PolicyError(f"latest's num_versions must be a whole number, got {count!r}")
        return VersionPolicy("latest", count=count)
    if kind == "specific":
        versions = args.get("versions", [])
        if not isinstance(versions, list):  # a string was read a character a version: "abc" named a, b and c
            raise PolicyError(f"specific's versions must be a list of versions, got {versions!r}")
        return VersionPolicy("specific", versions=tuple(version_name(v) for v in versions))
    return VersionPolicy("all")
