"""The routing table: the schema of routes.yaml, its loader, and model/task/image resolution.

Pure: loading reads one file, everything else works on values. Configuration fails here, at
start-up (or at reload), with a message that names the file, the key path and the fix; a request
never meets a half-valid table.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Literal, NamedTuple, get_args
from urllib.parse import urlsplit

import orjson
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.errors import BadRequest, ModelNotFound, UnknownTask
from gateway.team.keys import KeySpec

Engine = Literal["vllm", "llamacpp"]
Policy = Literal["round_robin", "least_busy", "prefix_affinity", "session"]
Volatile = Literal["off", "warn", "move", "strip"]
RouteReason = Literal["model", "alias", "pattern", "task", "images", "default", "capability"]
# Named rewrites for what agents send and local engines or chat templates reject (dialects/).
Fix = Literal[
    "billing_header",
    "system_in_turns",
    "anthropic_only_fields",
    "codex_lite",
    "codex_tools",
    "reasoning_replay",
    "unknown_tool_types",
    "tool_schemas",
    "tool_images",
    "tool_call_repair",  # opt-in: the engine's parser is missing or misses the model's call format
    "tool_pairing",  # opt-in: a template that refuses any unpaired call or result
]
OPT_IN_FIXES: frozenset[Fix] = frozenset({"tool_call_repair", "tool_pairing"})
# The default `compat`: every fix but the opt-in ones.
ALL_FIXES: tuple[Fix, ...] = tuple(fix for fix in get_args(Fix) if fix not in OPT_IN_FIXES)
# `openai/coder` names the preset `coder` for clients that prefix a provider (LiteLLM, aider).
PROVIDER_PREFIXES = ("openai/", "anthropic/", "hosted_vllm/", "vllm/", "llamacpp/", "local/", "fleet/")
# Claude Code asks for `claude-opus-4-8[1m]` when it wants a 1M context: the suffix names a mode
# of Anthropic's service, not another model.
_MODE_SUFFIX = re.compile(r"\[[0-9a-z]+\]$")
LOOKUP_CACHE = 1024  # model names remembered per table
LOOKUP_NAME_MAX = 256  # ... each at most this long
_GLOB = re.compile(r"[*?]")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Timeouts(_Strict):
    """Seconds. `read` is the overall deadline of one request, retries included."""

    connect: float = Field(5.0, gt=0)
    first_byte: float = Field(60.0, gt=0)  # streaming only: a non-streaming answer's headers come at the end
    idle: float = Field(120.0, gt=0)  # longest silence between two chunks of a stream
    read: float = Field(1800.0, gt=0)
    # How long a request waits for a launched replica to start, or for a device to free up.
    load: float = Field(600.0, gt=0)


class Limits(_Strict):
    """A preset's admission limits: places per replica, the queue's length and wait, and the share
    of a replica's places batch-priority requests may hold."""

    max_in_flight: int = Field(64, ge=1)  # per replica; more wait in the queue
    queue: int = Field(32, ge=0)  # per preset; more get 429
    queue_timeout: float = Field(30.0, gt=0)  # a queued request older than this gets 504
    # Batch-priority requests hold at most this share of each replica's places (rounded down, at
    # least 1): the rest stays free for interactive work that arrives while a batch job runs.
    batch_max_share: float = Field(0.75, gt=0, le=1)


class Retries(_Strict):
    """How a preset retries a request that failed before its first byte: attempts in all, and the
    cap on retries in flight (a share of the requests in flight, with a floor)."""

    # Attempts in all, the first included. Three, because with two replicas a request can meet both
    # failures at once: a dead replica and a live one closing a stale keep-alive connection.
    attempts: int = Field(3, ge=1, le=5)
    budget: float = Field(0.2, ge=0, le=1)  # retries in flight <= max(min_concurrent, budget * in flight)
    # Envoy's default is 3; a replica that dies under a team's load must move more than that at once
    # (every request it held that had not started), and a storm of 100 still makes at most 20.
    min_concurrent: int = Field(10, ge=0)


