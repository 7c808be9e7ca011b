"""Agent sessions on real llama-server replicas, per balancing policy: `python -m bench.sessions`.

Each session is built from a request Claude Code (Messages) or Codex (Responses) really sent
(tests/fixtures/agents/): its system prompt, tools and first user turn, with a session id of its
own, then a history that grows by a tool call and its output every turn, with a short pause for
the tool between turns. Sessions run at once, staggered, through the gateway in front of two
llama-server replicas with four slots each, started afresh for every scenario with the flags
docs/engines.md §13 asks for (`--slot-prompt-similarity 0`, the default `--cache-ram`,
`--slot-save-path`).

Reported per scenario: the hit ratio (cached / prompt tokens, as the replicas count them) and its
share of the ideal, where the ideal caches every turn's whole previous prompt (a perfect
placement, one slot per session); the tokens prefilled on turns after each session's first and
the share of round robin's excess over the ideal that the policy removed ("gap closed"); the
answer time per turn (8 tokens, so about the time to the first token); and where each session's
turns ran: the replica (the gateway's `x-gateway-replica`) and the slot (the one whose held tokens
match the answer in `GET /slots`).

    python -m bench.sessions                      # 8 and 16 sessions, both dialects, three policies
    python -m bench.sessions --quick              # 8 sessions, 3 turns, smaller prompts
    python -m bench.sessions --swap-only          # the swap round trip alone
    python -m bench.sessions --engine-only --flags="--slot-prompt-similarity 0"
                                                  # one replica, no gateway: how its slots behave

The swap round trip: a launched llama-server replica serves four sessions, another preset on the
same device takes it over (the gateway saves its slots before the stop) and gives it back (they
are restored before it takes a request); reported: each session's first turn after the swap,
cached tokens and time, with and without --slot-save-path on the engine.

Run from the repository root; results also go to --out as JSON lines.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
import statistics
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx2

from bench.support.engines import GGUF_PATH, LlamaServer, ensure_gguf, free_port, llama_server_binary
from bench.support.gateway import Running, run_gateway

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "agents"
POLICIES = ("round_robin", "prefix_affinity", "session")
DIALECTS = ("messages", "responses")
# What a fleet of session-keeping llama-servers runs with (docs/engines.md §13): slots chosen by
# least recent use rather than prompt similarity, so a slot is never taken over without first
# being saved to the host-memory cache (--cache-ram, default 8192 MiB), from which a session that
# lost its slot is restored. HTTP threads beyond the default (slots + 2 on a small host): the
# gateway's own /slots and /health reads must not queue behind its requests, or llama-server closes
# the queued connections unanswered and a session's retry lands on another replica.
ENGINE_FLAGS = ("--slot-prompt-similarity", "0", "--threads-http", "16")
ANSWER_TOKENS = 8
# The gateway opens a waiting stream itself after 1.5 s, with its own message_start, and drops the
# replica's, whose usage holds the cached tokens: the bench waits longer than any prefill first.
KEEPALIVE_AFTER = 600.0


@dataclass(frozen=True)
class Shape:
    """How big the sessions are: how much of the captured prompt is kept, how fast they grow."""

    turns: int = 6
    tools: int = 1  # of the captured tool list (Claude Code sends 24, Codex 9)
    trim: int = 800  # characters kept of each long text (the captured system prompts are 7-9k)
    tool_output: int = 700  # characters of tool output a turn adds (plus its call)
    gap: tuple[float, float] = (0.2, 1.2)  # seconds the "tool" runs between two turns


@dataclass
class Script:
    """One session: its headers and the body of each turn."""

    dialect: str
    index: int
    headers: dict[str, str]
    bodies: list[dict[str, Any]]


def _fixture(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return loaded


def _trim_text(value: Any, limit: int) -> Any:
    if isinstance(value, str):
        return value[:limit]
    if isinstance(value, list):
        return [_trim_text(item, limit) for item in value]
    if isinstance(value, dict):
        return {k: (_trim_text(v, limit) if k in ("text", "content") else v) for k, v in value.items()}
    return value


def _noise(rng: random.Random, size: int) -> str:
    words = ("ok", "PASS", "FAIL", "test_", "src/", "def", "return", "assert", "line", "\n", "error:", "=")
    return " ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(size // 6))[:size]


def _task(index: int) -> str:
    # Of a different length per session, so that GET /slots tells the sessions' slots apart.
    return f"Task {index}: fix the failing test in module_{index}." + " Be brief." * (4 * index)


def claude_script(index: int, shape: Shape, seed: int = 0) -> Script:
    """A Claude Code session: its captured first request, then Bash tool rounds."""
    captured = _fixture("claude-code-messages.json")
    rng = random.Random(seed * 7919 + index)
    session = str(uuid.UUID(int=rng.getrandbits(128), version=4))
    body = copy.deepcopy(captured["body"])
    body["tools"] = body["tools"][: shape.tools]
    body["system"] = _trim_text(body["system"], shape.trim)
    meta = json.loads(body["metadata"]["user_id"])
    meta["session_id"] = session
    body["metadata"]["user_id"] = json.dumps(meta)
    messages = _trim_text(body["messages"], shape.trim)
    messages[0]["content"][-1] = {"type": "text", "text": _task(index)}
    body.update(max_tokens=ANSWER_TOKENS, stream=True, temperature=0)
    headers = {
        k.lower(): v
        for k, v in captured["headers"].items()
        if k.lower() in ("anthropic-version", "anthropic-beta", "user-agent", "x-app")
    }
    headers["x-claude-code-session-id"] = session
    bodies = []
    for turn in range(shape.turns):
        bodies.append({**body, "messages": copy.deepcopy(messages)})
        call = f"toolu_{index:04d}{turn:04d}{rng.getrandbits(48):012x}"
        command = {"command": f"pytest -q tests/test_module_{index}.py -k case_{turn}"}
        messages.append(
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": call, "name": "Bash", "input": command}],
            }
        )
        output = _noise(rng, shape.tool_output)
        messages.append(
            {
                "role": "user",
                "content": [
                    {"tool_use_id": call, "type": "tool_result", "content": output, "is_error": False}
                ],
            }
        )
    return Script("messages", index, headers, bodies)


def codex_script(index: int, shape: Shape, seed: int = 0) -> Script:
    """A Codex session (custom model name: plain `tools`): its captured first request, then
    exec_command rounds."""
    captured = _fixture("codex-responses.json")
    rng = random.Random(seed * 7919 + index + 100_000)
    session = str(uuid.UUID(int=rng.getrandbits(128), version=4))
    body = copy.deepcopy(captured["body"])
    body["tools"] = body["tools"][: shape.tools]
    items = _trim_text(body["input"], shape.trim)
    for item in items:
        if "id" in item:
            item["id"] = f"msg_{uuid.UUID(int=rng.getrandbits(128))}"
    items[-1]["content"] = [{"type": "input_text", "text": _task(index)}]
    body.update(max_output_tokens=ANSWER_TOKENS, stream=True, temperature=0, prompt_cache_key=session)
    body.pop("client_metadata", None)
    headers = {"session-id": session, "thread-id": session, "originator": "codex_exec"}
    bodies = []
    for turn in range(shape.turns):
        bodies.append({**body, "input": copy.deepcopy(items)})
        call = f"call_{index:04d}{turn:04d}{rng.getrandbits(48):012x}"
        arguments = json.dumps({"cmd": f"pytest -q tests/test_module_{index}.py -k case_{turn}"})
        items.append(
            {"type": "function_call", "name": "exec_command", "arguments": arguments, "call_id": call}
        )
        items.append(
            {"type": "function_call_output", "call_id": call, "output": _noise(rng, shape.tool_output)}
        )
    return Script("responses", index, headers, bodies)


def scripts(dialect: str, sessions: int, shape: Shape, seed: int = 0) -> list[Script]:
    make = claude_script if dialect == "messages" else codex_script
    return [make(i, shape, seed) for i in range(sessions)]


# --- one run ---------------------------------------------------------------------------------------


@dataclass
class Turn:
    session: int
    turn: int
    prompt: int
    cached: int
    completion: int
    seconds: float  # to the first token (the first delta of the stream)
    replica: str
    slot: int | None


@dataclass
class Streamed:
    status: int
    prompt: int = 0
    cached: int = 0
    completion: int = 0
    first_token: float | None = None
    replica: str = "?"


async def post_stream(
    http: httpx2.AsyncClient, url: str, dialect: str, body: dict[str, Any], headers: dict[str, str]
) -> Streamed:
    """One streamed turn, as the agents send them: its usage from the events that carry it
    (Messages: message_start and message_delta; Responses: response.completed), and the time to its
    first delta."""
    began = time.perf_counter()
    async with http.stream("POST", url, json=body, headers=headers) as response:
        out = Streamed(response.status_code, replica=response.headers.get("x-gateway-replica", "?"))
        usage: dict[str, Any] = {}  # a Messages answer's usage, as its events report it
        if response.status_code != 200:
            await response.aread()
            return out
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            try:
                event = json.loads(line[5:])
            except ValueError:
                continue
            kind = str(event.get("type", ""))
            if out.first_token is None and kind.endswith("delta"):
                out.first_token = time.perf_counter() - began
            if kind == "message_start":
                usage = dict((event.get("message") or {}).get("usage") or {})
                out.prompt, out.cached, _ = _usage("messages", {"usage": usage})
            elif kind == "message_delta":
                # Each figure the delta carries replaces the start's, as the Anthropic SDK reads
                # them: a stream the gateway opened while its replica started began with a
                # message_start of its own, and the prompt's cache figures come here instead.
                usage |= {k: v for k, v in (event.get("usage") or {}).items() if v is not None}
                out.prompt, out.cached, out.completion = _usage("messages", {"usage": usage})
            elif kind == "response.completed":
                out.prompt, out.cached, out.completion = _usage("responses", event.get("response") or {})
        if out.first_token is None:
            out.first_token = time.perf_counter() - began
    return out


def _usage(dialect: str, payload: dict[str, Any]) -> tuple[int, int, int]:
    usage = payload.get("usage") or {}
    if dialect == "messages":
        cached = int(usage.get("cache_read_input_tokens") or 0)
        return int(usage.get("input_tokens") or 0) + cached, cached, int(usage.get("output_tokens") or 0)
    details = usage.get("input_tokens_details") or {}
    return (
        int(usage.get("input_tokens") or 0),
        int(details.get("cached_tokens") or 0),
        int(usage.get("output_tokens") or 0),
    )


async def _slot_of(http: httpx2.AsyncClient, url: str | None, held: int) -> int | None:
    """The slot of the replica at `url` whose held tokens match an answer (prompt + answer - 1)."""
    if url is None:
        return None
    try:
        slots = (await http.get(url + "/slots")).json()
    except (httpx2.HTTPError, ValueError):
        return None
    found = [
        int(slot["id"])
        for slot in slots
        if not slot.get("is_processing")
        and isinstance(slot.get("n_prompt_tokens"), int)
        and abs(slot["n_prompt_tokens"] - held) <= 1
    ]
    return found[0] if len(found) == 1 else None


async def run_session(
    http: httpx2.AsyncClient,
    gateway: str,
    replicas: dict[str, str],
    script: Script,
    shape: Shape,
    out: list[Turn],
    errors: Counter[str],
    start_after: float,
) -> None:
    rng = random.Random(script.index)
    await asyncio.sleep(start_after)
    path = "/v1/messages" if script.dialect == "messages" else "/v1/responses"
    for turn, body in enumerate(script.bodies):
        try:
            got = await post_stream(http, gateway + path, script.dialect, body, script.headers)
        except httpx2.HTTPError as exc:
            errors[type(exc).__name__] += 1
            continue
        if got.status != 200 or not got.prompt:
            errors[f"http_{got.status}" if got.status != 200 else "no_usage"] += 1
            continue
        slot = await _slot_of(http, replicas.get(got.replica), got.prompt + got.completion - 1)
        seconds = got.first_token or 0.0
        out.append(
            Turn(script.index, turn, got.prompt, got.cached, got.completion, seconds, got.replica, slot)
        )
        await asyncio.sleep(rng.uniform(*shape.gap))


def summarise(turns: list[Turn], sessions: int) -> dict[str, Any]:
    by_session: dict[int, list[Turn]] = defaultdict(list)
    for t in sorted(turns, key=lambda t: (t.session, t.turn)):
        by_session[t.session].append(t)
    prompt = cached = ideal = 0
    later_prompt = later_cached = later_ideal = 0
    for history in by_session.values():
        previous: Turn | None = None
        for t in history:
            # A perfect placement caches the whole previous prompt of the session (its slot holds it).
            best = 0 if previous is None else min(previous.prompt, t.prompt)
            prompt, cached, ideal = prompt + t.prompt, cached + t.cached, ideal + best
            if previous is not None:
                later_prompt, later_cached, later_ideal = (
                    later_prompt + t.prompt,
                    later_cached + t.cached,
                    later_ideal + best,
                )
            previous = t
    per_turn: dict[int, list[float]] = defaultdict(list)
    for t in turns:
        per_turn[t.turn].append(t.seconds)
    places = {s: {(t.replica, t.slot) for t in h} for s, h in by_session.items()}
    replicas_of = {s: {t.replica for t in h} for s, h in by_session.items()}
    first_replica = Counter(h[0].replica for h in by_session.values() if h)
    return {
        "requests": len(turns),
        "hit_ratio": round(cached / prompt, 4) if prompt else 0.0,
        "ideal_hit_ratio": round(ideal / prompt, 4) if prompt else 0.0,
        "of_ideal": round(cached / ideal, 4) if ideal else None,
        "prefilled": prompt - cached,
        "later_prefilled": later_prompt - later_cached,
        "later_ideal_prefilled": later_prompt - later_ideal,
        "later_of_ideal": round(later_cached / later_ideal, 4) if later_ideal else None,
        "seconds_p50_by_turn": {n: round(statistics.median(v), 3) for n, v in sorted(per_turn.items())},
        "sessions_on_one_replica": sum(len(r) == 1 for r in replicas_of.values()),
        "sessions_on_one_slot": sum(len(p) == 1 and None not in {s for _, s in p} for p in places.values()),
        "sessions_by_first_replica": dict(sorted(first_replica.items())),
        "sessions": sessions,
    }


def routes(policy: str, replicas: list[LlamaServer]) -> str:
    members = ", ".join(f'{{name: r{i}, url: "{r.url}", engine: llamacpp}}' for i, r in enumerate(replicas))
    return f"""
