"""Failure behaviour against real llama-server replicas: a replica killed under streaming load, and
client disconnects that must free the replica's slot."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx2
import orjson
import pytest

from tests.support.harness import Running, eventually, run_gateway
from tests.support.streams import kill_routes, stream_once

from .backends import LlamaServer

CHAT = "/v1/chat/completions"


@pytest.fixture
def pair(tiny_gguf: Path) -> Iterator[tuple[LlamaServer, LlamaServer]]:
    """Two replicas of our own: this test kills one."""
    with (
        LlamaServer(tiny_gguf, slots=4, name="kill-a") as a,
        LlamaServer(tiny_gguf, slots=4, name="kill-b") as b,
    ):
        yield a, b


def routes(replicas: tuple[LlamaServer, ...]) -> str:
    return kill_routes([r.url for r in replicas])


def test_killing_a_replica_under_load_loses_no_request_that_had_no_byte(
    pair: tuple[LlamaServer, LlamaServer],
) -> None:
    """SIGKILL one of two real llama-servers while 8 clients stream continuously: no request fails
    before its first byte, and every stream the kill cut ends with the error event.

    The checks are on outcomes, never on how many streams fit in the time: a slow or stolen CI
    machine finishes fewer, and that says nothing about the gateway."""
    outcomes: Counter[str] = Counter()
    after_kill: Counter[str] = Counter()  # streams that began after the kill
    killed = threading.Event()
    lock = threading.Lock()
    stop = threading.Event()
    with run_gateway(routes(pair)) as gw:

        def client() -> None:
            # The clients stream until told to stop, however long the kill takes to come on a slow
            # machine: a deadline from their own start once ran out before the kill, and then no
            # stream began after it. This bound only keeps the loop finite if the test breaks.
            deadline = time.monotonic() + 150
            while not stop.is_set() and time.monotonic() < deadline:
                began_after_kill = killed.is_set()
                # 1500 tokens last seconds: some streams are mid-answer at the kill.
                outcome = stream_once(gw.url, max_tokens=1500)
                with lock:
                    outcomes[outcome] += 1
                    if began_after_kill:
                        after_kill[outcome] += 1

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(client) for _ in range(8)]
            # Killed while the engine is mid-answer on a stream, not at a fixed time or on a count of
            # requests in flight: those can all still be before their first byte (retried, not cut) on
            # a slow machine, or already fully written by this fast model.
            assert eventually(lambda: mid_answer(pair[0], 1500), 30), "r0 never was mid-answer"
            pair[0].kill()
            killed.set()

            # Every client finishes a stream it began after the kill (cut ones restart at once, the
            # others when the survivor has served them), then all stop.
            def all_began_one() -> bool:
                with lock:
                    return sum(after_kill.values()) >= 8

            eventually(all_began_one, 90)
            stop.set()
            for future in futures:
                future.result(timeout=120)
        entries = gw.log_entries()
    failed = [
        (e["error_code"], e["attempts"], e["retries"], e["replica"], e["path"])
        for e in entries
        if e["status"] >= 500
    ]
    assert not failed, failed
    assert not [o for o in outcomes if o.startswith("failed_before")], outcomes  # retried on the survivor
    assert not [o for o in outcomes if o.startswith("truncated")], (
        outcomes
    )  # every cut ended with the error event
    assert outcomes["error_event"] >= 1, outcomes  # streams running on the killed replica
    # A client whose stream was cut starts another at once, so streams began after the kill; the
    # survivor serves every one of them to the end (those sent to the dead replica are retried).
    assert after_kill["done"] >= 1 and set(after_kill) == {"done"}, after_kill
    cut = [e for e in entries if e["outcome"] == "upstream_error"]
    assert all(e["replica"] == "r0" for e in cut), cut
    retried = [e for e in entries if e["retries"]]
    assert all(e["status"] == 200 for e in retried)
    print(
        f"case 17 (real): outcomes {dict(outcomes)}, {sum(after_kill.values())} began after the kill,"
        f" {len(retried)} retried on the survivor, {len(cut)} cut"
    )


def mid_answer(server: LlamaServer, max_tokens: int) -> bool:
    """A slot has written some of its answer (so the gateway relayed bytes) and has most still to go."""
    try:
        slots = httpx2.get(server.url + "/slots", timeout=5).json()
    except httpx2.HTTPError:
        return False
    for slot in slots:
        decoded = (slot.get("next_token") or [{}])[0].get("n_decoded", 0)
        if slot.get("is_processing") and 32 <= decoded <= max_tokens // 2:
            return True
    return False


def busy_slots(server: LlamaServer) -> int:
    slots = httpx2.get(server.url + "/slots", timeout=5).json()
    return sum(1 for slot in slots if slot.get("is_processing"))


def wait_for(check: object, timeout: float) -> float | None:
    """Seconds until check() is true, or None."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if check():  # type: ignore[operator]
            return time.monotonic() - started
        time.sleep(0.02)
    return None


