"""gateway/tools/ps.py: the launched replicas' table, with each slot's session under its replica."""

from __future__ import annotations

from typing import Any

from gateway.tools.ps import render


def replica(**extra: Any) -> dict[str, Any]:
    return {
        "name": "gpu0-agents",
        "state": "ready",
        "since_s": 12.0,
        "uses": {"gpu0": 30},
        "in_flight": 1,
        "idle_s": 3.0,
        "last_load_s": 4.2,
        "loads": 1,
        "reason": "ready in 4.2 s",
        **extra,
    }


def test_each_slot_shows_its_sessions_digest_tokens_and_idle_time() -> None:
    slots = [
        {"slot": 0, "session": "3f2a9c1e", "tokens": 41250, "idle_s": 12.4, "busy": False},
        {"slot": 1, "session": "77aa0b12", "tokens": 9000, "idle_s": 0.0, "busy": True},
        {"slot": 2, "session": None, "tokens": 0, "idle_s": None, "busy": False},
    ]
    lines = render([replica(slots=slots, saved_slots=0)]).splitlines()
    assert lines[1].startswith("gpu0-agents")
    assert lines[2:] == [
        "  slot 0  session 3f2a9c1e  41250 tok  idle 12s",
        "  slot 1  session 77aa0b12  9000 tok  idle 0s  busy",
        "  slot 2  free",
    ]


def test_slots_saved_across_a_stop_are_counted() -> None:
    lines = render([replica(state="stopped", slots=[], saved_slots=3)]).splitlines()
    assert lines[-1] == "  3 slots saved, restored at the next start"


def test_a_replica_without_slots_is_one_line() -> None:
    assert len(render([replica()]).splitlines()) == 2
