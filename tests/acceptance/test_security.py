"""Bad input, resource limits and security: cases 26-36 of docs/failures.md.

Malformed and hostile requests are written as raw bytes where a well-behaved client library would
refuse to send them (smuggling probes, Host-header tricks, bare CR). The upstream is FU
(tests/support/faults.py); "0 upstream attempts" is checked on what FU actually received.
"""

from __future__ import annotations

import copy
import hashlib
import hmac
import importlib.metadata
import json
import random
import re
import select
import socket
import string
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from gateway.edge.auth import KeyAuth
from gateway.pipeline.body import read_object
from gateway.pipeline.rewrite import cap_to_context, check_request, rewrite
from gateway.routing.table import parse_table
from gateway.team.keys import build_keyring
from tests.support.asgi import Downstream, call, http_scope
from tests.support.fault_behaviours import HugeBody, Reply, Sse
from tests.support.fault_records import now
from tests.support.faults import FaultServer, fault_server
from tests.support.gateway_answers import addresses_in, assert_envelope, series_count, strict_json
from tests.support.gateway_process import GatewayProcess, chat_body, routes_yaml, rss_bytes, wait_until
from tests.support.harness import Running, eventually, run_gateway
from tests.support.rawhttp import (
    HttpReader,
    RawResponse,
    address_of,
    connect,
    encode_request,
    free_port,
    http_request,
    send_raw,
)

CHAT = "/v1/chat/completions"
REPO = Path(__file__).resolve().parents[2]

# What every real client sends with a JSON body (open mode refuses a body without it).
JSON = ("Content-Type", "application/json")


def post(gw: Running, body: dict[str, Any] | bytes, timeout: float = 10.0, **kw: Any) -> RawResponse:
    return http_request(address_of(gw.url), "POST", CHAT, body, timeout=timeout, **kw)


def raw_exchange(gw: Running, data: bytes, timeout: float = 5.0) -> RawResponse:
    """Send bytes as they are; a server that closes without answering gives status 0."""
    with connect(address_of(gw.url), timeout) as sock:
        try:
            return send_raw(sock, data, timeout)
        except (ConnectionResetError, BrokenPipeError):
            return RawResponse(closed=True)


@pytest.fixture(scope="module")
def upstream() -> Iterator[FaultServer]:
    with fault_server(name="A") as server:
        yield server
        assert server.errors == []  # the scripted upstream itself must not have failed


@pytest.fixture(scope="module")
def gw(upstream: FaultServer) -> Iterator[Running]:
    with run_gateway(
        routes_yaml([("A", upstream.url)]), max_body_bytes=1024 * 1024, body_timeout=1
    ) as running:
        yield running


# --- 26: body too large ---------------------------------------------------------------------------------


def test_case_26_content_length_above_the_limit(gw: Running, upstream: FaultServer) -> None:
    """Case 26: Content-Length over the limit: 413 request_too_large at once, body unread, 0 upstream."""
    before = len(upstream.chat_requests)
    head = encode_request(
        "POST",
        CHAT,
        None,
        [("Content-Type", "application/json"), ("Content-Length", str(2 * 1024 * 1024 + 1))],
    )
    with connect(address_of(gw.url)) as sock:
        # The body is never sent: a gateway that waited for it would answer 408 at the body timeout.
        response = send_raw(sock, head, timeout=5)
    assert_envelope(response, 413, "invalid_request_error", "request_too_large")
    assert len(upstream.chat_requests) == before


def test_case_26_chunked_body_above_the_limit(gw: Running, upstream: FaultServer) -> None:
    """Case 26: a chunked body over the limit gets 413 after <= limit + 64 KiB is read."""
    limit = 1024 * 1024
    before = len(upstream.chat_requests)
    piece = b"x" * 16 * 1024
    frame = b"%x\r\n%s\r\n" % (len(piece), piece)
    with connect(address_of(gw.url)) as sock:
        sock.sendall(encode_request("POST", CHAT, None, [JSON, ("Transfer-Encoding", "chunked")]))
        sent = 0
        answered = False
        while sent < 8 * limit:
            try:
                sock.sendall(frame)
            except (BrokenPipeError, ConnectionResetError):
                answered = True
                break
            sent += len(piece)
            sock.settimeout(0.005)
            try:
                if sock.recv(1, socket.MSG_PEEK):
                    answered = True
                    break
            except TimeoutError:
                continue
        assert answered, "the gateway read 8x the limit without answering"
        assert sent <= limit + 64 * 1024 + 256 * 1024, sent  # 256 KiB for what the kernel holds in transit
        sock.settimeout(5)
        with sock.makefile("rb") as stream:
            status_line = stream.readline()
    assert b" 413 " in status_line, status_line
    assert len(upstream.chat_requests) == before


