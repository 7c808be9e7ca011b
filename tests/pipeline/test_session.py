"""gateway/pipeline/session.py: which agent session a request belongs to; and the request path's
use of it (pipeline/attempts.py): the slot a session is pinned to on llama-server, and the picture
corrected from the answer, against a scripted UpstreamClient (no sockets)."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.dialects.registry import BY_NAME
from gateway.fleet.replicas import Fleet, Pool
from gateway.ops.exchange import Exchange
from gateway.pipeline.attempts import Attempt, Dispatcher, RetryBudget
from gateway.pipeline.session import Session, session_of, stable_prefix
from gateway.routing.table import parse_table
from gateway.upstream import Timeouts

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agents"


def captured(name: str) -> tuple[dict[str, str], dict[str, Any]]:
    data = json.loads((FIXTURES / name).read_text())
    return {k.lower(): v for k, v in data["headers"].items()}, data["body"]


# --- who the session is ---------------------------------------------------------------------------


def test_claude_code_names_its_session_in_a_header_and_the_key_is_a_digest() -> None:
    headers, body = captured("claude-code-messages.json")
    session = session_of(body, headers)
    assert session is not None and session.source == "claude"
    assert session.key == session.group and len(session.key) == 16
    assert headers["x-claude-code-session-id"] not in session.key


def test_two_captured_claude_code_sessions_are_two_sessions_and_a_tool_round_stays_in_its_session() -> None:
    first = session_of(*reversed(captured("claude-code-messages.json")))
    second = session_of(*reversed(captured("claude-code-messages-session2.json")))
    assert first is not None and second is not None and first.key != second.key
    headers, body = captured("claude-code-messages.json")
    later = copy.deepcopy(body)
    later["messages"].append({"role": "assistant", "content": [{"type": "text", "text": "ok"}]})
    assert session_of(later, headers) == first


def test_claude_code_without_the_header_is_named_by_its_metadata_user_id() -> None:
    headers, body = captured("claude-code-messages.json")
    named = session_of(body, headers)
    headers.pop("x-claude-code-session-id")
    assert session_of(body, headers) == named


def test_a_claude_code_sub_agent_is_a_session_of_its_own_grouped_with_its_parent() -> None:
    headers, body = captured("claude-code-messages.json")
    parent = session_of(body, headers)
    child = session_of(
        body, {**headers, "x-claude-code-agent-id": "a1b2", "x-claude-code-parent-agent-id": "root"}
    )
    sibling = session_of(body, {**headers, "x-claude-code-agent-id": "c3d4"})
    assert parent is not None and child is not None and sibling is not None
    assert child.key not in (parent.key, sibling.key)
    assert child.group == sibling.group == parent.group
    assert child.source == "claude_agent"


def test_a_claude_code_auxiliary_request_is_transient_and_a_compaction_is_not() -> None:
    headers, body = captured("claude-code-messages.json")
    auxiliary = session_of(body, {**headers, "x-claude-code-request-class": "auxiliary"})
    compaction = session_of(body, {**headers, "x-claude-code-request-class": "compaction"})
    assert auxiliary is not None and auxiliary.transient
    assert compaction is not None and not compaction.transient


def test_codex_names_its_session_and_a_thread_of_its_own_is_grouped_with_it() -> None:
    headers, body = captured("codex-responses.json")
    session = session_of(body, headers)
    assert session is not None and session.source == "codex"
    thread = session_of(body, {**headers, "thread-id": "another-thread"})
    assert thread is not None and thread.key != session.key and thread.group == session.group
    after = session_of(*reversed(captured("codex-responses-tool-output.json")))
    assert after is not None and after.key != session.key  # another captured session


def test_other_agents_headers_and_prompt_cache_key_name_a_session() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    opencode = session_of(body, {"x-session-affinity": "s1"})
    generic = session_of(body, {"x-session-id": "s1"})
    cache_key = session_of({**body, "prompt_cache_key": "s1"}, {})
    assert opencode is not None and opencode.source == "header"
    assert generic == opencode
    assert cache_key is not None and cache_key.source == "prompt_cache_key" and cache_key.key != opencode.key


def test_an_unnamed_conversation_is_keyed_by_its_stable_prefix_which_later_turns_keep() -> None:
    first: dict[str, Any] = {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "fix test_a"},
        ],
        "tools": [{"type": "function", "function": {"name": "run"}}],
    }
    later = copy.deepcopy(first)
    later["messages"] += [{"role": "assistant", "content": "done"}, {"role": "user", "content": "and b"}]
    other = copy.deepcopy(first)
    other["messages"][1]["content"] = "fix test_b"
    fewer_tools = {**first, "tools": []}
    key = session_of(first, {})
    assert key is not None and key.source == "prefix"
    assert session_of(later, {}) == key
    assert session_of(other, {}) != key
    assert session_of(fewer_tools, {}) != key


def test_a_responses_prefix_reads_instructions_and_input() -> None:
    body = {"instructions": "be brief", "input": [{"role": "user", "content": "hi"}]}
    assert stable_prefix(body) is not None
    assert stable_prefix({**body, "instructions": "be verbose"}) != stable_prefix(body)


def test_a_body_without_a_conversation_has_no_session() -> None:
    assert session_of({"prompt": "once upon a time"}, {}) is None
    assert session_of({"input": "a string input"}, {}) is None
    assert session_of({"messages": [{"role": "system", "content": "only a system prompt"}]}, {}) is None


def test_an_oversized_or_malformed_metadata_user_id_names_nothing() -> None:
    messages = [{"role": "user", "content": "hi"}]
    for user_id in ("{not json", "{" + " " * 5000 + "}", '{"session_id": 5}', "plain-user"):
        found = session_of({"messages": messages, "metadata": {"user_id": user_id}}, {})
        assert found is not None and found.source == "prefix"


# --- the request path's use of it ----------------------------------------------------------------


@dataclass
class Answer:
    status: int = 200
    body: bytes = b'{"usage": {}}'
    headers: Mapping[str, str] = field(default_factory=dict)

    async def read(self, limit: int | None = None) -> bytes:
        return self.body

    async def chunks(self) -> AsyncIterator[bytes]:
        yield self.body

    async def close(self) -> None:
        pass


@dataclass
class Engine:
    """Answers every request; serves GET /slots from `slots`."""

    slots: list[dict[str, Any]] = field(default_factory=list)
    sent: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    slot_reads: int = 0

    async def send(
        self, url: str, headers: list[tuple[str, str]], body: bytes, timeouts: Timeouts, method: str = "POST"
    ) -> Answer:
        self.sent.append((url, orjson.loads(body)))
        return Answer()

    async def get(self, url: str, headers: list[tuple[str, str]], timeout: float) -> tuple[int, bytes]:
        assert url.endswith("/slots")
        self.slot_reads += 1
        return 200, orjson.dumps(self.slots)

    async def aclose(self) -> None:
        pass


def session_pool(engine: str = "llamacpp") -> Pool:
    table = f"""
