"""The gateway's error tree: every failure a client can see, with its status and OpenAI error type.

    GatewayError                       status  type                    code                   fallback
    ├── BadRequest                     400     invalid_request_error   (per case)
    │   ├── RequestTooLarge            413                             request_too_large
    │   ├── UnknownTask                400                             unknown_task
    │   └── ContextExceeded            400                             context_length_exceeded  context
    ├── Unauthorized                   401     authentication_error    invalid_api_key
    ├── Forbidden                      403     invalid_request_error   (per case: host_not_allowed)
    ├── NotFound                       404     invalid_request_error   not_found
    │   └── ModelNotFound              404                             model_not_found
    ├── MethodNotAllowed               405     invalid_request_error   method_not_allowed
    ├── RequestTimeout                 408     invalid_request_error   body_timeout, header_timeout
    ├── UnsupportedMediaType           415     invalid_request_error   (per case)
    ├── HeadersTooLarge                431     invalid_request_error   headers_too_large
    ├── QueueFull                      429     rate_limit_exceeded     queue_full             full     busy
    ├── RateLimited                    429     rate_limit_exceeded     (the limit's name)              busy
    ├── GatewayBug                     500     gateway_error           internal_error
    ├── UpstreamServerError            500     upstream_error          upstream_error
    ├── UpstreamFailure                502     upstream_error          (per case)
    ├── NoUpstream                     503     service_unavailable     no_healthy_upstream    down
    │   ├── ReplicaFailed              503                             replica_failed         failed
    │   └── LoadTimeout                503                             load_timeout           loading  busy
    ├── Overloaded                     503     service_unavailable     too_many_connections            busy
    └── GatewayTimeout                 504     timeout                 (per case)
        └── QueueTimeout               504                             queue_timeout                   busy

The transport's failures have their own tree (upstream/__init__.py), translated into these at one
place (pipeline/attempts.py), as HTTPX keeps transport and client errors apart. One renderer
(`render`) turns any of them into `{"error": {"message", "type", "code", "param"}}`; each dialect
renders them in its own envelope and words (dialects/).
`fallback` is the reason a failure before the answer started hands the request to a fallback
preset (routing/fallback.py), carried by the class rather than matched from its code. `busy` marks
the failures that say "the fleet or the key is busy, retry after a while": each dialect answers
them in the terms its agents retry on (dialects/), with `retry_after` seconds when known.
Messages are written by the gateway, never copied from an exception, so no stack trace, replica
URL or key can leak through them.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import orjson

MAX_MESSAGE = 512
# Why a preset hands a request to one of its fallbacks: none ready, its launched replicas failed,
# a load longer than the client waits, its queue full, the prompt past its context.
FallbackReason = Literal["down", "failed", "loading", "full", "context"]


class GatewayError(Exception):
    """A failure the client sees: the class fixes the status, OpenAI error type, default code,
    fallback reason and whether it means busy; an instance carries a message (cut to `MAX_MESSAGE`),
    a code, the offending parameter and response headers such as `retry-after`."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "gateway_error"
    default_code: ClassVar[str] = "internal_error"
    fallback: ClassVar[FallbackReason | None] = None
    busy: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message[:MAX_MESSAGE]
        self.code = code or self.default_code
        self.param = param
        self.headers = headers or {}

    def body(self) -> bytes:
        return render(self.message, self.type, self.code, self.param)

    @property
    def key_limit(self) -> str | None:
        """The key's limit this refusal enforces (the `gateway_key_limited` label), else None."""
        return None

    @property
    def retry_after(self) -> int | None:
        """The seconds its `retry-after` header says, where it has one."""
        value = self.headers.get("retry-after")
        return int(value) if value is not None and value.isdigit() else None


class BadRequest(GatewayError):
    """A body the gateway or its dialect refuses before any replica sees it (400); the code and
    `param` name the case."""

    status = 400
    type = "invalid_request_error"
    default_code = "invalid_request"


class RequestTooLarge(BadRequest):
    """A request body past the size limit, counted as it arrives or after decompression (413)."""

    status = 413
    default_code = "request_too_large"


class UnknownTask(BadRequest):
    """A request that names a task the routing table does not map to a preset."""

    default_code = "unknown_task"


class ContextExceeded(BadRequest):
    """The prompt does not fit the preset's context: estimated or counted by the gateway before
    sending, or refused by the engine itself. The numbers, where known, let each dialect say it in
    the words its agents act on (compact, or lower the budget)."""

    default_code = "context_length_exceeded"
    fallback: ClassVar[FallbackReason | None] = "context"

    def __init__(
        self,
        message: str,
        *,
        prompt_tokens: int | None = None,
        context: int | None = None,
        budget: int | None = None,
        param: str | None = "messages",
    ) -> None:
        super().__init__(message, param=param)
        self.prompt_tokens, self.context, self.budget = prompt_tokens, context, budget


