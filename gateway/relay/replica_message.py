"""A replica's error message as the client may see it (pure): its status and message kept, in the
client's dialect's envelope, with addresses and credentials scrubbed and the length bounded."""

from __future__ import annotations

import re

import orjson

from gateway.dialects.base import Dialect
from gateway.dialects.openai import OPENAI
from gateway.types import ReadBytes

FORWARDED_MESSAGE_LIMIT = 4096
_CREDENTIAL = re.compile(
    r"(?i)\bbearer\s+\S+|\b(?:api[_-]?key|key|token|secret|password)=\S+|\bsk-[A-Za-z0-9_-]{8,}"
)
_URL = re.compile(r"\b(?:https?|wss?)://\S+|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b")


def upstream_error(
    status: int, raw: ReadBytes, secrets: tuple[str, ...] = (), dialect: Dialect = OPENAI
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
    status: int, raw: ReadBytes, request_id: str, secrets: tuple[str, ...] = (), dialect: Dialect = OPENAI
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