@pytest.mark.slow
def test_case_26_memory_stays_within_twice_the_limit(upstream: FaultServer) -> None:
    """Case 26: RSS growth <= 2 x the body limit while oversized bodies are refused."""
    limit = 8 * 1024 * 1024
    with run_gateway(routes_yaml([("A", upstream.url)]), max_body_bytes=limit) as running:
        chunk = b"y" * (256 * 1024)
        frame = b"%x\r\n%s\r\n" % (len(chunk), chunk)

        def oversized() -> None:
            with connect(address_of(running.url), 10) as sock:
                sock.sendall(encode_request("POST", CHAT, None, [JSON, ("Transfer-Encoding", "chunked")]))
                try:
                    for _ in range(4 * limit // len(chunk)):
                        sock.sendall(frame)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        oversized()  # warm-up: the first large read sizes the allocator's arenas
        baseline = rss_bytes()
        for _ in range(3):
            oversized()
        assert rss_bytes() - baseline <= 2 * limit


@pytest.mark.parametrize(
    "headers",
    [
        [("X-Big", "a" * 100_000)],
        [(f"X-Field-{i}", "1") for i in range(150)],
    ],
    ids=["100-KB-header", "150-fields"],
)
def test_case_26_request_headers_too_large(
    gw: Running, upstream: FaultServer, headers: list[tuple[str, str]]
) -> None:
    """Headers over 64 KiB or 100 fields get 431 headers_too_large and never reach a replica."""
    before = len(upstream.chat_requests)
    response = raw_exchange(gw, encode_request("POST", CHAT, chat_body(), headers))
    assert_envelope(response, 431, "invalid_request_error", "headers_too_large")
    assert len(upstream.chat_requests) == before


# --- 27: slowloris --------------------------------------------------------------------------------------


def test_case_27_body_slowloris_times_out(gw: Running, upstream: FaultServer) -> None:
    """A body sent one byte at a time is cut at the body timeout: 408 body_timeout (or a close)."""
    before = len(upstream.chat_requests)
    with connect(address_of(gw.url), 10) as sock:
        sock.sendall(encode_request("POST", CHAT, None, [JSON, ("Content-Length", "100")]))
        answered = False
        sent = 0
        for _ in range(40):  # <= 10 s at 4 bytes a second
            try:
                sock.sendall(b"{")
                sent += 1
            except (BrokenPipeError, ConnectionResetError):
                break
            readable, _, _ = select.select([sock], [], [], 0.25)
            if readable:
                answered = True
                break
        response = RawResponse(closed=True)
        if answered:
            reader = HttpReader(sock)
            reader.read_head(3)
            response = reader.read_body(3)
    assert response.status in (0, 408), response.status
    if response.status == 408:
        assert_envelope(response, 408, "invalid_request_error", "body_timeout")
    assert 1 < sent < 40  # it waited while bytes trickled, and not for the whole trickle
    entry = eventually(lambda: [e for e in gw.log_entries() if e.get("error_code") == "body_timeout"])
    assert entry, "the cut was not the body timeout"
    assert len(upstream.chat_requests) == before


@pytest.mark.slow
def test_case_27_hundred_slowloris_clients_do_not_stop_normal_requests(upstream: FaultServer) -> None:
    """Case 27: 100 slowloris clients hold no slot: a normal request still succeeds."""
    with run_gateway(
        routes_yaml([("A", upstream.url)], limits={"max_in_flight": 4, "queue": 0}), body_timeout=2
    ) as running:
        socks = []
        try:
            for _ in range(100):
                sock = connect(address_of(running.url), 10)
                sock.sendall(encode_request("POST", CHAT, None, [JSON, ("Content-Length", "1000")]) + b"{")
                socks.append(sock)
            response = post(running, chat_body(), timeout=5)
            assert response.status == 200
            deadline = now() + 2 + 5
            for sock in socks:
                sock.settimeout(max(0.1, deadline - now()))
                try:
                    answer = sock.recv(65536)
                except (TimeoutError, ConnectionResetError):
                    answer = b"TIMEOUT"
                assert answer == b"" or b" 408 " in answer.split(b"\r\n", 1)[0], answer[:100]
        finally:
            for sock in socks:
                sock.close()


# --- 28: malformed JSON ---------------------------------------------------------------------------------

DEEP = (
    b'{"model":"m","messages":[{"role":"user","content":"x"}],"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
)
MALFORMED = [
    ("invalid-json", b'{"model": "m", "messages": [', 400, "invalid_json", None),
    ("top-level-array", b'[{"model": "m"}]', 400, "invalid_json", None),
    ("top-level-string", b'"hello"', 400, "invalid_json", None),
    (
        "model-not-a-string",
        b'{"model": 5, "messages": [{"role": "user", "content": "x"}]}',
        400,
        None,
        "model",
    ),
    (
        "unknown-task",
        b'{"task": "no-such-task", "messages": [{"role": "user", "content": "x"}]}',
        400,
        "unknown_task",
        "task",
    ),
    ("depth-100000", DEEP, 400, None, None),
    (
        "nan",
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        400,
        "invalid_json",
        None,
    ),
    (
        "infinity",
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": Infinity}',
        400,
        "invalid_json",
        None,
    ),
    (
        "1e999",
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 1e999}',
        400,
        "invalid_json",
        None,
    ),
    (
        "not-utf8",
        b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe\xfd"}]}',
        400,
        "invalid_json",
        None,
    ),
    (
        "unknown-model",
        b'{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}',
        404,
        "model_not_found",
        "model",
    ),
]


