"""The request path end to end: the official openai client -> gateway -> simulated replicas, over sockets."""

from __future__ import annotations

import gzip
import itertools
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx2
import openai
import orjson
import pytest

from tests.support.harness import Running, run_gateway
from tests.support.servers import ThreadServer, sim_replica


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, ThreadServer]]:
    servers = {
        "d0": sim_replica("vllm", "dense-served", context=4096),
        "d1": sim_replica("llamacpp", "dense-served", context=4096),
        "vis": sim_replica("vllm", "vision-served", thinking_default=False),
        "think": sim_replica("llamacpp", "thinker-served", reasoning_tokens=300),
    }
    yield servers
    for server in servers.values():
        server.stop()


def table(fleet: dict[str, ThreadServer], extra: str = "") -> str:
    return f"""
defaults: {{max_tokens: 8192, min_max_tokens: 1024}}
presets:
  dense:
    served_model: dense-served
    aliases: [coder]
    params: {{temperature: 0.6}}
    replicas:
      - {{name: d0, url: "{fleet["d0"].url}", engine: vllm}}
      - {{name: d1, url: "{fleet["d1"].url}", engine: llamacpp}}
  vision:
    served_model: vision-served
    vision: true
    replicas: [{{name: vis, url: "{fleet["vis"].url}", engine: vllm}}]
  thinker:
    served_model: thinker-served
    thinking: true
    min_max_tokens: 0
    replicas: [{{name: think, url: "{fleet["think"].url}", engine: llamacpp}}]
{extra}
tasks: {{code: dense, look: vision, think: thinker}}
routing: {{default: dense, images: vision}}
"""


@pytest.fixture(scope="module")
def gw(fleet: dict[str, ThreadServer]) -> Iterator[Running]:
    with run_gateway(table(fleet)) as running:
        yield running


@pytest.fixture
def client(gw: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


def last_body(server: ThreadServer) -> dict[str, Any]:
    stats = httpx2.get(server.url + "/sim/stats").json()
    return orjson.loads(stats["last_bodies"][-1])  # type: ignore[no-any-return]


HELLO = [{"role": "user", "content": "hello"}]
IMAGE = [
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
]


@pytest.mark.parametrize(
    ("kwargs", "headers", "preset", "route"),
    [
        ({"model": "dense"}, {}, "dense", "model"),
        ({"model": "coder"}, {}, "dense", "alias"),
        ({"model": "auto", "extra_body": {"task": "look"}}, {}, "vision", "task"),
        ({"model": "auto"}, {"x-task": "think"}, "thinker", "task"),
        ({"model": "auto"}, {}, "dense", "default"),
        ({"model": "coder", "messages": IMAGE}, {}, "vision", "images"),
    ],
)
def test_routing_by_model_alias_task_and_images(
    client: openai.OpenAI, kwargs: dict[str, Any], headers: dict[str, str], preset: str, route: str
) -> None:
    kwargs.setdefault("messages", HELLO)
    raw = client.chat.completions.with_raw_response.create(extra_headers=headers, **kwargs)
    assert raw.headers["x-gateway-preset"] == preset
    assert raw.headers["x-gateway-route"] == route
    assert raw.headers["x-gateway-replica"] in {"d0", "d1", "vis", "think"}
    assert "127.0.0.1" not in raw.headers["x-gateway-replica"]
    assert raw.parse().choices[0].message is not None


def test_the_replica_sees_only_the_keys_the_gateway_owns_changed(
    client: openai.OpenAI, fleet: dict[str, ThreadServer]
) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read",
                "parameters": {
                    "type": "object",
                    "properties": {"z": {"type": "string"}, "a": {"type": "integer"}},
                },
            },
        }
    ]
    messages = [{"role": "system", "content": "You are terse."}, *HELLO]
    raw = client.chat.completions.with_raw_response.create(
        model="dense",
        messages=messages,
        tools=tools,
        tool_choice="none",
        max_tokens=200,
        extra_body={"task": "code", "seed": 7},
    )
    replica = fleet[raw.headers["x-gateway-replica"]]
    sent = last_body(replica)
    assert sent["model"] == "dense-served" and "task" not in sent
    assert sent["chat_template_kwargs"] == {"enable_thinking": False}
    assert sent["max_tokens"] == 200  # thinking is off: the floor protects nothing here
    assert sent["temperature"] == 0.6 and sent["seed"] == 7
    if raw.headers["x-gateway-replica"] == "d0":
        assert "stream_options" not in sent and "stream" not in sent  # vLLM: 400 to stream_options alone
    else:
        # llama-server keeps generating a whole answer whose client left: it is asked for a stream,
        # and the gateway assembles the whole answer the client asked for.
        assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
        assert raw.parse().choices[0].message.content
    assert orjson.dumps(sent["messages"]) == orjson.dumps(messages)
    assert orjson.dumps(sent["tools"]) == orjson.dumps(tools)  # key order inside parameters kept
    assert raw.headers["x-gateway-rewrites"] == "thinking=off,params=temperature"


