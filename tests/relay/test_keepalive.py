"""gateway/relay/keepalive.py: a waiting streaming request's client kept connected: the stream opened
in the dialect's terms once the first timer fires, the dialect's keep-alive written after that, and
nothing more once `stop()` returns. Intervals of zero seconds: every test waits for events or counts
loop turns, never for time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from gateway.dialects.anthropic import ANTHROPIC
from gateway.dialects.base import Dialect
from gateway.dialects.openai import OPENAI
from gateway.dialects.responses import RESPONSES
from gateway.errors import NoUpstream
from gateway.ops.exchange import Exchange
from gateway.relay.keepalive import KeepAlive
from gateway.relay.respond import Responder
from gateway.types import Message
from tests.support.asgi import Sent

NEVER = 3600.0  # a timer no test lets fire


def responder(dialect: Dialect = OPENAI, send: Sent | None = None) -> tuple[Responder, Sent]:
    sent = send if send is not None else Sent()
    ex = Exchange(request_id="req-1", endpoint="chat", started=0.0, preset="dense", stream=True)
    found = Responder(sent, ex, dialect, clock=lambda: 0.0)
    found.streaming, found.model = True, "dense"
    return found, sent


async def turns(count: int = 20) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def until(condition: Callable[[], bool], what: str) -> None:
    """Runs the loop until `condition` holds, for a bounded number of turns: a keep-alive that never
    comes fails the test instead of hanging it."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


async def until_beats(alive: KeepAlive, beats: int) -> None:
    await until(lambda: alive.beats >= beats, f"{beats} keep-alives written")


def bodies(sent: Sent) -> list[bytes]:
    return [m["body"] for m in sent.messages if m["type"] == "http.response.body"]


@pytest.mark.anyio
async def test_a_request_answered_before_the_first_timer_writes_nothing() -> None:
    reply, sent = responder()
    alive = KeepAlive(reply, after=0.0, every=0.0)
    await alive.stop()  # before the loop ran the timer
    await turns()
    assert sent.messages == [] and not reply.started and alive.beats == 0


@pytest.mark.anyio
async def test_stopping_twice_is_harmless() -> None:
    reply, sent = responder()
    alive = KeepAlive(reply, after=NEVER)
    await alive.stop()
    await alive.stop()
    assert sent.messages == []


@pytest.mark.anyio
async def test_a_chat_stream_is_opened_with_the_status_line_then_kept_alive_with_comments() -> None:
    reply, sent = responder(OPENAI)
    alive = KeepAlive(reply, after=0.0, every=0.0)
    await until_beats(alive, 3)
    await alive.stop()
    assert sent.status == 200 and sent.headers["content-type"] == "text/event-stream"
    assert sent.headers["x-request-id"] == "req-1"
    assert reply.started and reply.opened and not reply.spliced  # chat has no opening events
    written = bodies(sent)
    assert written == [b": keep-alive\n\n"] * alive.beats and alive.beats >= 3


@pytest.mark.anyio
async def test_a_messages_stream_is_opened_with_message_start_then_pinged() -> None:
    reply, sent = responder(ANTHROPIC)
    reply.input_tokens = 321
    alive = KeepAlive(reply, after=0.0, every=0.0)
    await until_beats(alive, 2)
    await alive.stop()
    opening, *pings = bodies(sent)
    assert opening.startswith(b"event: message_start\n") and b'"input_tokens":321' in opening
    assert reply.spliced  # the replica's own message_start is to be dropped
    assert pings == [b'event: ping\ndata: {"type": "ping"}\n\n'] * alive.beats


@pytest.mark.anyio
async def test_a_responses_stream_is_opened_with_created_then_kept_alive_with_in_progress_events() -> None:
    reply, sent = responder(RESPONSES)
    alive = KeepAlive(reply, after=0.0, every=0.0)
    await until_beats(alive, 2)
    await alive.stop()
    opening, *beats = bodies(sent)
    assert b"event: response.created\n" in opening and b"event: response.in_progress\n" in opening
    assert len(beats) == alive.beats
    assert all(b.startswith(b"event: response.in_progress\n") for b in beats)


@pytest.mark.anyio
async def test_nothing_is_written_once_stop_returns() -> None:
    reply, sent = responder()
    alive = KeepAlive(reply, after=0.0, every=0.0)
    await until_beats(alive, 2)
    await alive.stop()
    written, beats = len(sent.messages), alive.beats
    await turns(200)
    assert (len(sent.messages), alive.beats) == (written, beats)


@pytest.mark.anyio
async def test_stop_lets_a_write_in_progress_finish_whole() -> None:
    release, writing = asyncio.Event(), asyncio.Event()

    class SlowClient(Sent):
        """A client whose socket takes the keep-alive slowly: the write waits for `release`."""

        async def __call__(self, message: Message) -> None:
            if message.get("body") == b": keep-alive\n\n":
                writing.set()
                await release.wait()
            await super().__call__(message)

    reply, sent = responder(OPENAI, SlowClient())
    alive = KeepAlive(reply, after=0.0, every=0.0)
    await until(writing.is_set, "a keep-alive write began")
    stopping = asyncio.ensure_future(alive.stop())
    await turns()
    assert not stopping.done()  # waits for the write rather than cutting the event in half
    release.set()
    await until(stopping.done, "stop returned")
    stopping.result()
    assert bodies(sent) == [b": keep-alive\n\n"] and alive.beats == 1


@pytest.mark.anyio
async def test_a_stream_the_gateway_ended_with_an_error_gets_no_more_keep_alives() -> None:
    reply, sent = responder(OPENAI)
    alive = KeepAlive(reply, after=0.0, every=0.0)
    await until_beats(alive, 1)
    async with reply.writing:
        await reply.fail(NoUpstream("no replica", code="no_healthy_upstream"))
    ended = len(sent.messages)
    await turns(200)
    assert len(sent.messages) == ended and not reply.opened
    assert sent.messages[-1]["more_body"] is False
    await alive.stop()


@pytest.mark.anyio
async def test_a_replica_answer_already_started_is_never_interleaved_with_keep_alives() -> None:
    reply, sent = responder(OPENAI)
    await reply.start(200, [(b"content-type", b"text/event-stream")])  # the replica's own stream
    alive = KeepAlive(reply, after=0.0, every=0.0)
    await turns(200)
    assert alive.beats == 0 and len(sent.messages) == 1 and not reply.opened
    await alive.stop()
