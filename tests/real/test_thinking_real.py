"""The thinking-budget trap on a real llama-server, and the no-think default that avoids it.

The replica here runs a Qwen3-style template: with thinking on, the generation prompt ends in an
open `<think>` block and past assistant turns render their `reasoning_content`, which is how this
llama.cpp build's template analysis finds the reasoning markers. With `--reasoning-format deepseek`
every token the tiny random model writes is then reasoning, so a short `max_tokens` ends in HTTP
200, `finish_reason: "length"`, empty `content`: exactly the silent failure a real thinking model
gives a client that sent `max_tokens=200`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx2
import openai
import pytest

from tests.support.harness import Running, eventually, run_gateway

from .backends import LlamaServer
from .make_gguf import CHAT_TEMPLATE

TRAP = "reasoning consumed max_tokens"
HELLO = [{"role": "user", "content": "Hello there"}]
# At the default temperature the random model samples its end-of-turn token now and then: 9 of 200
# streams stopped before 8 tokens, and one in CI before any reasoning at all. Greedy decoding with
# EOS ignored makes every run spend exactly the 8 tokens, as a real thinking model would.
SAMPLING = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
_GENERATION = (
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}"
)
_CONTENT = "{%- if message.content is string %}{{- message.content }}{%- endif %}"


def thinking_template() -> str:
    """The tests' ChatML template, made to think the way Qwen3's does."""
    assert _GENERATION in CHAT_TEMPLATE and _CONTENT in CHAT_TEMPLATE
    past_reasoning = (
        "{%- if message.role == 'assistant' and message.reasoning_content is defined"
        " and message.reasoning_content %}"
        "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    )
    return CHAT_TEMPLATE.replace(_GENERATION, _GENERATION + "{%- else %}{{- '<think>\\n' }}").replace(
        _CONTENT, past_reasoning + _CONTENT
    )


@pytest.fixture(scope="module")
def thinker(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    template = tmp_path_factory.mktemp("thinking") / "qwen3-style.jinja"
    template.write_text(thinking_template())
    args = ("--jinja", "--chat-template-file", str(template), "--reasoning-format", "deepseek")
    with LlamaServer(tiny_gguf, slots=1, ctx=4096, extra_args=args, name="thinker") as server:
        yield server


@pytest.fixture(scope="module")
def gateway(thinker: LlamaServer) -> Iterator[Running]:
    # Both presets on one replica: `thinks` leaves thinking on and the client's small budget alone
    # (min_max_tokens 0), as a careless table would; `nothink` is the shipped default behaviour.
    table = f"""
presets:
  thinks:
    served_model: tiny
    thinking: true
    min_max_tokens: 0
    replicas: [{{name: thinker-a, url: "{thinker.url}", engine: llamacpp}}]
  nothink:
    served_model: tiny
    thinking: false
    min_max_tokens: 0
    replicas: [{{name: thinker-b, url: "{thinker.url}", engine: llamacpp}}]
routing: {{default: nothink}}
"""
    with run_gateway(table) as running:
        yield running


@pytest.fixture(scope="module")
def client(gateway: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_replica_really_spends_a_small_budget_on_reasoning(thinker: LlamaServer) -> None:
    """The premise, straight at the replica: no gateway, no warning, nothing to show."""
    answer = httpx2.post(
        thinker.url + "/v1/chat/completions", json={"messages": HELLO, **SAMPLING}, timeout=60
    ).json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == ""
    assert choice["message"]["reasoning_content"]


def test_the_gateway_flags_the_trap_on_a_non_streaming_answer(
    client: openai.OpenAI, gateway: Running
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="thinks", messages=HELLO, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    assert raw.headers["x-gateway-warning"] == TRAP
    counted = 'gateway_thinking_budget_exhausted_total{preset="thinks",replica="thinker-a"} 1.0'
    assert eventually(lambda: counted in gateway.metrics())
    entry = eventually(
        lambda: next(
            (e for e in gateway.log_entries() if e["request_id"] == raw.headers["x-request-id"]), None
        )
    )
    assert entry is not None and TRAP in entry["warnings"]


def test_the_gateway_flags_the_trap_on_a_stream(gateway: Running) -> None:
    body = {"model": "thinks", "messages": HELLO, "stream": True, **SAMPLING}
    with httpx2.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=60) as response:
        text = response.read().decode("utf-8", "replace")
    assert '"reasoning_content"' in text and '"finish_reason":"length"' in text
    # The headers left before the trap could be seen: an SSE comment, just before [DONE].
    assert f": gateway-warning: {TRAP}\n\ndata: [DONE]" in text
    assert text.rstrip().endswith("data: [DONE]")


def test_the_no_think_default_gets_an_answer_from_the_same_budget(client: openai.OpenAI) -> None:
    """What the gateway is for: the same request to a `thinking: false` preset is not a silent failure."""
    raw = client.chat.completions.with_raw_response.create(
        model="nothink", messages=HELLO, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = raw.parse().choices[0]
    assert choice.message.content  # the model's words, not its thoughts
    assert "x-gateway-warning" not in raw.headers
    assert "thinking=off" in raw.headers["x-gateway-rewrites"]