def test_the_clients_own_enable_thinking_wins(client: openai.OpenAI, fleet: dict[str, ThreadServer]) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="dense", messages=HELLO, extra_body={"chat_template_kwargs": {"enable_thinking": True, "x": 1}}
    )
    sent = last_body(fleet[raw.headers["x-gateway-replica"]])
    assert sent["chat_template_kwargs"] == {"enable_thinking": True, "x": 1}


def test_max_tokens_is_capped_to_the_replicas_context(
    client: openai.OpenAI, fleet: dict[str, ThreadServer]
) -> None:
    raw = client.chat.completions.with_raw_response.create(model="dense", messages=HELLO, max_tokens=30000)
    sent = last_body(fleet[raw.headers["x-gateway-replica"]])
    # Both dense replicas report a 4096 context; the prompt ("user", "hello") is estimated at 2.
    assert sent["max_tokens"] == 4094
    assert "max_tokens=30000->4094" in raw.headers["x-gateway-rewrites"]


def test_round_robin_alternates_between_two_replicas_of_mixed_engines(client: openai.OpenAI) -> None:
    seen = [
        client.chat.completions.with_raw_response.create(model="dense", messages=HELLO).headers[
            "x-gateway-replica"
        ]
        for _ in range(10)
    ]
    assert Counter(seen) == {"d0": 5, "d1": 5}
    assert all(a != b for a, b in itertools.pairwise(seen))


@pytest.mark.parametrize("model", ["dense", "thinker"])
def test_streaming_relays_chunks_and_hides_the_injected_usage_chunk(
    client: openai.OpenAI, model: str
) -> None:
    chunks = list(client.chat.completions.create(model=model, messages=HELLO, stream=True))
    assert chunks and all(chunk.choices for chunk in chunks)  # no `choices: []` usage chunk
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    text = "".join((c.choices[0].delta.content or "") for c in chunks)
    assert text or model == "thinker"


def test_streaming_with_usage_requested_keeps_the_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="dense", messages=HELLO, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_streaming_passes_events_through_as_they_arrive(fleet: dict[str, ThreadServer], gw: Running) -> None:
    """A stream of ~1 s: the first event must reach the client long before the last is generated."""
    slow = sim_replica("vllm", "dense-served", answer_tokens=20, decode_tps=20, thinking_default=False)
    try:
        httpx2.post(slow.url + "/sim/config", json={"time_scale": 1})
        with run_gateway(table({**fleet, "d0": slow, "d1": slow})) as own:
            started = time.monotonic()
            arrivals = []
            with httpx2.stream(
                "POST",
                own.url + "/v1/chat/completions",
                json={"model": "dense", "messages": HELLO, "stream": True},
                timeout=30,
            ) as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                assert response.headers["x-accel-buffering"] == "no"
                assert "content-length" not in response.headers
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        arrivals.append(time.monotonic() - started)
        assert len(arrivals) > 10
        assert arrivals[1] < arrivals[-1] / 2
    finally:
        slow.stop()


