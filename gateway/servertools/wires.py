"""Server tools in the two wire formats that have them: what a client declares, what the engine is
given instead, and what the client gets back.

Messages (Claude Code's WebSearch and WebFetch tools send a request of their own that declares
`{type: web_search_20250305, name: web_search, max_uses, allowed_domains, blocked_domains}` or
`{type: web_fetch_20250910, name: web_fetch, ...}`): the engine is given a function tool of the
same name; the client gets Anthropic's blocks, `server_tool_use` then `web_search_tool_result`
(results `{type: web_search_result, url, title, encrypted_content, page_age}`, or an error object)
or `web_fetch_tool_result` (`{type: web_fetch_result, url, content: {type: document, source:
{type: text, ...}, title}, retrieved_at}`), and `usage.server_tool_use`. Those blocks come back in
the next request's history: each becomes the `tool_use` and `tool_result` the engine saw while the
gateway ran the tool, byte for byte (the page text and snippets ride in the blocks' own fields, the
snippet in `encrypted_content`, which is opaque to clients), so the prefix cache holds.

Responses (Codex declares `{type: web_search}`): the engine is given a function `web_search`; the
client gets a `web_search_call` item (`action: {type: search, query, sources}`). Codex replays
the item without its results; the engine then sees the call and a note that the results were not
kept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.servertools.execute import Fetched, Hit, Searched

Result = Searched | Fetched
SEARCH, FETCH = "web_search", "web_fetch"
QUERY_SCHEMA = {
    "type": "object",
    "properties": {"query": {"type": "string", "description": "The search query"}},
    "required": ["query"],
}
URL_SCHEMA = {
    "type": "object",
    "properties": {"url": {"type": "string", "description": "The http or https URL to fetch"}},
    "required": ["url"],
}
DESCRIPTIONS = {
    SEARCH: "Search the web. Returns the top results: title, URL and a snippet of each.",
    FETCH: (
        "Fetch a web page or document by URL and return its text. Only URLs that appeared in the "
        "conversation or in search results can be fetched."
    ),
}


@dataclass(frozen=True)
class Declared:
    """One server tool as the client declared it."""

    kind: str  # SEARCH or FETCH
    max_uses: int | None = None
    allowed: tuple[str, ...] | None = None
    blocked: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Call:
    """A call of a server tool in an engine's answer."""

    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


Executed = list[tuple[Call, Result]]


def result_text(result: Result) -> str:
    """What the engine is told a tool returned (the same bytes when the history replays it)."""
    if isinstance(result, Searched):
        if result.error:
            return f"web_search failed: {result.error}"
        if not result.hits:
            return f'No web results for "{result.query}".'
        lines = [f'Web search results for "{result.query}":']
        for number, hit in enumerate(result.hits, 1):
            lines += [f"{number}. {hit.title}", f"   {hit.url}"]
            if hit.page_age:
                lines.append(f"   {hit.page_age}")
            if hit.snippet:
                lines.append(f"   {hit.snippet}")
        return "\n".join(lines)
    if result.error:
        return f"web_fetch failed: {result.error}"
    title = f" ({result.title})" if result.title else ""
    return f"Content of {result.url}{title}:\n{result.text}"


