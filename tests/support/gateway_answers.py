"""Reading what the gateway answered: SSE events, error envelopes, Prometheus text, strict JSON, and
replica addresses that must not leak into a message or header.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from typing import Any

from tests.support.rawhttp import RawResponse


@dataclass(frozen=True)
class Event:
    """One SSE event as a client sees it: its data lines joined, and whether it was only a comment."""

    data: str | None
    comment: bool
    raw: bytes


def sse_events(body: bytes) -> list[Event]:
    """Split a text/event-stream body per the SSE spec: CRLF, LF and CR all end lines."""
    text = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    events = []
    for block in text.split(b"\n\n"):
        if not block.strip(b"\n"):
            continue
        lines = block.strip(b"\n").split(b"\n")
        data = [line[5:].removeprefix(b" ") for line in lines if line.startswith(b"data:")]
        comment = all(line.startswith(b":") for line in lines)
        events.append(Event(b"\n".join(data).decode() if data else None, comment, block))
    return events


def data_events(body: bytes) -> list[str]:
    return [event.data for event in sse_events(body) if event.data is not None]


def error_events(body: bytes) -> list[dict[str, Any]]:
    out = []
    for data in data_events(body):
        with contextlib.suppress(ValueError):
            value = json.loads(data)
            if isinstance(value, dict) and "error" in value:
                out.append(value["error"])
    return out


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when there are none)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def series_count(text: str) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def strict_json(data: bytes) -> Any:
    """Parse as RFC 8259 JSON: NaN, Infinity and duplicate keys are errors, not values."""

    def no_constant(name: str) -> Any:
        raise ValueError(f"not JSON: {name}")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in pairs]
        if len(keys) != len(set(keys)):
            raise ValueError(f"duplicate keys: {keys}")
        return dict(pairs)

    return json.loads(data.decode("utf-8"), parse_constant=no_constant, object_pairs_hook=no_duplicates)


_HOST_PORT = re.compile(r"\d{1,3}(?:\.\d{1,3}){3}:\d+")


def addresses_in(text: str) -> list[str]:
    """host:port pairs in a text: a replica address leaking into a message or header."""
    return _HOST_PORT.findall(text)


def assert_envelope(
    response: RawResponse, status: int, type_: str, code: str | None = None
) -> dict[str, Any]:
    """The gateway's own error: status, JSON envelope with the four keys, and an x-request-id."""
    assert response.status == status, (response.status, response.body[:500])
    assert response.header("x-request-id"), response.headers
    assert (response.header("content-type") or "").startswith("application/json"), response.headers
    error: dict[str, Any] = response.json()["error"]
    assert {"message", "type", "code", "param"} <= set(error), error
    assert error["type"] == type_, error
    if code is not None:
        assert error["code"] == code, error
    assert isinstance(error["message"], str), error
    assert len(error["message"]) <= 512, error
    return error