def test_the_thinking_trap_is_flagged(client: openai.OpenAI) -> None:
    # The thinker preset leaves thinking on and has no max_tokens floor: 200 tokens of budget are
    # spent on reasoning and the answer is empty, with HTTP 200.
    raw = client.chat.completions.with_raw_response.create(model="thinker", messages=HELLO, max_tokens=200)
    completion = raw.parse()
    assert completion.choices[0].finish_reason == "length" and not completion.choices[0].message.content
    assert raw.headers["x-gateway-warning"] == "reasoning consumed max_tokens"


def test_the_thinking_trap_is_flagged_on_a_stream_before_done(gw: Running) -> None:
    body = {"model": "thinker", "messages": HELLO, "max_tokens": 200, "stream": True}
    with httpx2.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as response:
        text = response.read().decode()
    assert '"finish_reason":"length"' in text
    assert text.endswith(": gateway-warning: reasoning consumed max_tokens\n\ndata: [DONE]\n\n")


def test_cached_tokens_are_reported_on_a_repeat(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "A long and stable system prompt. " * 40}, *HELLO]
    first = client.chat.completions.with_raw_response.create(model="vision", messages=messages)
    second = client.chat.completions.with_raw_response.create(model="vision", messages=messages)
    assert int(second.headers["x-gateway-cached-tokens"]) > int(first.headers["x-gateway-cached-tokens"])