def _strings(value: Any) -> tuple[str, ...] | None:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    return None


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _arguments(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def _usage_tokens(usage: Any, key: str) -> int:
    value = usage.get(key) if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class Wire:
    """The operations the loop needs from a wire format."""

    def declared(self, body: Mapping[str, Any]) -> dict[str, Declared]:
        raise NotImplementedError

    def prepare(self, body: dict[str, Any], declared: Mapping[str, Declared]) -> None:
        """Server tools become functions, replayed server blocks the engine's own turns (in place,
        copy-on-write)."""
        raise NotImplementedError

    def calls(self, answer: Mapping[str, Any], declared: Mapping[str, Declared]) -> tuple[list[Call], bool]:
        """The answer's calls of server tools, and whether it also calls a client tool."""
        raise NotImplementedError

    def follow_up(
        self, body: dict[str, Any], answer: Mapping[str, Any], executed: Executed
    ) -> dict[str, Any]:
        raise NotImplementedError

    def last_round(self, body: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def final(self, answers: Sequence[Mapping[str, Any]], executed: Sequence[Executed]) -> dict[str, Any]:
        raise NotImplementedError


# --- Messages ----------------------------------------------------------------------------------------


class MessagesWire(Wire):
    """Server tools in Anthropic Messages: `web_search_*` and `web_fetch_*` declarations become
    function tools for the engine, replayed server blocks become the `tool_use` and `tool_result`
    turns the engine saw, and the final answer carries `server_tool_use` and result blocks with
    `usage.server_tool_use`."""

    RESULT_TYPES = {SEARCH: "web_search_tool_result", FETCH: "web_fetch_tool_result"}

    def declared(self, body: Mapping[str, Any]) -> dict[str, Declared]:
        """The server tools a Messages request declares, by name: each `web_search_*` or
        `web_fetch_*` tool with its `max_uses` and allowed and blocked domains."""
        found: dict[str, Declared] = {}
        tools = body.get("tools")
        for tool in tools if isinstance(tools, list) else ():
            kind = tool.get("type") if isinstance(tool, dict) else None
            if not isinstance(kind, str):
                continue
            for base in (SEARCH, FETCH):
                if kind.startswith(base + "_"):
                    uses = tool.get("max_uses")
                    found[str(tool.get("name") or base)] = Declared(
                        base,
                        uses if isinstance(uses, int) and uses > 0 else None,
                        _strings(tool.get("allowed_domains")),
                        _strings(tool.get("blocked_domains")),
                    )
        return found

    def prepare(self, body: dict[str, Any], declared: Mapping[str, Declared]) -> None:
        tools = body.get("tools")
        if isinstance(tools, list):
            body["tools"] = [self._function(tool, declared) for tool in tools]
        messages = body.get("messages")
        if isinstance(messages, list) and any(self._has_server_blocks(m) for m in messages):
            replayed: list[Any] = []
            for message in messages:
                replayed += self._replay(message) if self._has_server_blocks(message) else [message]
            body["messages"] = replayed

    @staticmethod
    def _function(tool: Any, declared: Mapping[str, Declared]) -> Any:
        name = tool.get("name") if isinstance(tool, dict) else None
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not (isinstance(name, str) and name in declared and isinstance(kind, str) and kind != "custom"):
            return tool
        base = declared[name].kind
        schema = QUERY_SCHEMA if base == SEARCH else URL_SCHEMA
        return {"name": name, "description": DESCRIPTIONS[base], "input_schema": schema}

    @staticmethod
    def _has_server_blocks(message: Any) -> bool:
        content = message.get("content") if isinstance(message, dict) else None
        return (
            isinstance(message, dict)
            and message.get("role") == "assistant"
            and isinstance(content, list)
            and any(isinstance(b, dict) and b.get("type") == "server_tool_use" for b in content)
        )

    def _replay(self, message: dict[str, Any]) -> list[Any]:
        """An assistant turn with server blocks as the turns the engine saw: each `server_tool_use`
        ends an assistant turn as a `tool_use`, its result is a user turn's `tool_result`."""
        turns: list[Any] = []
        segment: list[Any] = []
        uses: dict[str, dict[str, Any]] = {}
        for block in message["content"]:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "server_tool_use":
                uses[str(block.get("id"))] = block
                segment.append(
                    {
                        "type": "tool_use",
                        "id": block.get("id"),
                        "name": block.get("name"),
                        "input": block.get("input", {}),
                    }
                )
            elif kind in self.RESULT_TYPES.values() and str(block.get("tool_use_id")) in uses:
                use = uses[str(block.get("tool_use_id"))]
                text = result_text(self._read_result(block, use))
                turns.append({**message, "content": segment})
                turns.append(
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": block.get("tool_use_id"), "content": text}
                        ],
                    }
                )
                segment = []
            else:
                segment.append(block)
        if segment:
            turns.append({**message, "content": segment})
        return turns

    @staticmethod
    def _read_result(block: dict[str, Any], use: dict[str, Any]) -> Result:
        arguments = _object(use.get("input"))
        content = block.get("content")
        if block.get("type") == "web_search_tool_result":
            query = str(arguments.get("query", ""))
            if isinstance(content, dict):
                return Searched(query, error=str(content.get("error_code", "unavailable")))
            hits = tuple(
                Hit(
                    str(r.get("url", "")),
                    str(r.get("title", "")),
                    str(r.get("encrypted_content", "")),
                    r.get("page_age") if isinstance(r.get("page_age"), str) else None,
                )
                for r in (content if isinstance(content, list) else ())
                if isinstance(r, dict)
            )
            return Searched(query, hits)
        url = str(arguments.get("url", ""))
        if not isinstance(content, dict) or content.get("type") != "web_fetch_result":
            code = content.get("error_code") if isinstance(content, dict) else None
            return Fetched(url, error=str(code or "unavailable"))
        document = _object(content.get("content"))
        source = _object(document.get("source"))
        return Fetched(
            str(content.get("url", url)), str(document.get("title") or ""), str(source.get("data", ""))
        )

    def calls(self, answer: Mapping[str, Any], declared: Mapping[str, Declared]) -> tuple[list[Call], bool]:
        found: list[Call] = []
        others = False
        content = answer.get("content")
        for block in content if isinstance(content, list) else ():
            if not isinstance(block, dict) or block.get("type") != "tool_use":
                continue
            if block.get("name") in declared:
                found.append(Call(str(block.get("id")), str(block["name"]), _arguments(block.get("input"))))
            else:
                others = True
        return found, others

    def follow_up(
        self, body: dict[str, Any], answer: Mapping[str, Any], executed: Executed
    ) -> dict[str, Any]:
        content = answer.get("content") if isinstance(answer.get("content"), list) else []
        results = [
            {"type": "tool_result", "tool_use_id": call.id, "content": result_text(result)}
            for call, result in executed
        ]
        turns = [{"role": "assistant", "content": content}, {"role": "user", "content": results}]
        return {**body, "messages": [*body.get("messages", []), *turns]}

    def last_round(self, body: dict[str, Any]) -> dict[str, Any]:
        return {**body, "tool_choice": {"type": "none"}}

    def final(self, answers: Sequence[Mapping[str, Any]], executed: Sequence[Executed]) -> dict[str, Any]:
        """The client's one answer from every round: each executed call as a `server_tool_use` block
        followed by its result block, the rest of the content as it came, the last round's envelope,
        the rounds' output tokens summed and the successful searches and fetches in
        `usage.server_tool_use`."""
        content: list[Any] = []
        counts = {SEARCH: 0, FETCH: 0}
        for answer, done in zip(answers, executed, strict=True):
            by_id = {call.id: (call, result) for call, result in done}
            for block in answer.get("content") or ():
                pair = by_id.get(str(block.get("id"))) if isinstance(block, dict) else None
                if pair is None or block.get("type") != "tool_use":
                    content.append(block)
                    continue
                call, result = pair
                kind = FETCH if isinstance(result, Fetched) else SEARCH
                counts[kind] += result.error is None
                content.append(
                    {"type": "server_tool_use", "id": call.id, "name": call.name, "input": call.arguments}
                )
                content.append(self._result_block(call, result))
        last = dict(answers[-1])
        usage = dict(last.get("usage") or {})
        usage["output_tokens"] = sum(_usage_tokens(a.get("usage"), "output_tokens") for a in answers)
        usage["server_tool_use"] = {
            "web_search_requests": counts[SEARCH],
            "web_fetch_requests": counts[FETCH],
        }
        return {**last, "content": content, "usage": usage}

    @staticmethod
    def _result_block(call: Call, result: Result) -> dict[str, Any]:
        if isinstance(result, Searched):
            body: Any = (
                {"type": "web_search_tool_result_error", "error_code": result.error}
                if result.error
                else [
                    {
                        "type": "web_search_result",
                        "url": h.url,
                        "title": h.title,
                        "encrypted_content": h.snippet,
                        "page_age": h.page_age,
                    }
                    for h in result.hits
                ]
            )
            return {"type": "web_search_tool_result", "tool_use_id": call.id, "content": body}
        if result.error:
            body = {"type": "web_fetch_tool_result_error", "error_code": result.error}
        else:
            body = {
                "type": "web_fetch_result",
                "url": result.url,
                "content": {
                    "type": "document",
                    "source": {"type": "text", "media_type": "text/plain", "data": result.text},
                    "title": result.title or None,
                },
                "retrieved_at": result.retrieved_at,
            }
        return {"type": "web_fetch_tool_result", "tool_use_id": call.id, "content": body}