presets:
  m:
    served_model: m
    policy: session
    replicas: [{{name: r0, url: "http://127.0.0.1:9100", engine: {engine}}}]
routing: {{default: m}}
"""
    pool = Fleet(parse_table(table), clock=lambda: 0.0).pools["m"]
    pool.replicas[0].cache.resize(2)
    return pool


def request(pool: Pool, endpoint: str, session: Session) -> Attempt:
    ex = Exchange(request_id="req-1", endpoint=endpoint, started=0.0)
    body = {"model": "m", "input": [{"role": "user", "content": "hi"}]}
    return Attempt(ex, pool, BY_NAME[endpoint], body, 64, 100.0, session=session)


async def send(client: Engine, attempt: Attempt, prompt: int = 100, cached: int = 0) -> None:
    dispatcher = Dispatcher(client, RetryBudget(), 1 << 20, clock=lambda: 0.0)
    _, replica = await dispatcher.open(attempt)
    attempt.ex.answer.prompt_tokens, attempt.ex.answer.cached_tokens = prompt, cached
    attempt.ex.answer.completion_tokens = 8
    attempt.release(replica)


@pytest.mark.anyio
async def test_a_responses_session_is_pinned_to_a_free_slot_and_comes_back_to_it() -> None:
    pool, engine = session_pool(), Engine()
    alice, bob = Session("a" * 16, "a" * 16, "codex"), Session("b" * 16, "b" * 16, "codex")
    await send(engine, request(pool, "responses", alice))
    await send(engine, request(pool, "responses", bob))
    await send(engine, request(pool, "responses", alice), prompt=150, cached=100)
    assert [body.get("id_slot") for _, body in engine.sent] == [0, 1, 0]
    assert pool.replicas[0].cache.held(alice.key) is not None
    assert pool.replicas[0].cache.stats.plans == {"free": 2, "held": 1}


@pytest.mark.anyio
async def test_a_streamed_messages_session_goes_as_chat_pinned_to_its_slot() -> None:
    pool, engine = session_pool(), Engine()
    alice, bob = Session("a" * 16, "a" * 16, "claude"), Session("b" * 16, "b" * 16, "claude")
    for session in (alice, bob, alice):
        attempt = request(pool, "messages", session)
        attempt.body = {"model": "m", "system": "be brief", "messages": [{"role": "user", "content": "hi"}]}
        attempt.as_stream = frozenset({"llamacpp"})  # a whole answer asked for as a stream
        await send(engine, attempt)
        assert attempt.ex.upstream_as_chat
    # llama-server's /v1/messages drops id_slot; its chat endpoint honours it (messages_chat.py).
    assert [url for url, _ in engine.sent] == ["http://127.0.0.1:9100/v1/chat/completions"] * 3
    assert [body["id_slot"] for _, body in engine.sent] == [0, 1, 0]
    assert engine.sent[0][1]["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert engine.sent[0][1]["stream"] is True and engine.slot_reads == 0


@pytest.mark.anyio
async def test_a_messages_session_asked_whole_is_not_pinned_and_slots_are_read_before_the_next_placement() -> (
    None
):
    # A whole answer the gateway reads before answering (its server-tool rounds) goes to the
    # engine's own Messages endpoint, which drops id_slot: the engine places it.
    pool, engine = session_pool(), Engine()
    alice = Session("a" * 16, "a" * 16, "claude")
    await send(engine, request(pool, "messages", alice), prompt=100)
    assert "id_slot" not in engine.sent[0][1]
    assert pool.replicas[0].cache.stale and engine.slot_reads == 0
    # The engine put it in slot 1: it holds the prompt and the answer less one token.
    engine.slots = [{"id": 0}, {"id": 1, "id_task": 7, "n_prompt_tokens": 107, "is_processing": False}]
    await send(engine, request(pool, "messages", alice), prompt=120, cached=107)
    assert engine.slot_reads == 1
    assert pool.replicas[0].cache.held(alice.key) is not None
    assert pool.replicas[0].cache.holders == [None, alice.key]


@pytest.mark.anyio
async def test_a_session_on_vllm_is_placed_and_remembered_but_never_pinned() -> None:
    pool, engine = session_pool("vllm"), Engine()
    alice = Session("a" * 16, "a" * 16, "codex")
    await send(engine, request(pool, "responses", alice))
    assert "id_slot" not in engine.sent[0][1]
    assert pool.replicas[0].cache.held(alice.key) is not None


@pytest.mark.anyio
@pytest.mark.parametrize("policy", ["round_robin", "prefix_affinity"])
async def test_other_policies_never_pin_a_slot(policy: str) -> None:
    pool, engine = session_pool(), Engine()
    pool.preset = pool.preset.__class__(**{**pool.preset.__dict__, "policy": policy})
    await send(engine, request(pool, "responses", Session("a" * 16, "a" * 16, "codex")))
    assert "id_slot" not in engine.sent[0][1]
    assert not pool.replicas[0].cache.sessions


@pytest.mark.anyio
async def test_a_new_session_waiting_for_a_full_replica_counts_there_and_the_next_goes_elsewhere() -> None:
    table = """
