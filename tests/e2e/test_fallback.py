"""Fallbacks between presets, for each reason, and the client's `x-gateway-fallback: none`.

Preset `a` falls back to `b`; both in front of scripted replicas on 127.0.0.1 (or, for `loading` and
`failed`, replicas the gateway launches). Every answer a fallback served says so in its
`x-gateway-fallback` header, the access log and the metrics.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.fault_behaviours import Reply
from tests.support.faults import fault_server
from tests.support.gateway_answers import metric
from tests.support.gateway_process import chat_body
from tests.support.harness import Running, eventually, run_gateway
from tests.support.rawhttp import RawResponse, address_of, free_port, http_request

NO_FALLBACK = [("x-gateway-fallback", "none")]
# vLLM's refusal of a prompt longer than max_model_len.
VLLM_TOO_LONG = {
    "error": {
        "message": "This model's maximum context length is 2048 tokens. However, you requested 2100 tokens "
        "(2084 in the messages, 16 in the completion). Please reduce the length of the messages.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
}


def preset(
    replica: dict[str, Any], name: str, limits: dict[str, Any] | None = None, **extra: Any
) -> dict[str, Any]:
    return {
        "served_model": name,
        "min_max_tokens": 0,
        "limits": {"max_in_flight": 4, "queue": 4, "queue_timeout": 5, **(limits or {})},
        "retries": {"attempts": 1},
        "timeouts": {"connect": 1, "first_byte": 10, "load": 20},
        "replicas": [replica],
        **extra,
    }


def remote(url: str, name: str) -> dict[str, Any]:
    return {"name": name, "url": url, "engine": "vllm"}


def table(a: dict[str, Any], b: dict[str, Any], **top: Any) -> str:
    spec = {
        "health": {"interval": 60, "timeout": 1},
        "presets": {"a": a, "b": b},
        "routing": {"default": "a"},
    }
    return json.dumps({**spec, **top})


def post(gw: Running, body: dict[str, Any], headers: list[tuple[str, str]] | None = None) -> RawResponse:
    return http_request(address_of(gw.url), "POST", "/v1/chat/completions", body, headers or [], timeout=30)


def fell_back(gw: Running, answer: RawResponse, reason: str) -> None:
    assert answer.status == 200, answer.body[:300]
    assert answer.header("x-gateway-fallback") == f"a->b ({reason})"
    assert answer.header("x-gateway-replica") == "b0"
    assert eventually(lambda: [e for e in gw.log_entries() if e.get("fallback")])
    entry = next(e for e in gw.log_entries() if e.get("fallback"))
    assert entry["fallback"] == f"a->b ({reason})" and entry["preset"] == "b"
    assert metric(gw.metrics(), "gateway_fallbacks_total", preset="a", target="b", reason=reason) == 1


def test_a_preset_with_no_ready_replica_falls_back_down() -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: the start-up probe marks it down
    with fault_server(name="B") as b:
        routes = table(preset(remote(dead, "a0"), "a", fallback=["b"]), preset(remote(b.url, "b0"), "b"))
        with run_gateway(routes) as gw:
            assert eventually(
                lambda: not gw.gateway.fleet.pools["a"].replicas[0].health.available(gw.gateway.clock())
            )
            fell_back(gw, post(gw, chat_body(model="a")), "down")
            refused = post(gw, chat_body(model="a"), NO_FALLBACK)
            assert refused.status == 503 and refused.header("x-gateway-fallback") is None
        assert len(b.chat_requests) == 1


def test_a_full_queue_falls_back_full() -> None:
    with fault_server(name="A") as a, fault_server(name="B") as b:
        a.push(Reply(delay=1.5))
        routes = table(
            preset(remote(a.url, "a0"), "a", {"max_in_flight": 1, "queue": 0}, fallback=["b"]),
            preset(remote(b.url, "b0"), "b"),
        )
        with run_gateway(routes) as gw, concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(post, gw, chat_body(model="a"))
            assert eventually(lambda: len(a.chat_requests) == 1)
            fell_back(gw, post(gw, chat_body(model="a")), "full")
            refused = post(gw, chat_body(model="a"), NO_FALLBACK)
            assert refused.status == 429 and refused.json()["error"]["code"] == "queue_full"
            assert held.result(timeout=20).status == 200
        assert len(a.chat_requests) == 1 and len(b.chat_requests) == 1


def test_a_prompt_longer_than_the_context_falls_back_before_any_gpu_time() -> None:
    long_prompt = "word " * 400  # 2000 characters and the role: 501 tokens by the estimate
    with fault_server(name="A", context=256) as a, fault_server(name="B", context=8192) as b:
        routes = table(preset(remote(a.url, "a0"), "a", fallback=["b"]), preset(remote(b.url, "b0"), "b"))
        with run_gateway(routes) as gw:
            assert eventually(lambda: gw.gateway.fleet.pools["a"].replicas[0].context == 256)
            fell_back(gw, post(gw, chat_body(model="a", content=long_prompt)), "context")
            refused = post(gw, chat_body(model="a", content=long_prompt), NO_FALLBACK)
            assert refused.status == 400
            error = refused.json()["error"]
            assert error["code"] == "context_length_exceeded"
            assert "about 501 tokens" in error["message"] and "its context is 256 tokens" in error["message"]
            assert post(gw, chat_body(model="a")).status == 200  # a short prompt stays on a
        assert len(a.chat_requests) == 1 and len(b.chat_requests) == 1


def test_an_estimated_too_long_prompt_without_a_fallback_gets_400_naming_both_sizes() -> None:
    with fault_server(name="A", context=128) as a, fault_server(name="B") as b:
        routes = table(preset(remote(a.url, "a0"), "a"), preset(remote(b.url, "b0"), "b"))
        with run_gateway(routes) as gw:
            assert eventually(lambda: gw.gateway.fleet.pools["a"].replicas[0].context == 128)
            refused = http_request(
                address_of(gw.url),
                "POST",
                "/v1/messages",
                {"model": "a", "max_tokens": 8, "messages": [{"role": "user", "content": "x" * 4000}]},
                timeout=10,
            )
            assert refused.status == 400
            payload = refused.json()
            assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
            # Claude Code compacts and retries on exactly Anthropic's wording (the estimate, far past).
            assert payload["error"]["message"] == "prompt is too long: 1001 tokens > 128 maximum"
        assert a.chat_requests == [] and a.other_requests == []  # refused before any GPU time


def test_the_engines_own_context_refusal_falls_back_context() -> None:
    with fault_server(name="A") as a, fault_server(name="B") as b:
        a.push(Reply(400, VLLM_TOO_LONG), Reply(400, VLLM_TOO_LONG))
        routes = table(preset(remote(a.url, "a0"), "a", fallback=["b"]), preset(remote(b.url, "b0"), "b"))
        with run_gateway(routes) as gw:
            fell_back(gw, post(gw, chat_body(model="a")), "context")
            refused = post(gw, chat_body(model="a"), NO_FALLBACK)
            assert refused.status == 400  # the engine's own refusal, its words kept
            assert "maximum context length is 2048 tokens" in refused.json()["error"]["message"]
        assert len(a.chat_requests) == 2 and len(b.chat_requests) == 1


def launched(port: int, name: str, command: list[str]) -> dict[str, Any]:
    return {
        "name": name,
        "url": f"http://127.0.0.1:{port}",
        "engine": "llamacpp",
        "launch": {"cmd": command, "grace": 5, "load_timeout": 20},
    }


def simulator(port: int, model: str, load_seconds: float) -> list[str]:
    return [
        sys.executable,
        *("-m", "gateway.simulator", "--engine", "llamacpp", "--port", str(port), "--model", model),
        *("--time-scale", "0", "--load-seconds", str(load_seconds)),
    ]


@pytest.mark.slow
def test_a_load_that_outlasts_the_clients_patience_falls_back_loading(tmp_path: Path) -> None:
    port = free_port()
    with fault_server(name="B") as b:
        routes = table(
            preset(launched(port, "a0", simulator(port, "a", load_seconds=4)), "a", fallback=["b"]),
            preset(remote(b.url, "b0"), "b"),
        )
        with run_gateway(routes, state_dir=tmp_path) as gw:
            answer = post(gw, chat_body(model="a"), [("x-gateway-max-wait", "0.5")])
            fell_back(gw, answer, "loading")
            # The start it began goes on: once a is ready, a's requests stay on a.
            assert eventually(lambda: gw.gateway.supervisor.units["a0"].state == "ready", timeout=20)
            again = post(gw, chat_body(model="a"), [("x-gateway-max-wait", "0.5")])
            assert again.status == 200 and again.header("x-gateway-fallback") is None
            bad = post(gw, chat_body(model="a"), [("x-gateway-max-wait", "soon")])
            assert bad.status == 400 and bad.json()["error"]["param"] == "x-gateway-max-wait"


@pytest.mark.slow
def test_a_failed_preset_falls_back_failed(tmp_path: Path) -> None:
    port = free_port()
    crash = [sys.executable, "-c", "import sys; sys.exit(3)"]
    with fault_server(name="B") as b:
        routes = table(
            preset(launched(port, "a0", crash), "a", fallback=["b"]),
            preset(remote(b.url, "b0"), "b"),
            restarts={"first_delay": 0, "max_failures": 1, "window": 60},
        )
        with run_gateway(routes, state_dir=tmp_path) as gw:
            first = post(gw, chat_body(model="a"))  # starts a0, which exits: a is failed
            assert first.status == 200 and first.header("x-gateway-fallback") in ("a->b (failed)",)
            assert gw.gateway.supervisor.units["a0"].state == "failed"
            fell_back(gw, first, "failed")
            refused = post(gw, chat_body(model="a"), NO_FALLBACK)
            assert refused.status == 503 and refused.json()["error"]["code"] == "replica_failed"