# --- Responses ---------------------------------------------------------------------------------------

RESPONSES_SEARCH_TYPES = frozenset(
    {"web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26"}
)
NOT_KEPT = 'Web search for "{query}": its results are not kept in the conversation history.'


class ResponsesWire(Wire):
    """Server tools in the Responses API (Codex's `web_search`): the engine gets a `web_search`
    function, replayed `web_search_call` items become a call and a note that the results were not
    kept, and the client gets `web_search_call` items."""

    def declared(self, body: Mapping[str, Any]) -> dict[str, Declared]:
        tools = body.get("tools")
        for tool in tools if isinstance(tools, list) else ():
            if isinstance(tool, dict) and tool.get("type") in RESPONSES_SEARCH_TYPES:
                filters = tool.get("filters")
                allowed = _strings(filters.get("allowed_domains")) if isinstance(filters, dict) else None
                return {SEARCH: Declared(SEARCH, None, allowed, None)}
        return {}

    def prepare(self, body: dict[str, Any], declared: Mapping[str, Declared]) -> None:
        """Replaces the request's web-search tools (and any function of the same name) with one
        `web_search` function, and each replayed `web_search_call` item with a function call and an
        output saying its results were not kept; changes `body` in place."""
        tools = body.get("tools")
        kept = [
            t
            for t in (tools if isinstance(tools, list) else ())
            if not (
                isinstance(t, dict)
                and (
                    t.get("type") in RESPONSES_SEARCH_TYPES
                    or (t.get("type") == "function" and t.get("name") in declared)
                )
            )
        ]
        function = {
            "type": "function",
            "name": SEARCH,
            "description": DESCRIPTIONS[SEARCH],
            "parameters": QUERY_SCHEMA,
            "strict": False,
        }
        body["tools"] = [*kept, function]
        items = body.get("input")
        if isinstance(items, list) and any(
            isinstance(i, dict) and i.get("type") == "web_search_call" for i in items
        ):
            replayed: list[Any] = []
            for item in items:
                if isinstance(item, dict) and item.get("type") == "web_search_call":
                    replayed += self._replay(item)
                else:
                    replayed.append(item)
            body["input"] = replayed

    @staticmethod
    def _replay(item: dict[str, Any]) -> list[Any]:
        action = _object(item.get("action"))
        query = str(action.get("query", ""))
        call_id = str(item.get("id", ""))
        return [
            {
                "type": "function_call",
                "call_id": call_id,
                "name": SEARCH,
                "arguments": orjson.dumps({"query": query}).decode(),
            },
            {"type": "function_call_output", "call_id": call_id, "output": NOT_KEPT.format(query=query)},
        ]

    def calls(self, answer: Mapping[str, Any], declared: Mapping[str, Declared]) -> tuple[list[Call], bool]:
        found: list[Call] = []
        others = False
        output = answer.get("output")
        for item in output if isinstance(output, list) else ():
            if not isinstance(item, dict) or item.get("type") not in ("function_call", "custom_tool_call"):
                continue
            if item.get("type") == "function_call" and item.get("name") in declared:
                found.append(
                    Call(str(item.get("call_id")), str(item["name"]), _arguments(item.get("arguments")))
                )
            else:
                others = True
        return found, others

    def follow_up(
        self, body: dict[str, Any], answer: Mapping[str, Any], executed: Executed
    ) -> dict[str, Any]:
        """The next round's request: the input so far (a string input becomes a user message), the
        answer's function calls and messages (its reasoning left out), and an output item per
        executed call."""
        given = body.get("input")
        items = list(given) if isinstance(given, list) else [{"role": "user", "content": str(given or "")}]
        output = answer.get("output")
        for item in output if isinstance(output, list) else ():
            # The answer's reasoning stays out: llama-server refuses a replayed reasoning item whose
            # content is empty (dialects/codex.py), and the next round does not need it.
            if isinstance(item, dict) and item.get("type") in ("function_call", "message"):
                items.append(item)
        items += [
            {"type": "function_call_output", "call_id": call.id, "output": result_text(result)}
            for call, result in executed
        ]
        return {**body, "input": items}

    def last_round(self, body: dict[str, Any]) -> dict[str, Any]:
        return {**body, "tool_choice": "none"}

    def final(self, answers: Sequence[Mapping[str, Any]], executed: Sequence[Executed]) -> dict[str, Any]:
        """The client's one answer from every round: each executed search as a `web_search_call`
        item with its query and sources, other items as they came, the last round's envelope and,
        where usage was given, the rounds' output tokens summed."""
        output: list[Any] = []
        for answer, done in zip(answers, executed, strict=True):
            by_id = {call.id: (call, result) for call, result in done}
            for item in answer.get("output") or ():
                pair = by_id.get(str(item.get("call_id"))) if isinstance(item, dict) else None
                if pair is None or item.get("type") != "function_call":
                    output.append(item)
                    continue
                call, result = pair
                assert isinstance(result, Searched)
                output.append(
                    {
                        "type": "web_search_call",
                        "id": f"ws_{call.id}",
                        "status": "failed" if result.error else "completed",
                        "action": {
                            "type": "search",
                            "query": result.query,
                            "sources": [{"type": "url", "url": hit.url} for hit in result.hits],
                        },
                    }
                )
        last = dict(answers[-1])
        usage = dict(last.get("usage") or {})
        if usage:
            usage["output_tokens"] = sum(_usage_tokens(a.get("usage"), "output_tokens") for a in answers)
            usage["total_tokens"] = _usage_tokens(usage, "input_tokens") + usage["output_tokens"]
            last["usage"] = usage
        return {**last, "output": output}


WIRES: dict[str, Wire] = {"messages": MessagesWire(), "responses": ResponsesWire()}
