"""Replica health as a pure state machine; time is passed in, nothing here sleeps or does I/O.

Two kinds of evidence, treated differently because they fail differently:
- Active probes of `/health` (never `/v1/models`: llama-server answers it with 200 while `/health`
  still says 503 "Loading model"). `unhealthy_threshold` failures in a row take a replica down,
  `healthy_threshold` successes bring it back, so a flapping replica changes state at most once per
  (unhealthy + healthy) intervals.
- Live traffic. Consecutive connect failures mean the process is gone: down until probes say it is
  back. Consecutive 5xx from a replica whose `/health` still says 200 (a lying replica) eject it for
  a time that doubles on repeat, capped, and probes do not cut that short. 4xx never count: they are
  the client's fault, and one client's bad requests must not eject a working replica. A live success
  within the last probe interval outweighs a probe timeout: a replica busy streaming may answer
  `/health` slowly.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from gateway.routing.table import Health

Outcome = Literal["success", "connect_error", "server_error", "client_error"]
Probe = Literal["ok", "fail", "timeout"]


class Status(StrEnum):
    """A replica's health as probes and live traffic decided it; `unknown` until its first probe."""

    UNKNOWN = "unknown"  # not probed yet: usable (fail-open) but not "ready"
    UP = "up"
    DOWN = "down"


@dataclass
class HealthState:
    """One replica's health: its status, the probe and live-failure streaks, and any 5xx ejection
    with its doubling length. Fed by the prober (`on_probe`), the request path (`on_outcome`,
    `progress`) and the supervisor (`on_started`, `on_stopped`); read through `available` and
    `ready`."""

    config: Health
    status: Status = Status.UNKNOWN
    probe_ok_streak: int = 0
    probe_fail_streak: int = 0
    connect_fail_streak: int = 0
    server_error_streak: int = 0
    ejected_until: float = 0.0
    ejected_for: float = 0.0  # the length of the latest ejection: eject_base, doubling, capped
    ejections: int = 0
    last_ejection_end: float = float("-inf")
    last_live_success: float = float("-inf")
    transitions: int = 0
    last_reason: str = ""

    def available(self, now: float) -> bool:
        return self.status is not Status.DOWN and now >= self.ejected_until

    def ready(self, now: float) -> bool:
        return self.status is Status.UP and now >= self.ejected_until

    def ejected(self, now: float) -> bool:
        return now < self.ejected_until

    def on_probe(self, result: Probe, now: float) -> None:
        """Records one active probe's result at `now`: a success brings an unknown replica up at
        once and a down one after `healthy_threshold` in a row; failures take it down after
        `unhealthy_threshold`, and a timeout is ignored while live traffic succeeded within the last
        probe interval."""
        if result == "ok":
            self.probe_fail_streak = 0
            self.probe_ok_streak += 1
            # A replica first seen healthy is ready at once; one that went down must prove itself.
            if self.status is Status.UNKNOWN or (
                self.status is Status.DOWN and self.probe_ok_streak >= self.config.healthy_threshold
            ):
                self._become(Status.UP, "probe ok")
                self.connect_fail_streak = 0
            return
        if result == "timeout" and now - self.last_live_success <= self.config.interval:
            return  # busy, not dead: live traffic is succeeding
        self.probe_ok_streak = 0
        self.probe_fail_streak += 1
        if self.status is Status.UNKNOWN or (
            self.status is Status.UP and self.probe_fail_streak >= self.config.unhealthy_threshold
        ):
            self._become(Status.DOWN, f"probe {result}")

    def progress(self, now: float) -> None:
        """A stream is flowing: live evidence the replica works, however slowly /health answers."""
        self.last_live_success = now

    def on_outcome(self, outcome: Outcome, now: float) -> bool:
        """Record one live attempt; True when this outcome ejected the replica or took it down."""
        if outcome == "client_error":
            return False
        if outcome == "success":
            self.last_live_success = now
            self.connect_fail_streak = self.server_error_streak = 0
            return False
        if outcome == "connect_error":
            self.connect_fail_streak += 1
            if self.connect_fail_streak >= self.config.eject_after and self.status is not Status.DOWN:
                self.probe_ok_streak = 0
                self._become(Status.DOWN, "connect failures")
                return True
            return False
        self.server_error_streak += 1
        if self.server_error_streak >= self.config.eject_after and not self.ejected(now):
            self._eject(now)
            return True
        return False

    def on_started(self) -> None:
        """A launched replica answered /health after its start: ready now, with a clean slate."""
        self.probe_fail_streak = self.connect_fail_streak = self.server_error_streak = 0
        self.probe_ok_streak = self.config.healthy_threshold
        self.ejected_until = 0.0
        self._become(Status.UP, "started")

    def on_stopped(self, reason: str) -> None:
        """A launched replica's process is gone (stopped, evicted, crashed)."""
        self.probe_ok_streak = 0
        self._become(Status.DOWN, reason)

    def _eject(self, now: float) -> None:
        if now - self.last_ejection_end > self.config.eject_max:
            self.ejections = 0  # a long quiet spell forgives earlier ejections
        self.ejections += 1
        duration = min(self.config.eject_base * 2 ** (self.ejections - 1), self.config.eject_max)
        self.ejected_until = now + duration
        self.ejected_for = duration
        self.last_ejection_end = self.ejected_until
        self.server_error_streak = 0
        self.last_reason = "5xx"

    def _become(self, status: Status, reason: str) -> None:
        if status is not self.status:
            self.status = status
            self.transitions += 1
            self.last_reason = reason