class Prefix(_Strict):
    """What the prefix step does with volatile content (timestamps, ids) in the leading system
    prompt: nothing, report it, move it to the end of the last user message, or remove it."""

    volatile: Volatile = "off"

    @field_validator("volatile", mode="before")
    @classmethod
    def _yaml_off(cls, value: object) -> object:
        # YAML 1.1 reads a bare `off` as false; the user meant "off".
        return "off" if value is False else value


class Health(_Strict):
    """Probe and ejection settings shared by every replica: the probe interval and timeout, the
    streaks that bring a replica up or down, live failures before ejection and the ejection's
    length, and whether replicas' own metrics are scraped."""

    interval: float = Field(5.0, gt=0)
    timeout: float = Field(2.0, gt=0)
    healthy_threshold: int = Field(2, ge=1)
    unhealthy_threshold: int = Field(3, ge=1)
    eject_after: int = Field(3, ge=1)  # consecutive connect failures or 5xx on live traffic
    eject_base: float = Field(30.0, gt=0)
    eject_max: float = Field(300.0, gt=0)
    scrape_metrics: bool = True  # read each replica's own /metrics on the probe cycle and re-export it


class Launch(_Strict):
    """How the gateway starts and stops a replica it owns (fleet/supervisor.py)."""

    cmd: list[str] = Field(min_length=1)  # argv, no shell
    env: dict[str, str] = Field(default_factory=dict)
    stop: list[str] | None = None  # default: SIGTERM to the process group, SIGKILL after `grace`
    grace: float = Field(30.0, gt=0)
    load_timeout: float = Field(900.0, gt=0)  # one start, until /health answers 200
    # vLLM only: make room by `POST /sleep?level=1` (weights to CPU RAM, KV cache freed) and come
    # back by `POST /wake_up`, instead of stop and start; needs `--enable-sleep-mode` and
    # VLLM_SERVER_DEV_MODE=1 on the engine. A failed sleep or wake falls back to stop and start.
    sleep: bool = False


