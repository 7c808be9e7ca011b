"""What FU records of the traffic it gets, on the monotonic clock the tests measure with.

Most gates of the catalogue are measured on the upstream side ("the FU sees EOF within 1.2 s", "B
receives exactly one request"), so every connection and request is kept, with its timestamps.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any


def now() -> float:
    # CLOCK_MONOTONIC is system-wide on Linux, so FU subprocesses and the test agree on it.
    return time.monotonic()


@dataclass(eq=False)
class Request:
    conn: Connection
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    body: bytes
    t_received: float
    index: int  # position on its connection: > 0 means the gateway reused a keep-alive connection
    behaviour: str = ""
    events_sent: list[float] = field(default_factory=list)  # each SSE event's blank line, when written
    bytes_sent: int = 0
    t_done: float | None = None

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    def header(self, name: str) -> str | None:
        values = self.header_values(name)
        return values[0] if values else None

    def header_values(self, name: str) -> list[str]:
        lowered = name.lower()
        return [value for key, value in self.headers if key.lower() == lowered]

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(eq=False)
class Connection:
    id: int
    peer: tuple[str, int]
    t_accept: float
    t_eof: float | None = None  # the gateway's FIN or RST; None while open or when the FU closed first
    reset_by_peer: bool = False
    t_closed_by_fu: float | None = None
    t_lost: float | None = None
    requests: list[Request] = field(default_factory=list)
    eof: threading.Event = field(default_factory=threading.Event)  # set on the gateway's FIN/RST
    lost: threading.Event = field(default_factory=threading.Event)  # set however the socket ended

    @property
    def closed(self) -> bool:
        return self.lost.is_set()


class ConnectionGone(Exception):
    """The gateway closed the connection while a behaviour was still writing."""