@pytest.fixture
def single(tiny_gguf: Path) -> Iterator[tuple[LlamaServer, Running]]:
    with LlamaServer(tiny_gguf, slots=2, name="slots") as server, run_gateway(routes((server,))) as gw:
        yield server, gw


def open_raw(gw: Running, stream: bool, request_id: str) -> socket.socket:
    body = orjson.dumps(
        {
            "messages": [{"role": "user", "content": "go on forever"}],
            "stream": stream,
            "max_tokens": 100000,
            "ignore_eos": True,
        }
    )
    host, port = gw.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        b"POST " + CHAT.encode() + b" HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"x-request-id: %s\r\ncontent-length: %d\r\n\r\n%s" % (request_id.encode(), len(body), body)
    )
    return sock


def predicted(server: LlamaServer) -> float:
    """Tokens the replica has generated so far, cancelled generations included (measured)."""
    for line in httpx2.get(server.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("llamacpp:tokens_predicted_total"):
            return float(line.split()[-1])
    raise AssertionError("llamacpp:tokens_predicted_total not in /metrics")


def slot_tokens(server: LlamaServer) -> int:
    return server.ctx // server.slots


def test_a_streaming_client_that_leaves_frees_the_replicas_slot(single: tuple[LlamaServer, Running]) -> None:
    """Case 13 for real: when the client closes its socket, llama-server stops the generation: the
    slot goes idle having generated far fewer tokens than its context would have taken."""
    server, gw = single
    before = predicted(server)
    sock = open_raw(gw, stream=True, request_id="case-13")
    try:
        assert wait_for(lambda: busy_slots(server) == 1, 10) is not None
        assert sock.recv(1024)  # the stream really started
    finally:
        sock.close()
    freed = wait_for(lambda: busy_slots(server) == 0, 60)
    assert freed is not None, "the slot stayed busy"
    generated = predicted(server) - before
    assert generated < slot_tokens(server) - 100, generated  # cut short, not run to the context's end
    print(f"case 13 (real): slot idle {freed * 1000:.0f} ms after the client closed, {generated:.0f} tokens")
    entry = log_entry(gw, "case-13")
    assert (entry["outcome"], entry["disconnect_phase"]) == ("client_disconnected", "streaming")


def log_entry(gw: Running, request_id: str) -> dict:
    """The access-log line of an abandoned request. The gateway writes it when the cancelled handler
    unwinds, which can be a moment after the upstream socket is already closed."""
    entry = eventually(lambda: next((e for e in gw.log_entries() if e["request_id"] == request_id), None))
    assert entry is not None, f"no access-log line for {request_id}"
    return entry


def test_a_non_streaming_client_that_leaves_frees_the_replicas_slot(
    single: tuple[LlamaServer, Running],
) -> None:
    """Case 15 for real: this llama-server build stops a non-streaming generation only when it ends
    (docs/engines.md), so the gateway asks it for a stream and assembles the answer; when the client
    leaves, the gateway closes that stream and the slot goes idle with the generation cut short."""
    server, gw = single
    before = predicted(server)
    sock = open_raw(gw, stream=False, request_id="case-15")
    try:
        assert wait_for(lambda: busy_slots(server) == 1, 10) is not None
    finally:
        sock.close()
    freed = wait_for(lambda: busy_slots(server) == 0, 60)
    assert freed is not None, "the slot stayed busy"
    generated = predicted(server) - before
    assert generated < slot_tokens(server) - 100, generated
    print(f"case 15 (real): slot idle {freed * 1000:.0f} ms after the client closed, {generated:.0f} tokens")
    entry = log_entry(gw, "case-15")
    assert (entry["outcome"], entry["disconnect_phase"]) == ("client_disconnected", "waiting")
    assert entry["upstream"] == "stream"
