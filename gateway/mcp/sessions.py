"""Whose each MCP session is, and how many a key may hold (pure bookkeeping; server.py acts).

The SDK's session manager keeps every session for its idle timeout (30 minutes) up to 10,000 in
all, and binds none to a caller: one client that opened 10,000 sessions in 15 s (RSS 127 -> 452
MiB) locked every other client out for half an hour, and any key that held a session id could use
or end it. Here a session belongs to the key that opened it (fleet/stored.py's Owner): to any
other key, admins excepted, it does not exist. A key holds at most `per_key` sessions and all keys
together `total`; a new session first takes the place of the key's own least recently used idle
session, then of anyone's, and is refused only when every session in the way has a request in
flight (an open GET stream counts).

Every decision takes the time as an argument; nothing here sleeps, logs or touches a socket.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from gateway.fleet.stored import Owner


@dataclass
class Session:
    """One open MCP session: the owner key that opened it, when it was last used, and its requests
    in flight (an open GET stream counts)."""

    owner: str
    used: float  # when its last request ended (or began, while one is in flight)
    in_flight: int = 0


@dataclass(frozen=True)
class Admission:
    """A new session may open once `evict` are closed; `refused` names the cap in the way."""

    evict: tuple[str, ...] = ()
    refused: str | None = None  # "key" or "total"


class SessionBook:
    """The MCP sessions by owner, least recently used first, with the places of those still opening:
    `admit` decides a new session under the per-key and total caps (evicting idle ones), `opened`,
    `begin`, `end` and `forget` track each session's life. Pure; the MCP gate holds one and acts on
    its answers."""

    def __init__(self, per_key: int, total: int, idle: float) -> None:
        self.per_key, self.total, self.idle = per_key, total, idle
        # Least recently used first, so the first idle one found is the one to evict.
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._opening: dict[str, int] = {}  # owner -> sessions being opened (no id yet)

    def __len__(self) -> int:
        return len(self._sessions)

    def held(self, owner: str) -> int:
        return sum(1 for s in self._sessions.values() if s.owner == owner) + self._opening.get(owner, 0)

    def visible(self, session_id: str, owner: Owner) -> bool:
        """The session exists for this caller: its own, or any for an admin."""
        session = self._sessions.get(session_id)
        return session is not None and (owner.admin or session.owner == owner.key)

    def admit(self, owner: str, now: float, per_key: int | None = None) -> Admission:
        """Whether `owner` may open one more session now, and which sessions must be closed first
        (`per_key` overrides the cap for this owner). Sessions idle past the idle timeout are closed
        whatever the answer (the SDK closes them too; whichever comes first). The ones to close are
        forgotten here at once, so no request can start on them while they close; an admitted
        owner holds a place until `opened`."""
        evict = [sid for sid, s in self._sessions.items() if not s.in_flight and now - s.used >= self.idle]
        for sid in evict:
            del self._sessions[sid]
        if self.held(owner) >= (self.per_key if per_key is None else per_key):
            mine = self._oldest_idle(lambda s: s.owner == owner)
            if mine is None:
                return Admission(tuple(evict), "key")
            evict.append(mine)
            del self._sessions[mine]
        if len(self._sessions) + sum(self._opening.values()) >= self.total:
            anyone = self._oldest_idle(lambda s: True)
            if anyone is None:
                return Admission(tuple(evict), "total")
            evict.append(anyone)
            del self._sessions[anyone]
        self._opening[owner] = self._opening.get(owner, 0) + 1
        return Admission(tuple(evict))

    def opened(self, owner: str, session_id: str | None, now: float) -> None:
        """The admitted opening request answered: with the new session's id, or without one (it
        failed, and nothing was established)."""
        left = self._opening.get(owner, 0) - 1
        if left > 0:
            self._opening[owner] = left
        else:
            self._opening.pop(owner, None)
        if session_id is not None:
            self._sessions[session_id] = Session(owner, now, in_flight=1)

    def begin(self, session_id: str, now: float) -> None:
        session = self._sessions.get(session_id)
        if session is not None:
            session.in_flight += 1
            session.used = now
            self._sessions.move_to_end(session_id)

    def end(self, session_id: str, now: float) -> None:
        session = self._sessions.get(session_id)
        if session is not None:
            session.in_flight = max(0, session.in_flight - 1)
            session.used = now

    def forget(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def _oldest_idle(self, which: Callable[[Session], bool]) -> str | None:
        for sid, session in self._sessions.items():
            if not session.in_flight and which(session):
                return sid
        return None
