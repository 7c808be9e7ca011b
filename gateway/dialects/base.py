"""What every wire dialect provides to the request path: one object per dialect, no branches on
dialect names anywhere else.

A dialect knows its own shapes only: how its errors look (before and after the response headers),
how its answers report usage and their end, where its token budget and thinking controls live,
and what it checks in a body before any replica is bothered with it. The request path, the relay
and the rewrite rules call these methods and never look at a dialect's field names themselves.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from gateway.dialects.answer import Answer
from gateway.errors import BadRequest

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


class Dialect:
    name: ClassVar[str]
    # The byte strings that mark the few stream events worth parsing (usage, end of answer);
    # everything else is forwarded unparsed.
    markers: ClassVar[tuple[bytes, ...]]
    content: ClassVar[re.Pattern[bytes]]  # the first answer token (or tool call) in a stream block
    reasoning: ClassVar[re.Pattern[bytes]]  # the first reasoning token in a stream block
    done: ClassVar[bytes | None] = None  # the stream terminator, where the dialect has one
    # Where the token budget lives, in the precedence the engines apply.
    token_keys: ClassVar[tuple[str, ...]]

    # --- errors ---------------------------------------------------------------------------------
    def error_body(self, status: int, type_: str, message: str, code: str | int, param: str | None) -> bytes:
        raise NotImplementedError

    def stream_error(self, message: str, code: str) -> bytes:
        """The one event that ends a stream the gateway could not finish."""
        raise NotImplementedError

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
    def check(self, body: dict[str, Any], endpoint: str) -> None:
        """Reject what no replica can serve, in this dialect's terms (raises BadRequest)."""

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

    def fixes(self, body: dict[str, Any], wanted: frozenset[str]) -> list[Note]:
        """Named compatibility rewrites for what local engines reject (only those `wanted`)."""
        return []
