"""Server tools on the request path: the rounds of a request whose tools the gateway runs itself
(web_search, web_fetch; gateway/servertools/). Each round is a whole answer from the preset, read
before anything is sent; the client's answer is written once at the end, whole or as its dialect's
events, with the stream kept alive while the rounds run."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import orjson

from gateway.caught import Caught, raise_again
from gateway.errors import GatewayTimeout, UpstreamFailure
from gateway.pipeline.attempts import Attempt, Dispatcher, finish
from gateway.pipeline.rewrite import Plan
from gateway.relay.keepalive import KeepAlive
from gateway.relay.replica_errors import relay_replica_error
from gateway.relay.respond import Responder, gateway_headers, stream_head
from gateway.relay.whole import answer_headers
from gateway.routing.table import Preset, ServerTools
from gateway.servertools import loop as server_tools
from gateway.servertools.execute import Executor
from gateway.servertools.sse import events as server_tool_events
from gateway.settings import Settings
from gateway.types import ReadBytes


class _Answered(Exception):
    """A round's replica error went to the client already: the loop ends there."""


async def serve_rounds(
    dispatcher: Dispatcher,
    settings: Settings,
    config: ServerTools,
    responder: Responder,
    preset: Preset,
    plan: Plan,
    server: server_tools.ServerCalls,
    first: Attempt,
) -> None:
    """The server-tool loop (servertools/loop.py): each round a whole answer from the preset,
    sent through the dispatcher as `first` was, the client's answer written once at the end,
    whole or as its dialect's events."""
    ex, endpoint = responder.ex, first.endpoint
    first.as_stream = frozenset()  # each round whole: the loop reads it before anything is sent

    async def send(body: dict[str, Any]) -> dict[str, Any]:
        attempt = dataclasses.replace(first, body=body, tried=[], refused=[], encoded={})
        response, replica = await dispatcher.open(attempt)
        data: ReadBytes | None = None
        caught: Caught[BaseException] | None = None
        try:
            if response.status >= 300:
                secret = replica.api_key()
                await relay_replica_error(responder, response, (secret,) if secret else ())
            else:
                data = await response.read(settings.max_answer_bytes + 1)
        except BaseException as error:
            caught = Caught(error)
        await finish(response, attempt.release, replica)
        raise_again(caught)
        if data is None:
            raise _Answered
        try:
            payload = orjson.loads(data) if len(data) <= settings.max_answer_bytes else None
        except orjson.JSONDecodeError:
            payload = None
        if not isinstance(payload, dict):
            raise UpstreamFailure("The replica's answer was not a JSON object", code="upstream_error")
        return payload

    keepalive = (
        KeepAlive(responder, settings.keepalive_after, settings.keepalive_every) if plan.stream else None
    )
    loop_deadline = asyncio.get_running_loop().time() + preset.timeouts.read
    caught: Caught[BaseException] | None = None
    try:
        async with asyncio.timeout_at(loop_deadline):
            ran = await server_tools.Loop(config, Executor(config.search, config.fetch)).run(
                plan.body, server, send
            )
    except BaseException as error:
        caught = Caught(error)
    if keepalive is not None:
        await keepalive.stop()
    if caught is not None and isinstance(caught.error, _Answered):
        return
    if caught is not None and isinstance(caught.error, TimeoutError):
        caught.take()
        raise GatewayTimeout(
            f"No answer within the preset's deadline of {preset.timeouts.read:g} s",
            code="deadline_exceeded",
        )
    raise_again(caught)
    ex.rewrites.append(ran.note)
    endpoint.dialect.read_whole(ex.answer, ran.answer)
    if plan.stream:
        if not responder.started:
            await responder.start(200, stream_head(ex))
        skip = endpoint.dialect.opening_kinds if responder.spliced else frozenset()
        for kind, data in server_tool_events(endpoint.name, ran.answer):
            if kind not in skip:
                await responder.body(data)
        await responder.body(b"", more=False)
        responder.opened = False
    else:
        data = orjson.dumps(ran.answer)
        head = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        await responder.start(200, [*head, *gateway_headers(ex), *answer_headers(ex)])
        await responder.body(data, more=False)
    ex.finished = responder.clock()