@pytest.mark.parametrize(
    ("body", "status", "code", "param"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_case_28_malformed_json_family(
    gw: Running, upstream: FaultServer, body: bytes, status: int, code: str | None, param: str | None
) -> None:
    """Case 28: each malformed body gets 400 (unknown model: 404) with its param, 0 upstream."""
    before = len(upstream.chat_requests)
    response = post(gw, body)
    error = assert_envelope(response, status, "invalid_request_error", code)
    if param is not None:
        assert error["param"] == param, error
    assert len(upstream.chat_requests) == before


def test_case_28_lone_surrogate_is_never_a_5xx(gw: Running, upstream: FaultServer) -> None:
    """Case 28: a lone surrogate in content gets 400 or passes through escaped, never 5xx."""
    before = len(upstream.chat_requests)
    response = post(gw, b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}')
    assert response.status in (200, 400), response.body
    if response.status == 400:
        assert_envelope(response, 400, "invalid_request_error")
        assert len(upstream.chat_requests) == before
    else:
        strict_json(upstream.chat_requests[-1].body)  # forwarded as valid JSON


def test_case_28_missing_model_routes_to_the_default(gw: Running, upstream: FaultServer) -> None:
    """Case 28, adapted: no `model` goes to routing.default (documented), never a 5xx."""
    response = post(gw, {"messages": [{"role": "user", "content": "x"}]})
    assert response.status == 200, response.body
    assert upstream.chat_requests[-1].json()["model"] == "m"


# --- 29: rewrite invariants -----------------------------------------------------------------------------

PROPERTY_TABLE = parse_table(
    """
presets:
  plain: {served_model: plain-served, replicas: [{name: p, url: "http://127.0.0.1:9", engine: vllm}]}
  tuned:
    served_model: tuned-served
    max_tokens: 4096
    min_max_tokens: 512
    params: {temperature: 0.6, top_p: 0.9}
    replicas: [{name: t, url: "http://127.0.0.1:9", engine: llamacpp}]
  thinker:
    served_model: thinker-served
    thinking: true
    replicas: [{name: k, url: "http://127.0.0.1:9", engine: llamacpp}]
routing: {default: plain}
"""
)
TEXT = {"type": "string", "maxLength": 12}
CHAT_SCHEMA = {
    "type": "object",
    "properties": {
        "model": {"enum": ["plain", "tuned", "thinker", "auto"]},
        "messages": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"role": {"enum": ["system", "user", "assistant"]}, "content": TEXT},
                "required": ["role", "content"],
                "additionalProperties": False,
            },
        },
        "stream": {"type": "boolean"},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": 200_000},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": 200_000},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "chat_template_kwargs": {
            "type": "object",
            "properties": {
                "enable_thinking": {"type": "boolean"},
                "custom": TEXT,
                "depth": {"type": "integer", "minimum": -9, "maximum": 9},
            },
            "additionalProperties": False,
        },
        "stream_options": {
            "type": "object",
            "properties": {"include_usage": {"type": "boolean"}},
            "additionalProperties": False,
        },
        "stop": {"type": "array", "items": TEXT, "maxItems": 3},
        "user": TEXT,
        "reasoning_effort": {"enum": ["none", "low", "high"]},
        # Past 64 bits on purpose: orjson alone would turn these into floats.
        "seed": {"type": "integer", "minimum": -(2**70), "maximum": 2**70},
    },
    "required": ["model", "messages"],
    "additionalProperties": False,
}
OWNED = {"model", "chat_template_kwargs", "max_tokens", "max_completion_tokens", "stream_options"}


def schema_strategy(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """hypothesis-jsonschema for the leaves; objects composed here, because its own object strategy
    fails with the installed hypothesis ('many' object has no attribute 'more')."""
    if schema.get("type") == "object":
        properties = {name: schema_strategy(sub) for name, sub in schema.get("properties", {}).items()}
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: v for k, v in properties.items() if k in required},
            optional={k: v for k, v in properties.items() if k not in required},
        )
    if schema.get("type") == "array" and schema.get("items", {}).get("type") == "object":
        return st.lists(
            schema_strategy(schema["items"]),
            min_size=schema.get("minItems", 0),
            max_size=schema.get("maxItems"),
        )
    return from_schema(schema)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=schema_strategy(CHAT_SCHEMA), context=st.sampled_from([None, 1024, 8192, 300_000]))
def test_case_29_rewrite_invariants(body: dict[str, Any], context: int | None) -> None:
    """Case 29: rewrite changes only owned keys, merges kwargs, caps tokens, is idempotent; from
    the bytes a client sends, so the parser's own changes (a big integer made a float) show too."""
    original = copy.deepcopy(body)
    body = read_object(json.dumps(body).encode(), max_depth=64)[0]
    check_request(body, "chat")
    route = PROPERTY_TABLE.resolve(body.get("model"), None, False)
    preset = route.preset
    plan = rewrite(body, preset, "chat", want_usage=True)
    body = plan.body
    upstream_body, _ = cap_to_context(body, context)
    wire = orjson.dumps(upstream_body)
    forwarded = strict_json(wire)
    for key, value in original.items():
        if key not in OWNED and key not in preset.params:
            assert json.dumps(forwarded[key]) == json.dumps(value), key  # 2**64 == 2.0**64 in Python
    for key in set(forwarded) - set(original):
        assert key in OWNED or key in preset.params, key
    assert forwarded["model"] == preset.served_model
    assert ("stream" in forwarded) == ("stream" in original)
    assert forwarded.get("stream") == original.get("stream")
    assert plan.stream == (original.get("stream") is True)
    for key, value in original.get("chat_template_kwargs", {}).items():
        assert forwarded["chat_template_kwargs"][key] == value  # merged, never clobbered
    token_key = next(
        (k for k in ("max_completion_tokens", "max_tokens") if original.get(k) is not None), None
    )
    budget = forwarded[token_key or "max_tokens"]
    wanted = original[token_key] if token_key else preset.max_tokens
    # The floor guards a budget that thinking would eat; a request that does not think keeps its own.
    thinks = (
        forwarded.get("chat_template_kwargs", {}).get("enable_thinking") is not False
        and forwarded.get("reasoning_effort") != "none"
    )
    if thinks:
        wanted = max(wanted, preset.min_max_tokens)
    assert budget == (min(wanted, context) if context else wanted)
    again = read_object(orjson.dumps(body), max_depth=64)[0]
    again = rewrite(again, preset, "chat", want_usage=True).body
    assert orjson.dumps(again) == orjson.dumps(body)  # idempotent


def test_case_29_upstream_body_is_valid_json_with_a_correct_length(
    gw: Running, upstream: FaultServer
) -> None:
    """Case 29: duplicate `model` keys collapse; upstream body is strict JSON, right Content-Length."""
    body = b'{"model": "no-such-model", "model": "alias-m", "stream": false, "messages": [{"role": "user", "content": "x"}]}'
    response = post(gw, body)
    assert response.status == 200, response.body
    request = upstream.chat_requests[-1]
    assert request.header("content-length") == str(len(request.body))
    assert request.header("transfer-encoding") is None
    forwarded = strict_json(request.body)  # duplicate keys would raise here
    assert forwarded["model"] == "m"
    assert forwarded["stream"] is False


# --- 30: event-loop isolation ---------------------------------------------------------------------------


PROBE = """
import json, socket, sys, time
port, seconds = int(sys.argv[1]), float(sys.argv[2])
request = b"GET /health HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\n\\r\\n"
lags = []
with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.monotonic()
        sock.sendall(request)
        data = b""
        while not (b"\\r\\n\\r\\n" in data and data.endswith(b"}")):
            piece = sock.recv(65536)
            if not piece:
                raise SystemExit("closed")
            data += piece
        lags.append(time.monotonic() - started)
        time.sleep(0.01)
print(json.dumps(lags))
"""


