"""What every wire dialect provides to the request path: one object per dialect, no branches on
dialect names anywhere else.

A dialect knows its own shapes only: how its errors look (before and after the response headers),
how its answers report usage and their end, where its token budget and thinking controls live,
and what it checks in a body before any replica is bothered with it. The request path, the relay
and the rewrite rules call these methods and never look at a dialect's field names themselves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

from gateway.answers.changes import Changes
from gateway.dialects.answer import Answer
from gateway.errors import BadRequest, GatewayError

Note = tuple[str, str]  # (bounded metric label, text for x-gateway-rewrites)


def require_list(body: dict[str, Any], key: str) -> None:
    """`key` must be a non-empty array."""
    value = body.get(key)
    if not isinstance(value, list) or not value:
        raise BadRequest(f"'{key}' must be a non-empty array", param=key)


def optional(body: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> None:
    """`key`, where present, must be of `kind` (`what` names it in the error)."""
    value = body.get(key)
    if value is not None and not isinstance(value, kind):
        raise BadRequest(f"'{key}' must be {what}", param=key)


# Tuples of types where a check runs per item: `str | None` would be a new object on every call.
_TYPE_NAME = (str, type(None))


def part_types(items: Any, key: str, content_key: str = "content") -> None:
    """Each content part's `type`, where given, must be a string: the request path compares it
    with sets of part types (images, text), and an array or object there is a client's mistake to
    answer with a 400, not a gateway failure."""
    if not isinstance(items, list):
        return
    for i, item in enumerate(items):
        content = item.get(content_key) if isinstance(item, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:  # every part of a long history: the index only for the error
            if isinstance(part, dict) and not isinstance(part.get("type", ""), _TYPE_NAME):
                # The first part equal to this one is this one: an earlier equal part would have
                # failed first.
                where = f"{key}[{i}].{content_key}[{content.index(part)}].type"
                raise BadRequest(f"'{where}' must be a string", param=where)


@dataclass(frozen=True)
class ErrorReply:
    """How a client is told of the gateway's own failure: an error response (`status`, `body`,
    `headers`), or, where `stream` is set, the events that end a stream with it (`body`)."""

    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()
    stream: bool = False


# The most an agent is asked to wait in a `retry-after`: Claude Code gives up at once on a longer
# one, and a busy fleet frees a place within seconds.
MAX_RETRY_HINT = 59


class Dialect:
    """The seam for one wire format: its error envelopes, stream opening and keep-alive, how usage
    and the end of an answer are read, its body check, thinking switch and compatibility fixes. One
    stateless instance per dialect, named by `registry.py` entries and called by the request path,
    the relay and the rewrite rules."""

    name: ClassVar[str]
    # The byte strings that mark the few stream events worth parsing (usage, end of answer);
    # everything else is forwarded unparsed.
    markers: ClassVar[tuple[bytes, ...]]
    content: ClassVar[re.Pattern[bytes]]  # the first answer token (or tool call) in a stream block
    reasoning: ClassVar[re.Pattern[bytes]]  # the first reasoning token in a stream block
    done: ClassVar[bytes | None] = None  # the stream terminator, where the dialect has one
    # Where the token budget lives, in the precedence the engines apply.
    token_keys: ClassVar[tuple[str, ...]]
    # The events a replica's stream opens with: dropped when the gateway opened the stream already.
    opening_kinds: ClassVar[frozenset[str]] = frozenset()

    # --- errors ---------------------------------------------------------------------------------
    def error_body(self, status: int, type_: str, message: str, code: str | int, param: str | None) -> bytes:
        raise NotImplementedError

    def stream_error(self, message: str, code: str) -> bytes:
        """The one event that ends a stream the gateway could not finish."""
        raise NotImplementedError

    def error_reply(
        self, error: GatewayError, *, streaming: bool, opened: bool, request_id: str, model: str | None
    ) -> ErrorReply:
        """The gateway's own failure in this dialect's terms: on a stream the gateway already opened
        (`opened`), the events that end it; otherwise an error response with the error's status and
        headers. `streaming`: the client asked for a stream (Responses answers some failures with
        one, because that is where Codex reads them)."""
        if opened:
            return ErrorReply(200, self.stream_error(self.describe(error), str(error.code)), stream=True)
        body = self.error_body(error.status, error.type, self.describe(error), error.code, error.param)
        return ErrorReply(error.status, body, tuple(error.headers.items()))

    # --- streams the gateway keeps alive ----------------------------------------------------------
    def opening(self, *, request_id: str, model: str | None, input_tokens: int) -> bytes:
        """The events that open a stream before any replica answered (the status line alone, here)."""
        return b""

    def keepalive(self) -> bytes:
        """What keeps a waiting stream alive for this dialect's clients: an SSE comment here."""
        return b": keep-alive\n\n"

    def describe(self, error: GatewayError) -> str:
        """The error's message as this dialect's clients recognise it (a context overflow in the
        words their agents act on); by default the gateway's own."""
        return error.message

    def error_message(self, payload: Any) -> tuple[str, str | None, str | int | None, str | None]:
        """A replica's error body read as (message, type, code, param); blanks where absent."""
        raise NotImplementedError

    # --- answers --------------------------------------------------------------------------------
    def read_whole(self, answer: Answer, payload: dict[str, Any]) -> None:
        raise NotImplementedError

    def read_event(self, answer: Answer, payload: dict[str, Any]) -> None:
        raise NotImplementedError

    def injected_usage(self, payload: dict[str, Any]) -> bool:
        """An event that exists only because the gateway asked for usage (dropped when so)."""
        return False

    # --- requests -------------------------------------------------------------------------------
    def check(self, body: dict[str, Any], endpoint: str, odd_types: bool = True) -> None:
        """Reject what no replica can serve, in this dialect's terms (raises BadRequest).
        `odd_types` False: the body's walk saw no `type` that is neither a string nor null, so
        `part_types` could find nothing and is not run."""

    def has_images(self, body: dict[str, Any]) -> bool:
        return False

    def thinking(self, body: dict[str, Any], on: bool, override: bool) -> list[Note]:
        """Apply the preset's thinking setting; the client's own choice wins unless `override`."""
        return []

    def thinks(self, body: dict[str, Any]) -> bool:
        """Whether the request, as it will be sent, leaves thinking on: the template switch both
        engines read is not off (each dialect adds its own spelling of "off")."""
        kwargs = body.get("chat_template_kwargs")
        return not (isinstance(kwargs, dict) and kwargs.get("enable_thinking") is False)

    def default_budget_key(self, endpoint: str) -> str:
        return self.token_keys[-1]

    def fixes(
        self, body: dict[str, Any], wanted: frozenset[str], changes: Changes | None = None
    ) -> list[Note]:
        """Named compatibility rewrites for what local engines reject (only those `wanted`); a fix
        whose answer must be changed back adds that change to `changes`."""
        return []
