"""The gateway in front of real engines: two llama-server replicas and one vLLM replica, driven by
the official openai client. What the simulator only models is checked here against the real thing."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx2
import openai
import pytest

from tests.support.harness import Running, eventually, run_gateway

from .backends import LlamaServer, VllmServer

HELLO = [{"role": "user", "content": "Hello there"}]


def routes(llama: tuple[LlamaServer, LlamaServer], vllm: VllmServer) -> str:
    # Small budgets: the tiny random models never stop on their own (docs/engines.md §11).
    return f"""
defaults: {{max_tokens: 16, min_max_tokens: 0}}
presets:
  gguf:
    served_model: tiny-gguf
    aliases: [llama]
    replicas:
      - {{name: llama-a, url: "{llama[0].url}", engine: llamacpp}}
      - {{name: llama-b, url: "{llama[1].url}", engine: llamacpp}}
  hf:
    served_model: tiny
    aliases: [vllm]
    replicas: [{{name: vllm-0, url: "{vllm.url}", engine: vllm}}]
  hf-long:
    served_model: tiny
    max_tokens: 30000
    replicas: [{{name: vllm-1, url: "{vllm.url}", engine: vllm}}]
tasks: {{bulk: gguf}}
routing: {{default: gguf}}
"""


@pytest.fixture(scope="module")
def gateway(llama_pair: tuple[LlamaServer, LlamaServer], vllm_replica: VllmServer) -> Iterator[Running]:
    with run_gateway(routes(llama_pair, vllm_replica)) as running:
        yield running


@pytest.fixture(scope="module")
def client(gateway: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def direct(url: str, **body: Any) -> httpx2.Response:
    return httpx2.post(url + "/v1/chat/completions", json={"messages": HELLO, **body}, timeout=120)


@pytest.mark.parametrize("model", ["llama", "vllm"])
def test_non_streaming_through_the_gateway(client: openai.OpenAI, model: str) -> None:
    raw = client.chat.completions.with_raw_response.create(model=model, messages=HELLO)
    completion = raw.parse()
    assert completion.choices[0].finish_reason in ("length", "stop")
    assert completion.usage is not None and 0 < completion.usage.completion_tokens <= 16
    assert raw.headers["x-gateway-preset"] == ("gguf" if model == "llama" else "hf")
    assert raw.headers["x-gateway-cached-tokens"].isdigit()


@pytest.mark.parametrize("model", ["llama", "vllm"])
def test_streaming_through_the_gateway(client: openai.OpenAI, model: str) -> None:
    chunks = list(client.chat.completions.create(model=model, messages=HELLO, stream=True))
    assert chunks[-1].choices and chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert all(chunk.choices for chunk in chunks)  # the usage chunk the gateway asked for is hidden


@pytest.mark.parametrize("model", ["llama", "vllm"])
def test_streaming_with_usage_keeps_it(client: openai.OpenAI, model: str) -> None:
    chunks = list(
        client.chat.completions.create(
            model=model, messages=HELLO, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0


def test_no_think_injection_reaches_llama_servers_template(
    client: openai.OpenAI, llama_pair: tuple[LlamaServer, LlamaServer]
) -> None:
    """The replicas think by default; the gateway's enable_thinking=false adds the empty think block."""
    plain = direct(llama_pair[0].url, max_tokens=1).json()["usage"]["prompt_tokens"]
    off = direct(llama_pair[0].url, max_tokens=1, chat_template_kwargs={"enable_thinking": False})
    through = client.chat.completions.create(model="llama", messages=HELLO, max_tokens=1)
    assert through.usage is not None
    assert through.usage.prompt_tokens == off.json()["usage"]["prompt_tokens"] > plain


def test_no_think_injection_reaches_vllms_template(client: openai.OpenAI, vllm_replica: VllmServer) -> None:
    plain = direct(vllm_replica.url, model="tiny", max_tokens=1).json()["usage"]["prompt_tokens"]
    through = client.chat.completions.create(model="vllm", messages=HELLO, max_tokens=1)
    assert through.usage is not None and through.usage.prompt_tokens > plain