def probe_lags(port: int, seconds: float) -> subprocess.Popen[str]:
    """/health every 10 ms from a process of its own, so the test's threads do not skew the clock."""
    return subprocess.Popen(
        [sys.executable, "-c", PROBE, str(port), str(seconds)], stdout=subprocess.PIPE, text=True
    )


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


@pytest.mark.slow
def test_case_30_event_loop_isolation(tmp_path: Path) -> None:
    """Case 30: /health answers while 4 x 8 MiB bodies pass; a 100 MB error body is cut, a 502."""
    routes = tmp_path / "routes.yaml"
    big = "z" * (8 * 1024 * 1024)
    # A context that holds the 2M-token prompt: the gateway refuses a prompt it estimates longer
    # than the replica's context before sending it, and these bodies must pass.
    with fault_server(name="A", context=4_000_000) as a:
        routes.write_text(routes_yaml([("A", a.url)], limits={"max_in_flight": 8}))
        gateway = GatewayProcess(routes, free_port(), GATEWAY_LOG_REQUESTS="false").start()
        try:
            probe = probe_lags(gateway.port, 2.5)
            time.sleep(0.5)
            results: list[int] = []
            senders = [
                threading.Thread(
                    target=lambda: results.append(
                        http_request(gateway.address, "POST", CHAT, chat_body(content=big), timeout=30).status
                    ),
                    daemon=True,
                )
                for _ in range(4)
            ]
            for sender in senders:
                sender.start()
            for sender in senders:
                sender.join(30)
            output, _ = probe.communicate(timeout=10)
            lags = json.loads(output)
            assert results == [200] * 4
            assert len(a.chat_requests) == 4
            # How long a probe waited is a speed (bench/gateway.py measures it side by side); here
            # only that /health kept answering while the big bodies went through.
            print(f"case 30: probe p99 {_p99(lags) * 1000:.1f} ms over {len(lags)} probes")
            assert len(lags) >= 10

            a.push(HugeBody(status=502), HugeBody(status=502))
            response = http_request(gateway.address, "POST", CHAT, chat_body(), timeout=10)
            assert_envelope(response, 502, "upstream_error")
            huge = a.chat_requests[-1]
            assert huge.conn.eof.wait(3), "the gateway kept reading a 100 MB error body"
            assert huge.bytes_sent < 16 * 1024 * 1024  # what the gateway read, plus the kernel's buffers
        finally:
            gateway.stop()


# --- 31: authentication ---------------------------------------------------------------------------------

KEY = "sk-gw-0123456789abcdef"


@pytest.fixture(scope="module")
def locked(upstream: FaultServer) -> Iterator[Running]:
    with run_gateway(routes_yaml([("A", upstream.url)]), api_keys=KEY) as running:
        yield running


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "Basic dXNlcjpwYXNz",
        "Bearer",
        "Bearer ",
        "bearer-sk-WRONGKEY-CANARY",
        "Bearer sk-WRONGKEY-CANARY-42",
    ],
    ids=["missing", "basic", "bearer-no-token", "bearer-blank", "malformed", "wrong-key"],
)
@pytest.mark.parametrize(("method", "path"), [("POST", CHAT), ("GET", "/v1/models"), ("GET", "/metrics")])
def test_case_31_authentication(
    locked: Running, upstream: FaultServer, authorization: str | None, method: str, path: str
) -> None:
    """Case 31: missing, malformed or wrong key: 401 + WWW-Authenticate, key not echoed, 0 upstream."""
    before = len(upstream.chat_requests)
    headers = [("Authorization", authorization)] if authorization is not None else []
    body = chat_body() if method == "POST" else None
    response = http_request(address_of(locked.url), method, path, body, headers, timeout=5)
    assert_envelope(response, 401, "authentication_error")
    assert response.header("www-authenticate") == "Bearer"
    assert b"WRONGKEY" not in response.body
    assert len(upstream.chat_requests) == before


