"""Named keys: who a request is, what it may use, and how it is limited.

A key is declared in routes.yaml's `keys:` (or a keys file of the same shape, GATEWAY_KEYS_FILE),
by the environment variable that holds it (`key_env`) or by its SHA-256 (`key_sha256`, so the file
holds no secret). The plain keys of GATEWAY_API_KEYS and GATEWAY_API_KEYS_FILE stay anonymous:
admitted, unlimited, counted as `anonymous`. Only the name ever leaves this module; a key is
looked up by its digest and compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gateway.team.limits import KeyLimits

Priority = Literal["interactive", "batch"]
ANONYMOUS = "anonymous"  # every key of GATEWAY_API_KEYS(_FILE): one name in metrics and usage
_NAME = r"^[A-Za-z0-9_.:-]{1,64}$"


class LimitsSpec(BaseModel):
    """A named key's limits as routes.yaml or a keys file declares them; each is off when unset."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    concurrent: int | None = Field(None, ge=1)
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    tokens_per_day: int | None = Field(None, ge=1)


class KeySpec(BaseModel):
    """A named key as declared: its name, the key itself by exactly one source (an environment
    variable or a SHA-256 digest), the presets it may use (None: all), its priority, limits and
    admin flag."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=_NAME)
    key_env: str | None = Field(None, min_length=1)
    key_sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")
    presets: list[str] | None = None  # None: every preset
    priority: Priority = "interactive"
    limits: LimitsSpec = LimitsSpec()
    admin: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> KeySpec:
        if (self.key_env is None) == (self.key_sha256 is None):
            raise ValueError("give exactly one of key_env (the variable that holds the key) or key_sha256")
        return self


class KeysFile(BaseModel):
    """A `GATEWAY_KEYS_FILE`: the same `keys:` list as routes.yaml, nothing else."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    keys: list[KeySpec] = Field(default_factory=list)


@dataclass(frozen=True)
class Identity:
    """Who a request is. `presets` None: all of them."""

    name: str
    priority: Priority = "interactive"
    presets: frozenset[str] | None = None
    limits: KeyLimits = field(default_factory=KeyLimits)
    admin: bool = False

    def allows(self, preset: str) -> bool:
        return self.presets is None or preset in self.presets


OPEN = Identity(ANONYMOUS)  # a gateway with no keys: everyone is the anonymous, unlimited caller


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeysError(ValueError):
    """A keys declaration is unusable; the message names where and how to fix it."""


class Keyring:
    """Digest -> identity. Immutable: a reload builds a new one and swaps it whole."""

    def __init__(self, entries: Mapping[bytes, Identity], names: Iterable[str] = ()) -> None:
        self._entries = dict(entries)
        self.names = tuple(dict.fromkeys(names))  # the configured names, for bounded metric labels

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def identify(self, presented: str) -> Identity | None:
        # Every digest is compared, in constant time each, so neither a match's position nor a
        # prefix can be timed; the dict is not consulted by the presented value.
        candidate = digest(presented)
        found: Identity | None = None
        for known, identity in self._entries.items():
            if hmac.compare_digest(candidate, known):
                found = identity
        return found

    def identities(self) -> dict[str, Identity]:
        return {identity.name: identity for identity in self._entries.values()}


def identity_of(spec: KeySpec) -> Identity:
    limits = KeyLimits(**spec.limits.model_dump())
    presets = frozenset(spec.presets) if spec.presets is not None else None
    return Identity(spec.name, spec.priority, presets, limits, spec.admin)


def build_keyring(
    specs: Iterable[KeySpec],
    anonymous: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
    presets: Iterable[str] | None = None,
) -> Keyring:
    """Named keys first, then anonymous ones. Raises KeysError naming every problem at once: a
    key variable that is unset, two entries with one name or one key, an unknown preset."""
    environ = os.environ if environ is None else environ
    known = set(presets) if presets is not None else None
    entries: dict[bytes, Identity] = {}
    problems: list[str] = []
    names: list[str] = []
    for index, spec in enumerate(specs):
        where = f"keys[{index}] ({spec.name})"
        if spec.name in names or spec.name == ANONYMOUS:
            problems.append(f"{where}: the name is already used; give each key its own name")
            continue
        names.append(spec.name)
        if spec.key_env is not None:
            value = environ.get(spec.key_env, "").strip()
            if not value:
                problems.append(f"{where}.key_env: the variable {spec.key_env} is not set or empty")
                continue
            key_digest = digest(value)
        else:
            assert spec.key_sha256 is not None
            key_digest = bytes.fromhex(spec.key_sha256)
        if key_digest in entries:
            problems.append(f"{where}: the same key as '{entries[key_digest].name}'; keys must differ")
            continue
        if known is not None:
            unknown = sorted(set(spec.presets or ()) - known)
            if unknown:
                listing = ", ".join(sorted(known))
                problems.append(f"{where}.presets: {', '.join(unknown)} not a preset (presets: {listing})")
                continue
        entries[key_digest] = identity_of(spec)
    for key in anonymous:
        entries.setdefault(digest(key), OPEN)
    if problems:
        raise KeysError("; ".join(problems))
    if any(identity is OPEN for identity in entries.values()):
        names.append(ANONYMOUS)
    return Keyring(entries, names)


def load_keys_file(path: Path) -> list[KeySpec]:
    """GATEWAY_KEYS_FILE: `keys:` as in routes.yaml."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise KeysError(f"{path}: cannot read the keys file ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise KeysError(f"{path}: not valid YAML: {exc}") from None
    try:
        return list(KeysFile.model_validate(raw or {}).keys)
    except ValidationError as exc:
        details = "; ".join(
            ".".join(str(part) for part in error["loc"]) + f": {error['msg']}" for error in exc.errors()
        )
        raise KeysError(f"{path}: {details}") from None


def plain_keys(text: str) -> list[str]:
    """GATEWAY_API_KEYS (comma-separated) or its file (one key per line, `#` comments)."""
    return [
        k.strip() for k in text.replace("\n", ",").split(",") if k.strip() and not k.strip().startswith("#")
    ]