def test_completions_endpoint(client: openai.OpenAI, fleet: dict[str, ThreadServer]) -> None:
    raw = client.completions.with_raw_response.create(model="vision", prompt="Once upon a time", max_tokens=5)
    assert raw.parse().choices[0].text
    sent = last_body(fleet["vis"])
    # No chat template, so no thinking: the client's small budget stands.
    assert "chat_template_kwargs" not in sent and sent["max_tokens"] == 5


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (b'{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}', 404, "model_not_found"),
        (b'{"task": "poetry", "messages": [{"role": "user", "content": "x"}]}', 400, "unknown_task"),
        (b'{"model": "dense", "messages": []}', 400, "invalid_request"),
        (
            b'{"model": "dense", "messages": [{"role":"user","content":"x"}], "api_base": "http://127.0.0.2:9"}',
            400,
            "invalid_request",
        ),
    ],
)
def test_bad_requests_get_openai_errors(gw: Running, body: bytes, status: int, code: str) -> None:
    response = httpx2.post(
        gw.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["code"] == code
    assert response.headers["x-request-id"]


def test_unknown_model_names_the_valid_ones(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-9", messages=HELLO)
    assert "coder" in str(caught.value)


def test_upstream_4xx_keeps_status_and_message(fleet: dict[str, ThreadServer]) -> None:
    tiny = sim_replica("llamacpp", "x", context=64)
    try:
        with run_gateway(table({**fleet, "think": tiny})) as own:
            client = openai.OpenAI(base_url=own.url + "/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError) as caught:
                # CJK text: the gateway's estimate (characters / 4) is near the context, so the
                # engine counts the bytes it tokenizes: far past it, said in OpenAI's own words.
                client.chat.completions.create(
                    model="thinker", messages=[{"role": "user", "content": "字" * 200}]
                )
            assert caught.value.code == "context_length_exceeded"
            message = str(caught.value)
            assert "This model's maximum context length is 64 tokens" in message
            counted = int(message.split("resulted in ")[1].split(" tokens")[0])
            assert counted > 100  # the engine counts the UTF-8 bytes it tokenizes; the estimate is 51
            assert tiny.url not in message
    finally:
        tiny.stop()


def test_no_reachable_replica_is_503_with_retry_after(fleet: dict[str, ThreadServer]) -> None:
    dead = sim_replica("vllm", "x")
    url = dead.url
    dead.stop()
    with run_gateway(table({**fleet, "vis": _Stub(url)})) as own:
        response = httpx2.post(own.url + "/v1/chat/completions", json={"model": "vision", "messages": HELLO})
        assert response.status_code == 503
        assert response.headers["retry-after"]
        assert response.json()["error"]["code"] == "no_healthy_upstream"
        assert url not in response.text and str(dead.port) not in response.text
        ready = httpx2.get(own.url + "/ready")
        assert ready.status_code == 503 and ready.json()["not_ready"] == ["vision"]


class _Stub:
    def __init__(self, url: str) -> None:
        self.url = url


def test_models_health_ready_and_metrics(gw: Running, client: openai.OpenAI) -> None:
    ids = {model.id for model in client.models.list()}
    assert {"dense", "coder", "vision", "thinker"} <= ids
    assert httpx2.get(gw.url + "/health").json() == {"status": "ok"}
    assert httpx2.get(gw.url + "/ready").json() == {"status": "ready"}
    client.chat.completions.create(model="dense", messages=HELLO)
    metrics = httpx2.get(gw.url + "/metrics").text
    assert (
        'gateway_requests_total{engine="vllm",preset="dense",replica="d0",route="model",status="2xx"}'
        in metrics
        or (
            'gateway_requests_total{engine="llamacpp",preset="dense",replica="d1",route="model",status="2xx"}'
            in metrics
        )
    )
    assert "gateway_request_duration_seconds_bucket" in metrics
    assert 'gateway_replica_up{engine="vllm",preset="dense",replica="d0"} 1.0' in metrics


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v1/chat/completions", 405), ("GET", "/nope", 404), ("POST", "/v1/../admin", 404)],
)
def test_other_paths_and_methods(gw: Running, method: str, path: str, status: int) -> None:
    response = httpx2.request(method, gw.url + path)
    assert response.status_code == status and "error" in response.json()


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_compressed_body_is_inflated_and_forwarded_plain(
    gw: Running, fleet: dict[str, ThreadServer], encoding: str
) -> None:
    body = orjson.dumps({"model": "dense", "messages": HELLO, "max_tokens": 9})
    packed = gzip.compress(body) if encoding == "gzip" else zlib.compress(body)
    answer = httpx2.post(
        gw.url + "/v1/chat/completions",
        content=packed,
        headers={"content-type": "application/json", "content-encoding": encoding},
        timeout=10,
    )
    assert answer.status_code == 200, answer.text
    sent = last_body(fleet[answer.headers["x-gateway-replica"]])
    assert sent["messages"] == HELLO and sent["max_tokens"] == 9


def test_a_compression_bomb_is_413_in_the_clients_dialect(gw: Running) -> None:
    bomb = gzip.compress(b" " * (40 << 20))  # 40 MiB of spaces, past the 32 MiB body limit
    answer = httpx2.post(
        gw.url + "/v1/messages",
        content=bomb,
        headers={"content-type": "application/json", "content-encoding": "gzip"},
        timeout=10,
    )
    assert answer.status_code == 413
    assert answer.json()["type"] == "error"


def test_integers_beyond_64_bits_reach_the_replica_as_sent(
    gw: Running, fleet: dict[str, ThreadServer]
) -> None:
    body = b'{"model": "dense", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, '
    body += (
        b'"seed": 18446744073709551616, "logit_bias": {"7": -100}, "metadata": {"n": -9223372036854775809}}'
    )
    answer = httpx2.post(
        gw.url + "/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert answer.status_code == 200, answer.text
    replica = fleet[answer.headers["x-gateway-replica"]]
    sent = httpx2.get(replica.url + "/sim/stats").json()["last_bodies"][-1]
    assert '"seed":18446744073709551616' in sent  # not 1.8446744073709552e+19
    assert '"n":-9223372036854775809' in sent


def test_a_budget_beyond_64_bits_is_a_400_not_a_500(gw: Running) -> None:
    body = b'{"model": "dense", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 99999999999999999999999}'
    answer = httpx2.post(
        gw.url + "/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "max_tokens"