def test_case_31_keys_are_compared_with_compare_digest(
    locked: Running, upstream: FaultServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Case 31: keys are compared with hmac.compare_digest (a spy, not a timing test)."""
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return bool(real(a, b))

    # The keyring (gateway/team/keys.py) looks compare_digest up on the hmac module at each call, so
    # the spy sees them all; it compares the keys' SHA-256 digests, never the keys' own bytes.
    monkeypatch.setattr(hmac, "compare_digest", spy)
    response = post(locked, chat_body(), headers=[("Authorization", f"Bearer {KEY}")])
    assert response.status == 200
    known = hashlib.sha256(KEY.encode()).digest()
    assert (known, known) in calls
    calls.clear()
    assert post(locked, chat_body(), headers=[("Authorization", "Bearer sk-nope")]).status == 401
    assert calls, "a wrong key was rejected without compare_digest"


# --- 32: Host-header auth bypass ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /v1/models HTTP/1.1\r\nHost: localhost/v1/models?\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nHost: x/health#\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nHost: x/healthz#\r\n\r\n",
        b"GET http://localhost/v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n",
        b"GET http://localhost/health/../v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n",
        b"POST http://x/v1/chat/completions HTTP/1.1\r\nHost: x/health?\r\nContent-Length: 2\r\n\r\n{}",
    ],
    ids=[
        "host-path-query",
        "host-health-fragment",
        "host-healthz-fragment",
        "absolute-form",
        "absolute-dotdot",
        "absolute-post",
    ],
)
def test_case_32_host_header_auth_bypass(
    locked: Running, upstream: FaultServer, request_bytes: bytes
) -> None:
    """Case 32 (GHSA-94f4-hr76-p5j6): Host-header and absolute-form tricks without a key get 401."""
    before = len(upstream.requests)
    response = raw_exchange(locked, request_bytes)
    assert response.status == 401, (response.status, response.body[:200])
    assert len(upstream.requests) == before


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("host", "path"),
    [
        ("127.0.0.1/health#", "/v1/models"),
        ("localhost/ui?", "/v1/chat/completions"),
        ("x/health", "/metrics"),
        ("gateway", "/v1/models/../health"),
    ],
)
async def test_case_32_auth_decides_on_the_scopes_path_whatever_the_host_says(host: str, path: str) -> None:
    """Case 32: a Host header that names a public path, or a path that only looks like one, opens
    nothing: the key check reads the request's own path, never a URL rebuilt from the Host."""
    inner = Downstream()
    sent = await call(
        KeyAuth(inner, lambda: build_keyring([], [KEY])), http_scope(path, "GET", [("host", host)])
    )
    assert sent.status == 401 and inner.scopes == []
    opened = await call(
        KeyAuth(inner, lambda: build_keyring([], [KEY])), http_scope("/health", "GET", [("host", host)])
    )
    assert opened.status == 204  # and a public path stays public under any Host


# --- 33: SSRF / upstream selection ----------------------------------------------------------------------


@pytest.fixture
def trap() -> Iterator[socket.socket]:
    """A listener no request may ever reach."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        listener.setblocking(False)
        yield listener


def _trap_hits(listener: socket.socket) -> int:
    hits = 0
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return hits
        conn.close()
        hits += 1


@pytest.mark.parametrize("field", ["api_base", "base_url", "url", "extra_headers"])
def test_case_33_body_cannot_choose_the_upstream(
    gw: Running, upstream: FaultServer, trap: socket.socket, field: str
) -> None:
    """Case 33: api_base/base_url/url/extra_headers are rejected or stripped; the trap sees 0."""
    address = f"http://127.0.0.1:{trap.getsockname()[1]}/x"
    value: Any = {"Host": address} if field == "extra_headers" else address
    before = len(upstream.chat_requests)
    response = post(gw, chat_body(**{field: value}))
    if response.status == 200:
        assert field not in upstream.chat_requests[-1].json()  # stripped
    else:
        error = assert_envelope(response, 400, "invalid_request_error")
        assert error["param"] == field
        assert len(upstream.chat_requests) == before
    time.sleep(0.1)
    assert _trap_hits(trap) == 0


@pytest.mark.parametrize(
    "model", ["http://127.0.0.1:{port}/x", "../../admin", "/v1/../admin", "m/../../admin"]
)
def test_case_33_model_names_are_not_addresses(
    gw: Running, upstream: FaultServer, trap: socket.socket, model: str
) -> None:
    """Case 33: a model that looks like a URL or a path is a 404; nothing else is connected to."""
    before = len(upstream.chat_requests)
    name = model.format(port=trap.getsockname()[1])
    response = post(gw, chat_body(model=name))
    assert_envelope(response, 404, "invalid_request_error", "model_not_found")
    assert len(upstream.chat_requests) == before
    time.sleep(0.1)
    assert _trap_hits(trap) == 0


def test_case_33_upstream_redirect_is_not_followed() -> None:
    """Case 33: an upstream 302 is not followed: 502, no Location leaks. The redirect points back
    at the same scripted upstream, so a followed one would show there as a request to that path."""
    with fault_server(name="A") as a:
        location = f"{a.url}/latest/meta-data/?key=URLKEY"
        redirect = Reply(302, b"", headers=(("location", location),))
        a.push(redirect, redirect, redirect)
        with run_gateway(routes_yaml([("A", a.url)])) as running:
            response = post(running, chat_body())
        assert_envelope(response, 502, "upstream_error")
        assert b"URLKEY" not in response.body and b"meta-data" not in response.body
        assert response.header("location") is None
        assert [r.path for r in a.other_requests] == []  # /latest/meta-data was never asked for
        assert len(a.chat_requests) == 1


# --- 34: header hygiene ---------------------------------------------------------------------------------

HOP_AND_SECRET_HEADERS = [
    ("Authorization", "Bearer sk-client-CANARY-0001"),
    ("Proxy-Authorization", "Basic c2VjcmV0"),
    ("Cookie", "session=SECRET-COOKIE"),
    ("Connection", "keep-alive, X-Secret"),
    ("X-Secret", "1"),
    ("Keep-Alive", "timeout=99"),
    ("Proxy-Connection", "keep-alive"),
    ("TE", "trailers"),
    ("Upgrade", "h2c"),
    ("X-Forwarded-For", "1.2.3.4"),
]


def test_case_34_request_header_hygiene(tmp_path: Path) -> None:
    """Case 34: the replica sees no client secret or hop-by-hop header; its own key, length, XFF."""
    routes = tmp_path / "routes.yaml"
    with fault_server(name="A") as a:
        routes.write_text(routes_yaml([("A", a.url)], api_key_env="FU_BACKEND_KEY"))
        # The real process: its uvicorn settings (proxy_headers off) are part of what is checked.
        gateway = GatewayProcess(routes, free_port(), FU_BACKEND_KEY="BACKEND-KEY-34").start()
        try:
            response = http_request(
                gateway.address, "POST", CHAT, chat_body(), HOP_AND_SECRET_HEADERS, timeout=10
            )
        finally:
            gateway.stop()
        assert response.status == 200, response.body
        request = a.chat_requests[-1]
        names = {key.lower() for key, _ in request.headers}
        for forbidden in (
            "proxy-authorization",
            "cookie",
            "x-secret",
            "keep-alive",
            "proxy-connection",
            "te",
            "upgrade",
        ):
            assert forbidden not in names, (forbidden, request.headers)
        assert "x-secret" not in (request.header("connection") or "").lower()
        assert request.header_values("authorization") == ["Bearer BACKEND-KEY-34"]
        assert request.header_values("x-forwarded-for") == ["127.0.0.1"]
        assert request.header("content-length") == str(len(request.body))
        assert request.header("transfer-encoding") is None


def test_case_34_response_header_hygiene() -> None:
    """Case 34: replica hop-by-hop headers do not reach the client; no header names its address."""
    with fault_server(name="A") as a:
        address = f"127.0.0.1:{a.port}"
        hop = (
            ("Connection", "X-Hop"),
            ("X-Hop", "1"),
            ("Keep-Alive", "timeout=5"),
            ("Proxy-Authenticate", "Basic"),
            ("Upgrade", "h2c"),
            ("Trailer", "X-Checksum"),
            ("Server", f"vllm at {address}"),
            ("X-Upstream-Addr", address),
        )
        a.default = Reply(headers=hop)
        with run_gateway(routes_yaml([("A", a.url)])) as running:
            for body in (chat_body(), chat_body(stream=True)):
                if body["stream"]:
                    a.default = Sse(events=1, headers=hop)
                response = post(running, body)
                assert response.status == 200
                names = {key.lower() for key, _ in response.headers}
                for forbidden in (
                    "x-hop",
                    "keep-alive",
                    "proxy-authenticate",
                    "upgrade",
                    "trailer",
                    "x-upstream-addr",
                ):
                    assert forbidden not in names, (forbidden, response.headers)
                assert "x-hop" not in (response.header("connection") or "").lower()
                for key, value in response.headers:
                    assert str(a.port) not in value, (key, value)
                    assert addresses_in(value) == [], (key, value)


@pytest.mark.parametrize(
    "header_line",
    [
        b"X-Request-Id: a\rX-Injected: 1",
        b"X-Request-Id: a\nX-Injected: 1",
        b"X-Request-Id: a\r\n X-Injected: 1",
    ],
    ids=["bare-CR", "bare-LF", "obs-fold"],
)
def test_case_34_crlf_in_a_header_value(gw: Running, upstream: FaultServer, header_line: bytes) -> None:
    """Case 34: CR/LF inside a client header value gets 400 at the parser; nothing is split."""
    before = len(upstream.chat_requests)
    body = json.dumps(chat_body()).encode()
    raw = b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\n%s\r\nContent-Length: %d\r\n\r\n%s" % (
        CHAT.encode(),
        header_line,
        len(body),
        body,
    )
    response = raw_exchange(gw, raw)
    assert response.status in (0, 400), (response.status, response.headers)
    assert all(key.lower() != "x-injected" for key, _ in response.headers)
    assert len(upstream.chat_requests) == before


@pytest.mark.parametrize("field", ["model", "task"])
def test_case_34_crlf_in_a_body_value(gw: Running, upstream: FaultServer, field: str) -> None:
    """Case 34: a body value with CRLF gets a 4xx invalid_request_error, no 500, no split header."""
    before = len(upstream.chat_requests)
    body = chat_body()
    body[field] = "m\r\nX-Injected: 1"
    if field == "task":
        del body["model"]
    response = post(gw, body)
    assert response.status in (400, 404), response.body
    assert_envelope(response, response.status, "invalid_request_error")
    assert all(key.lower() != "x-injected" for key, _ in response.headers)
    assert len(upstream.chat_requests) == before


# --- 35: path allowlist and smuggling -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "target"),
    [
        ("GET", "/v1/../admin"),
        ("GET", "/%2e%2e/metrics"),
        ("GET", "//v1/models"),
        ("POST", "/v1/chat/completions/../../x"),
        ("POST", "/v1/chat/completions%00"),
        ("POST", "/V1/chat/completions"),
        ("POST", "/v1/chat/completions/"),
        ("POST", "/v1/fine_tuning/jobs"),  # embeddings is served now; a path no engine serves
        ("POST", "/v1/audio/speech"),
    ],
)
def test_case_35_path_allowlist(gw: Running, upstream: FaultServer, method: str, target: str) -> None:
    """Case 35: paths off the allowlist get the gateway's 404 envelope and 0 upstream attempts."""
    before = len(upstream.requests)
    body = chat_body() if method == "POST" else None
    response = raw_exchange(gw, encode_request(method, target, body))
    assert_envelope(response, 404, "invalid_request_error")
    probes = {"/health", "/v1/models", "/metrics"}
    assert [r.path for r in upstream.requests[before:] if r.path not in probes] == []


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


SMUGGLED = encode_request("POST", CHAT, chat_body(content="SMUGGLED"))
BODY = json.dumps(chat_body()).encode()
SMUGGLING = [
    (
        "CL-TE",
        b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n%s0\r\n\r\n%s"
        % (CHAT.encode(), len(_chunk(BODY)) + 5, _chunk(BODY), SMUGGLED),
    ),
    (
        "TE-CL",
        b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n%s0\r\n\r\n%s"
        % (CHAT.encode(), _chunk(BODY), SMUGGLED),
    ),
    (
        "duplicate-CL",
        b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\nContent-Length: 0\r\n\r\n%s%s"
        % (CHAT.encode(), len(BODY), BODY, SMUGGLED),
    ),
    (
        "bad-chunk-terminator",
        b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%sXX0\r\n\r\n%s"
        % (CHAT.encode(), len(BODY), BODY, SMUGGLED),
    ),
    (
        "bare-CR",
        b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\rContent-Length: %d\r\n\r\n%s%s"
        % (CHAT.encode(), len(BODY), BODY, SMUGGLED),
    ),
    (
        "TE-obfuscated",
        b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\nTransfer-Encoding: xchunked\r\n\r\n%s%s"
        % (CHAT.encode(), len(BODY), BODY, SMUGGLED),
    ),
]


@pytest.mark.parametrize("raw", [s[1] for s in SMUGGLING], ids=[s[0] for s in SMUGGLING])
def test_case_35_smuggling_probes(gw: Running, upstream: FaultServer, raw: bytes) -> None:
    """Case 35: smuggling probes get 400 or a close; the replica sees one request per accepted one."""
    before = len(upstream.chat_requests)
    with connect(address_of(gw.url), 5) as sock:
        sock.sendall(raw)
        sock.settimeout(3)
        received = b""
        deadline = now() + 3
        while now() < deadline:
            try:
                piece = sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not piece:
                break
            received += piece
    statuses = re.findall(rb"^HTTP/1\.1 (\d{3})", received, re.MULTILINE)
    accepted = sum(1 for status in statuses if status == b"200")
    forwarded = upstream.chat_requests[before:]
    assert len(forwarded) == accepted, (statuses, [r.body[:80] for r in forwarded])
    assert all(b"SMUGGLED" not in r.body for r in forwarded)
    assert statuses[:1] in ([], [b"400"]), statuses


def test_case_35_h11_is_pinned() -> None:
    """Case 35: h11 >= 0.16.0 (the request-smuggling fix) is pinned and installed."""
    version = tuple(int(part) for part in importlib.metadata.version("h11").split(".")[:2])
    assert version >= (0, 16)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'"h11>=0\.16(\.\d+)?"', pyproject)


