"""Smoke tests of the real-backend kit itself: the engines answer the way the gateway tests expect.

These pin the facts from docs/engines.md that the gateway's end-to-end tests rely on, so a change of
engine build shows up here first, not as a puzzling gateway failure.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx2
import pytest

from bench.support import engines as backends

from .backends import LlamaServer, VllmServer

TIMEOUT = 60.0


def client(base_url: str) -> httpx2.Client:
    return httpx2.Client(base_url=base_url, timeout=TIMEOUT, trust_env=False)


def chat(base_url: str, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    with client(base_url) as http:
        response = http.post("/v1/chat/completions", json={"messages": messages, **fields})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def sse_events(base_url: str, messages: list[dict[str, Any]], **fields: Any) -> list[str]:
    """The ``data:`` payloads of a streamed chat completion, in order."""
    body = {"messages": messages, "stream": True, **fields}
    with client(base_url) as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, response.read().decode()
        assert response.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def long_prompt(tokens: int) -> list[dict[str, Any]]:
    # Both tiny tokenizers spend about one token per character on this made-up text.
    words = " ".join(f"w{i % 97}q{i % 13}" for i in range(tokens // 6))
    return [
        {"role": "system", "content": f"You are a test. {words}"},
        {"role": "user", "content": "Say something."},
    ]


HELLO = [{"role": "user", "content": "Hello there"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


# -- llama-server ---------------------------------------------------------------------------


def test_llama_pair_answers_chat(llama_pair: tuple[LlamaServer, LlamaServer]) -> None:
    assert llama_pair[0].port != llama_pair[1].port
    for server in llama_pair:
        body = chat(server.url, HELLO, max_tokens=4)
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["usage"]["completion_tokens"] <= 4


def test_llama_streams_sse_until_done(llama_pair: tuple[LlamaServer, LlamaServer]) -> None:
    events = sse_events(llama_pair[0].url, HELLO, max_tokens=4)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert "timings" in chunks[-1]


def test_llama_reuses_cached_prefix(llama_pair: tuple[LlamaServer, LlamaServer]) -> None:
    messages = long_prompt(2000)
    first = chat(llama_pair[1].url, messages, max_tokens=2)
    again = chat(llama_pair[1].url, messages, max_tokens=2)
    assert first["usage"]["prompt_tokens"] >= 2000
    assert again["timings"]["cache_n"] > 0
    assert again["timings"]["prompt_n"] < again["usage"]["prompt_tokens"]


def test_llama_enable_thinking_false_renders_think_block(
    llama_pair: tuple[LlamaServer, LlamaServer],
) -> None:
    plain = chat(llama_pair[0].url, HELLO, max_tokens=1)
    thinking_off = chat(
        llama_pair[0].url, HELLO, max_tokens=1, chat_template_kwargs={"enable_thinking": False}
    )
    # The servers start with enable_thinking true, so only an explicit false adds the
    # "<think>\n\n</think>\n\n" block.
    assert thinking_off["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]


def test_llama_models_report_slot_context(llama_pair: tuple[LlamaServer, LlamaServer]) -> None:
    server = llama_pair[0]
    with client(server.url) as http:
        data = http.get("/v1/models").json()["data"]
    assert len(data) == 1
    assert data[0]["meta"]["n_ctx"] == server.ctx // server.slots


def test_llama_slots_and_metrics(llama_pair: tuple[LlamaServer, LlamaServer]) -> None:
    server = llama_pair[0]
    with client(server.url) as http:
        slots = http.get("/slots").json()
        metrics = http.get("/metrics").text
    assert [slot["id"] for slot in slots] == list(range(server.slots))
    assert "llamacpp:requests_processing" in metrics


def test_llama_kill_and_restart(tiny_gguf: Path) -> None:
    with LlamaServer(tiny_gguf, slots=1, ctx=2048, name="restart") as server:
        pid = server.pid
        server.kill()
        assert not server.is_running()
        assert server.health_status() is None
        server.restart()
        assert server.pid != pid
        assert server.health_status() == 200
    assert not server.is_running()


def test_missing_backends_name_the_install_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("FLEET_LLAMA_SERVER", raising=False)
    monkeypatch.delenv("FLEET_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(backends, "BACKENDS", tmp_path)
    for locate in (backends.llama_server_binary, backends.vllm_python):
        with pytest.raises(backends.BackendsMissing, match="scripts/install-backends"):
            locate()
    monkeypatch.setenv("FLEET_LLAMA_SERVER", str(tmp_path / "llama-server"))
    with pytest.raises(backends.BackendsMissing, match="FLEET_LLAMA_SERVER"):
        backends.llama_server_binary()


# -- vLLM -------------------------------------------------------------------------------------


def test_vllm_answers_chat(vllm_replica: VllmServer) -> None:
    body = chat(vllm_replica.url, HELLO, model=vllm_replica.served_name, max_tokens=4)
    assert body["model"] == vllm_replica.served_name
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] <= 4


def test_vllm_streams_sse_until_done(vllm_replica: VllmServer) -> None:
    events = sse_events(
        vllm_replica.url,
        HELLO,
        model=vllm_replica.served_name,
        max_tokens=4,
        stream_options={"include_usage": True},
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] <= 4


def test_vllm_models_report_max_model_len(vllm_replica: VllmServer) -> None:
    with client(vllm_replica.url) as http:
        data = http.get("/v1/models").json()["data"]
    assert [model["id"] for model in data] == [vllm_replica.served_name]
    assert data[0]["max_model_len"] == vllm_replica.max_model_len == 1024


def test_vllm_reports_cached_prompt_tokens(vllm_replica: VllmServer) -> None:
    messages = long_prompt(300)
    chat(vllm_replica.url, messages, model=vllm_replica.served_name, max_tokens=2)
    again = chat(vllm_replica.url, messages, model=vllm_replica.served_name, max_tokens=2)
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    # Hits come in whole 32-token blocks and never include the last prompt token.
    assert cached > 0
    assert cached % 32 == 0
    assert cached < again["usage"]["prompt_tokens"]


def test_vllm_accepts_tools(vllm_replica: VllmServer) -> None:
    plain = chat(vllm_replica.url, HELLO, model=vllm_replica.served_name, max_tokens=2)
    with_tools = chat(vllm_replica.url, HELLO, model=vllm_replica.served_name, max_tokens=2, tools=TOOLS)
    # The tools are rendered into the system block of the prompt.
    assert with_tools["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 20
