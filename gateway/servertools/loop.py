"""The server-tool loop: the model asks for `web_search` or `web_fetch` as a function call, the
gateway runs it and sends the conversation on with the result, until the model answers without
one, calls a client tool as well (the client runs that one; its answer holds both), or the rounds
run out (`server_tools.max_rounds`: the last round is sent with `tool_choice: none`, and a server
call it still makes is answered `max_uses_exceeded` without running).

Each round is one whole (non-streaming) request through the caller's `send`, which runs the
proxy's usual steps against the preset; the client gets one answer in its own dialect, holding
every round's content with the server tools' own blocks (wires.py), or, for a streaming client,
that answer as its dialect's events (sse.py). Off unless the table configures it, and then only for
a request that declares a configured server tool.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.routing.table import ServerTools
from gateway.servertools.execute import Executor, Fetched, Searched
from gateway.servertools.wires import FETCH, SEARCH, WIRES, Call, Declared, Executed, Result, Wire

# One round: the body to send (whole, not streamed) -> the engine's whole answer, in the
# request's dialect. Failures raise, as any request's would.
Send = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class ServerCalls:
    """A request the loop serves: its wire format and the server tools it declares."""

    wire: Wire
    declared: Mapping[str, Declared]


@dataclass(frozen=True)
class Ran:
    """What the loop produced for one request: the client's whole answer, the model rounds it took
    and the searches and fetches that succeeded."""

    answer: dict[str, Any]  # the client's answer, whole
    rounds: int
    searches: int
    fetches: int

    @property
    def note(self) -> tuple[str, str]:
        """For `x-gateway-rewrites` and the access log."""
        return (
            "server_tools",
            f"server_tool_rounds={self.rounds},searches={self.searches},fetches={self.fetches}",
        )


def plan(body: Mapping[str, Any], endpoint: str, config: ServerTools | None) -> ServerCalls | None:
    """Whether the loop serves this request: the table configures server tools, the endpoint has
    them, and the client declared at least one that is configured (search or fetch)."""
    wire = WIRES.get(endpoint)
    if config is None or wire is None:
        return None
    configured = {SEARCH: config.search is not None, FETCH: config.fetch is not None}
    declared = {name: d for name, d in wire.declared(body).items() if configured[d.kind]}
    return ServerCalls(wire, declared) if declared else None


def prepare(body: dict[str, Any], found: ServerCalls) -> None:
    """The request as the engine gets it (the rewrite's copy, changed in place)."""
    found.wire.prepare(body, found.declared)
    body["stream"] = False
    body.pop("stream_options", None)


class Loop:
    """Runs the rounds of one request."""

    def __init__(self, config: ServerTools, executor: Executor) -> None:
        self.config = config
        self.executor = executor

    async def run(self, body: dict[str, Any], found: ServerCalls, send: Send) -> Ran:
        """Sends rounds through `send` until the model answers without a server-tool call, also
        calls a client tool, or `max_rounds` is reached (the last round asked to call none); runs
        each call within its `max_uses` and, for fetches, only for URLs already in the conversation
        or a result. Returns the combined answer and counts."""
        wire, declared = found.wire, found.declared
        seen = bytearray(orjson.dumps(body))  # what a fetched URL must appear in, when required
        uses: Counter[str] = Counter()
        answers: list[dict[str, Any]] = []
        executed: list[Executed] = []
        current = body
        for number in range(self.config.max_rounds):
            last = number == self.config.max_rounds - 1
            answer = await send(wire.last_round(current) if last else current)
            answers.append(answer)
            calls, others = wire.calls(answer, declared)
            if not calls:
                executed.append([])
                break
            if last:  # asked not to, it called anyway: told so, not run
                executed.append([(call, _refused(call, declared, "max_uses_exceeded")) for call in calls])
                break
            done: Executed = []
            for call in calls:
                result = await self._execute(call, declared[call.name], uses, seen)
                done.append((call, result))
            executed.append(done)
            if others:
                break
            current = wire.follow_up(current, answer, done)
        results = [result for done in executed for _, result in done]
        return Ran(
            wire.final(answers, executed),
            len(answers),
            sum(isinstance(r, Searched) and r.error is None for r in results),
            sum(isinstance(r, Fetched) and r.error is None for r in results),
        )

    async def _execute(self, call: Call, declared: Declared, uses: Counter[str], seen: bytearray) -> Result:
        if declared.max_uses is not None and uses[call.name] >= declared.max_uses:
            return _refused(call, {call.name: declared}, "max_uses_exceeded")
        uses[call.name] += 1
        if declared.kind == SEARCH:
            searched = await self.executor.search(
                call.arguments.get("query"), declared.allowed, declared.blocked
            )
            for hit in searched.hits:  # a search result's URL may be fetched next
                seen += b"\n" + hit.url.encode()
            return searched
        url = call.arguments.get("url")
        policy = self.config.fetch
        if (
            isinstance(url, str)
            and policy is not None
            and policy.prior_context_only
            and url.encode() not in seen
        ):
            # As Anthropic's own web_fetch: a URL the user or a result gave, never one the model
            # made up (a page's text cannot make the model carry the conversation to a new URL).
            return Fetched(url, error="url_not_in_prior_context")
        return await self.executor.fetch(url, declared.allowed, declared.blocked)


def _refused(call: Call, declared: Mapping[str, Declared], code: str) -> Result:
    if declared[call.name].kind == SEARCH:
        return Searched(str(call.arguments.get("query", "")), error=code)
    return Fetched(str(call.arguments.get("url", "")), error=code)
