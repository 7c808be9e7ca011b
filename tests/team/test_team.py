"""What the request path calls on the team: `reserve` at admission (429 naming the limit and the
wait), `charge` with the reservation at the end, and the calls from before reservations."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.errors import RateLimited
from gateway.team.keys import Identity
from gateway.team.limits import KeyLimits, Usage
from gateway.team.team import Team

PROMPT = 7500


def alice(**limits: int) -> Identity:
    return Identity("alice", limits=KeyLimits(**limits))


def test_concurrent_reservations_over_tokens_per_minute_refuse_all_but_one() -> None:
    team = Team.solo()
    identity = alice(tokens_per_minute=1000)

    async def scenario() -> list[Any]:
        return await asyncio.gather(
            *(team.reserve(identity, "m", PROMPT) for _ in range(20)), return_exceptions=True
        )

    answers = asyncio.run(scenario())
    refused = [a for a in answers if isinstance(a, RateLimited)]
    assert len(refused) == 19 and len(answers) == 20
    error = refused[0]
    assert error.code == "tokens_per_minute"
    assert "tokens_per_minute=1000: 7500 tokens in the last 60 s" in str(error)
    assert 1 <= int(error.headers["retry-after"]) <= 60


def test_charging_the_reservation_lets_the_key_in_again() -> None:
    team = Team.solo()
    identity = alice(tokens_per_minute=1000)

    async def scenario() -> int:
        admission = await team.reserve(identity, "m", PROMPT)
        with pytest.raises(RateLimited):
            await team.reserve(identity, "m", PROMPT)
        # A stream cut early: what the request path counted of it.
        team.charge(
            "alice", "m", Usage(prompt_tokens=PROMPT // 10, completion_tokens=20), admission.reservation
        )
        await team.settle()
        again = await team.reserve(identity, "m", 100)
        return again.ticket

    assert asyncio.run(scenario()) == 1


def test_ticket_and_charge_without_a_reservation_count_when_the_answer_ends() -> None:
    team = Team.solo()
    identity = alice(tokens_per_minute=16)

    async def scenario() -> list[int]:
        tickets = []
        for _ in range(2):
            tickets.append(await team.ticket(identity, "m"))
            team.charge("alice", "m", Usage(prompt_tokens=5, completion_tokens=3))
            await team.settle()
        with pytest.raises(RateLimited):
            await team.ticket(identity, "m")
        return tickets

    assert asyncio.run(scenario()) == [0, 1]


def test_start_on_local_counters_keeps_them_local() -> None:
    team = Team.solo()
    asyncio.run(team.start())
    assert team.counters.condition() == "local"