# --- 36: no secrets or prompts in logs, errors or metrics -----------------------------------------------

CLIENT_KEY = "sk-test-CANARYKEY123456"
PROMPT = "PROMPT-CANARY-7f3a"
BACKEND_KEY = "BACKEND-CANARY-9b1c"
URL_KEY = "URLKEY-CANARY-5d2e"


@pytest.mark.slow
def test_case_36_no_secrets_or_prompts_in_logs_errors_or_metrics(tmp_path: Path) -> None:
    """Case 36: no key, prompt or backend-key canary in logs or bodies; metrics bounded, behind the key."""

    def route(request: Any) -> Any:
        text = request.body.decode(errors="replace")
        # A replica that echoes its own key and a keyed URL in an error (the prompt is not echoed:
        # the client sent it, so seeing it back leaks nothing).
        leaky = f"auth to http://10.9.8.7/v1?key={URL_KEY} failed with key {BACKEND_KEY}"
        if "fail-400" in text:
            return Reply(400, {"error": {"message": leaky, "type": "invalid_request_error", "code": 400}})
        if "fail-500" in text:
            return Reply(500, {"error": {"message": leaky, "type": "server_error", "code": 500}})
        if "fail-302" in text:
            return Reply(302, b"", headers=(("location", f"http://169.254.169.254/?key={URL_KEY}"),))
        if "fail-stream" in text:
            return Sse(events=1, partial=leaky.encode(), end="close", done=False)
        return Reply()

    routes = tmp_path / "routes.yaml"
    seen: list[bytes] = []
    with fault_server(name="A", route=route) as a:
        dead = f"http://127.0.0.1:{free_port()}"
        extra = {
            "down": {
                "served_model": "down",
                "replicas": [
                    {"name": "D", "url": dead, "engine": "vllm", "api_key_env": "CANARY_BACKEND_KEY"}
                ],
            }
        }
        routes.write_text(routes_yaml([("A", a.url)], api_key_env="CANARY_BACKEND_KEY", extra_presets=extra))
        gateway = GatewayProcess(
            routes,
            free_port(),
            GATEWAY_API_KEYS=CLIENT_KEY,
            GATEWAY_LOG_LEVEL="debug",
            CANARY_BACKEND_KEY=BACKEND_KEY,
        ).start()
        try:
            auth = [("Authorization", f"Bearer {CLIENT_KEY}")]
            with httpx2.Client(base_url=f"http://127.0.0.1:{gateway.port}", timeout=10) as client:
                for content, stream, model in [
                    (f"hello {PROMPT}", False, "m"),
                    (f"hello {PROMPT}", True, "m"),
                    (f"fail-400 {PROMPT}", False, "m"),
                    (f"fail-500 {PROMPT}", False, "m"),
                    (f"fail-302 {PROMPT}", False, "m"),
                    (f"fail-stream {PROMPT}", True, "m"),
                    (f"hello {PROMPT}", False, "down"),
                    (f"hello {PROMPT}", False, "no-such-model"),
                ]:
                    response = client.post(
                        CHAT, json=chat_body(content=content, stream=stream, model=model), headers=auth
                    )
                    seen.append(response.content + repr(response.headers.multi_items()).encode())
                wrong = client.post(
                    CHAT,
                    json=chat_body(content=PROMPT),
                    headers=[("Authorization", "Bearer sk-test-CANARYKEY999999")],
                )
                assert wrong.status_code == 401
                seen.append(wrong.content + repr(wrong.headers.multi_items()).encode())
                unauthorised = client.get("/metrics")
                assert unauthorised.status_code == 401  # /metrics on the main port needs the key
                before = series_count(client.get("/metrics", headers=auth).text)
                rng = random.Random(36)
                for _ in range(500):
                    name = "".join(rng.choices(string.ascii_letters, k=12))
                    client.post(CHAT, json=chat_body(model=name), headers=auth)
                text = client.get("/metrics", headers=auth).text
                seen.append(text.encode())
                assert series_count(text) - before <= 5, series_count(text) - before
        finally:
            gateway.stop()
        output = gateway.output()
    assert output, "the gateway wrote nothing at DEBUG: the test would prove nothing"
    leaks = []
    for where, blob in [
        ("stdout/stderr", output.encode()),
        *((f"response {i}", b) for i, b in enumerate(seen)),
    ]:
        for canary in ("CANARYKEY", PROMPT, BACKEND_KEY, URL_KEY):
            if canary.encode() in blob:
                at = blob.find(canary.encode())
                leaks.append((where, canary, blob[max(0, at - 80) : at + 40]))
    assert leaks == [], leaks


