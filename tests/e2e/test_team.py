"""Named keys with their own presets, limits, priority and usage.

The gateway under uvicorn on 127.0.0.1, in front of scripted replicas (tests/support/faults.py, whose
answers report 5 prompt + 3 completion tokens) or simulated ones (every dialect); each key is given
by its SHA-256, so no secret sits in the table.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
from collections.abc import Sequence
from typing import Any

import httpx2
import pytest

from tests.support.fault_behaviours import Reply
from tests.support.faults import fault_server
from tests.support.gateway_answers import metric
from tests.support.gateway_process import chat_body
from tests.support.harness import Running, eventually, run_gateway
from tests.support.rawhttp import RawResponse, address_of, http_request
from tests.support.servers import sim_replica


def secret(name: str) -> str:
    return f"{name}-key"


def key(name: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "key_sha256": hashlib.sha256(secret(name).encode()).hexdigest(), **fields}


def preset(url: str, name: str, limits: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "served_model": name,
        "min_max_tokens": 0,
        "limits": {"max_in_flight": 8, "queue": 8, "queue_timeout": 5, **(limits or {})},
        "replicas": [{"name": f"{name}0", "url": url, "engine": "vllm"}],
        **extra,
    }


def routes(presets: dict[str, dict[str, Any]], keys: Sequence[dict[str, Any]]) -> str:
    table = {
        "health": {"interval": 60, "timeout": 1},
        "presets": presets,
        "routing": {"default": next(iter(presets))},
        "keys": list(keys),
    }
    return json.dumps(table)


def post(
    gw: Running,
    who: str,
    body: dict[str, Any],
    path: str = "/v1/chat/completions",
    headers: Sequence[tuple[str, str]] = (),
) -> RawResponse:
    auth = [("authorization", f"Bearer {secret(who)}")]
    return http_request(address_of(gw.url), "POST", path, body, headers=[*auth, *headers], timeout=20)


def get(gw: Running, who: str, target: str) -> RawResponse:
    auth = [("authorization", f"Bearer {secret(who)}")]
    return http_request(address_of(gw.url), "GET", target, headers=auth, timeout=10)


def messages_body(model: str, content: str = "hi") -> dict[str, Any]:
    return {"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": content}]}


def responses_body(model: str) -> dict[str, Any]:
    return {"model": model, "input": "hi", "max_output_tokens": 16}


def settle(gw: Running) -> None:
    """Tokens are charged just after an answer ends; wait for those charges."""
    gw.server.call(gw.gateway.team.settle())


def contents(server: Any) -> list[str]:
    return [req.json()["messages"][0]["content"] for req in server.chat_requests]


def anthropic_error(response: RawResponse) -> dict[str, Any]:
    payload = response.json()
    assert payload["type"] == "error", payload
    error: dict[str, Any] = payload["error"]
    return error


# --- presets -----------------------------------------------------------------------------------------


def test_a_key_may_use_only_its_presets_and_is_told_which() -> None:
    with fault_server(name="A") as a, fault_server(name="B") as b:
        table = routes(
            {"a": preset(a.url, "a"), "b": preset(b.url, "b")},
            [key("alice", presets=["a"]), key("bob")],
        )
        with run_gateway(table) as gw:
            assert post(gw, "alice", chat_body(model="a")).status == 200
            denied = post(gw, "alice", chat_body(model="b"))
            assert denied.status == 403
            error = denied.json()["error"]
            assert error["code"] == "preset_not_allowed"
            assert "'alice'" in error["message"] and "'b'" in error["message"]
            assert "its presets: a" in error["message"]
            # Claude Code's dialect: the same refusal as an Anthropic permission error.
            denied = post(gw, "alice", messages_body("b"), "/v1/messages")
            assert denied.status == 403
            assert anthropic_error(denied)["type"] == "permission_error"
            assert "its presets: a" in anthropic_error(denied)["message"]
            assert post(gw, "bob", chat_body(model="b")).status == 200  # no list: every preset
            assert eventually(
                lambda: (
                    metric(gw.metrics(), "gateway_key_limited_total", key="alice", limit="preset_not_allowed")
                    == 2
                )
            )
        assert len(b.chat_requests) == 1  # nothing of alice's reached b


def test_an_unknown_key_is_refused_and_anonymous_keys_keep_working() -> None:
    with fault_server(name="A") as a:
        table = routes({"a": preset(a.url, "a")}, [key("alice")])
        with run_gateway(table, api_keys="plain-one") as gw:
            assert post(gw, "mallory", chat_body(model="a")).status == 401
            plain = [("authorization", "Bearer plain-one")]
            answer = http_request(
                address_of(gw.url), "POST", "/v1/chat/completions", chat_body(model="a"), plain
            )
            assert answer.status == 200
            assert eventually(lambda: [e for e in gw.log_entries() if e["status"] == 200])
            assert [e["key"] for e in gw.log_entries() if e["status"] == 200] == ["anonymous"]


# --- rate and token limits ---------------------------------------------------------------------------


def test_requests_per_minute_counts_every_dialect_and_refuses_with_retry_after() -> None:
    replica = sim_replica("vllm", "a", reasoning_tokens=0, answer_tokens=4)
    try:
        table = routes(
            {"a": preset(replica.url, "a")}, [key("alice", limits={"requests_per_minute": 3}), key("bob")]
        )
        with run_gateway(table) as gw:
            assert post(gw, "alice", chat_body(model="a")).status == 200
            assert post(gw, "alice", messages_body("a"), "/v1/messages").status == 200
            assert post(gw, "alice", responses_body("a"), "/v1/responses").status == 200
            refused = post(gw, "alice", chat_body(model="a"))
            assert refused.status == 429
            error = refused.json()["error"]
            assert error["code"] == "requests_per_minute" and error["type"] == "rate_limit_exceeded"
            assert "requests_per_minute=3" in error["message"] and "60 s" in error["message"]
            retry = int(refused.header("retry-after") or "0")
            assert 1 <= retry <= 60
            refused = post(gw, "alice", messages_body("a"), "/v1/messages")
            assert refused.status == 429
            assert anthropic_error(refused)["type"] == "rate_limit_error"
            assert "requests_per_minute=3" in anthropic_error(refused)["message"]
            refused = post(gw, "alice", responses_body("a"), "/v1/responses")
            assert refused.status == 429 and "requests_per_minute=3" in refused.json()["error"]["message"]
            assert post(gw, "bob", chat_body(model="a")).status == 200  # one key's limit is its own
            text = gw.metrics()
            assert metric(text, "gateway_key_limited_total", key="alice", limit="requests_per_minute") == 3
            assert metric(text, "gateway_key_requests_total", key="alice") == 3
    finally:
        replica.stop()


def test_tokens_per_minute_are_charged_when_the_answer_ends() -> None:
    with fault_server(name="A") as a:  # 8 tokens (5 prompt + 3 completion) per answer
        table = routes({"a": preset(a.url, "a")}, [key("alice", limits={"tokens_per_minute": 16})])
        with run_gateway(table) as gw:
            for _ in range(2):
                assert post(gw, "alice", chat_body(model="a")).status == 200
                settle(gw)
            refused = post(gw, "alice", chat_body(model="a"))
            assert refused.status == 429
            error = refused.json()["error"]
            assert error["code"] == "tokens_per_minute"
            assert "tokens_per_minute=16" in error["message"] and "16 tokens" in error["message"]
            assert 1 <= int(refused.header("retry-after") or "0") <= 60
        assert len(a.chat_requests) == 2


def test_tokens_per_day_names_its_window() -> None:
    with fault_server(name="A") as a:
        table = routes({"a": preset(a.url, "a")}, [key("alice", limits={"tokens_per_day": 8})])
        with run_gateway(table) as gw:
            assert post(gw, "alice", chat_body(model="a")).status == 200
            settle(gw)
            refused = post(gw, "alice", messages_body("a"), "/v1/messages")
            assert refused.status == 429
            error = anthropic_error(refused)
            assert error["type"] == "rate_limit_error"
            assert "tokens_per_day=8" in error["message"] and "24 h" in error["message"]
            # The 24 h window slides from the first charge: not before a minute has passed.
            assert int(refused.header("retry-after") or "0") > 60


def test_a_stream_that_crosses_a_token_limit_runs_to_its_end() -> None:
    replica = sim_replica("vllm", "a", reasoning_tokens=0, answer_tokens=60)
    try:
        table = routes({"a": preset(replica.url, "a")}, [key("alice", limits={"tokens_per_minute": 20})])
        with run_gateway(table) as gw:
            answer = post(gw, "alice", chat_body(model="a", stream=True, max_tokens=200))
            assert answer.status == 200
            assert b"data: [DONE]" in answer.body and b'"finish_reason":"stop"' in answer.body.replace(
                b" ", b""
            )
            settle(gw)
            refused = post(gw, "alice", chat_body(model="a"))
            assert refused.status == 429 and refused.json()["error"]["code"] == "tokens_per_minute"
    finally:
        replica.stop()


LONG_PROMPT = "lorem ipsum dolor sit amet " * 1100  # about 7,500 tokens by the gateway's estimate


def test_a_stream_its_client_cuts_early_is_charged_for_its_prompt_and_what_it_streamed() -> None:
    # Slow enough that the client is gone long before the answer (and its usage) would end.
    replica = sim_replica("vllm", "a", reasoning_tokens=0, answer_tokens=400, time_scale=1.0, decode_tps=20)
    try:
        table = routes({"a": preset(replica.url, "a")}, [key("alice", limits={"tokens_per_minute": 1000})])
        with run_gateway(table) as gw:
            body = chat_body(model="a", stream=True, max_tokens=400, content=LONG_PROMPT)
            with (
                httpx2.Client(timeout=20) as client,
                client.stream(
                    "POST",
                    gw.url + "/v1/chat/completions",
                    json=body,
                    headers={"authorization": f"Bearer {secret('alice')}"},
                ) as stream,
            ):
                assert stream.status_code == 200
                for line in stream.iter_lines():
                    if '"content":"' in line.replace(" ", "") and '"content":""' not in line.replace(" ", ""):
                        break  # the first content event: the client leaves here
            entry = eventually(lambda: [e for e in gw.log_entries() if e["outcome"] == "client_disconnected"])
            assert entry
            settle(gw)
            refused = post(gw, "alice", chat_body(model="a"))
            assert refused.status == 429 and refused.json()["error"]["code"] == "tokens_per_minute"
            usage = get(gw, "alice", "/v1/usage").json()["presets"]["a"]
            assert usage["prompt_tokens"] >= 7000 and usage["completion_tokens"] >= 1
    finally:
        replica.stop()


def test_concurrent_requests_over_a_token_limit_are_refused_once_one_is_admitted() -> None:
    replica = sim_replica("vllm", "a", reasoning_tokens=0, answer_tokens=5, time_scale=1.0, decode_tps=5)
    try:
        table = routes(
            {"a": preset(replica.url, "a", limits={"queue": 32})},
            [key("alice", limits={"tokens_per_minute": 1000})],
        )
        with run_gateway(table) as gw:
            body = chat_body(model="a", max_tokens=16, content=LONG_PROMPT)
            with concurrent.futures.ThreadPoolExecutor(20) as pool:
                answers = list(pool.map(lambda _: post(gw, "alice", body), range(20)))
            statuses = sorted(answer.status for answer in answers)
            assert statuses == [200] + [429] * 19
            codes = {a.json()["error"]["code"] for a in answers if a.status == 429}
            assert codes == {"tokens_per_minute"}
    finally:
        replica.stop()


# --- concurrency -------------------------------------------------------------------------------------


def test_over_concurrent_a_request_waits_for_one_of_its_keys_requests() -> None:
    with fault_server(name="A") as a:
        a.push(Reply(delay=1.0))
        table = routes({"a": preset(a.url, "a")}, [key("alice", limits={"concurrent": 1}), key("bob")])
        with run_gateway(table) as gw, concurrent.futures.ThreadPoolExecutor(3) as pool:
            first = pool.submit(post, gw, "alice", chat_body(model="a", content="first"))
            assert eventually(lambda: len(a.chat_requests) == 1)
            second = pool.submit(post, gw, "alice", chat_body(model="a", content="second"))
            assert eventually(lambda: gw.gateway.team.waiting() == {"alice": 1})
            # Another key is not held back by alice's limit.
            assert post(gw, "bob", chat_body(model="a", content="bob")).status == 200
            assert contents(a) == ["first", "bob"]
            assert first.result(timeout=20).status == 200
            assert second.result(timeout=20).status == 200
        assert contents(a) == ["first", "bob", "second"]
        assert gw.gateway.team.in_flight() == {}


def test_a_request_that_waits_past_the_queue_timeout_for_its_key_gets_504() -> None:
    with fault_server(name="A") as a:
        a.push(Reply(delay=2.0))
        table = routes(
            {"a": preset(a.url, "a", {"queue_timeout": 0.3})}, [key("alice", limits={"concurrent": 1})]
        )
        with run_gateway(table) as gw, concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(post, gw, "alice", chat_body(model="a"))
            assert eventually(lambda: len(a.chat_requests) == 1)
            late = post(gw, "alice", chat_body(model="a"))
            assert late.status == 504
            error = late.json()["error"]
            assert error["code"] == "key_concurrency_timeout" and "concurrent=1" in error["message"]
            assert first.result(timeout=20).status == 200
        assert len(a.chat_requests) == 1


# --- priority ----------------------------------------------------------------------------------------


def test_an_interactive_request_never_waits_behind_queued_batch_requests() -> None:
    with fault_server(name="A") as a:
        a.push(Reply(delay=1.0))  # the first batch request holds the only place while others queue
        table = routes(
            {"a": preset(a.url, "a", {"max_in_flight": 1})},
            [key("eval", priority="batch"), key("alice")],
        )
        with run_gateway(table) as gw, concurrent.futures.ThreadPoolExecutor(6) as pool:
            pooled = gw.gateway.fleet.pools["a"]
            futures = [pool.submit(post, gw, "eval", chat_body(model="a", content="batch-0"))]
            assert eventually(lambda: len(a.chat_requests) == 1)
            for index in range(1, 4):
                futures.append(pool.submit(post, gw, "eval", chat_body(model="a", content=f"batch-{index}")))
                # One at a time: each is queued before the next is sent, so their order is certain.
                assert eventually(lambda index=index: pooled.queued_batch == index)
            futures.append(pool.submit(post, gw, "alice", chat_body(model="a", content="interactive")))
            assert eventually(lambda: pooled.queued == 4)
            assert [f.result(timeout=20).status for f in futures] == [200] * 5
        assert contents(a) == ["batch-0", "interactive", "batch-1", "batch-2", "batch-3"]
        entries = {e["key"]: e for e in gw.log_entries() if e["status"] == 200}
        assert entries["alice"]["priority"] == "interactive" and entries["eval"]["priority"] == "batch"
        assert entries["alice"]["queue_wait_ms"] > 0
        assert metric(gw.metrics(), "gateway_queue_wait_seconds_count", preset="a", priority="batch") == 4


def test_batch_requests_leave_a_share_of_each_replica_to_interactive_work() -> None:
    with fault_server(name="A") as a:
        a.push(*[Reply(delay=1.5)] * 4)
        # 4 places, batch_max_share 0.75: batch requests hold at most 3 of them at once.
        table = routes(
            {"a": preset(a.url, "a", {"max_in_flight": 4})}, [key("eval", priority="batch"), key("alice")]
        )
        with run_gateway(table) as gw, concurrent.futures.ThreadPoolExecutor(6) as pool:
            pooled = gw.gateway.fleet.pools["a"]
            batch = [pool.submit(post, gw, "eval", chat_body(model="a", content=f"b{i}")) for i in range(5)]
            assert eventually(lambda: len(a.chat_requests) == 3 and pooled.queued_batch == 2)
            replica = pooled.replicas[0]
            assert (replica.in_flight, replica.batch_in_flight) == (3, 3)
            interactive = pool.submit(post, gw, "alice", chat_body(model="a", content="interactive"))
            assert eventually(lambda: len(a.chat_requests) == 4)  # the free place, at once
            assert contents(a)[3] == "interactive"
            assert interactive.result(timeout=20).status == 200
            assert [f.result(timeout=20).status for f in batch] == [200] * 5
        assert a.max_active == 4


def test_a_request_may_lower_its_priority_but_never_raise_it() -> None:
    with fault_server(name="A") as a:
        a.push(Reply(delay=1.0))
        table = routes(
            {"a": preset(a.url, "a", {"max_in_flight": 1})}, [key("eval", priority="batch"), key("alice")]
        )
        lower = [("x-gateway-priority", "batch")]
        raise_ = [("x-gateway-priority", "interactive")]
        with run_gateway(table) as gw, concurrent.futures.ThreadPoolExecutor(4) as pool:
            pooled = gw.gateway.fleet.pools["a"]
            held = pool.submit(post, gw, "alice", chat_body(model="a", content="held"))
            assert eventually(lambda: len(a.chat_requests) == 1)
            lowered = pool.submit(post, gw, "alice", chat_body(model="a", content="lowered"), headers=lower)
            assert eventually(lambda: pooled.queued_batch == 1)
            raised = pool.submit(post, gw, "eval", chat_body(model="a", content="raised"), headers=raise_)
            assert eventually(lambda: pooled.queued_batch == 2)
            plain = pool.submit(post, gw, "alice", chat_body(model="a", content="plain"))
            assert eventually(lambda: pooled.queued == 3)
            assert all(f.result(timeout=20).status == 200 for f in (held, lowered, raised, plain))
        assert contents(a) == ["held", "plain", "lowered", "raised"]


# --- usage -------------------------------------------------------------------------------------------


def test_usage_per_key_and_preset_for_the_key_itself_and_for_an_admin() -> None:
    with fault_server(name="A") as a, fault_server(name="B") as b:
        table = routes(
            {"a": preset(a.url, "a"), "b": preset(b.url, "b")},
            [key("alice"), key("bob"), key("root", admin=True)],
        )
        with run_gateway(table) as gw:
            for model in ("a", "a", "b"):
                assert post(gw, "alice", chat_body(model=model)).status == 200
            assert post(gw, "bob", chat_body(model="a")).status == 200
            settle(gw)
            own = get(gw, "alice", "/v1/usage")
            assert own.status == 200
            payload = own.json()
            assert payload["key"] == "alice" and payload["since"].endswith("T00:00:00Z")
            counts = {"requests": 2, "prompt_tokens": 10, "cached_tokens": 0, "completion_tokens": 6}
            assert payload["presets"]["a"] == {**counts, "reasoning_tokens": 0}
            assert payload["presets"]["b"]["requests"] == 1
            assert set(get(gw, "bob", "/v1/usage").json()["presets"]) == {"a"}
            everyone = get(gw, "root", "/v1/usage?days=7").json()
            assert set(everyone["keys"]) == {"alice", "bob", "root"}
            assert everyone["keys"]["alice"]["a"]["requests"] == 2 and everyone["keys"]["root"] == {}
            assert get(gw, "alice", "/v1/usage?days=99").status == 400
            page = get(gw, "root", "/ui/state").json()["team"]
            assert page["today"]["keys"]["bob"]["a"]["requests"] == 1
            assert page["week"]["keys"]["alice"]["b"]["prompt_tokens"] == 5
            assert get(gw, "alice", "/ui/state").json()["team"]["week"]["keys"].keys() == {"alice"}
            text = gw.metrics()
            assert metric(text, "gateway_key_requests_total", key="alice", preset="a") == 2
            assert metric(text, "gateway_key_tokens_total", key="alice", preset="a", kind="prompt") == 10
            assert metric(text, "gateway_key_tokens_total", key="bob", kind="completion") == 3
            raw_log = gw.log.getvalue()
            for name in ("alice", "bob"):
                assert secret(name) not in text and secret(name).encode() not in raw_log
            served = [e["key"] for e in gw.log_entries() if e["endpoint"] == "chat"]
            assert sorted(served) == ["alice"] * 3 + ["bob"]
            refused = [e for e in gw.log_entries() if e["status"] == 400]
            assert [e["key"] for e in refused] == ["alice"]  # the bad usage query, by its key's name


def test_admin_endpoints_are_for_admin_keys() -> None:
    with fault_server(name="A") as a:
        table = routes({"a": preset(a.url, "a")}, [key("alice"), key("root", admin=True)])
        with run_gateway(table) as gw:
            denied = get(gw, "alice", "/admin/replicas")
            assert denied.status == 403 and denied.json()["error"]["code"] == "admin_only"
            assert get(gw, "root", "/admin/replicas").status == 200


# --- reload ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["routes", "keys_file"])
def test_keys_reload_without_dropping_a_running_request(tmp_path: Any, where: str) -> None:
    with fault_server(name="A") as a:
        a.push(Reply(delay=1.0))
        routes_path, keys_path = tmp_path / "routes.yaml", tmp_path / "keys.yaml"

        def write(keys: list[dict[str, Any]]) -> None:
            if where == "routes":
                routes_path.write_text(routes({"a": preset(a.url, "a")}, keys))
            else:
                routes_path.write_text(routes({"a": preset(a.url, "a")}, []))
                keys_path.write_text(json.dumps({"keys": keys}))

        write([key("alice")])
        extra = {"keys_file": keys_path} if where == "keys_file" else {}
        with run_gateway(routes_path.read_text(), routes=routes_path, **extra) as gw:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                running = pool.submit(post, gw, "alice", chat_body(model="a"))
                assert eventually(lambda: len(a.chat_requests) == 1)
                write([key("bob", limits={"requests_per_minute": 1})])
                gw.server.call(_reload(gw))
                assert running.result(timeout=20).status == 200  # admitted before: it finishes
            assert post(gw, "alice", chat_body(model="a")).status == 401
            assert post(gw, "bob", chat_body(model="a")).status == 200
            assert post(gw, "bob", chat_body(model="a")).status == 429  # the new limits hold at once
            write([key("bob"), key("bob")])  # a broken declaration keeps the keys in force
            with pytest.raises(Exception, match="already used"):
                gw.server.call(_reload(gw))
            assert post(gw, "bob", chat_body(model="a")).status == 429


async def _reload(gw: Running) -> None:
    gw.gateway.reload()