class ReplicaSpec(_Strict):
    """One replica as routes.yaml declares it: a unique name, the server root URL (no path or
    credentials), its engine, the environment variable holding its key, and, for a replica the
    gateway launches, the launch, device use, idle unload and `keep`."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    url: str
    engine: Engine
    api_key_env: str | None = None
    max_in_flight: int | None = Field(None, ge=1)
    launch: Launch | None = None
    uses: dict[str, float] = Field(default_factory=dict)  # GiB per device while it runs
    idle_unload: float = Field(0.0, ge=0)  # seconds after its last answer before it is stopped; 0 never
    keep: bool = False  # never evicted to make room

    @field_validator("url")
    @classmethod
    def _server_root(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:8000")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError("give the server root without a path (the gateway adds /v1/...)")
        if parts.username or parts.password:
            raise ValueError("must not carry credentials; use api_key_env")
        return url.rstrip("/")


class Discover(_Strict):
    """A preset's replicas found in DNS: the name and port to resolve, their engine, how often
    (seconds), the scheme and the environment variable holding their key."""

    dns: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    engine: Engine
    every: float = Field(10.0, gt=0)
    scheme: Literal["http", "https"] = "http"
    api_key_env: str | None = None


def _json_params(params: dict[str, Any] | None) -> dict[str, Any] | None:
    if params is not None:
        try:
            orjson.dumps(params)
        except TypeError as exc:
            raise ValueError(f"must hold JSON values only ({exc})") from None
    return params


class _Inherited(_Strict):
    """Keys that `defaults` sets and any preset may override."""

    thinking: bool | None = None
    # True: the preset's thinking setting replaces the client's (Claude Code always asks to think).
    thinking_override: bool | None = None
    compat: list[Fix] | None = None
    max_tokens: int | None = Field(None, ge=1)
    min_max_tokens: int | None = Field(None, ge=0)
    policy: Policy | None = None
    timeouts: Timeouts | None = None
    limits: Limits | None = None
    retries: Retries | None = None
    prefix: Prefix | None = None
    abort_on_disconnect: bool | None = None
    # Swaps on a shared device (fleet/supervisor.py): a started replica that keeps getting requests
    # stays this long before another preset's request may evict it ...
    min_resident: float | None = Field(None, ge=0)
    # ... unless that request has waited this long; then it drains and makes room.
    max_wait: float | None = Field(None, ge=0)
    params: dict[str, Any] | None = None

    _params_are_json = field_validator("params")(_json_params)


class PresetSpec(_Inherited):
    """One preset as routes.yaml declares it: the inherited settings it overrides, the model its
    replicas serve, its names, capabilities, replicas (listed or discovered) and fallback
    presets."""

    served_model: str = Field(min_length=1)
    # What the preset is good at, in a sentence: the MCP tools' descriptions quote it to orchestrators.
    description: str = Field(default="", max_length=300)
    aliases: list[str] = Field(default_factory=list)
    vision: bool = False
    embeddings: bool = False  # its replicas serve /v1/embeddings (a pooling model, --embeddings)
    rerank: bool = False  # its replicas serve /v1/rerank
    replicas: list[ReplicaSpec] = Field(default_factory=list)
    discover: Discover | None = None
    # Presets that serve a request this one cannot: none ready, failed, loading too long, queue
    # full, prompt too long for its context (pipeline/fallback.py).
    fallback: list[str] = Field(default_factory=list)


class SharedState(_Strict):
    """Where counters live that several gateway processes share (team/state.py)."""

    redis: str | None = Field(None, pattern=r"^(redis|rediss|unix)://")
    prefix: str = Field("fleet-gateway:", min_length=1, max_length=64)


class Routing(_Strict):
    """Which preset takes a request that names no model or task, and which takes images the chosen
    preset cannot read."""

    default: str
    images: str | None = None


class Restarts(_Strict):
    """A launched replica that fails this often within `window` seconds is `failed` until reloaded."""

    max_failures: int = Field(5, ge=1)
    window: float = Field(600.0, gt=0)
    first_delay: float = Field(1.0, ge=0)  # the first restart; each next one waits twice as long
    max_delay: float = Field(300.0, gt=0)


_HOST_PATTERN = re.compile(
    r"^(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
)


class SearchBackend(_Strict):
    """Where `web_search` runs: a SearXNG instance's JSON API (`/search?q=...&format=json`)."""

    url: str
    max_results: int = Field(5, ge=1, le=20)
    timeout: float = Field(10.0, gt=0, le=120)  # seconds for the whole search request
    max_bytes: int = Field(1 << 20, ge=1024, le=16 << 20)  # of the backend's answer

    @field_validator("url")
    @classmethod
    def _search_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                "must be an http:// or https:// URL with a host, e.g. http://searxng:8080/search"
            )
        if parts.username or parts.password or parts.query or parts.fragment:
            raise ValueError("give the search endpoint without credentials, query or fragment")
        return url


class FetchPolicy(_Strict):
    """What `web_fetch` may open. Every URL's host must match `allow` (a name, or `*.example.org`
    for its subdomains), and every address the name resolves to must be public: loopback, private,
    link-local (the metadata services), shared, multicast and reserved ranges are refused unless a
    network in `allow_networks` holds the address."""

    allow: list[str] = Field(min_length=1)
    allow_networks: list[str] = Field(default_factory=list)  # e.g. ["10.1.2.0/24"]; tests: 127.0.0.1/32
    ports: list[int] = Field(default_factory=lambda: [80, 443])
    timeout: float = Field(15.0, gt=0, le=120)  # seconds for one fetch, redirects included
    max_bytes: int = Field(2 << 20, ge=1024, le=32 << 20)  # read of one response body
    max_chars: int = Field(50_000, ge=1000, le=1_000_000)  # of the text given to the model
    max_redirects: int = Field(3, ge=0, le=10)  # each one checked like the first URL
    prior_context_only: bool = True  # a URL must appear in the conversation or a search result first

    @field_validator("allow")
    @classmethod
    def _hosts(cls, hosts: list[str]) -> list[str]:
        for host in hosts:
            if not _HOST_PATTERN.match(host.lower()) and not _is_address(host):
                raise ValueError(
                    f"'{host}' is not a host name, `*.domain` pattern or IP address (no scheme, port or path)"
                )
        return [host.lower() for host in hosts]

    @field_validator("allow_networks")
    @classmethod
    def _networks(cls, networks: list[str]) -> list[str]:
        for network in networks:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError:
                raise ValueError(f"'{network}' is not a network (e.g. 10.0.0.0/8 or 127.0.0.1/32)") from None
        return networks

    @field_validator("ports")
    @classmethod
    def _ports(cls, ports: list[int]) -> list[int]:
        if not ports or any(not 0 < port < 65536 for port in ports):
            raise ValueError("list the ports fetches may use, each 1-65535")
        return ports


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class ServerTools(_Strict):
    """The server tools the gateway runs itself (servertools/): off unless this block is present,
    and each tool only with its own part (`search`, `fetch`)."""

    search: SearchBackend | None = None
    fetch: FetchPolicy | None = None
    max_rounds: int = Field(4, ge=1, le=10)  # model answers per request, the last without server tools

    @model_validator(mode="after")
    def _some_tool(self) -> ServerTools:
        if self.search is None and self.fetch is None:
            raise ValueError("configure `search`, `fetch` or both (or leave `server_tools` out)")
        return self