def test_case_36_metrics_on_their_own_port_leave_the_main_port(upstream: FaultServer) -> None:
    """Case 36: with GATEWAY_METRICS_PORT set, /metrics is not served on the main port."""
    with run_gateway(routes_yaml([("A", upstream.url)]), metrics_port=free_port()) as running:
        response = http_request(address_of(running.url), "GET", "/metrics", timeout=5)
        assert response.status == 404


def test_prompts_reach_the_log_only_when_enabled() -> None:
    """GATEWAY_LOG_PROMPTS adds the messages to the access log; off by default (case 36)."""
    canary = [{"role": "user", "content": "PROMPT-CANARY-log"}]
    body = chat_body(content="PROMPT-CANARY-log")
    with fault_server(name="A") as a:
        for enabled in (False, True):
            with run_gateway(routes_yaml([("A", a.url)]), log_prompts=enabled) as gw:
                response = http_request(address_of(gw.url), "POST", "/v1/chat/completions", body)
                assert response.status == 200
                assert wait_until(lambda: len(gw.log_entries()) == 1, 3)
                line = gw.log_entries()[0]
                assert (line.get("prompt") == canary) is enabled
                assert ("PROMPT-CANARY-log" in json.dumps(line)) is enabled


# --- the new surfaces: malformed parts, stored answers across keys, descriptors -------------------------