health: {{interval: 1, timeout: 10, unhealthy_threshold: 5}}  # a busy 2-core host answers /health late
defaults: {{min_max_tokens: 0, thinking: false, timeouts: {{read: 900, first_byte: 600, idle: 600}}}}
presets:
  agents:
    served_model: tiny
    aliases: ["*"]
    policy: {policy}
    replicas: [{members}]
routing: {{default: agents}}
"""


@contextmanager
def fleet(
    count: int, slots: int, ctx_per_slot: int, save_dir: Path, flags: tuple[str, ...]
) -> Iterator[list[LlamaServer]]:
    with ExitStack() as stack:
        servers = []
        for i in range(count):
            extra = (*flags, "--slot-save-path", str(save_dir))
            server = LlamaServer(
                GGUF_PATH, slots=slots, ctx=ctx_per_slot * slots, extra_args=extra, name=f"sessions{i}"
            )
            servers.append(stack.enter_context(server))
        yield servers


async def drive(
    gw: Running, servers: list[LlamaServer], plan: list[Script], shape: Shape
) -> tuple[list[Turn], Counter[str]]:
    replicas = {f"r{i}": s.url for i, s in enumerate(servers)}
    turns: list[Turn] = []
    errors: Counter[str] = Counter()
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=2.0)
    async with httpx2.AsyncClient(timeout=900, limits=limits, trust_env=False) as http:
        await asyncio.gather(
            *(run_session(http, gw.url, replicas, s, shape, turns, errors, 0.4 * s.index) for s in plan)
        )
    return turns, errors


def run_scenario(
    policy: str,
    dialect: str,
    sessions: int,
    shape: Shape,
    *,
    replicas: int = 2,
    slots: int = 4,
    ctx_per_slot: int = 32768,
    flags: tuple[str, ...] = ENGINE_FLAGS,
) -> dict[str, Any]:
    ensure_gguf()
    plan = scripts(dialect, sessions, shape)
    began = time.perf_counter()
    with (
        tempfile.TemporaryDirectory() as save_dir,
        fleet(replicas, slots, ctx_per_slot, Path(save_dir), flags) as servers,
        run_gateway(routes(policy, servers), keepalive_after=KEEPALIVE_AFTER) as gw,
    ):
        turns, errors = asyncio.run(drive(gw, servers, plan, shape))
        entries = gw.log_entries()
    result = summarise(turns, sessions)
    result["picks"] = dict(sorted(Counter(str(e.get("pick")) for e in entries).items()))
    result["retried"] = sum(bool(e.get("retries")) for e in entries)
    result.update(
        policy=policy,
        dialect=dialect,
        errors=sum(errors.values()),
        error_kinds=dict(errors),
        wall_s=round(time.perf_counter() - began, 1),
        shape=asdict(shape),
        flags=" ".join(flags),
    )
    return result


def gap_closed(policy: dict[str, Any], round_robin: dict[str, Any]) -> float | None:
    """Of the prefill round robin spends above a perfect placement on later turns, the share saved."""
    excess = int(round_robin["later_prefilled"]) - int(round_robin["later_ideal_prefilled"])
    if excess <= 0:
        return None
    return round((int(round_robin["later_prefilled"]) - int(policy["later_prefilled"])) / excess, 3)


# --- one replica alone --------------------------------------------------------------------------


def engine_only(
    dialect: str,
    sessions: int,
    shape: Shape,
    flags: tuple[str, ...],
    slots: int = 4,
    ctx_per_slot: int = 32768,
) -> dict[str, Any]:
    """The sessions' turns straight to one replica, one request at a time, each turn's sessions in
    a shuffled order, each body as the gateway would send it (its rewrites applied): what the
    engine's own slot choice and host-memory cache keep, with these flags."""
    from gateway.pipeline.rewrite import rewrite
    from gateway.routing.table import parse_table

    ensure_gguf()
    preset = parse_table(
        "presets: {m: {served_model: tiny, min_max_tokens: 0, replicas: "
        '[{name: r0, url: "http://127.0.0.1:1", engine: llamacpp}]}}\nrouting: {default: m}'
    ).presets["m"]
    plan = scripts(dialect, sessions, shape)
    path = "/v1/messages" if dialect == "messages" else "/v1/responses"
    turns: list[Turn] = []
    with (
        tempfile.TemporaryDirectory() as save_dir,
        fleet(1, slots, ctx_per_slot, Path(save_dir), flags) as servers,
    ):
        url = servers[0].url

        async def run() -> None:
            async with httpx2.AsyncClient(timeout=900, trust_env=False) as http:
                for turn in range(shape.turns):
                    order = list(plan)
                    random.Random(turn).shuffle(order)
                    for script in order:
                        body = rewrite(script.bodies[turn], preset, dialect, want_usage=True).body
                        got = await post_stream(http, url + path, dialect, body, script.headers)
                        if got.status != 200:
                            raise RuntimeError(f"the replica answered {got.status}")
                        slot = await _slot_of(http, url, got.prompt + got.completion - 1)
                        seconds = got.first_token or 0.0
                        turns.append(
                            Turn(
                                script.index,
                                turn,
                                got.prompt,
                                got.cached,
                                got.completion,
                                seconds,
                                "r0",
                                slot,
                            )
                        )

        asyncio.run(run())
    result = summarise(turns, sessions)
    result.update(engine_only=True, flags=" ".join(flags), dialect=dialect, slots=slots, shape=asdict(shape))
    return result