class Unauthorized(GatewayError):
    """A request without a key, or with one the keyring does not know (401)."""

    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class Forbidden(GatewayError):
    """A request the caller may not make (403): a Host name not allowed, a page from another origin
    on a gateway without keys, a preset the key may not use, an admin route for a key that is no
    admin."""

    status = 403
    type = "invalid_request_error"
    default_code = "forbidden"

    @property
    def key_limit(self) -> str | None:
        return "preset_not_allowed" if self.code == "preset_not_allowed" else None


class NotFound(GatewayError):
    """A path, stored response or admin target the gateway does not have (404)."""

    status = 404
    type = "invalid_request_error"
    default_code = "not_found"


class ModelNotFound(NotFound):
    """A model name that resolves to no preset, alias or pattern of the routing table."""

    default_code = "model_not_found"


class MethodNotAllowed(GatewayError):
    """A method the path does not take (405)."""

    status = 405
    type = "invalid_request_error"
    default_code = "method_not_allowed"


class RequestTimeout(GatewayError):
    """A request head or body that did not arrive within its deadline (408); the code says which."""

    status = 408
    type = "invalid_request_error"
    default_code = "body_timeout"


class UnsupportedMediaType(GatewayError):
    """A body not declared as JSON where a gateway without keys requires it (a page could send it
    without a preflight), or in a content encoding the gateway does not read (415)."""

    status = 415
    type = "invalid_request_error"
    default_code = "unsupported_media_type"


class HeadersTooLarge(GatewayError):
    """A request head past the field or byte limit, refused while it is read (edge/connection.py)."""

    status = 431
    type = "invalid_request_error"
    default_code = "headers_too_large"


class QueueFull(GatewayError):
    """No place left in a preset's admission queue or a key's concurrency queue (429, busy); a
    preset's fallback may take the request instead."""

    status = 429
    type = "rate_limit_exceeded"
    default_code = "queue_full"
    fallback: ClassVar[FallbackReason | None] = "full"
    busy = True


class RateLimited(GatewayError):
    """A named key over one of its rate or token limits; the code is the limit's name."""

    status = 429
    type = "rate_limit_exceeded"
    default_code = "rate_limited"
    busy = True

    @property
    def key_limit(self) -> str | None:
        return self.code


class GatewayBug(GatewayError):
    """A failure inside the gateway before anything was sent upstream: never retried."""


class UpstreamFailure(GatewayError):
    """A replica's answer the gateway cannot pass on (502): it broke off, was not what its dialect
    reads, was a redirect, or the replica answered 502."""

    status = 502
    type = "upstream_error"
    default_code = "bad_gateway"


class UpstreamServerError(GatewayError):
    """A replica's own 500: passed on as a 500, with a generic message, and never retried."""

    status = 500
    type = "upstream_error"
    default_code = "upstream_error"


class NoUpstream(GatewayError):
    """No replica of the preset can take the request (503): none healthy, none reachable, none
    configured, or the gateway is shutting down; a fallback preset may take it."""

    status = 503
    type = "service_unavailable"
    default_code = "no_healthy_upstream"
    fallback: ClassVar[FallbackReason | None] = "down"


class ReplicaFailed(NoUpstream):
    """Every launched replica of the preset is `failed` (a crash loop)."""

    default_code = "replica_failed"
    fallback: ClassVar[FallbackReason | None] = "failed"


class LoadTimeout(NoUpstream):
    """A launched replica did not become ready within the load timeout (or the client's patience)."""

    default_code = "load_timeout"
    fallback: ClassVar[FallbackReason | None] = "loading"
    busy = True


class Overloaded(GatewayError):
    """The gateway itself is at a limit (open connections), not its replicas."""

    status = 503
    type = "service_unavailable"
    default_code = "too_many_connections"
    busy = True


class GatewayTimeout(GatewayError):
    """A deadline passed while waiting on a replica (504): the request's whole-answer deadline, a
    replica's 504, or response headers that never came."""

    status = 504
    type = "timeout"
    default_code = "upstream_timeout"


class QueueTimeout(GatewayTimeout):
    """A request waited its whole queue timeout for a free place (its preset's, or its key's)."""

    default_code = "queue_timeout"
    busy = True


def render(message: str, type_: str, code: str | int, param: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message[:MAX_MESSAGE], "type": type_, "code": code, "param": param}}
    )
