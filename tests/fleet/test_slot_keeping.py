"""Sessions kept across a stop (fleet/supervisor.py) and the slot picture read from GET /slots
(fleet/prober.py), against a scripted engine: no sockets, no processes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.fleet.prober import Prober, read_slots
from gateway.fleet.replicas import Fleet, Replica
from gateway.fleet.slots import SlotPlan, slot_file
from gateway.fleet.supervisor import Supervisor
from gateway.routing.table import parse_table
from gateway.upstream import Timeouts

A, B = "a" * 16, "b" * 16
TABLE = """
presets:
  m:
    served_model: m
    policy: session
    replicas: [{name: r0, url: "http://127.0.0.1:9100", engine: llamacpp}]
routing: {default: m}
"""


@dataclass
class Answer:
    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)

    async def read(self, limit: int | None = None) -> bytes:
        return self.body if limit is None else self.body[:limit]

    async def chunks(self) -> AsyncIterator[bytes]:
        yield self.body

    async def close(self) -> None:
        pass


@dataclass
class SlotEngine:
    """Saves and restores slots like llama-server with --slot-save-path (or without: 400s)."""

    save_path: bool = True
    files: dict[str, int] = field(default_factory=dict)  # file -> tokens
    held: dict[int, int] = field(default_factory=dict)  # slot -> tokens
    short_restore: bool = False
    actions: list[str] = field(default_factory=list)
    slots: list[dict[str, Any]] = field(default_factory=list)

    async def send(
        self, url: str, headers: list[tuple[str, str]], body: bytes, timeouts: Timeouts, method: str = "POST"
    ) -> Answer:
        path, _, query = url.partition("?")
        slot = int(path.rsplit("/", 1)[1])
        action = query.removeprefix("action=")
        filename = orjson.loads(body)["filename"]
        self.actions.append(f"{action} {slot} {filename}")
        if not self.save_path:
            return Answer(400, b'{"error": {"message": "slot save path not set"}}')
        if action == "save":
            self.files[filename] = self.held[slot]
            return Answer(200, orjson.dumps({"id_slot": slot, "n_saved": self.held[slot]}))
        tokens = self.files[filename] // (2 if self.short_restore else 1)
        self.held[slot] = tokens
        return Answer(200, orjson.dumps({"id_slot": slot, "n_restored": tokens}))

    async def get(self, url: str, headers: list[tuple[str, str]], timeout: float) -> tuple[int, bytes]:
        if url.endswith("/slots"):
            return 200, orjson.dumps(self.slots)
        return 200, b"{}"

    async def aclose(self) -> None:
        pass


def fleet_with_sessions() -> tuple[Fleet, Replica]:
    fleet = Fleet(parse_table(TABLE), clock=lambda: 0.0)
    replica = fleet.pools["m"].replicas[0]
    replica.cache.resize(2)
    for key, tokens in ((A, 4000), (B, 6000)):
        plan = replica.cache.plan(key, pinnable=True)
        replica.cache.begin(key, key, plan, 0.0)
        replica.cache.settle(key, plan, tokens, 0, 9, 1.0)
    return fleet, replica


def supervisor(fleet: Fleet, engine: SlotEngine, tmp_path: Path) -> Supervisor:
    return Supervisor(lambda: fleet, engine, tmp_path, clock=lambda: 0.0)


@pytest.mark.anyio
async def test_a_stopped_replicas_slots_are_saved_and_restored_into_the_same_slots(tmp_path: Path) -> None:
    fleet, replica = fleet_with_sessions()
    engine = SlotEngine(held={0: 4008, 1: 6008})
    keeper = supervisor(fleet, engine, tmp_path)
    await keeper._save_slots(replica)
    assert engine.actions == [f"save 0 {slot_file('r0', 0)}", f"save 1 {slot_file('r0', 1)}"]
    replica.cache.clear()  # the process is gone
    assert replica.cache.held(A) is None
    await keeper._restore_slots(replica)
    assert engine.actions[2:] == [f"restore 0 {slot_file('r0', 0)}", f"restore 1 {slot_file('r0', 1)}"]
    assert replica.cache.plan(A, pinnable=True) == SlotPlan(0, "held")
    assert replica.cache.plan(B, pinnable=True) == SlotPlan(1, "held")
    stats = replica.cache.stats
    assert (stats.saves, stats.restores, stats.saved_tokens, stats.restored_tokens) == (2, 2, 10016, 10016)
    assert not replica.cache.saved


@pytest.mark.anyio
async def test_an_engine_without_a_slot_save_path_is_said_so_and_keeps_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fleet, replica = fleet_with_sessions()
    engine = SlotEngine(save_path=False, held={0: 4008, 1: 6008})
    await supervisor(fleet, engine, tmp_path)._save_slots(replica)
    assert replica.cache.stats.save_failures == 2 and not replica.cache.saved
    assert caplog.text.count("--slot-save-path") == 2
    assert A not in caplog.text  # only short digests in the log


@pytest.mark.anyio
async def test_a_restore_that_brings_back_too_little_is_a_failure_and_leaves_the_slot_free(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fleet, replica = fleet_with_sessions()
    engine = SlotEngine(held={0: 4008, 1: 6008}, short_restore=True)
    keeper = supervisor(fleet, engine, tmp_path)
    await keeper._save_slots(replica)
    replica.cache.clear()
    await keeper._restore_slots(replica)
    assert replica.cache.stats.restore_failures == 2 and replica.cache.stats.restores == 0
    assert replica.cache.plan(A, pinnable=True) == SlotPlan(0, "free")
    assert "restored 2004 of 4008 saved tokens" in caplog.text


@pytest.mark.anyio
async def test_a_restart_with_fewer_slots_restores_only_those_that_exist(tmp_path: Path) -> None:
    fleet, replica = fleet_with_sessions()
    engine = SlotEngine(held={0: 4008, 1: 6008})
    keeper = supervisor(fleet, engine, tmp_path)
    await keeper._save_slots(replica)
    replica.cache.clear()
    replica.cache.resize(1)
    await keeper._restore_slots(replica)
    assert replica.cache.stats.restores == 1 and replica.cache.stats.restore_failures == 1


@pytest.mark.anyio
async def test_the_prober_reads_slots_where_sessions_live_and_corrects_the_picture(tmp_path: Path) -> None:
    fleet, replica = fleet_with_sessions()
    engine = SlotEngine()
    engine.slots = [{"id": 0}, {"id": 1}]  # restarted behind the gateway's back
    prober = Prober(lambda: fleet, engine)
    await prober.probe(replica)
    assert replica.cache.holders == [None, None]
    engine.slots = "garbage"  # type: ignore[assignment]
    assert await read_slots(engine, replica)  # read, and ignored