@pytest.fixture(scope="module")
def sim_gw() -> Iterator[Running]:
    from tests.support.harness import one_replica_table
    from tests.support.servers import sim_replica

    replica = sim_replica("vllm", "m")
    try:
        with run_gateway(one_replica_table(replica.url), api_keys="key-a,key-b") as running:
            yield running
    finally:
        replica.stop()


def _as(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


BAD_PART_TYPES = [["text"], {"kind": "text"}]


@pytest.mark.parametrize("bad", BAD_PART_TYPES, ids=["list", "object"])
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"model": "m", "messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages"),
        (
            "/v1/messages",
            {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [{}]}]},
            "messages",
        ),
        (
            "/v1/messages/count_tokens",
            {"model": "m", "messages": [{"role": "user", "content": [{}]}]},
            "messages",
        ),
        ("/v1/responses", {"model": "m", "input": [{"role": "user", "content": [{"text": "x"}]}]}, "input"),
    ],
    ids=["chat", "messages", "count_tokens", "responses"],
)
def test_a_content_part_type_that_is_not_a_string_is_a_400_in_the_dialect(
    sim_gw: Running, path: str, body: dict[str, Any], param: str, bad: Any
) -> None:
    body = copy.deepcopy(body)
    items = body["messages" if "messages" in body else "input"]
    items[0]["content"][0]["type"] = bad
    response = http_request(address_of(sim_gw.url), "POST", path, body, _as("key-a"), timeout=10)
    assert response.status == 400, response.body[:300]
    payload = response.json()
    error = payload["error"]
    if path.startswith("/v1/messages"):
        assert payload["type"] == "error" and error["type"] == "invalid_request_error"
    else:
        assert error["param"] == f"{param}[0].content[0].type"
    assert "must be a string" in error["message"]


@pytest.mark.parametrize("value", [{"id": "resp_1"}, ["resp_1"], 5, True])
def test_a_previous_response_id_that_is_not_a_string_is_a_400(sim_gw: Running, value: Any) -> None:
    body = {"model": "m", "input": "hi", "previous_response_id": value}
    response = http_request(address_of(sim_gw.url), "POST", "/v1/responses", body, _as("key-a"), timeout=10)
    assert response.status == 400 and response.json()["error"]["param"] == "previous_response_id"


# As sent on the wire: a superscript two and an Arabic-Indic one (str.isdigit accepts both, int()
# does not), 5000 digits (past int()'s limit).
@pytest.mark.parametrize("days", ["%C2%B2", "%D9%A1", "0", "36", "1" * 5000, "-1", "7.0"])
def test_usage_days_other_than_a_plain_number_is_a_400(sim_gw: Running, days: str) -> None:
    response = http_request(address_of(sim_gw.url), "GET", f"/v1/usage?days={days}", None, _as("key-a"))
    assert response.status == 400 and response.json()["error"]["code"] == "invalid_days"


def test_a_stored_response_is_its_own_keys_only(sim_gw: Running) -> None:
    address = address_of(sim_gw.url)
    made = http_request(
        address, "POST", "/v1/responses", {"model": "m", "input": "hi", "store": True}, _as("key-a")
    )
    assert made.status == 200
    response_id = made.json()["id"]
    target = f"/v1/responses/{response_id}"
    assert http_request(address, "GET", target, None, _as("key-b")).status == 404
    assert http_request(address, "DELETE", target, None, _as("key-b")).status == 404
    assert http_request(address, "GET", target, None, _as("key-a")).status == 200
    follow = {"model": "m", "input": "and then?", "previous_response_id": response_id}
    assert http_request(address, "POST", "/v1/responses", follow, _as("key-b")).status == 404


def test_the_connection_cap_fits_the_open_file_limit(tmp_path: Path) -> None:
    """300 unfinished heads under a hard file limit of 256: the cap is lowered to fit the
    descriptors (logged once), so a real request is answered instead of waiting in the backlog."""
    import resource

    with fault_server(name="A") as upstream:
        routes = tmp_path / "routes.yaml"
        routes.write_text(routes_yaml([("A", upstream.url)]))
        port = free_port()
        env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("GATEWAY_")}
        env.update({"GATEWAY_LOG_REQUESTS": "false", "GATEWAY_HEADER_TIMEOUT": "30"})
        out = tmp_path / "gateway.out"

        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

        with out.open("wb") as log:
            proc = subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "fleet-gateway"),
                    "serve",
                    "--routes",
                    str(routes),
                    "--port",
                    str(port),
                ],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=limit,
                start_new_session=True,
            )
        socks: list[socket.socket] = []
        try:
            assert wait_until(lambda: _answers(port), 20), out.read_text()
            for _ in range(300):
                try:
                    sock = socket.create_connection(("127.0.0.1", port), timeout=2)
                    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n")
                    socks.append(sock)
                except OSError:
                    break
            answer = http_request(("127.0.0.1", port), "GET", "/health", timeout=5)
            assert answer.status in (200, 503), "a real request waited unanswered"
            assert out.read_text().count("the open-file limit is 256") == 1
        finally:
            for sock in socks:
                sock.close()
            proc.kill()
            proc.wait(10)


def _answers(port: int) -> bool:
    try:
        return http_request(("127.0.0.1", port), "GET", "/health", timeout=1).status == 200
    except OSError:
        return False
