"""A request head that trickles, never ends or grows without bound is cut off while
it is read, and open connections are capped with a clear refusal (gateway/edge/connection.py).

The last test checks that an answer leaves the same protocol in one write (gateway/edge/corked.py).

Each test speaks raw bytes over a socket to the gateway under uvicorn with httptools, as shipped.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from tests.support.gateway_answers import metric
from tests.support.harness import Running, eventually, one_replica_table, run_gateway
from tests.support.servers import sim_replica

HEAD = b"POST /v1/messages HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"


@pytest.fixture
def gw() -> Iterator[Running]:
    replica = sim_replica("vllm", "m")
    try:
        with run_gateway(
            one_replica_table(replica.url), header_timeout=1.0, max_connections=8, max_header_bytes=4096
        ) as running:
            yield running
    finally:
        replica.stop()


def connect(gw: Running) -> socket.socket:
    host, port = gw.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    return sock


def read_all(sock: socket.socket, limit: float = 10.0) -> bytes:
    """Everything until the server closes (bounded in time)."""
    sock.settimeout(limit)
    data = b""
    while True:
        try:
            piece = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            return data
        if not piece:
            return data
        data += piece


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def body_of(answer: bytes) -> dict[str, object]:
    loaded: dict[str, object] = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    return loaded


def healthy(gw: Running) -> bool:
    with connect(gw) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
        return status_of(read_all(sock)) == 200


def test_a_trickled_head_is_cut_off_with_408_in_the_dialect_of_its_path(gw: Running) -> None:
    with connect(gw) as sock:
        sock.sendall(HEAD)
        answer = b""
        sock.settimeout(0.2)
        for i in range(100):  # one header line every 0.1 s; the deadline is 1 s from the first byte
            try:
                sock.sendall(b"x-trickle-%d: y\r\n" % i)
                answer = sock.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            if answer:
                break
        else:
            pytest.fail("the gateway kept reading a head that never ended")
    assert status_of(answer) == 408, answer
    error = body_of(answer)
    assert error["type"] == "error"  # Anthropic's envelope: the path was /v1/messages
    assert b"connection: close" in answer
    entries = eventually(lambda: [e for e in gw.log_entries() if e.get("status") == 408])
    assert entries and entries[0]["endpoint"] == "messages"
    assert metric(gw.metrics(), "gateway_endpoint_requests_total", endpoint="messages", status="4xx") == 1


def test_a_silent_connection_is_closed_without_an_answer(gw: Running) -> None:
    with connect(gw) as sock:
        sock.settimeout(10)
        assert sock.recv(1) == b""  # closed by the server after header_timeout (a hang raises)
    assert not [e for e in gw.log_entries() if e.get("status") == 408]


def test_a_head_that_grows_past_the_limit_is_refused_while_it_is_read(gw: Running) -> None:
    with connect(gw) as sock:
        sock.sendall(HEAD)
        sent = 0
        try:
            for _ in range(1000):  # up to 64 MiB, never finished
                sock.sendall(b"x-big: " + b"a" * 65526 + b"\r\n")
                sent += 65536
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = read_all(sock)
    assert sent < 8 * 1024 * 1024, "the gateway read megabytes of one unfinished head"
    assert status_of(answer) in (431, 0)  # 0: the reset overtook the answer on the wire
    assert eventually(lambda: [e for e in gw.log_entries() if e.get("status") == 431])


def test_too_many_fields_are_refused_before_the_head_ends(gw: Running) -> None:
    with connect(gw) as sock:
        sock.sendall(HEAD + b"".join(b"x-f%d: 1\r\n" % i for i in range(300)))
        answer = read_all(sock)
    assert status_of(answer) == 431, answer
    assert "100 fields" in str(body_of(answer))


def test_connections_beyond_the_cap_are_refused_and_freed_ones_serve_again(gw: Running) -> None:
    idle = [connect(gw) for _ in range(8)]
    try:
        time.sleep(0.2)  # let the server accept all eight
        with connect(gw) as extra:
            answer = read_all(extra)
        assert status_of(answer) == 503, answer
        assert b"retry-after: 1" in answer
        assert "too_many_connections" in str(body_of(answer))
    finally:
        for sock in idle:
            sock.close()
    assert eventually(lambda: healthy(gw), timeout=5)


def test_a_keep_alive_connection_gets_a_fresh_deadline_for_each_request(gw: Running) -> None:
    request = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
    with connect(gw) as sock:
        for _ in range(3):  # 3 x 0.6 s on one connection: longer than one deadline, shorter than each
            sock.sendall(request[:20])
            time.sleep(0.3)
            sock.sendall(request[20:])
            sock.settimeout(5)
            answer = b""
            while not answer.endswith(b"}"):
                answer += sock.recv(65536)
            assert status_of(answer) == 200, answer
            time.sleep(0.3)


def test_the_next_head_on_a_kept_alive_connection_is_cut_off_when_it_trickles(gw: Running) -> None:
    """The deadline of a kept-alive connection's next head is set once a read ends inside it."""
    with connect(gw) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        sock.settimeout(5)
        answer = b""
        while not answer.endswith(b"}"):
            answer += sock.recv(65536)
        assert status_of(answer) == 200, answer
        sock.sendall(HEAD)  # the next request's head begins, and never ends
        answer = read_all(sock)
    assert status_of(answer) == 408, answer
    assert b"connection: close" in answer


def data_segments_in(sock: socket.socket) -> int | None:
    """Segments with data this socket has received (Linux's tcp_info `tcpi_data_segs_in`), or None
    where the kernel does not report it."""
    info = sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, "TCP_INFO", 11), 256)
    return int.from_bytes(info[152:156], "little") if len(info) >= 160 else None


def read_answers(sock: socket.socket, count: int) -> list[bytes]:
    """`count` answers with a content-length, read whole: one read may hold several of them."""
    data, answers = b"", []
    while len(answers) < count:
        while (end := answer_end(data)) is None:
            piece = sock.recv(65536)
            assert piece, (answers, data)
            data += piece
        answers.append(data[:end])
        data = data[end:]
    assert not data, data
    return answers


def answer_end(data: bytes) -> int | None:
    """Where the first answer in `data` ends, or None while it is incomplete."""
    head, blank, _ = data.partition(b"\r\n\r\n")
    if not blank:
        return None
    length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
    end = len(head) + 4 + length
    return end if len(data) >= end else None


@pytest.mark.skipif(not hasattr(socket, "TCP_INFO"), reason="tcp_info is Linux's")
def test_a_whole_answer_leaves_in_one_write_and_pipelined_answers_keep_their_order(gw: Running) -> None:
    """The head and body of an answer reach the client as one segment (edge/corked.py: one write),
    and pipelined requests are answered in order."""
    with connect(gw) as sock:
        before = data_segments_in(sock)
        if before is None:
            pytest.skip("this kernel does not report data segments")
        sock.sendall(HEALTH)
        [answer] = read_answers(sock, 1)
        assert status_of(answer) == 200 and data_segments_in(sock) == before + 1
        sock.sendall(b"".join(HEALTH.replace(b"/health", path) for path in PATHS))
        answers = read_answers(sock, len(PATHS))
        assert [status_of(a) for a in answers] == [200, 404, 200], answers
        assert b'"data"' in answers[2]  # /v1/models, last, as asked


HEALTH = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
PATHS = (b"/health", b"/nowhere", b"/v1/models")
