"""gateway/pipeline/tokens.py: what a key's token limits reserve at admission, and when the engine is
asked to count a prompt (only near the context) and how, through a scripted upstream client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from gateway.dialects.registry import BY_NAME
from gateway.fleet.replicas import Fleet, Pool
from gateway.pipeline.tokens import RESERVED_BUDGET, TRUST, near, prompt_tokens, reservation
from gateway.routing.table import parse_table
from gateway.team.keys import Identity
from gateway.team.limits import KeyLimits
from gateway.upstream import ConnectFailed, Timeouts, UpstreamError, UpstreamResponse

TABLE = """
defaults: {max_tokens: 512, min_max_tokens: 0}
presets:
  dense:
    served_model: dense-served
    replicas: [{name: d0, url: "http://dense.test:1", engine: vllm, api_key_env: TEST_TOKENS_DENSE_KEY}]
  moe:
    served_model: moe-served
    replicas: [{name: m0, url: "http://moe.test:1", engine: llamacpp}]
  big:
    served_model: big-served
    max_tokens: 100000
    replicas: [{name: b0, url: "http://big.test:1", engine: vllm}]
routing: {default: dense}
"""

CONTEXT = 1000
CHAT_BODY: dict[str, Any] = {
    "model": "coder",
    "messages": [{"role": "user", "content": "hello"}],
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "temperature": 0.2,
    "max_tokens": 50,
}
MESSAGES_BODY: dict[str, Any] = {
    "model": "claude-sonnet",
    "max_tokens": 50,
    "messages": [{"role": "user", "content": "hello"}],
}


def fleet() -> Fleet:
    return Fleet(parse_table(TABLE), clock=lambda: 0.0)


def pool(name: str, context: int | None = CONTEXT) -> Pool:
    found = fleet().pools[name]
    for replica in found.replicas:
        replica.context = context
    return found


def limited(**limits: int) -> Identity:
    return Identity("alice", limits=KeyLimits(**limits))


class Reply:
    """One answer of the scripted engine: a status and a whole body; `closed` once released."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.headers: Mapping[str, str] = {"content-type": "application/json"}
        self.body = body
        self.closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        yield self.body

    async def read(self, limit: int | None = None) -> bytes:
        return self.body if limit is None else self.body[:limit]

    async def close(self) -> None:
        self.closed = True


def reply(payload: dict[str, Any], status: int = 200) -> Reply:
    return Reply(status, orjson.dumps(payload))


@dataclass
class Request:
    path: str
    headers: dict[str, str]
    body: Any


class Engine:
    """An upstream client whose replicas answer per path; what each request carried is in `sent`."""

    def __init__(self, by_path: dict[str, Reply | UpstreamError] | None = None) -> None:
        self.by_path = by_path or {}
        self.sent: list[Request] = []
        self.replies: list[Reply] = []

    async def send(
        self, url: str, headers: list[tuple[str, str]], body: bytes, timeouts: Timeouts, method: str = "POST"
    ) -> UpstreamResponse:
        path = "/" + url.split("//", 1)[1].split("/", 1)[1]
        self.sent.append(Request(path, dict(headers), orjson.loads(body)))
        answer = self.by_path[path]
        if isinstance(answer, UpstreamError):
            raise answer
        self.replies.append(answer)
        return answer

    async def get(self, url: str, headers: list[tuple[str, str]], timeout: float) -> tuple[int, bytes]:
        raise AssertionError("counting never GETs")

    async def aclose(self) -> None:
        return None

    def paths(self) -> list[str]:
        return [r.path for r in self.sent]

    def bodies(self) -> list[Any]:
        return [r.body for r in self.sent]


def counted(engine: Engine, found: Pool, endpoint: str, body: dict[str, Any], estimate: int) -> int | None:
    return asyncio.run(prompt_tokens(engine, found, BY_NAME[endpoint], body, estimate, 0.0))


# --- the reservation ----------------------------------------------------------------------------


def test_a_key_without_token_limits_reserves_nothing() -> None:
    preset = fleet().table.presets["dense"]
    for identity in (Identity("open"), limited(concurrent=2, requests_per_minute=10)):
        assert reservation(identity, 700, dict(CHAT_BODY), BY_NAME["chat"], preset) == 0