presets:
  m:
    served_model: m
    policy: session
    replicas:
      - {name: r0, url: "http://127.0.0.1:9100", engine: llamacpp, max_in_flight: 1}
      - {name: r1, url: "http://127.0.0.1:9101", engine: llamacpp, max_in_flight: 1}
routing: {default: m}
"""
    pool = Fleet(parse_table(table), clock=lambda: 0.0).pools["m"]
    r0, r1 = pool.replicas
    for replica in pool.replicas:
        replica.cache.resize(1)
    # Every slot is taken: r0 holds one session, r1 two (one in its memory tier); r0 is busy.
    r0.cache.restored(0, "a" * 16, "a" * 16, 500, 0.0)
    r1.cache.restored(0, "b" * 16, "b" * 16, 500, 0.0)
    r1.cache.restored(0, "e" * 16, "e" * 16, 500, 0.0)
    r0.in_flight = 1
    engine = Engine()
    carol, dave = Session("c" * 16, "c" * 16, "codex"), Session("d" * 16, "d" * 16, "codex")
    # Carol goes to the replica with fewer sessions per slot, and waits there for its place.
    waiting = asyncio.create_task(send(engine, request(pool, "responses", carol)))
    for _ in range(100):
        if pool.queued:
            break
        await asyncio.sleep(0)
    assert r0.waiting == 1 and not engine.sent
    # Dave sees Carol on r0 already: two sessions each, and r0 has a queue.
    assert pool.pick(pool.ticket(), session=dave.key, tokens=100).order[0] == "r1"
    pool.release(r0)
    await waiting
    assert [url for url, _ in engine.sent] == ["http://127.0.0.1:9100/v1/responses"]
    assert r0.cache.held(carol.key) is not None and not r0.cache.arriving and r0.waiting == 0
