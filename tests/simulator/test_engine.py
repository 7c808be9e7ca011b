"""The simulator's pure model: rendering, budgets, caches, text and wire shapes, with plain values."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import orjson
import pytest

from gateway.simulator import SimConfig, dialect
from gateway.simulator import cache as sim_cache
from gateway.simulator import engine as e
from gateway.simulator.app import SlotPool

VLLM = SimConfig("vllm", "tiny", context=1024, reasoning_tokens=300, answer_tokens=24)
LLAMA = SimConfig("llamacpp", "tiny", context=1024, reasoning_tokens=300, answer_tokens=24)
USER = [{"role": "user", "content": "hello"}]
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["c", "f"]},
                "detailed": {"type": ["boolean", "null"]},
                "tags": {"type": "array"},
            },
            "required": ["city", "days", "unit", "detailed", "tags"],
        },
    },
}


def prep(cfg: SimConfig, body: dict[str, Any], kind: str = "chat") -> e.Prepared:
    return e.prepare(cfg, kind, orjson.dumps(body), "application/json")  # type: ignore[arg-type]


def refusal(cfg: SimConfig, body: dict[str, Any], ctype: str | None = "application/json") -> e.ApiError:
    with pytest.raises(e.ApiError) as info:
        e.prepare(cfg, "chat", orjson.dumps(body), ctype)
    return info.value


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (b"", b"", 0),
        (b"abcd", b"abcd", 1),
        (b"abcdefgh", b"abcdXfgh", 1),
        (b"abcdefgh", b"abcdefgX", 1),
        (b"abcdef", b"abcdef", 2),  # identical, partial last slice counts
        (b"abcdef", b"abcdefgh", 1),  # the partial slice differs from the longer one's
        (b"Xbcdefgh", b"abcdefgh", 0),
    ],
)
def test_common_tokens(a: bytes, b: bytes, expected: int) -> None:
    assert sim_cache.common_tokens(a, b) == expected


def test_n_tokens_counts_started_4_byte_slices() -> None:
    assert [e.n_tokens(b"x" * n) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    assert e.n_tokens("é".encode()) == 1


def test_chat_rendering_is_chatml_with_think_block_only_when_thinking_is_off() -> None:
    on = e.render_chat(VLLM, [{"role": "system", "content": "S"}, *USER], [], thinking=True)
    off = e.render_chat(VLLM, [{"role": "system", "content": "S"}, *USER], [], thinking=False)
    assert on == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert off == on + e.THINK_OFF


def test_tools_render_in_client_order_and_parameter_key_order_matters() -> None:
    other = {"type": "function", "function": {"name": "other", "parameters": {}}}
    base = e.render_chat(VLLM, USER, [WEATHER, other], True)
    assert base.index("get_weather") < base.index('"other"')
    assert e.render_chat(VLLM, USER, [other, WEATHER], True) != base
    wrapper_swapped = {"function": WEATHER["function"], "type": "function"}
    assert e.render_chat(VLLM, USER, [wrapper_swapped, other], True) == base
    params = WEATHER["function"]["parameters"]
    reordered = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": dict(reversed(params.items()))},
    }
    assert e.render_chat(VLLM, USER, [reordered, other], True) != base
    assert '"description": null' in base
    assert '"description": ""' in e.render_chat(LLAMA, USER, [WEATHER], True)


def test_image_parts_cost_256_tokens_and_differ_by_url() -> None:
    def msg(url: str) -> list[dict[str, Any]]:
        return [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "see"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ]

    text_only = len(e.render_chat(VLLM, [{"role": "user", "content": "see"}], [], True).encode())
    with_image = e.render_chat(VLLM, msg("a.png"), [], True)
    assert "<image>" in with_image
    assert len(with_image.encode()) - text_only == len("<image>") + 256 * 4
    assert with_image != e.render_chat(VLLM, msg("b.png"), [], True)


@pytest.mark.parametrize(
    ("cfg", "extra", "thinking"),
    [
        (VLLM, {}, True),
        (VLLM, {"chat_template_kwargs": {"enable_thinking": False}}, False),
        (VLLM, {"chat_template_kwargs": {"enable_thinking": "false"}}, True),  # vLLM ignores a string
        (VLLM, {"reasoning_effort": "none"}, False),
        (VLLM, {"reasoning_effort": "low"}, True),
        (LLAMA, {"chat_template_kwargs": {"enable_thinking": False}}, False),
        (LLAMA, {"reasoning_effort": "none"}, False),
        (dataclasses.replace(LLAMA, thinking_default=False), {}, False),
        (
            dataclasses.replace(LLAMA, thinking_default=False),
            {"chat_template_kwargs": {"enable_thinking": True}},
            True,
        ),
    ],
)
def test_thinking_switch(cfg: SimConfig, extra: dict[str, Any], thinking: bool) -> None:
    p = prep(cfg, {"messages": USER, **extra})
    assert p.thinking is thinking
    assert p.prompt.endswith(e.THINK_OFF.encode()) is (not thinking)


def test_llama_rejects_string_enable_thinking() -> None:
    err = refusal(LLAMA, {"messages": USER, "chat_template_kwargs": {"enable_thinking": "false"}})
    assert err.status == 400
    assert (
        err.payload["error"]["message"] == 'invalid type for "enable_thinking" (expected boolean, got string)'
    )
    assert err.payload["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("cfg", "fields", "budget"),
    [
        (VLLM, {}, None),  # max_model_len - prompt
        (VLLM, {"max_tokens": 200}, 200),
        (VLLM, {"max_tokens": 100, "max_completion_tokens": 50}, 50),
        (VLLM, {"max_tokens": 1024}, None),  # allowed, clamped to the room left
        (LLAMA, {}, None),
        (LLAMA, {"n_predict": -1, "max_tokens": 5}, None),
        (LLAMA, {"n_predict": 7, "max_completion_tokens": 6, "max_tokens": 5}, 7),
        (LLAMA, {"max_completion_tokens": 6, "max_tokens": 5}, 6),
        (LLAMA, {"max_tokens": 99999}, None),  # never an error: stops at the context
    ],
)
def test_budget_precedence(cfg: SimConfig, fields: dict[str, Any], budget: int | None) -> None:
    p = prep(cfg, {"messages": USER, **fields})
    assert p.budget == (cfg.context - p.prompt_tokens if budget is None else budget)


@pytest.mark.parametrize(
    ("cfg", "body", "ctype", "status", "etype"),
    [
        (VLLM, {"messages": USER, "max_tokens": 1025}, "application/json", 400, "BadRequestError"),
        (VLLM, {"messages": USER, "max_completion_tokens": 5000}, "application/json", 400, "BadRequestError"),
        (
            VLLM,
            {"messages": USER, "stream_options": {"include_usage": True}},
            "application/json",
            400,
            "Bad Request",
        ),
        (VLLM, {"messages": USER, "model": "nope"}, "application/json", 404, "NotFoundError"),
        (VLLM, {"messages": USER}, "text/plain", 400, "Bad Request"),
        (VLLM, {"messages": USER}, None, 400, "Bad Request"),
        (VLLM, {"messages": USER, "chat_template": "x"}, "application/json", 400, "BadRequestError"),
        (
            VLLM,
            {
                "messages": USER,
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "zz"}},
            },
            "application/json",
            400,
            "BadRequestError",
        ),
        (VLLM, {"prompt": "x"}, "application/json", 400, "BadRequestError"),
        (LLAMA, {"messages": USER, "n_predict": -2}, "application/json", 400, "invalid_request_error"),
    ],
)
def test_refusals(cfg: SimConfig, body: dict[str, Any], ctype: str | None, status: int, etype: str) -> None:
    err = refusal(cfg, body, ctype)
    assert err.status == status
    assert err.payload["error"]["type"] == etype
    assert err.payload["error"]["code"] == status
    if cfg.engine == "vllm":
        assert set(err.payload["error"]) == {"message", "type", "param", "code"}


def test_vllm_unknown_model_message_lists_aliases_and_missing_model_is_fine() -> None:
    err = refusal(VLLM, {"messages": USER, "model": "x"})
    assert err.payload == {
        "error": {
            "message": "The model `x` does not exist. Valid aliases: tiny.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    assert prep(VLLM, {"messages": USER, "model": ""}).prompt_tokens > 0
    assert prep(LLAMA, {"messages": USER, "model": "whatever", "task": "x"}).prompt_tokens > 0


def test_prompt_over_context() -> None:
    big = {"messages": [{"role": "user", "content": "x" * 4 * 1100}]}
    err = refusal(LLAMA, big)
    assert err.payload["error"]["type"] == "exceed_context_size_error"
    assert err.payload["error"]["n_ctx"] == 1024
    assert err.payload["error"]["n_prompt_tokens"] > 1024
    assert refusal(VLLM, big).payload["error"]["param"] == "input_tokens"


def test_completions_prompt_forms_and_no_thinking() -> None:
    assert prep(VLLM, {"prompt": "abcdefgh"}, "completion").prompt_tokens == 2
    assert prep(VLLM, {"prompt": ["abcd", "efgh"]}, "completion").prompt == b"abcdefgh"
    ids = prep(LLAMA, {"prompt": [1, 2, 3]}, "completion")
    assert ids.prompt_tokens == 3
    assert not ids.thinking


@pytest.mark.parametrize("cfg", [VLLM, LLAMA])
def test_thinking_eats_max_tokens(cfg: SimConfig) -> None:
    out = e.generate(cfg, prep(cfg, {"messages": USER, "max_tokens": 200}), 1)
    assert (out.finish_reason, len(out.reasoning), out.content, out.answered) == ("length", 200, (), False)
    off = {"messages": USER, "max_tokens": 200, "chat_template_kwargs": {"enable_thinking": False}}
    out = e.generate(cfg, prep(cfg, off), 1)
    assert (out.finish_reason, out.reasoning, len(out.content)) == ("stop", (), 24)
    out = e.generate(cfg, prep(cfg, {"messages": USER, "max_tokens": 310}), 1)
    assert (out.finish_reason, len(out.reasoning), len(out.content)) == ("length", 300, 10)
    out = e.generate(cfg, prep(cfg, {"messages": USER}), 1)
    assert (out.finish_reason, out.completion_tokens) == ("stop", 324)


def test_text_is_deterministic_per_seed_and_counter() -> None:
    p = prep(VLLM, {"messages": USER})
    assert e.generate(VLLM, p, 3) == e.generate(VLLM, p, 3)
    assert e.generate(VLLM, p, 3).content != e.generate(VLLM, p, 4).content
    assert e.generate(VLLM, p, 3).content != e.generate(dataclasses.replace(VLLM, seed=9), p, 3).content
    assert set(e.generate(VLLM, p, 3).content) <= set(e.VOCAB)


@pytest.mark.parametrize(
    ("extra", "called"),
    [
        ({"tool_choice": "required"}, True),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, True),
        ({}, False),  # auto, and the user did not ask
        ({"tool_choice": "none", "messages": [{"role": "user", "content": "Call the tool"}]}, False),
        ({"messages": [{"role": "user", "content": "please call it"}]}, True),
        ({"messages": [{"role": "user", "content": "use a Tool!"}]}, True),
        ({"messages": [{"role": "user", "content": "recall toolbox"}]}, False),  # words, not substrings
    ],
)
def test_tool_calls(extra: dict[str, Any], called: bool) -> None:
    p = prep(VLLM, {"messages": USER, "tools": [WEATHER], **extra})
    out = e.generate(VLLM, p, 7)
    assert (out.tool_call is not None) is called
    if out.tool_call is not None:
        assert out.finish_reason == "tool_calls"
        assert out.tool_call["id"] == "call_7"
        assert out.tool_call["function"]["name"] == "get_weather"
        args = json.loads(out.tool_call["function"]["arguments"])
        assert args == {"city": "example", "days": 1, "unit": "c", "detailed": True, "tags": []}


@pytest.mark.parametrize("choice", [None, "auto", "required"])
def test_vllm_without_tool_parser_refuses_tools(choice: str | None) -> None:
    cfg = dataclasses.replace(VLLM, tool_parser=False)
    body: dict[str, Any] = {"messages": USER, "tools": [WEATHER]}
    if choice:
        body["tool_choice"] = choice
    err = refusal(cfg, body)
    assert err.status == 400
    if choice != "required":
        assert "--enable-auto-tool-choice" in err.payload["error"]["message"]
    assert prep(cfg, {**body, "tool_choice": "none"}).tool is None


def test_block_cache_rounds_down_to_blocks_and_keeps_the_last_token() -> None:
    cache = sim_cache.BlockCache(block_size=16, capacity=100)
    prompt = b"s" * 4 * 100  # 100 tokens
    assert cache.match_and_insert(prompt) == 0
    assert cache.match_and_insert(prompt) == 96
    assert cache.match_and_insert(b"s" * 4 * 96) == 80  # at most n-1 tokens: the 6th block is recomputed
    assert cache.match_and_insert(b"X" + prompt[1:]) == 0  # the hash chain breaks at the first block
    assert cache.match_and_insert(prompt, salt="tenant") == 0
    assert cache.match_and_insert(prompt[:200] + b"Y" * 200) == 48


def test_block_cache_is_lru_bounded() -> None:
    cache = sim_cache.BlockCache(block_size=1, capacity=4)
    cache.match_and_insert(b"aaaabbbbccccdddd")
    cache.match_and_insert(b"eeeeffffgggghhhh")
    assert len(cache.blocks) == 4
    assert cache.match_and_insert(b"aaaabbbbccccdddd") == 0


def test_slot_cache_picks_longest_prefix_then_lru() -> None:
    slots = sim_cache.SlotCache(3)
    slots.store(0, b"system A" * 20)
    slots.store(1, b"system B" * 20)
    prompt = b"system B" * 20 + b"next turn"
    assert slots.pick([0, 1, 2], prompt) == (1, 40)
    assert slots.pick([0, 2], b"unrelated") == (0, 0)
    assert slots.pick([0, 2], b"unrelated") == (2, 0)  # no prefix anywhere: least recently used
    assert slots.pick([1], b"system B") == (1, 1)  # capped at n-1


def test_slot_pool_is_fifo_and_survives_cancelled_waiters() -> None:
    async def scenario() -> list[str]:
        pool = SlotPool(1, lambda idle, prompt: (idle[0], 0))
        order: list[str] = []
        held, _ = await pool.acquire(b"")

        async def user(name: str) -> None:
            slot, _ = await pool.acquire(b"")
            order.append(name)
            pool.release(slot)

        tasks = [asyncio.ensure_future(user(n)) for n in ("b", "c", "d")]
        await asyncio.sleep(0)
        assert len(pool.waiters) == 3
        tasks[1].cancel()
        await asyncio.sleep(0)
        assert len(pool.waiters) == 2
        pool.release(held)
        await asyncio.gather(tasks[0], tasks[2])
        assert pool.idle == [0]
        return order

    assert asyncio.run(scenario()) == ["b", "d"]


def reply(cfg: SimConfig, body: dict[str, Any], cached: int = 0) -> dialect.Reply:
    p = prep(cfg, body)
    return dialect.Reply("chatcmpl-x", 1, p, e.generate(cfg, p, 1), cached)


def events(cfg: SimConfig, body: dict[str, Any]) -> list[Any]:
    raw = [data for _, data in dialect.stream_events(cfg, reply(cfg, body))]
    assert all(d.startswith(b"data: ") and d.endswith(b"\n\n") for d in raw)
    assert raw[-1] == b"data: [DONE]\n\n"
    return [orjson.loads(d[6:]) for d in raw[:-1]]


SHORT = {"messages": USER, "stream": True}


def test_vllm_stream_shape() -> None:
    cfg = dataclasses.replace(VLLM, reasoning_tokens=2, answer_tokens=3)
    chunks = events(cfg, SHORT)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    assert [list(d) for d in deltas] == [["reasoning"]] * 2 + [["content"]] * 3
    assert deltas[1]["reasoning"].startswith(" ")  # later tokens carry their leading space
    assert "".join(d["content"] for d in deltas[2:]).count(" ") == 2
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] is None
    assert "content" in chunks[-1]["choices"][0]["delta"]
    assert all("usage" not in c for c in chunks)
    with_usage = events(cfg, {**SHORT, "stream_options": {"include_usage": True}})
    assert with_usage[-1]["choices"] == []
    assert with_usage[-1]["usage"]["completion_tokens"] == 5


def test_llama_stream_shape_has_timings_on_the_last_chunk() -> None:
    cfg = dataclasses.replace(LLAMA, reasoning_tokens=2, answer_tokens=3, chunk_tokens=2)
    chunks = events(cfg, SHORT)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-1]]
    assert [next(iter(d)) for d in deltas] == ["reasoning_content", "content", "content"]
    assert len(deltas[0]["reasoning_content"].split()) == 2
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert set(chunks[-1]["timings"]) >= {"cache_n", "prompt_n", "prompt_ms", "predicted_n", "predicted_ms"}
    assert all("timings" not in c for c in chunks[:-1])
    with_usage = events(cfg, {**SHORT, "stream_options": {"include_usage": True}})
    assert with_usage[-1]["choices"] == []
    assert "timings" in with_usage[-1]
    assert with_usage[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_usage_details_follow_prompt_tokens_details_flag() -> None:
    body = {"messages": USER}
    assert dialect.response(VLLM, reply(VLLM, body, 5))["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 5
    }
    off = dataclasses.replace(VLLM, prompt_tokens_details=False)
    assert dialect.response(off, reply(off, body, 5))["usage"]["prompt_tokens_details"] is None
    r = dialect.response(LLAMA, reply(LLAMA, body, 5))
    assert r["timings"]["cache_n"] == 5
    assert r["timings"]["prompt_n"] == r["usage"]["prompt_tokens"] - 5


def test_prometheus_text() -> None:
    text = dialect.prometheus(
        {"vllm:num_requests_running": 2, "vllm:prompt_tokens": 7}, dialect.vllm_labels(VLLM)
    )
    assert 'vllm:num_requests_running{engine="0",model_name="tiny"} 2.0' in text
    assert 'vllm:prompt_tokens_total{engine="0",model_name="tiny"} 7.0' in text
    assert "# TYPE vllm:prompt_tokens_total counter" in text


@pytest.mark.parametrize("bad", [{"engine": "tgi"}, {"slots": 0}, {"decode_tps": 0}, {"time_scale": -1}])
def test_config_validation(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011
        dataclasses.replace(VLLM, **bad)
