"""A replica's own error answer, as the client may see it: its status and message kept, in the
client's dialect's envelope, with addresses and credentials scrubbed and the length bounded."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import orjson

from gateway.dialects.base import Dialect
from gateway.dialects.openai import OPENAI
from gateway.errors import ContextExceeded, UpstreamFailure, UpstreamServerError
from gateway.routing.fallback import context_error, context_numbers
from gateway.upstream import UpstreamResponse

if TYPE_CHECKING:
    from gateway.relay.respond import Responder

ERROR_BODY_LIMIT = 64 * 1024  # an upstream error body is read this far and no further

FORWARDED_MESSAGE_LIMIT = 4096
_CREDENTIAL = re.compile(
    r"(?i)\bbearer\s+\S+|\b(?:api[_-]?key|key|token|secret|password)=\S+|\bsk-[A-Za-z0-9_-]{8,}"
)
_URL = re.compile(r"\b(?:https?|wss?)://\S+|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b")


def upstream_error(
    status: int, raw: bytes, secrets: tuple[str, ...] = (), dialect: Dialect = OPENAI
) -> tuple[str, str, str | int, str | None]:
    """A replica's 4xx as (message, type, code, param): its message scrubbed and bounded. Either
    engine may answer in either envelope."""
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        payload = None
    message, type_, code, param = dialect.error_message(payload)
    if not message and dialect is not OPENAI:
        message, type_, code, param = OPENAI.error_message(payload)
    if type_ is None or len(type_) > 64:
        type_ = "invalid_request_error"
    message = scrub(message, secrets)[:FORWARDED_MESSAGE_LIMIT] or f"The replica answered {status}"
    return message, type_, status if code is None else code, param


def upstream_error_body(
    status: int, raw: bytes, request_id: str, secrets: tuple[str, ...] = (), dialect: Dialect = OPENAI
) -> bytes:
    """A replica's 4xx keeps its status and message (scrubbed, bounded), in the client's own
    dialect's envelope."""
    message, type_, code, param = upstream_error(status, raw, secrets, dialect)
    return dialect.error_body(status, type_, message, code, param)


def scrub(message: str, secrets: tuple[str, ...] = ()) -> str:
    """A replica's message may echo its address or its key: neither reaches the client."""
    for secret in secrets:
        if secret:
            message = message.replace(secret, "[redacted]")
    return _URL.sub("[address]", _CREDENTIAL.sub("[redacted]", message))


async def relay_replica_error(
    responder: Responder, response: UpstreamResponse, secrets: tuple[str, ...], data: bytes | None = None
) -> None:
    """A replica's answer with a status of 300 or more: its 4xx reaches the client with status and
    message kept; a redirect or a 5xx becomes the gateway's own failure (raised); a prompt the
    engine found too long is raised as ContextExceeded with the engine's own count, so that a
    fallback preset may take it, or the client hears it in its agent's words."""
    ex = responder.ex
    if data is None:  # the caller may have read it already (the tool_schemas retry)
        data = await response.read(ERROR_BODY_LIMIT)
    if response.status < 400:
        raise UpstreamFailure("The replica answered with a redirect, which the gateway does not follow")
    if response.status >= 500:
        ex.outcome = "upstream_error"
        raise UpstreamServerError(
            f"The replica failed to answer (HTTP {response.status}); request {ex.request_id}"
        )
    if context_error(response.status, data):
        message = upstream_error(response.status, data, secrets, responder.dialect)[0]
        prompt, context = context_numbers(data) or (None, None)
        raise ContextExceeded(message, prompt_tokens=prompt, context=context, param=None)
    await responder.replica_error(response.status, data, secrets)