class RoutesFile(_Strict):
    """The whole routes.yaml as validated (unknown keys refused): defaults, health, devices,
    preloads, restarts, presets, tasks, routing, keys, shared state and server tools. `build_table`
    checks what spans sections."""

    defaults: _Inherited = _Inherited()
    health: Health = Health()
    devices: dict[str, float] = Field(default_factory=dict)  # GiB each device offers to the fleet
    preload: list[str] = Field(default_factory=list)  # presets whose launched replicas start with the gateway
    restarts: Restarts = Restarts()
    presets: dict[str, PresetSpec]
    tasks: dict[str, str] = Field(default_factory=dict)
    routing: Routing
    keys: list[KeySpec] = Field(default_factory=list)
    state: SharedState = SharedState()
    server_tools: ServerTools | None = None


BUILTIN_DEFAULTS: dict[str, Any] = {
    "thinking": False,
    "thinking_override": False,
    "compat": list(ALL_FIXES),
    "max_tokens": 8192,
    "min_max_tokens": 1024,
    "policy": "round_robin",
    "abort_on_disconnect": True,
    "min_resident": 30.0,
    "max_wait": 60.0,
    "params": {},
}


@dataclass(frozen=True)
class Preset:
    """One preset with every setting resolved (its own, else `defaults`, else the built-in
    defaults): what the request path, fleet and balancer read. Immutable."""

    name: str
    served_model: str
    aliases: tuple[str, ...]
    vision: bool
    embeddings: bool
    rerank: bool
    thinking: bool
    thinking_override: bool
    compat: frozenset[str]
    max_tokens: int
    min_max_tokens: int
    policy: Policy
    timeouts: Timeouts
    limits: Limits
    retries: Retries
    prefix: Prefix
    abort_on_disconnect: bool
    min_resident: float
    max_wait: float
    params: Mapping[str, Any]
    replicas: tuple[ReplicaSpec, ...]
    discover: Discover | None
    description: str = ""
    fallback: tuple[str, ...] = ()

    @functools.cached_property
    def engines(self) -> frozenset[str]:
        """The engines its replicas run (a discovered preset's included); computed once."""
        found = {replica.engine for replica in self.replicas}
        if self.discover is not None:
            found.add(self.discover.engine)
        return frozenset(found)


class Route(NamedTuple):
    """The preset a request resolved to, and why (the metric label)."""

    preset: Preset
    reason: RouteReason


