"""The simulator over real sockets, spoken to as a gateway would (httpx2, the openai package)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx2
import openai
import orjson
import pytest

from gateway.simulator import SimConfig, create_app, serve_sim
from tests.support.servers import ThreadServer, free_port, serve

FAST = {"time_scale": 0.0, "reasoning_tokens": 6, "answer_tokens": 4}
CHAT = {"model": "qwen3", "messages": [{"role": "user", "content": "hello"}]}
LONG_SYSTEM = "You are a careful assistant. " * 40  # ~1100 bytes: several vLLM blocks


KNOBS = {"time_scale", "decode_tps", "prefill_tps", "reasoning_tokens", "answer_tokens"}
SHARED: dict[str, dict[str, Any]] = {"vllm": {"context": 4096}, "llamacpp": {"context": 8192, "slots": 2}}
_shared: dict[str, ThreadServer] = {}


@pytest.fixture(scope="module", autouse=True)
def _stop_shared_replicas() -> Iterator[None]:
    yield
    for srv in _shared.values():
        srv.stop()
    _shared.clear()


@contextlib.contextmanager
def replica(engine: str, **fields: Any) -> Iterator[tuple[ThreadServer, httpx2.Client]]:
    """A replica with these settings: a shared one, reset, when only run-time knobs differ (starts cost)."""
    fixed = {k: v for k, v in fields.items() if k not in KNOBS}
    if any(SHARED[engine].get(k) != v for k, v in fixed.items()):
        cfg = SimConfig(engine, "qwen3", **{**FAST, **fields})  # type: ignore[arg-type]
        with serve(create_app(cfg)) as srv, httpx2.Client(base_url=srv.url, timeout=10) as client:
            yield srv, client
        return
    if engine not in _shared:
        cfg = SimConfig(engine, "qwen3", **{**FAST, **SHARED[engine]})  # type: ignore[arg-type]
        _shared[engine] = ThreadServer(create_app(cfg)).start()
    srv = _shared[engine]
    defaults = SimConfig(engine, "qwen3", **FAST)  # type: ignore[arg-type]
    knobs = {k: fields.get(k, getattr(defaults, k)) for k in KNOBS}
    with httpx2.Client(base_url=srv.url, timeout=10) as client:
        assert client.post("/sim/reset").status_code == 200
        assert client.post("/sim/config", json={**knobs, "fail": None}).status_code == 200
        yield srv, client


def wait_for(probe: Callable[[], bool], what: str, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def stats(client: httpx2.Client) -> dict[str, Any]:
    result: dict[str, Any] = client.get("/sim/stats").json()
    return result


def sse(text: str) -> list[Any]:
    lines = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [orjson.loads(line) for line in lines[:-1]]


def chat(client: httpx2.Client, **extra: Any) -> dict[str, Any]:
    r = client.post("/v1/chat/completions", json={**CHAT, **extra})
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


# --- health, models, metrics --------------------------------------------------------------------------


def test_vllm_health_models_metrics_load() -> None:
    with replica("vllm", context=4096) as (_, c):
        health = c.get("/health")
        assert (health.status_code, health.content) == (200, b"")
        card = c.get("/v1/models").json()["data"][0]
        assert (card["id"], card["owned_by"], card["max_model_len"]) == ("qwen3", "vllm", 4096)
        assert c.get("/load").json() == {"server_load": 0}
        assert c.get("/version").json() == {"version": "0.32.0"}
        chat(c)
        text = c.get("/metrics").text
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert f'vllm:{name}{{engine="0",model_name="qwen3"}} 0.0' in text
        for name in ("prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total"):
            assert f'vllm:{name}{{engine="0",model_name="qwen3"}}' in text
        assert 'vllm:generation_tokens_total{engine="0",model_name="qwen3"} 10.0' in text
        assert c.get("/nope").json() == {"detail": "Not Found"}


def test_llama_health_models_props_slots_metrics() -> None:
    with replica("llamacpp", context=8192, slots=2) as (_, c):
        assert c.get("/health").json() == {"status": "ok"}
        models = c.get("/v1/models").json()
        assert len(models["data"]) == 1
        assert models["models"][0]["name"] == "qwen3"
        assert models["data"][0]["meta"]["n_ctx"] == 8192
        assert c.get("/models").json()["data"][0]["owned_by"] == "llamacpp"
        props = c.get("/props").json()
        assert (props["total_slots"], props["model_alias"]) == (2, "qwen3")
        assert props["default_generation_settings"]["n_ctx"] == 8192
        slots = c.get("/slots").json()
        assert [(s["id"], s["is_processing"], s["n_ctx"]) for s in slots] == [
            (0, False, 8192),
            (1, False, 8192),
        ]
        chat(c)
        text = c.get("/metrics").text
        assert "llamacpp:tokens_predicted_total 10.0" in text
        for name in (
            "prompt_tokens_total",
            "prompt_tokens_cached_total",
            "requests_processing",
            "requests_deferred",
        ):
            assert f"llamacpp:{name} " in text
        assert c.get("/nope").json()["error"] == {
            "code": 404,
            "message": "File Not Found",
            "type": "not_found_error",
        }


def test_llama_metrics_off_is_501() -> None:
    with replica("llamacpp", metrics=False) as (_, c):
        r = c.get("/metrics")
        assert r.status_code == 501
        assert r.json()["error"]["type"] == "not_supported_error"


# --- loading ------------------------------------------------------------------------------------------


def test_llama_loading_is_503_everywhere_but_models() -> None:
    with replica("llamacpp", load_seconds=60) as (_, c):
        for path in ("/health", "/v1/health", "/props", "/slots", "/metrics"):
            r = c.get(path)
            assert r.status_code == 503, path
            assert r.json() == {
                "error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}
            }
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 503
        models = c.get("/v1/models")
        assert models.status_code == 200
        assert models.json()["data"][0]["id"] == "qwen3"
        assert stats(c)["requests"] == 0


def test_vllm_refuses_connections_until_loaded() -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = free_port()
    cfg = SimConfig("vllm", "qwen3", time_scale=0, load_seconds=1.0)
    sim = asyncio.run_coroutine_threadsafe(serve_sim(cfg, port), loop).result(10)
    try:
        seen: list[Any] = []
        for _ in range(400):  # bounded: ~20 s at most
            try:
                seen.append(httpx2.get(f"{sim.url}/health", timeout=2).status_code)
                break
            except httpx2.ConnectError:
                seen.append("refused")
                time.sleep(0.05)
        assert seen[0] == "refused"
        assert seen[-1] == 200
        assert 503 not in seen
    finally:
        asyncio.run_coroutine_threadsafe(sim.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


# --- responses and streams ----------------------------------------------------------------------------


@pytest.mark.parametrize(("engine", "field"), [("vllm", "reasoning"), ("llamacpp", "reasoning_content")])
def test_non_stream_shape_and_reasoning_field(engine: str, field: str) -> None:
    with replica(engine) as (_, c):
        body = chat(c, model="anything" if engine == "llamacpp" else "qwen3")
        assert body["object"] == "chat.completion"
        assert body["model"] == "qwen3"
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert len(choice["message"][field].split()) == 6
        assert len(choice["message"]["content"].split()) == 4
        assert body["usage"]["completion_tokens"] == 10
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 10
        assert "cached_tokens" in body["usage"]["prompt_tokens_details"]
        assert ("timings" in body) is (engine == "llamacpp")


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_shape_usage_only_when_asked(engine: str, include_usage: bool) -> None:
    with replica(engine) as (_, c):
        extra: dict[str, Any] = {"stream": True}
        if include_usage:
            extra["stream_options"] = {"include_usage": True}
        r = c.post("/v1/chat/completions", json={**CHAT, **extra})
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = sse(r.text)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
        finals = [ch for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"]]
        assert len(finals) == 1
        assert finals[0]["choices"][0]["finish_reason"] == "stop"
        usage = [ch for ch in chunks if "usage" in ch]
        assert len(usage) == int(include_usage)
        if include_usage:
            assert usage[0] is chunks[-1]
            assert usage[0]["choices"] == []
            assert usage[0]["usage"]["completion_tokens"] == 10


def test_openai_client_parses_both_dialects() -> None:
    for engine in ("vllm", "llamacpp"):
        with replica(engine) as (srv, _):
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
            done = client.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": "hi"}])
            assert done.choices[0].finish_reason == "stop"
            pieces = client.chat.completions.create(
                model="qwen3", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            text = "".join(ch.choices[0].delta.content or "" for ch in pieces if ch.choices)
            assert len(text.split()) == 4
            comp = client.completions.create(model="qwen3", prompt="once upon", max_tokens=2)
            assert comp.choices[0].finish_reason == "length"
            assert len(comp.choices[0].text.split()) == 2
            client.close()


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
def test_thinking_eats_max_tokens_unless_disabled(engine: str) -> None:
    field = "reasoning" if engine == "vllm" else "reasoning_content"
    with replica(engine, reasoning_tokens=300, answer_tokens=24) as (_, c):
        trap = chat(c, max_tokens=200)["choices"][0]
        assert trap["finish_reason"] == "length"
        assert not trap["message"]["content"]
        assert len(trap["message"][field].split()) == 200
        fine = chat(c, max_tokens=200, chat_template_kwargs={"enable_thinking": False})["choices"][0]
        assert fine["finish_reason"] == "stop"
        assert len(fine["message"]["content"].split()) == 24
        assert not fine["message"].get(field)


def test_string_enable_thinking() -> None:
    kwargs = {"chat_template_kwargs": {"enable_thinking": "false"}}
    with replica("vllm") as (_, c):
        assert chat(c, **kwargs)["choices"][0]["message"]["reasoning"]  # ignored: still thinking
    with replica("llamacpp") as (_, c):
        r = c.post("/v1/chat/completions", json={**CHAT, **kwargs})
        assert r.status_code == 400
        assert (
            r.json()["error"]["message"]
            == 'invalid type for "enable_thinking" (expected boolean, got string)'
        )


# --- prefix cache -------------------------------------------------------------------------------------


def conversation(system: str) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "hello"}]}


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
def test_prefix_cache(engine: str) -> None:
    with replica(engine) as (_, c):
        first = chat(c, **conversation(LONG_SYSTEM))["usage"]
        second = chat(c, **conversation(LONG_SYSTEM))["usage"]
        n = second["prompt_tokens"]
        cached = second["prompt_tokens_details"]["cached_tokens"]
        assert first["prompt_tokens_details"]["cached_tokens"] == 0
        if engine == "vllm":
            assert cached == (n - 1) // 16 * 16
        else:
            assert n - 2 <= cached <= n - 1  # the slot holds prompt+answer: LCP is the whole prompt
        changed = chat(c, **conversation("X" + LONG_SYSTEM[1:]))["usage"]
        # Only the role header before the changed byte can still match (llama-server is token-exact).
        assert changed["prompt_tokens_details"]["cached_tokens"] == (0 if engine == "vllm" else 4)
        s = stats(c)
        assert s["cached_tokens"] == cached + changed["prompt_tokens_details"]["cached_tokens"]


def test_vllm_cached_tokens_hidden_without_prompt_tokens_details() -> None:
    with replica("vllm", prompt_tokens_details=False) as (_, c):
        chat(c, **conversation(LONG_SYSTEM))
        usage = chat(c, **conversation(LONG_SYSTEM))["usage"]
        assert usage["prompt_tokens_details"] is None
        assert stats(c)["cached_tokens"] > 0


def test_llama_timings_report_cache() -> None:
    with replica("llamacpp") as (_, c):
        chat(c, **conversation(LONG_SYSTEM))
        body = chat(c, **conversation(LONG_SYSTEM))
        assert body["timings"]["cache_n"] == body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert body["timings"]["prompt_n"] == body["usage"]["prompt_tokens"] - body["timings"]["cache_n"]


# --- vLLM validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "status", "etype"),
    [
        ({"model": "gpt-4"}, 404, "NotFoundError"),
        ({"stream_options": {"include_usage": True}}, 400, "Bad Request"),
        ({"stream": False, "stream_options": {"include_usage": True}}, 400, "Bad Request"),
        ({"max_tokens": 4097}, 400, "BadRequestError"),
        ({"max_completion_tokens": 5000}, 400, "BadRequestError"),
        ({"messages": [{"role": "user", "content": "x" * 4 * 4100}]}, 400, "BadRequestError"),
    ],
)
def test_vllm_refusals(extra: dict[str, Any], status: int, etype: str) -> None:
    with replica("vllm", context=4096) as (_, c):
        r = c.post("/v1/chat/completions", json={**CHAT, **extra})
        assert r.status_code == status
        assert r.json()["error"]["type"] == etype
        assert r.json()["error"]["code"] == status
        if status == 404:
            assert "Valid aliases" in r.json()["error"]["message"]
        assert stats(c)["errors"] == 1


def test_vllm_accepts_unknown_fields_and_missing_model_but_not_other_content_types() -> None:
    with replica("vllm") as (_, c):
        assert chat(c, task="summarize", model=None)["model"] == "qwen3"
        r = c.post("/v1/chat/completions", content=orjson.dumps(CHAT), headers={"content-type": "text/plain"})
        assert r.status_code == 400
    with replica("llamacpp") as (_, c):
        r = c.post("/v1/chat/completions", content=orjson.dumps(CHAT), headers={"content-type": "text/plain"})
        assert r.status_code == 200


def test_llama_prompt_over_context() -> None:
    with replica("llamacpp", context=8192) as (_, c):
        r = c.post("/v1/chat/completions", json=conversation("x" * 4 * 8200))
        assert r.status_code == 400
        err = r.json()["error"]
        assert (err["type"], err["n_ctx"]) == ("exceed_context_size_error", 8192)
        assert err["n_prompt_tokens"] > 8192


# --- slots, queueing, disconnects ---------------------------------------------------------------------

SLOW = {"time_scale": 1.0, "decode_tps": 20.0, "reasoning_tokens": 0, "answer_tokens": 2000}


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
def test_one_slot_queues_the_second_request_and_disconnect_frees_it(engine: str) -> None:
    with replica(engine, slots=1, context=8192, **SLOW) as (srv, c):
        first = httpx2.Client(base_url=srv.url, timeout=10)
        with first.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            wait_for(lambda: stats(c)["running"] == 1, "first request to hold the slot")
            result: dict[str, Any] = {}

            def second() -> None:
                body = {**CHAT, "max_tokens": 3}
                result["r"] = httpx2.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30)

            thread = threading.Thread(target=second)
            thread.start()
            wait_for(lambda: stats(c)["queued"] == 1, "second request to queue")
            s = stats(c)
            assert (s["running"], s["in_flight"], s["completed"]) == (1, 2, 0)
            waiting = "vllm:num_requests_waiting" if engine == "vllm" else "llamacpp:requests_deferred"
            assert any(
                line.startswith(waiting) and line.endswith(" 1.0")
                for line in c.get("/metrics").text.splitlines()
            )
        first.close()  # the client goes away mid-stream
        thread.join(30)
        assert result["r"].status_code == 200
        assert result["r"].json()["choices"][0]["finish_reason"] == "length"
        wait_for(lambda: stats(c)["in_flight"] == 0, "slot to be released")
        s = stats(c)
        assert (s["aborted"], s["completed"], s["running"], s["queued"]) == (1, 1, 0, 0)


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
def test_disconnect_while_not_streaming_and_while_queued(engine: str) -> None:
    with replica(engine, slots=1, context=8192, **SLOW) as (srv, c):
        results: list[Any] = []

        def call() -> None:
            try:
                httpx2.post(f"{srv.url}/v1/chat/completions", json=CHAT, timeout=0.5)
            except httpx2.ReadTimeout as exc:
                results.append(exc)

        threads = [threading.Thread(target=call) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(results) == 2  # 2000 tokens at 20/s: far longer than the client waits
        wait_for(lambda: stats(c)["aborted"] == 2, "both requests to be aborted")
        wait_for(lambda: stats(c)["in_flight"] == 0, "in_flight to drop")
        assert stats(c)["running"] == 0
        assert stats(c)["queued"] == 0
        c.post("/sim/config", json={"time_scale": 0})
        assert chat(c, max_tokens=2)["choices"][0]["finish_reason"] == "length"


# --- tools, determinism, hooks ------------------------------------------------------------------------

TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look something up",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["query", "limit"],
        },
    },
}


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
def test_tool_call_output(engine: str) -> None:
    with replica(engine) as (_, c):
        ask = {"messages": [{"role": "user", "content": "Please call the lookup tool"}], "tools": [TOOL]}
        choice = chat(c, **ask)["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        call = choice["message"]["tool_calls"][0]
        assert call["id"] == "call_1"
        assert call["type"] == "function"
        assert call["function"]["name"] == "lookup"
        assert orjson.loads(call["function"]["arguments"]) == {"query": "example", "limit": 1}
        chunks = sse(c.post("/v1/chat/completions", json={**CHAT, **ask, "stream": True}).text)
        deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
        assert any("tool_calls" in d for d in deltas)
        plain = chat(c, tools=[TOOL])["choices"][0]
        assert plain["finish_reason"] == "stop"
        assert not plain["message"].get("tool_calls")


def test_same_seed_same_text_and_reset_restarts_the_sequence() -> None:
    texts = []
    for seed in (0, 0, 6):  # the shared replica (seed 0) twice, then a fresh one
        with replica("vllm", seed=seed) as (_, c):
            texts.append([chat(c)["choices"][0]["message"]["content"] for _ in range(2)])
            assert c.post("/sim/reset").json() == {"ok": True}
            assert stats(c)["requests"] == 0
            assert chat(c)["choices"][0]["message"]["content"] == texts[-1][0]
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]
    assert texts[0][0] != texts[0][1]


def test_stats_keep_raw_bodies_and_headers() -> None:
    with replica("llamacpp") as (_, c):
        raw = b'{"messages":[{"role":"user","content":"h\xc3\xa9"}],  "tools" : [] }'
        c.post(
            "/v1/chat/completions", content=raw, headers={"content-type": "application/json", "x-trace": "t1"}
        )
        s = stats(c)
        assert s["last_bodies"] == [raw.decode()]
        assert s["last_headers"][0]["x-trace"] == "t1"
        for _ in range(40):
            c.post("/v1/completions", json={"prompt": "p", "max_tokens": 1})
        assert len(stats(c)["last_bodies"]) == 32


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
def test_api_key(engine: str) -> None:
    with replica(engine, api_key="sekret") as (_, c):
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 401
        bad = c.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer nope"})
        assert bad.status_code == 401
        good = c.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer sekret"})
        assert good.status_code == 200
        assert c.get("/health").status_code == 200
        assert c.get("/v1/models").status_code == (401 if engine == "vllm" else 200)


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
@pytest.mark.parametrize("fail", ["500", "503"])
def test_injected_http_failures(engine: str, fail: str) -> None:
    with replica(engine) as (_, c):
        knobs = c.post("/sim/config", json={"fail": fail, "fail_count": 2}).json()
        assert knobs["fail"] == fail
        for _ in range(2):
            r = c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == int(fail)
            assert r.json()["error"]["code"] == int(fail)
            assert r.headers.get("retry-after") == ("1" if fail == "503" else None)
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert stats(c)["injected"] == 2


def test_injected_hang_and_close() -> None:
    with replica("vllm") as (srv, c):
        c.post("/sim/config", json={"fail": "hang"})
        with pytest.raises(httpx2.ReadTimeout):
            httpx2.post(f"{srv.url}/v1/chat/completions", json=CHAT, timeout=0.5)
        c.post("/sim/config", json={"fail": "close"})
        with pytest.raises(httpx2.RemoteProtocolError):
            httpx2.post(f"{srv.url}/v1/chat/completions", json=CHAT, timeout=5)
        c.post("/sim/config", json={"fail": None})
        chat(c)
        assert stats(c)["injected"] == 2


@pytest.mark.parametrize(
    "patch",
    [{"fail": "boom"}, {"nope": 1}, {"decode_tps": 0}, {"time_scale": "fast"}, {"fail_count": 0}, [1]],
)
def test_sim_config_rejects_bad_patches(patch: Any) -> None:
    with replica("vllm") as (_, c):
        r = c.post("/sim/config", json=patch)
        assert r.status_code == 400
        assert "error" in r.json()


def test_sim_config_changes_knobs_at_run_time() -> None:
    with replica("llamacpp") as (_, c):
        knobs = c.post("/sim/config", json={"reasoning_tokens": 0, "answer_tokens": 3}).json()
        assert (knobs["reasoning_tokens"], knobs["answer_tokens"]) == (0, 3)
        message = chat(c)["choices"][0]["message"]
        assert "reasoning_content" not in message
        assert len(message["content"].split()) == 3


def test_serve_sim_llamacpp_in_one_loop() -> None:
    async def scenario() -> list[int]:
        sims = [await serve_sim(SimConfig(e, "m", time_scale=0), free_port()) for e in ("llamacpp", "vllm")]
        try:
            async with httpx2.AsyncClient(timeout=5) as client:
                return [(await client.get(s.url + "/health")).status_code for s in sims]
        finally:
            for s in sims:
                await s.stop()

    assert asyncio.run(scenario()) == [200, 200]


def test_module_entry_point_runs_a_replica() -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.simulator", "--engine", "llamacpp", "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--model", "cli", "--slots", "2", "--no-metrics"])
    try:

        def up() -> bool:
            try:
                return httpx2.get(f"http://127.0.0.1:{port}/props", timeout=1).status_code == 200
            except httpx2.TransportError:
                return False

        wait_for(up, "the CLI replica", limit=30)
        props = httpx2.get(f"http://127.0.0.1:{port}/props").json()
        assert (props["model_alias"], props["total_slots"]) == ("cli", 2)
        assert httpx2.get(f"http://127.0.0.1:{port}/metrics").status_code == 501
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