def test_the_clients_enable_thinking_wins_on_a_real_replica(
    client: openai.OpenAI, llama_pair: tuple[LlamaServer, LlamaServer]
) -> None:
    plain = direct(llama_pair[0].url, max_tokens=1).json()["usage"]["prompt_tokens"]
    through = client.chat.completions.create(
        model="llama",
        messages=HELLO,
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    assert through.usage is not None and through.usage.prompt_tokens == plain


def test_max_tokens_is_capped_to_what_the_prompt_leaves_of_vllms_max_model_len(
    client: openai.OpenAI, vllm_replica: VllmServer
) -> None:
    refused = direct(vllm_replica.url, model="tiny", max_tokens=30000)
    assert refused.status_code == 400  # vLLM rejects max_tokens above max_model_len
    raw = client.chat.completions.with_raw_response.create(model="hf-long", messages=HELLO, max_tokens=30000)
    assert raw.http_response.status_code == 200
    # Capped to what the prompt leaves of max_model_len (1024), not to the whole context.
    rewrites = dict(r.split("=", 1) for r in raw.headers["x-gateway-rewrites"].split(","))
    old, capped = (int(n) for n in rewrites["max_tokens"].split("->"))
    assert old == 30000 and 1024 // 2 < capped < 1024  # the prompt's estimate taken off


def test_round_robin_across_two_llama_servers(
    client: openai.OpenAI, llama_pair: tuple[LlamaServer, LlamaServer]
) -> None:
    def served() -> list[float]:
        return [_metric(server.url, "llamacpp:prompt_tokens_total") for server in llama_pair]

    before = served()
    seen = [
        client.chat.completions.with_raw_response.create(model="llama", messages=HELLO, max_tokens=1).headers[
            "x-gateway-replica"
        ]
        for _ in range(6)
    ]
    after = served()
    assert Counter(seen) == {"llama-a": 3, "llama-b": 3}
    assert all(b > a for a, b in zip(before, after, strict=True))  # both replicas really did the work


def test_context_overflow_error_keeps_llamas_status_and_message(client: openai.OpenAI) -> None:
    words = "w " * 9000  # beyond the 8192-token slot
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="llama", messages=[{"role": "user", "content": words}])
    assert "context" in str(caught.value)


def test_gateway_reads_context_lengths_from_v1_models(gateway: Running) -> None:
    contexts = {r.name: r.context for r in gateway.gateway.fleet.replicas()}
    assert contexts["vllm-0"] == 1024 and contexts["llama-a"] == 8192


def _metric(url: str, name: str) -> float:
    text = httpx2.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in {url}/metrics")


def test_a_session_on_vllm_comes_back_to_its_replica_whose_cache_figures_the_gateway_reads(
    vllm_replica: VllmServer,
) -> None:
    """vLLM has no slots: `policy: session` keeps a session on the replica that served it, and
    reads the replica's KV-cache use and prefix-cache hits from its /metrics on the probe cycle."""
    table = f"""
health: {{interval: 0.5}}
defaults: {{max_tokens: 4, min_max_tokens: 0}}
presets:
  hf:
    served_model: tiny
    policy: session
    replicas: [{{name: vllm-s, url: "{vllm_replica.url}", engine: vllm}}]
routing: {{default: hf}}
"""
    messages = [{"role": "system", "content": "You are a careful assistant. " * 30}, *HELLO]

    def replica_says() -> float:
        text = httpx2.get(vllm_replica.url + "/metrics", timeout=5).text
        lines = [line for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

    before = replica_says()  # the replica serves other tests too: its counters started earlier
    with run_gateway(table) as gw:
        for _ in range(2):
            answer = httpx2.post(
                gw.url + "/v1/chat/completions",
                json={"model": "tiny", "messages": messages},
                headers={"x-session-id": "vllm-session-1"},
                timeout=120,
            )
            assert answer.status_code == 200, answer.text

        def picks() -> list[str] | None:
            found = [e["pick"] for e in gw.log_entries() if e.get("endpoint") == "chat"]
            return found if len(found) == 2 else None  # the access log is written in batches

        assert eventually(picks) == ["session_new", "session_home"]

        def matching() -> dict[str, float] | None:
            page = httpx2.get(gw.url + "/ui/state", timeout=5).json()
            figures: dict[str, float] = page["presets"][0]["replicas"][0]["backend"]
            return figures if figures.get("prefix_cache_hits_tokens") == replica_says() else None

        figures = eventually(matching, timeout=30)
    assert figures is not None, "the gateway's figures never matched the replica's /metrics"
    assert figures["prefix_cache_hits_tokens"] > before  # the second turn found the first one's prefix
    assert 0.0 <= figures["kv_cache_usage_ratio"] <= 1.0
    assert figures["prefix_cache_queries_tokens"] >= figures["prefix_cache_hits_tokens"]
