"""The server-tool loop with a scripted engine: the rounds, what each round sends, the client's
answer in its dialect, the bounds (max_uses, rounds, prior context), and the history that replays
the same bytes the engine saw."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from gateway.routing.table import FetchPolicy, SearchBackend, ServerTools
from gateway.servertools.execute import Executor
from gateway.servertools.loop import Loop, Ran, plan, prepare
from gateway.servertools.wires import NOT_KEPT
from tests.servertools.stub import StubWeb
from tests.support.servers import ThreadServer, serve

Json = dict[str, Any]


@pytest.fixture(scope="module")
def web() -> Iterator[ThreadServer]:
    with serve(StubWeb()) as server:
        yield server


def config(server: ThreadServer, rounds: int = 4) -> ServerTools:
    return ServerTools(
        search=SearchBackend(url=server.url + "/search"),
        fetch=FetchPolicy(allow=["127.0.0.1"], ports=[server.port], allow_networks=["127.0.0.1/32"]),
        max_rounds=rounds,
    )


class Engine:
    """Answers each round from a script, records the bodies it was sent."""

    def __init__(self, answers: list[Json]) -> None:
        self.answers = answers
        self.sent: list[Json] = []

    async def __call__(self, body: Json) -> Json:
        self.sent.append(copy.deepcopy(body))
        return self.answers[min(len(self.sent), len(self.answers)) - 1]


def tool_use(name: str, arguments: Json, call_id: str = "toolu_1") -> Json:
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": call_id, "name": name, "input": arguments},
        ],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 100, "output_tokens": 10},
    }


ANSWER = {
    "id": "msg_2",
    "type": "message",
    "role": "assistant",
    "content": [{"type": "text", "text": "It is installed with pip."}],
    "stop_reason": "end_turn",
    "usage": {"input_tokens": 180, "output_tokens": 7},
}
SEARCH_TOOL = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
FETCH_TOOL = {"type": "web_fetch_20250910", "name": "web_fetch"}


def messages_request(*tools: Json, text: str = "How do I install fleet?") -> Json:
    return {
        "model": "m",
        "max_tokens": 100,
        "stream": True,
        "tools": [{"name": "Bash", "input_schema": {"type": "object"}}, *tools],
        "messages": [{"role": "user", "content": text}],
    }


def serve_loop(
    server: ThreadServer, request: Json, engine: Engine, endpoint: str = "messages", rounds: int = 4
) -> Ran:
    settings = config(server, rounds)
    found = plan(request, endpoint, settings)
    assert found is not None
    body = dict(request)
    prepare(body, found)
    return asyncio.run(Loop(settings, Executor(settings.search, settings.fetch)).run(body, found, engine))


def test_a_web_search_round_trip_in_messages(web: ThreadServer) -> None:
    engine = Engine([tool_use("web_search", {"query": "install fleet"}), ANSWER])
    ran = serve_loop(web, messages_request(SEARCH_TOOL), engine)
    first, second = engine.sent
    assert first["stream"] is False and first["tools"][1] == {
        "name": "web_search",
        "description": first["tools"][1]["description"],
        "input_schema": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "The search query"}},
            "required": ["query"],
        },
    }
    assert first["tools"][0] == {"name": "Bash", "input_schema": {"type": "object"}}
    assert second["messages"][1]["content"][1]["type"] == "tool_use"
    result = second["messages"][2]["content"][0]
    assert result["type"] == "tool_result" and result["tool_use_id"] == "toolu_1"
    assert result["content"].startswith(
        'Web search results for "install fleet":\n1. Install\n   https://docs.example.org/install'
    )
    answer = ran.answer
    assert [b["type"] for b in answer["content"]] == [
        "text",
        "server_tool_use",
        "web_search_tool_result",
        "text",
    ]
    assert answer["content"][1] == {
        "type": "server_tool_use",
        "id": "toolu_1",
        "name": "web_search",
        "input": {"query": "install fleet"},
    }
    hits = answer["content"][2]["content"]
    assert hits[0]["type"] == "web_search_result" and hits[0]["url"] == "https://docs.example.org/install"
    assert answer["usage"]["input_tokens"] == 180 and answer["usage"]["output_tokens"] == 17
    assert answer["usage"]["server_tool_use"] == {"web_search_requests": 1, "web_fetch_requests": 0}
    assert (ran.rounds, ran.searches, ran.fetches) == (2, 1, 0)


def test_the_next_turn_replays_the_bytes_the_engine_saw(web: ThreadServer) -> None:
    engine = Engine([tool_use("web_search", {"query": "install fleet"}), ANSWER])
    request = messages_request(SEARCH_TOOL)
    ran = serve_loop(web, request, engine)
    later = copy.deepcopy(request)
    later["messages"] += [
        {"role": "assistant", "content": ran.answer["content"]},
        {"role": "user", "content": "thanks"},
    ]
    found = plan(later, "messages", config(web))
    assert found is not None
    prepare(later, found)
    # The engine's round-2 prompt, then its answer: the same bytes, so its prefix cache holds.
    seen = engine.sent[1]["messages"] + [{"role": "assistant", "content": ANSWER["content"]}]
    assert orjson.dumps(later["messages"][: len(seen)]) == orjson.dumps(seen)
    assert later["messages"][-1] == {"role": "user", "content": "thanks"}


def test_max_uses_is_honoured(web: ThreadServer) -> None:
    tool = {**SEARCH_TOOL, "max_uses": 1}
    engine = Engine(
        [tool_use("web_search", {"query": "a"}, "t1"), tool_use("web_search", {"query": "b"}, "t2"), ANSWER]
    )
    ran = serve_loop(web, messages_request(tool), engine)
    results = [b for b in ran.answer["content"] if b["type"] == "web_search_tool_result"]
    assert results[1]["content"] == {
        "type": "web_search_tool_result_error",
        "error_code": "max_uses_exceeded",
    }
    assert ran.searches == 1


def test_the_last_round_asks_for_no_tools_and_runs_none(web: ThreadServer) -> None:
    engine = Engine([tool_use("web_search", {"query": "again"})])
    ran = serve_loop(web, messages_request(SEARCH_TOOL), engine, rounds=2)
    assert len(engine.sent) == 2 and engine.sent[1]["tool_choice"] == {"type": "none"}
    assert "tool_choice" not in engine.sent[0]
    last = [b for b in ran.answer["content"] if b["type"] == "web_search_tool_result"][-1]
    assert last["content"]["error_code"] == "max_uses_exceeded" and ran.searches == 1


def test_a_client_tool_call_ends_the_loop_with_both_in_the_answer(web: ThreadServer) -> None:
    both = tool_use("web_search", {"query": "x"})
    both["content"].append({"type": "tool_use", "id": "toolu_2", "name": "Bash", "input": {"command": "ls"}})
    engine = Engine([both, ANSWER])
    ran = serve_loop(web, messages_request(SEARCH_TOOL), engine)
    assert len(engine.sent) == 1
    assert [b["type"] for b in ran.answer["content"]] == [
        "text",
        "server_tool_use",
        "web_search_tool_result",
        "tool_use",
    ]


def test_web_fetch_opens_only_urls_of_the_conversation(web: ThreadServer) -> None:
    page = web.url + "/page"
    made_up = Engine([tool_use("web_fetch", {"url": web.url + "/notes.txt"}), ANSWER])
    ran = serve_loop(web, messages_request(FETCH_TOOL, text=f"Read {page}"), made_up)
    result = ran.answer["content"][2]
    assert result["type"] == "web_fetch_tool_result"
    assert result["content"] == {
        "type": "web_fetch_tool_result_error",
        "error_code": "url_not_in_prior_context",
    }
    given = Engine([tool_use("web_fetch", {"url": page}), ANSWER])
    ran = serve_loop(web, messages_request(FETCH_TOOL, text=f"Read {page}"), given)
    fetched = ran.answer["content"][2]["content"]
    assert fetched["type"] == "web_fetch_result" and fetched["content"]["title"] == "Fleet docs"
    assert "Run fleet-gateway serve." in fetched["content"]["source"]["data"] and ran.fetches == 1
    assert given.sent[1]["messages"][2]["content"][0]["content"].startswith(
        f"Content of {page} (Fleet docs):"
    )


def responses_call(call_id: str = "call_1") -> Json:
    return {
        "id": "resp_1",
        "object": "response",
        "status": "completed",
        "output": [
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": call_id,
                "name": "web_search",
                "arguments": '{"query": "fleet"}',
            }
        ],
        "usage": {"input_tokens": 50, "output_tokens": 5, "total_tokens": 55},
    }


RESPONSE = {
    "id": "resp_2",
    "object": "response",
    "status": "completed",
    "output": [
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Done."}],
        }
    ],
    "usage": {"input_tokens": 90, "output_tokens": 3, "total_tokens": 93},
}


def test_a_web_search_round_trip_in_responses(web: ThreadServer) -> None:
    request = {
        "model": "m",
        "input": "search fleet",
        "tools": [{"type": "function", "name": "exec_command", "parameters": {}}, {"type": "web_search"}],
    }
    engine = Engine([responses_call(), RESPONSE])
    ran = serve_loop(web, request, engine, "responses")
    assert (
        engine.sent[0]["tools"][-1]["name"] == "web_search"
        and engine.sent[0]["tools"][-1]["type"] == "function"
    )
    second = engine.sent[1]["input"]
    assert second[0] == {"role": "user", "content": "search fleet"}
    assert second[1]["type"] == "function_call" and second[2]["type"] == "function_call_output"
    assert second[2]["output"].startswith('Web search results for "fleet"')
    call, message = ran.answer["output"]
    assert call["type"] == "web_search_call" and call["status"] == "completed"
    assert (
        call["action"]["query"] == "fleet"
        and call["action"]["sources"][0]["url"] == "https://docs.example.org/install"
    )
    assert message["type"] == "message" and ran.answer["usage"] == {
        "input_tokens": 90,
        "output_tokens": 8,
        "total_tokens": 98,
    }


def test_codex_replays_a_web_search_call_without_its_results(web: ThreadServer) -> None:
    item = {
        "type": "web_search_call",
        "id": "ws_call_1",
        "status": "completed",
        "action": {"type": "search", "query": "fleet"},
    }
    body = {
        "model": "m",
        "input": [{"role": "user", "content": "x"}, item],
        "tools": [{"type": "web_search"}],
    }
    found = plan(body, "responses", config(web))
    assert found is not None
    prepare(body, found)
    call, output = body["input"][1:]
    assert call["type"] == "function_call" and orjson.loads(call["arguments"]) == {"query": "fleet"}
    assert output == {
        "type": "function_call_output",
        "call_id": "ws_call_1",
        "output": NOT_KEPT.format(query="fleet"),
    }


def test_the_loop_serves_only_configured_and_declared_server_tools(web: ThreadServer) -> None:
    search_only = ServerTools(search=SearchBackend(url=web.url + "/search"))
    assert plan(messages_request(SEARCH_TOOL), "messages", None) is None
    assert plan(messages_request(), "messages", search_only) is None
    assert plan(messages_request(FETCH_TOOL), "messages", search_only) is None
    assert plan(messages_request(SEARCH_TOOL), "chat", search_only) is None
    assert plan(messages_request(SEARCH_TOOL), "messages", search_only) is not None