@dataclass(frozen=True)
class Table:
    """The validated routing table, immutable: presets, tasks, default and images presets, health,
    devices, keys and shared-state settings, with an index of exact names and alias patterns.
    `lookup` and `resolve` map a request to a preset; a reload builds a new one."""

    presets: Mapping[str, Preset]
    tasks: Mapping[str, str]
    default: str
    images: str | None
    health: Health
    source: str = "<memory>"
    devices: Mapping[str, float] = field(default_factory=dict)
    preload: tuple[str, ...] = ()
    restarts: Restarts = field(default_factory=Restarts)
    keys: tuple[KeySpec, ...] = ()
    state: SharedState = field(default_factory=SharedState)
    server_tools: ServerTools | None = None
    _names: Mapping[str, tuple[str, RouteReason]] = field(default_factory=dict, repr=False)
    _patterns: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # (casefolded glob, preset)
    # Names already looked up: clients send the same few on every request. Bounded: a name is the
    # client's text, so only short ones are kept, and the cache starts over when full.
    _looked_up: dict[str, tuple[str, RouteReason] | None] = field(
        default_factory=dict, repr=False, compare=False
    )

    def lookup(self, model: str) -> tuple[str, RouteReason] | None:
        """Exact names first, then alias patterns in table order; `[1m]`-style suffixes and
        provider prefixes are understood when the name as sent matches nothing."""
        cache = self._looked_up
        if model in cache:
            return cache[model]
        hit = self._lookup(model)
        if len(model) <= LOOKUP_NAME_MAX:
            if len(cache) >= LOOKUP_CACHE:
                cache.clear()
            cache[model] = hit
        return hit

    def _lookup(self, model: str) -> tuple[str, RouteReason] | None:
        for name in self._spellings(model):
            hit = self._names.get(name) or self._names.get(name.casefold())
            if hit is not None:
                return hit
        for name in self._spellings(model):
            folded = name.casefold()
            for pattern, preset in self._patterns:
                if fnmatchcase(folded, pattern):
                    return preset, "pattern"
        return None

    @staticmethod
    def _spellings(model: str) -> list[str]:
        names = [model]
        bare = _MODE_SUFFIX.sub("", model)
        if bare != model:
            names.append(bare)
        for name in list(names):
            for prefix in PROVIDER_PREFIXES:
                if name.casefold().startswith(prefix):
                    names.append(name[len(prefix) :])
        return names

    def pattern_overlaps(self) -> list[str]:
        """Patterns that an earlier pattern already covers for some name: `check` reports them."""
        found = []
        for i, (later, later_preset) in enumerate(self._patterns):
            probe = later.replace("*", "x").replace("?", "x")
            for earlier, earlier_preset in self._patterns[:i]:
                if fnmatchcase(probe, earlier) and earlier_preset != later_preset:
                    found.append(f"'{later}' ({later_preset}) is shadowed by '{earlier}' ({earlier_preset})")
        return found

    def model_names(self) -> list[str]:
        return sorted(self._names_exact())

    def _names_exact(self) -> set[str]:
        return {name for name, (_, reason) in self._names.items() if reason in ("model", "alias")}

    def resolve(self, model: str | None, task: str | None, has_images: bool) -> Route:
        """Model name or alias, else task, else the default; then images may move it to vision."""
        if model is not None and model != "auto":
            hit = self.lookup(model)
            if hit is None:
                raise ModelNotFound(
                    f"The model '{model[:64]}' is not served here. Valid: {', '.join(self.model_names())}",
                    param="model",
                )
            name, reason = hit
            route = Route(self.presets[name], reason)
        elif task is not None:
            target = self.tasks.get(task)
            if target is None:
                raise UnknownTask(
                    f"Unknown task '{task[:64]}'. Valid tasks: {', '.join(sorted(self.tasks)) or 'none'}",
                    param="task",
                )
            route = Route(self.presets[target], "task")
        else:
            route = Route(self.presets[self.default], "default")
        if has_images and not route.preset.vision:
            if self.images is None:
                raise BadRequest(
                    f"The request has image inputs but preset '{route.preset.name}' takes no images "
                    "and no vision preset is configured",
                    code="images_not_supported",
                )
            route = Route(self.presets[self.images], "images")
        return route


class TableError(ValueError):
    """routes.yaml is unusable; the message says where and how to fix it."""


def load_table(path: str | os.PathLike[str]) -> Table:
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise TableError(f"{source}: cannot read the routing table ({exc.strerror})") from None
    return parse_table(text, source)


