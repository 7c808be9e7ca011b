"""A replica's own error answer on the request path: a 4xx relayed in the client's dialect
(replica_message.py words it), a 5xx or a redirect raised as the gateway's failure, a prompt past
the context raised so that a fallback or the agent's own words can follow."""

from __future__ import annotations

from gateway.errors import ContextExceeded, UpstreamFailure, UpstreamServerError
from gateway.relay.replica_message import upstream_error
from gateway.relay.respond import Responder
from gateway.routing.fallback import context_error, context_numbers
from gateway.types import ReadBytes
from gateway.upstream import UpstreamResponse

ERROR_BODY_LIMIT = 64 * 1024  # an upstream error body is read this far and no further


async def relay_replica_error(
    responder: Responder, response: UpstreamResponse, secrets: tuple[str, ...], data: ReadBytes | None = None
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