# --- the swap round trip ---------------------------------------------------------------------------


def _launch(name: str, port: int, slots: int, ctx_per_slot: int, save_dir: Path | None) -> str:
    binary = llama_server_binary()
    argv = [
        str(binary),
        "-m",
        str(GGUF_PATH),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-c",
        str(ctx_per_slot * slots),
        "-np",
        str(slots),
        "--metrics",
        "-t",
        "1",
        *ENGINE_FLAGS,
    ]
    if save_dir is not None:
        argv += ["--slot-save-path", str(save_dir)]
    cmd = ", ".join(json.dumps(a) for a in argv)
    env = json.dumps({"LD_LIBRARY_PATH": str(binary.parent)})
    return (
        f'{{name: {name}, url: "http://127.0.0.1:{port}", engine: llamacpp, uses: {{gpu0: 1}}, '
        f"launch: {{cmd: [{cmd}], env: {env}, grace: 10, load_timeout: 60}}}}"
    )


def swap_routes(save_dir: Path | None, slots: int = 4, ctx_per_slot: int = 32768) -> str:
    agents = _launch("agents0", free_port(), slots, ctx_per_slot, save_dir)
    other = _launch("other0", free_port(), 1, 4096, None)
    return f"""
devices: {{gpu0: 1}}
health: {{interval: 1, timeout: 10, unhealthy_threshold: 5}}  # a busy 2-core host answers /health late
defaults:
  min_max_tokens: 0
  thinking: false
  min_resident: 0
  timeouts: {{load: 120, read: 900, first_byte: 600, idle: 600}}
presets:
  agents: {{served_model: tiny, aliases: ["*"], policy: session, replicas: [{agents}]}}
  other: {{served_model: tiny, replicas: [{other}]}}
routing: {{default: agents}}
"""