@pytest.mark.parametrize("limits", [{"tokens_per_minute": 10}, {"tokens_per_day": 10}])
def test_a_token_limited_key_reserves_the_prompt_and_the_asked_budget(limits: dict[str, int]) -> None:
    preset = fleet().table.presets["dense"]
    assert reservation(limited(**limits), 700, dict(CHAT_BODY), BY_NAME["chat"], preset) == 750


def test_a_request_without_a_budget_reserves_the_presets_default() -> None:
    preset = fleet().table.presets["dense"]
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert reservation(limited(tokens_per_minute=10), 700, body, BY_NAME["chat"], preset) == 700 + 512


def test_the_budget_reserved_is_capped_however_large_the_request_asks() -> None:
    preset = fleet().table.presets["dense"]
    body = {**MESSAGES_BODY, "max_tokens": 64000}  # what Claude Code asks for
    got = reservation(limited(tokens_per_minute=10), 700, body, BY_NAME["messages"], preset)
    assert got == 700 + RESERVED_BUDGET


def test_a_large_preset_default_is_capped_too() -> None:
    preset = fleet().table.presets["big"]
    body = {"messages": [{"role": "user", "content": "hi"}]}
    got = reservation(limited(tokens_per_day=10), 10, body, BY_NAME["chat"], preset)
    assert got == 10 + RESERVED_BUDGET


def test_the_dialects_own_budget_key_is_the_one_read() -> None:
    preset = fleet().table.presets["dense"]
    identity = limited(tokens_per_minute=10)
    chat = {"messages": [], "max_completion_tokens": 30, "max_tokens": 3000}  # the first wins, as on vLLM
    assert reservation(identity, 0, chat, BY_NAME["chat"], preset) == 30
    responses = {"input": "hi", "max_output_tokens": 40, "max_tokens": 3000}
    assert reservation(identity, 0, responses, BY_NAME["responses"], preset) == 40


def test_an_endpoint_without_a_budget_reserves_only_the_prompt() -> None:
    preset = fleet().table.presets["dense"]
    identity = limited(tokens_per_minute=10)
    body = dict(MESSAGES_BODY)
    assert reservation(identity, 700, body, BY_NAME["count_tokens"], preset) == 700
    assert reservation(identity, 700, {"input": "x"}, BY_NAME["embeddings"], preset) == 700


# --- near the context -----------------------------------------------------------------------------


def test_near_means_within_a_quarter_of_the_context_either_way() -> None:
    assert TRUST == 0.25
    assert near(750, 1000) and near(1000, 1000) and near(1250, 1000)
    assert not near(749, 1000) and not near(1251, 1000)


def test_an_unknown_context_is_never_near() -> None:
    assert not near(1000, None)


# --- when the engine counts -----------------------------------------------------------------------


def test_an_estimate_clearly_inside_the_context_stands_without_asking_the_engine() -> None:
    engine = Engine()
    assert counted(engine, pool("dense"), "chat", CHAT_BODY, 100) is None
    assert engine.sent == []


def test_an_estimate_clearly_past_the_context_stands_without_asking_the_engine() -> None:
    engine = Engine()
    assert counted(engine, pool("dense"), "chat", CHAT_BODY, 5000) is None
    assert engine.sent == []


def test_a_pool_whose_context_is_not_known_is_never_counted() -> None:
    engine = Engine()
    assert counted(engine, pool("dense", context=None), "chat", CHAT_BODY, CONTEXT) is None
    assert engine.sent == []


def test_the_smallest_context_of_the_pool_decides_whether_to_count() -> None:
    table = parse_table(
        """
presets:
  two:
    served_model: two-served
    replicas:
      - {name: a, url: "http://two.test:1", engine: vllm}
      - {name: b, url: "http://two.test:2", engine: vllm}
routing: {default: two}
"""
    )
    found = Fleet(table, clock=lambda: 0.0).pools["two"]
    found.replicas[0].context, found.replicas[1].context = 100_000, 1000
    engine = Engine({"/tokenize": reply({"count": 990})})
    assert counted(engine, found, "chat", CHAT_BODY, 1100) == 990


