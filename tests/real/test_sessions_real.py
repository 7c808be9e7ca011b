"""Agent sessions keep their cache: `policy: session` in front of real llama-server replicas.

The sessions are bench/sessions.py's, made small: Claude Code's and Codex's captured first requests
cut down, growing by a tool round per turn. Hit ratios, replicas and slots come from the engines'
own accounting (the answers' cached tokens, `GET /slots`), so they do not depend on the machine's
speed. The replicas run with the flags docs/engines.md §13 asks for.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from pathlib import Path
from typing import Any

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.sessions import (
    ENGINE_FLAGS,
    KEEPALIVE_AFTER,
    Shape,
    codex_script,
    drive,
    fleet,
    routes,
    run_scenario,
    run_swap,
    summarise,
)
from bench.support.gateway import run_gateway
from gateway.fleet import supervisor
from tests.support.harness import eventually

SMALL = Shape(turns=3, tools=1, trim=300, tool_output=250, gap=(0.05, 0.3))


def test_eight_codex_sessions_on_two_replicas_of_four_slots_split_four_four_and_stay_in_their_slots(
    tiny_gguf: Path,
) -> None:
    result = run_scenario("session", "responses", 8, SMALL)
    assert result["errors"] == 0, result["error_kinds"]
    assert result["sessions_by_first_replica"] == {"r0": 4, "r1": 4}, result
    assert result["sessions_on_one_replica"] == 8
    assert result["sessions_on_one_slot"] == 8
    assert result["of_ideal"] >= 0.98, result


def test_eight_claude_code_sessions_split_four_four_and_stay_in_their_slots(tiny_gguf: Path) -> None:
    # llama-server's Messages endpoint drops id_slot: the gateway sends these turns as chat
    # completions, pinned to their slots, and answers them as Messages.
    result = run_scenario("session", "messages", 8, SMALL)
    assert result["errors"] == 0, result["error_kinds"]
    assert result["sessions_by_first_replica"] == {"r0": 4, "r1": 4}, result
    assert result["sessions_on_one_replica"] == 8
    assert result["sessions_on_one_slot"] == 8
    assert result["of_ideal"] >= 0.98, result


@pytest.mark.parametrize("dialect", ["responses", "messages"])
def test_sixteen_sessions_on_eight_slots_keep_their_cache_across_turns(tiny_gguf: Path, dialect: str) -> None:
    shape = Shape(turns=4, tools=1, trim=300, tool_output=250, gap=(0.05, 0.3))
    result = run_scenario("session", dialect, 16, shape)
    assert result["errors"] == 0, result["error_kinds"]
    assert result["sessions_by_first_replica"] == {"r0": 8, "r1": 8}, result
    assert result["later_of_ideal"] >= 0.9, result


def test_a_sessions_turns_land_on_its_slot(tiny_gguf: Path) -> None:
    script = codex_script(0, Shape(turns=4, tools=1, trim=300, tool_output=250))
    with (
        tempfile.TemporaryDirectory() as save_dir,
        fleet(1, 4, 8192, Path(save_dir), ENGINE_FLAGS) as servers,
        run_gateway(routes("session", servers), keepalive_after=KEEPALIVE_AFTER) as gw,
    ):
        turns, errors = asyncio.run(drive(gw, servers, [script], SMALL))
        slots = httpx2.get(servers[0].url + "/slots", timeout=10).json()
        ratio_count = ("gateway_session_cache_hit_ratio_count", (("replica", "r0"),))

        def settled() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
            # The picture is settled just after an answer's last byte: the last turn's may lag.
            exposed = samples(httpx2.get(gw.url + "/metrics", timeout=10).text)
            return exposed if exposed.get(ratio_count) == 3 else None

        exposed = eventually(settled)
        rows = httpx2.get(gw.url + "/ui/state", timeout=10).json()["presets"][0]["replicas"][0]["slots"]
    assert not errors
    assert exposed is not None, "the last turn's answer never settled the slot picture"
    # What the operator sees: the status page's slot list and the session metrics.
    assert rows[0]["session"] is not None and rows[0]["tokens"] >= turns[-1].prompt
    assert [row["session"] for row in rows[1:]] == [None, None, None]
    assert exposed[("gateway_session_slot_plans_total", (("reason", "free"), ("replica", "r0")))] == 1
    assert exposed[("gateway_session_slot_plans_total", (("reason", "held"), ("replica", "r0")))] == 3
    assert exposed[("gateway_session_slots", (("replica", "r0"), ("state", "held")))] == 1
    assert [t.slot for t in turns] == [0, 0, 0, 0]
    assert [t.cached > 0 for t in turns] == [False, True, True, True]
    tasks = [s.get("id_task") for s in slots]
    assert tasks[0] is not None and tasks[1:] == [None, None, None]  # the other slots never ran
    assert summarise(turns, 1)["of_ideal"] >= 0.98


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def check_swap(result: dict[str, Any]) -> None:
    assert result["saves"] == 4 and result["restores"] == 4 and result["restore_failures"] == 0, result
    assert result["share_cached"] >= 0.9, result


def test_a_swap_of_a_launched_replica_and_back_restores_its_codex_sessions(tiny_gguf: Path) -> None:
    check_swap(run_swap("responses", SMALL, sessions=4))


def test_a_swap_of_a_launched_replica_and_back_restores_its_claude_code_sessions(tiny_gguf: Path) -> None:
    check_swap(run_swap("messages", SMALL, sessions=4))


def test_a_claude_code_turn_that_waits_for_its_replica_to_start_still_hears_its_cache_figures(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every wait for a start is announced at once, as a slow start is under load: the gateway opens
    # the stream with a message_start of its own, and the replica's cached tokens reach the client
    # in the answer's message_delta instead.
    monkeypatch.setattr(supervisor, "LOADING_FIRST", 0.0)
    check_swap(run_swap("messages", SMALL, sessions=4))


def test_without_a_slot_save_path_a_swap_loses_the_sessions_and_says_so(
    tiny_gguf: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="gateway"):
        result = run_swap("responses", SMALL, sessions=4, keep=False)
    assert result["saves"] == 0 and result["cached_after"] == 0, result
    assert caplog.text.count("could not be saved before the stop") == 4