async def swap_round_trip(gw: Running, plan: list[Script], shape: Shape, before: int) -> dict[str, Any]:
    """`before` turns of each session, the other preset takes the device and gives it back, then
    each session's next turn."""
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=2.0)
    async with httpx2.AsyncClient(timeout=900, limits=limits, trust_env=False) as http:

        async def turn(script: Script, index: int) -> Turn:
            path = "/v1/messages" if script.dialect == "messages" else "/v1/responses"
            got = await post_stream(http, gw.url + path, script.dialect, script.bodies[index], script.headers)
            if got.status != 200:
                raise RuntimeError(f"the gateway answered {got.status}")
            seconds = got.first_token or 0.0
            return Turn(
                script.index, index, got.prompt, got.cached, got.completion, seconds, got.replica, None
            )

        held: dict[int, int] = {}
        for index in range(before):
            for script in plan:
                last = await turn(script, index)
                held[script.index] = last.prompt
        await asyncio.sleep(2.5)  # idle past the supervisor's IDLE_AFTER: evictable
        other = {"model": "other", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        began = time.perf_counter()
        (await http.post(gw.url + "/v1/chat/completions", json=other)).raise_for_status()
        away = time.perf_counter() - began
        await asyncio.sleep(2.5)
        after = [await turn(script, before) for script in plan]
    cached = sum(t.cached for t in after)
    previous = sum(held.values())
    return {
        "sessions": len(plan),
        "tokens_before": previous,
        "cached_after": cached,
        "share_cached": round(cached / previous, 4) if previous else None,
        "first_turn_seconds": [round(t.seconds, 3) for t in after],
        "swap_away_seconds": round(away, 2),
    }


def run_swap(
    dialect: str, shape: Shape, sessions: int = 4, keep: bool = True, before: int = 2
) -> dict[str, Any]:
    ensure_gguf()
    plan = scripts(dialect, sessions, shape, seed=1)
    with tempfile.TemporaryDirectory() as state, tempfile.TemporaryDirectory() as save_dir:
        table = swap_routes(Path(save_dir) if keep else None)
        with run_gateway(table, state_dir=Path(state), keepalive_after=KEEPALIVE_AFTER) as gw:
            result = asyncio.run(swap_round_trip(gw, plan, shape, before))
            replica = gw.gateway.fleet.pools["agents"].replicas[0]
            stats = replica.cache.stats
            result.update(
                saves=stats.saves,
                restores=stats.restores,
                restore_failures=stats.restore_failures,
                save_ms=round(1000 * stats.save_seconds / stats.saves, 2) if stats.saves else None,
                restore_ms=round(1000 * stats.restore_seconds / stats.restores, 2)
                if stats.restores
                else None,
            )
    result.update(dialect=dialect, slot_save=keep)
    return result


# --- the command -----------------------------------------------------------------------------------


def table_lines(results: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| dialect | sessions | policy | hit ratio | of ideal | later turns: prefilled | gap closed "
        "| one replica | one slot | split | s/turn p50 (t0, t1, last) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rr = {(r["dialect"], r["sessions"]): r for r in results if r["policy"] == "round_robin"}
    for r in results:
        base = rr.get((r["dialect"], r["sessions"]))
        closed = gap_closed(r, base) if base is not None else None
        times = list(r["seconds_p50_by_turn"].values())
        shown = ", ".join(f"{v:.2f}" for v in (times[0], times[1], times[-1])) if len(times) > 1 else "-"
        lines.append(
            f"| {r['dialect']} | {r['sessions']} | {r['policy']} "
            f"| {r['hit_ratio']:.3f} (ideal {r['ideal_hit_ratio']:.3f}) "
            f"| {r['of_ideal']} | {r['later_prefilled']} (ideal {r['later_ideal_prefilled']}) | {closed} "
            f"| {r['sessions_on_one_replica']}/{r['sessions']} | {r['sessions_on_one_slot']}/{r['sessions']} "
            f"| {r['sessions_by_first_replica']} | {shown} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", default="8,16", help="session counts, comma-separated")
    parser.add_argument("--dialects", default=",".join(DIALECTS))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="8 sessions, 3 turns, smaller prompts")
    parser.add_argument("--swap-only", action="store_true")
    parser.add_argument("--no-swap", action="store_true")
    parser.add_argument("--engine-only", action="store_true", help="one replica, no gateway")
    parser.add_argument("--flags", default=" ".join(ENGINE_FLAGS), help="the llama-server replicas' flags")
    parser.add_argument("--out", type=Path, default=Path("test-artifacts/bench-sessions.jsonl"))
    args = parser.parse_args()
    shape = Shape(turns=args.turns)
    counts = [int(n) for n in args.sessions.split(",")]
    if args.quick:
        shape, counts = Shape(turns=3, tools=1, trim=500, tool_output=400), [8]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.engine_only:
        for dialect in args.dialects.split(","):
            for count in counts:
                result = engine_only(dialect, count, shape, tuple(args.flags.split()))
                print(json.dumps(result), flush=True)
                with args.out.open("a") as out:
                    out.write(json.dumps({"bench": "sessions_engine", **result}) + "\n")
        return
    results: list[dict[str, Any]] = []
    if not args.swap_only:
        for dialect in args.dialects.split(","):
            for count in counts:
                for policy in args.policies.split(","):
                    result = run_scenario(policy, dialect, count, shape, flags=tuple(args.flags.split()))
                    results.append(result)
                    print(json.dumps(result), flush=True)
                    with args.out.open("a") as out:
                        out.write(json.dumps({"bench": "sessions", **result}) + "\n")
        print("\n".join(table_lines(results)))
    if not args.no_swap:
        for dialect in args.dialects.split(","):
            for keep in (True, False):
                swap = run_swap(dialect, shape, keep=keep)
                print(json.dumps(swap), flush=True)
                with args.out.open("a") as out:
                    out.write(json.dumps({"bench": "sessions_swap", **swap}) + "\n")


if __name__ == "__main__":
    main()