def parse_table(text: str, source: str = "<memory>") -> Table:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TableError(f"{source}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise TableError(f"{source}: the top level must be a mapping with presets, tasks and routing")
    try:
        spec = RoutesFile.model_validate(raw)
    except ValidationError as exc:
        raise TableError(_explain(source, exc)) from None
    return build_table(spec, source)


def build_table(spec: RoutesFile, source: str = "<memory>") -> Table:
    """Builds the table from a validated routes file: checks what spans sections (targets that are
    presets, unique aliases and replicas, launches against devices), resolves each preset's
    settings, and indexes names, aliases and patterns. Raises `TableError` with every problem
    found."""
    problems = _cross_check(spec)
    if problems:
        raise TableError(f"{source}: " + "; ".join(problems))
    presets = {name: _resolve_preset(name, spec.defaults, each) for name, each in spec.presets.items()}
    names: dict[str, tuple[str, RouteReason]] = {}
    patterns: list[tuple[str, str]] = []
    served: dict[str, list[str]] = {}
    for preset in presets.values():
        names[preset.name] = names[preset.name.casefold()] = (preset.name, "model")
        for alias in preset.aliases:
            if _GLOB.search(alias):
                patterns.append((alias.casefold(), preset.name))
            else:
                names[alias] = names[alias.casefold()] = (preset.name, "alias")
        served.setdefault(preset.served_model, []).append(preset.name)
    # A client may name the model the replicas serve; only when that name is unambiguous.
    for served_name, owners in served.items():
        if len(owners) == 1 and served_name not in names and served_name.casefold() not in names:
            names[served_name] = names[served_name.casefold()] = (owners[0], "alias")
    return Table(
        presets=presets,
        tasks=dict(spec.tasks),
        default=spec.routing.default,
        images=spec.routing.images,
        health=spec.health,
        source=source,
        devices=dict(spec.devices),
        preload=tuple(spec.preload),
        restarts=spec.restarts,
        keys=tuple(spec.keys),
        state=spec.state,
        server_tools=spec.server_tools,
        _names=names,
        _patterns=tuple(patterns),
    )


def _resolve_preset(name: str, defaults: _Inherited, spec: PresetSpec) -> Preset:
    def pick(key: str) -> Any:
        own = getattr(spec, key)
        if own is not None:
            return own
        inherited = getattr(defaults, key)
        return BUILTIN_DEFAULTS[key] if inherited is None else inherited

    def merged(key: str) -> dict[str, Any]:
        # Key by key: a preset that sets `timeouts: {read: 7200}` keeps the default connect timeout.
        out: dict[str, Any] = {}
        for source in (defaults, spec):
            part = getattr(source, key)
            if part is not None:
                out.update(part.model_dump(exclude_unset=True))
        return out

    return Preset(
        name=name,
        served_model=spec.served_model,
        aliases=tuple(spec.aliases),
        vision=spec.vision,
        embeddings=spec.embeddings,
        rerank=spec.rerank,
        thinking=pick("thinking"),
        thinking_override=pick("thinking_override"),
        compat=frozenset(pick("compat")),
        max_tokens=pick("max_tokens"),
        min_max_tokens=pick("min_max_tokens"),
        policy=pick("policy"),
        timeouts=Timeouts.model_validate(merged("timeouts")),
        limits=Limits.model_validate(merged("limits")),
        retries=Retries.model_validate(merged("retries")),
        prefix=Prefix.model_validate(merged("prefix")),
        abort_on_disconnect=pick("abort_on_disconnect"),
        min_resident=pick("min_resident"),
        max_wait=pick("max_wait"),
        params={**(defaults.params or {}), **(spec.params or {})},
        replicas=tuple(spec.replicas),
        discover=spec.discover,
        description=spec.description,
        fallback=tuple(spec.fallback),
    )


def _cross_check(spec: RoutesFile) -> list[str]:
    problems: list[str] = []
    known = set(spec.presets)
    listing = ", ".join(sorted(known))
    if not spec.presets:
        problems.append("presets: define at least one preset")
    for task, target in spec.tasks.items():
        if target not in known:
            problems.append(f"tasks.{task}: '{target}' is not a preset (presets: {listing})")
    if spec.routing.default not in known:
        problems.append(f"routing.default: '{spec.routing.default}' is not a preset (presets: {listing})")
    if spec.routing.images is not None:
        if spec.routing.images not in known:
            problems.append(f"routing.images: '{spec.routing.images}' is not a preset (presets: {listing})")
        elif not spec.presets[spec.routing.images].vision:
            problems.append(f"routing.images: preset '{spec.routing.images}' needs `vision: true`")
    owner: dict[str, str] = {name.casefold(): f"preset '{name}'" for name in spec.presets}
    replica_owner: dict[str, tuple[str, ReplicaSpec]] = {}
    for name, preset in spec.presets.items():
        if not preset.replicas and preset.discover is None:
            problems.append(f"presets.{name}: list `replicas` or set `discover`")
        for alias in preset.aliases:
            key = alias.casefold()
            if key in owner:
                problems.append(f"presets.{name}.aliases: '{alias}' is already used by {owner[key]}")
            else:
                owner[key] = f"an alias of preset '{name}'"
        for index, replica in enumerate(preset.replicas):
            # One server may serve several presets (say, the dense model with and without
            # thinking): the same name and spec is one replica, with one health state and one limit.
            first = replica_owner.get(replica.name)
            if first is not None and first[1] != replica:
                problems.append(
                    f"presets.{name}.replicas[{index}].name: '{replica.name}' is already a different replica "
                    f"of preset '{first[0]}'; give it another name, or the same url, engine and settings"
                )
            replica_owner.setdefault(replica.name, (name, replica))
            problems += _launch_problems(f"presets.{name}.replicas[{index}]", replica, spec.devices)
    for name, preset in spec.presets.items():
        for index, target in enumerate(preset.fallback):
            if target not in known:
                problems.append(
                    f"presets.{name}.fallback[{index}]: '{target}' is not a preset (presets: {listing})"
                )
            elif target == name:
                problems.append(f"presets.{name}.fallback[{index}]: a preset cannot fall back to itself")
    for index, key_spec in enumerate(spec.keys):
        unknown = sorted(set(key_spec.presets or ()) - known)
        if unknown:
            problems.append(f"keys[{index}].presets: {', '.join(unknown)} not a preset (presets: {listing})")
    for index, preset_name in enumerate(spec.preload):
        if preset_name not in known:
            problems.append(f"preload[{index}]: '{preset_name}' is not a preset (presets: {listing})")
    return problems


def _launch_problems(where: str, replica: ReplicaSpec, devices: Mapping[str, float]) -> list[str]:
    problems = []
    if replica.launch is None:
        for key in ("uses", "idle_unload", "keep"):
            if key in replica.model_fields_set:
                problems.append(f"{where}.{key}: only for a replica the gateway launches (add `launch`)")
        return problems
    if replica.launch.sleep and replica.engine != "vllm":
        problems.append(
            f"{where}.launch.sleep: only vLLM has a sleep mode; use stop and start for {replica.engine}"
        )
    host = urlsplit(replica.url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        problems.append(f"{where}.url: a launched replica listens on this machine (127.0.0.1), not {host}")
    for device, gib in replica.uses.items():
        if device not in devices:
            known = ", ".join(sorted(devices)) or "none declared"
            problems.append(f"{where}.uses.{device}: not a device in `devices` ({known})")
        elif gib > devices[device]:
            problems.append(
                f"{where}.uses.{device}: {gib:g} GiB is more than the device offers ({devices[device]:g})"
            )
        elif gib < 0:
            problems.append(f"{where}.uses.{device}: must be 0 or more")
    return problems


def _explain(source: str, exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        path = _dotted(error["loc"])
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            message = "unknown key (check its spelling against the README's routes.yaml reference)"
        elif error["type"] == "literal_error":
            message = f"{message}, got {error.get('input')!r}"
        lines.append(f"{path}: {message}")
    return f"{source}: " + "; ".join(lines)


def _dotted(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part:
            out += f".{part}" if out else str(part)
    return out
