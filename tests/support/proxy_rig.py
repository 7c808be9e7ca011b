"""A proxy driven in process over a small routing table and a scripted upstream (fake_upstream.py):
what the request path did, without sockets or servers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from gateway.dialects.registry import for_path
from gateway.fleet.replicas import Fleet
from gateway.ops.exchange import Exchange
from gateway.pipeline.frame import Context
from gateway.pipeline.proxy import Proxy
from gateway.routing.table import parse_table
from gateway.settings import Settings
from gateway.upstream import UpstreamError
from tests.support.asgi import Sent, http_scope
from tests.support.fake_upstream import FakeUpstream, Scripted

TABLE = """
defaults: {max_tokens: 512, min_max_tokens: 0}
presets:
  dense:
    served_model: dense-served
    fallback: [moe]
    replicas: [{name: d0, url: "http://dense.test:1", engine: vllm}]
  moe:
    served_model: moe-served
    replicas: [{name: m0, url: "http://moe.test:1", engine: llamacpp}]
  lone:
    served_model: lone-served
    timeouts: {read: 0.2}
    replicas: [{name: l0, url: "http://lone.test:1", engine: vllm}]
  patient:
    served_model: patient-served
    abort_on_disconnect: false
    replicas: [{name: p0, url: "http://patient.test:1", engine: vllm}]
routing: {default: dense}
"""

HELLO = {"model": "dense", "messages": [{"role": "user", "content": "hello"}]}


class Rig:
    """A proxy over the table above, a scripted upstream, and the records it made."""

    def __init__(
        self, answer: Callable[[str, Any], Scripted | UpstreamError], table: str = TABLE, **settings: Any
    ) -> None:
        self.fleet = Fleet(parse_table(table))
        self.upstream = FakeUpstream(answer)
        self.records: list[Exchange] = []
        self.sents: list[Sent] = []  # what each call got so far, in the order the calls began
        self.proxy = Proxy(
            Context(Settings(**settings), lambda: self.fleet, self.upstream, self.records.append)
        )

    async def call(
        self,
        body: dict[str, Any],
        path: str = "/v1/chat/completions",
        headers: Sequence[tuple[str, str]] = (),
        leave: asyncio.Event | None = None,
    ) -> tuple[Sent, Exchange]:
        endpoint = for_path(path)
        assert endpoint is not None
        raw = orjson.dumps(body)
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await (leave or asyncio.Event()).wait()
            return {"type": "http.disconnect"}

        sent = Sent()
        self.sents.append(sent)
        scope = http_scope(path, headers=[("content-type", "application/json"), *headers])
        await self.proxy.handle(endpoint, scope, receive, sent)
        return sent, self.records[-1]

    def sent_so_far(self) -> list[dict[str, Any]]:
        """The messages the latest call has sent to its client so far."""
        return list(self.sents[-1].messages) if self.sents else []


def by_host(**answers: Scripted | UpstreamError) -> Callable[[str, Any], Scripted | UpstreamError]:
    def answer(url: str, body: Any) -> Scripted | UpstreamError:
        host = url.split("//", 1)[1].split(".", 1)[0]
        return answers[host]

    return answer