def test_chat_on_vllm_is_counted_with_tokenize_on_the_chat_template_keys() -> None:
    engine = Engine({"/tokenize": reply({"count": 987, "tokens": [1, 2, 3], "max_model_len": CONTEXT})})
    assert counted(engine, pool("dense"), "chat", CHAT_BODY, 900) == 987
    assert engine.paths() == ["/tokenize"]
    [sent] = engine.bodies()
    # The served model, and only what the chat template renders: not temperature or the budget.
    assert sent == {
        "model": "dense-served",
        "messages": CHAT_BODY["messages"],
        "tools": CHAT_BODY["tools"],
    }


def test_chat_on_llama_server_applies_the_template_then_counts_its_tokens() -> None:
    engine = Engine(
        {
            "/apply-template": reply({"prompt": "<|user|>hello<|assistant|>"}),
            "/tokenize": reply({"tokens": list(range(812))}),
        }
    )
    assert counted(engine, pool("moe"), "chat", CHAT_BODY, 900) == 812
    assert engine.paths() == ["/apply-template", "/tokenize"]
    template, tokenize = engine.bodies()
    assert template == {"messages": CHAT_BODY["messages"], "tools": CHAT_BODY["tools"]}
    assert tokenize == {"content": "<|user|>hello<|assistant|>"}


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_messages_are_counted_with_count_tokens_under_the_served_model(name: str) -> None:
    engine = Engine({"/v1/messages/count_tokens": reply({"input_tokens": 1111})})
    assert counted(engine, pool(name), "messages", MESSAGES_BODY, 1100) == 1111
    assert engine.paths() == ["/v1/messages/count_tokens"]
    [sent] = engine.bodies()
    assert sent == {**MESSAGES_BODY, "model": f"{name}-served"}


def test_a_responses_body_keeps_its_estimate_as_no_engine_counts_it() -> None:
    engine = Engine()
    assert counted(engine, pool("dense"), "responses", {"input": "hi"}, CONTEXT) is None
    assert engine.sent == []


def test_the_replicas_api_key_goes_with_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_TOKENS_DENSE_KEY", "sk-replica")
    engine = Engine({"/tokenize": reply({"count": 900})})
    assert counted(engine, pool("dense"), "chat", CHAT_BODY, 900) == 900
    headers = engine.sent[0].headers
    assert headers["authorization"] == "Bearer sk-replica"
    assert headers["content-type"] == "application/json"


def test_a_replica_without_an_api_key_is_sent_none() -> None:
    engine = Engine({"/apply-template": reply({"prompt": "p"}), "/tokenize": reply({"tokens": [1]})})
    counted(engine, pool("moe"), "chat", CHAT_BODY, 900)
    assert all("authorization" not in r.headers for r in engine.sent)


@pytest.mark.parametrize(
    "answer",
    [
        ConnectFailed("refused"),
        reply({"count": 900, "error": {"message": "no"}}, status=500),  # not believed under an error status
        reply({"count": 900, "error": {"message": "unknown model"}}, status=404),
        Reply(200, b"not json"),
        reply({"tokens": [1, 2]}),  # no count
        reply({"count": "many"}),
    ],
    ids=["connect-failed", "500", "404", "not-json", "missing-field", "not-a-number"],
)
def test_a_count_that_fails_for_any_reason_leaves_the_estimate(answer: Reply | UpstreamError) -> None:
    engine = Engine({"/tokenize": answer})
    assert counted(engine, pool("dense"), "chat", CHAT_BODY, 900) is None
    assert engine.paths() == ["/tokenize"]


def test_the_count_answer_is_closed_after_it_is_read() -> None:
    engine = Engine({"/tokenize": reply({"count": 900})})
    counted(engine, pool("dense"), "chat", CHAT_BODY, 900)
    assert [a.closed for a in engine.replies] == [True]


def test_a_pool_with_no_available_replica_is_not_counted() -> None:
    found = pool("dense")
    for replica in found.replicas:
        replica.health.on_stopped("stopped")
    engine = Engine({"/tokenize": reply({"count": 900})})
    assert counted(engine, found, "chat", CHAT_BODY, 900) is None
    assert engine.sent == []
