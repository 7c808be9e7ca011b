"""The gateway's error tree: every failure a client can see, with its status and OpenAI error type.

    GatewayError                       status  type                    code
    ├── BadRequest                     400     invalid_request_error   (per case)
    │   ├── RequestTooLarge            413                             request_too_large
    │   └── UnknownTask                400                             unknown_task
    ├── Unauthorized                   401     authentication_error    invalid_api_key
    ├── Forbidden                      403     invalid_request_error   (per case: host_not_allowed)
    ├── NotFound                       404     invalid_request_error   not_found
    │   └── ModelNotFound              404                             model_not_found
    ├── RequestTimeout                 408     invalid_request_error   body_timeout, header_timeout
    ├── UnsupportedMediaType           415     invalid_request_error   (per case)
    ├── QueueFull                      429     rate_limit_exceeded     queue_full
    ├── RateLimited                    429     rate_limit_exceeded     (the limit's name)
    ├── GatewayBug                     500     gateway_error           internal_error
    ├── UpstreamServerError            500     upstream_error          upstream_error
    ├── UpstreamFailure                502     upstream_error          (per case)
    ├── NoUpstream                     503     service_unavailable     no_healthy_upstream
    ├── Overloaded                     503     service_unavailable     too_many_connections
    └── GatewayTimeout                 504     timeout                 (per case)

One renderer (`render`) turns any of them into `{"error": {"message", "type", "code", "param"}}`.
Messages are written by the gateway, never copied from an exception, so no stack trace, replica
URL or key can leak through them.
"""

from __future__ import annotations

from typing import ClassVar

import orjson

MAX_MESSAGE = 512


class GatewayError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "gateway_error"
    default_code: ClassVar[str] = "internal_error"

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


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    default_code = "invalid_request"


class RequestTooLarge(BadRequest):
    status = 413
    default_code = "request_too_large"


class UnknownTask(BadRequest):
    default_code = "unknown_task"


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class Forbidden(GatewayError):
    status = 403
    type = "invalid_request_error"
    default_code = "forbidden"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    default_code = "not_found"


class ModelNotFound(NotFound):
    default_code = "model_not_found"


class RequestTimeout(GatewayError):
    status = 408
    type = "invalid_request_error"
    default_code = "body_timeout"


class UnsupportedMediaType(GatewayError):
    status = 415
    type = "invalid_request_error"
    default_code = "unsupported_media_type"


class QueueFull(GatewayError):
    status = 429
    type = "rate_limit_exceeded"
    default_code = "queue_full"


class RateLimited(GatewayError):
    """A named key over one of its rate or token limits; the code is the limit's name."""

    status = 429
    type = "rate_limit_exceeded"
    default_code = "rate_limited"


class GatewayBug(GatewayError):
    """A failure inside the gateway before anything was sent upstream: never retried."""


class UpstreamFailure(GatewayError):
    status = 502
    type = "upstream_error"
    default_code = "bad_gateway"


class UpstreamServerError(GatewayError):
    """A replica's own 500: passed on as a 500, with a generic message, and never retried."""

    status = 500
    type = "upstream_error"
    default_code = "upstream_error"


class NoUpstream(GatewayError):
    status = 503
    type = "service_unavailable"
    default_code = "no_healthy_upstream"


class Overloaded(GatewayError):
    """The gateway itself is at a limit (open connections), not its replicas."""

    status = 503
    type = "service_unavailable"
    default_code = "too_many_connections"


class GatewayTimeout(GatewayError):
    status = 504
    type = "timeout"
    default_code = "upstream_timeout"


def render(message: str, type_: str, code: str | int, param: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message[:MAX_MESSAGE], "type": type_, "code": code, "param": param}}
    )
