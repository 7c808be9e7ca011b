"""The in-process windows with reservations, over a fake clock: admission counts the tokens a
request is expected to cost at once, the end of the request replaces them by the real ones."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.team.limits import USAGE_FIELDS, KeyLimits, Usage
from gateway.team.windows import LocalCounters, TokenWindow, token_retry

PROMPT = 7500  # a coding agent's first turn, roughly


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def run(coro: Awaitable[Any]) -> Any:
    async def main() -> Any:
        return await coro

    return asyncio.run(main())


# Token limits far above what the tests use: the windows count, and nothing is refused.
ROOMY = KeyLimits(tokens_per_minute=10**9, tokens_per_day=10**9)


def test_a_reservation_counts_at_admission_and_refuses_the_next_request() -> None:
    clock = Clock()
    counters = LocalCounters(clock)
    limits = KeyLimits(tokens_per_minute=1000)

    async def scenario() -> None:
        first = await counters.admit("k", limits, "m", reserve=PROMPT)
        assert first.denial is None and first.reservation is not None
        assert first.reservation.tokens == PROMPT
        clock.now += 5
        refused = (await counters.admit("k", limits, "m", reserve=10)).denial
        assert refused is not None
        assert (refused.limit, refused.allowed, refused.used) == ("tokens_per_minute", 1000, PROMPT)
        # The reservation's bucket leaves the sliding window 60 s after it was made.
        assert refused.retry_after == pytest.approx(55)
        assert "tokens_per_minute=1000: 7500 tokens in the last 60 s" in refused.message("k")

    run(scenario())


@pytest.mark.parametrize("limit", ["tokens_per_minute", "tokens_per_day"])
def test_twenty_concurrent_admissions_over_a_token_limit_admit_exactly_one(limit: str) -> None:
    counters = LocalCounters(Clock())
    limits = KeyLimits(**{limit: 1000})

    async def scenario() -> list[bool]:
        answers = await asyncio.gather(*(counters.admit("k", limits, "m", reserve=PROMPT) for _ in range(20)))
        return [a.denial is None for a in answers]

    admitted = run(scenario())
    assert admitted.count(True) == 1


def test_settlement_down_leaves_only_the_real_charge_in_the_window() -> None:
    clock = Clock()
    counters = LocalCounters(clock)
    limits = KeyLimits(tokens_per_minute=400)

    async def scenario() -> Any:
        admission = await counters.admit("k", limits, "m", reserve=PROMPT)
        clock.now += 3
        await counters.charge(
            "k", "m", Usage(prompt_tokens=300, completion_tokens=100), admission.reservation
        )
        return (await counters.admit("k", limits, "m")).denial

    refused = run(scenario())
    assert refused is not None and refused.used == 400


def test_settlement_up_counts_the_real_charge_over_the_reservation() -> None:
    clock = Clock()
    counters = LocalCounters(clock)
    limits = KeyLimits(tokens_per_minute=1000)

    async def scenario() -> Any:
        admission = await counters.admit("k", limits, "m", reserve=500)
        assert (await counters.admit("k", limits, "m")).denial is None  # 500 of 1000 while it runs
        await counters.charge(
            "k", "m", Usage(prompt_tokens=500, completion_tokens=1000), admission.reservation
        )
        return (await counters.admit("k", limits, "m")).denial

    refused = run(scenario())
    assert refused is not None and refused.used == 1500


def test_charging_nothing_releases_the_reservation() -> None:
    counters = LocalCounters(Clock())
    limits = KeyLimits(tokens_per_minute=1, tokens_per_day=1)

    async def scenario() -> list[Any]:
        admission = await counters.admit("k", limits, "m", reserve=PROMPT)
        await counters.charge("k", "m", Usage(), admission.reservation)  # failed before a replica
        return [counters.check("k", limits), await counters.usage(1)]

    denial, usage = run(scenario())
    assert denial is None
    assert usage["k"]["m"]["requests"] == 1 and usage["k"]["m"]["prompt_tokens"] == 0


def test_settlement_after_the_minute_left_the_window_touches_only_the_day() -> None:
    clock = Clock()
    counters = LocalCounters(clock)

    async def scenario() -> list[Any]:
        admission = await counters.admit("k", ROOMY, "m", reserve=PROMPT)
        clock.now += 61  # a long answer: its reservation left the minute's window
        await counters.charge(
            "k", "m", Usage(prompt_tokens=300, completion_tokens=100), admission.reservation
        )
        minute = counters.check("k", KeyLimits(tokens_per_minute=1))
        day = counters.check("k", KeyLimits(tokens_per_day=1))
        return [minute, day]

    minute, day = run(scenario())
    assert minute is None  # the charge did not land in a bucket that already slid away
    assert day is not None and day.used == 400


def test_settlement_after_the_day_left_the_window_is_not_counted() -> None:
    clock = Clock()
    counters = LocalCounters(clock)

    async def scenario() -> Any:
        admission = await counters.admit("k", ROOMY, "m", reserve=PROMPT)
        clock.now += 86400 + 60
        await counters.charge("k", "m", Usage(prompt_tokens=300), admission.reservation)
        return counters.check("k", KeyLimits(tokens_per_minute=1, tokens_per_day=1))

    assert run(scenario()) is None


def test_a_refused_request_reserves_nothing() -> None:
    clock = Clock()
    counters = LocalCounters(clock)
    limits = KeyLimits(requests_per_minute=10, tokens_per_minute=1000)

    async def scenario() -> list[Any]:
        assert (await counters.admit("k", limits, "m", reserve=1000)).denial is None
        refusals = [await counters.admit("k", limits, "m", reserve=PROMPT) for _ in range(3)]
        return [refusals, counters.check("k", limits)]

    refusals, denial = run(scenario())
    assert all(r.denial is not None and r.reservation is None for r in refusals)
    assert denial is not None and denial.used == 1000


def test_requests_per_minute_stay_exact_with_reservations() -> None:
    counters = LocalCounters(Clock())
    limits = KeyLimits(requests_per_minute=3, tokens_per_minute=10**6)

    async def scenario() -> list[bool]:
        answers = await asyncio.gather(*(counters.admit("k", limits, "m", reserve=10) for _ in range(5)))
        return [a.denial is None for a in answers]

    assert run(scenario()) == [True, True, True, False, False]


def test_each_concurrent_request_settles_its_own_reservation() -> None:
    clock = Clock()
    counters = LocalCounters(clock)
    limits = KeyLimits(tokens_per_minute=10_000)

    async def scenario() -> Any:
        first = await counters.admit("k", limits, "m", reserve=3000)
        clock.now += 2
        second = await counters.admit("k", limits, "m", reserve=3000)
        await counters.charge("k", "m", Usage(prompt_tokens=100), second.reservation)
        await counters.charge("k", "m", Usage(prompt_tokens=200), first.reservation)
        return counters.check("k", KeyLimits(tokens_per_minute=1))

    denial = run(scenario())
    assert denial is not None and denial.used == 300


def test_a_settlement_never_leaves_a_bucket_below_zero() -> None:
    window = TokenWindow(60, 1.0)
    index = window.add(100, 1000.0)
    window.settle(index, 500, 0, 1001.0)
    assert window.used(1001.0) == 0
    window.add(50, 1001.0)
    assert window.used(1001.0) == 50


class PlainWindow:
    """The rule a token window keeps, written plainly: every bucket inside the window counts, and
    the window is read afresh on every call."""

    def __init__(self, window: float, width: float) -> None:
        self.width, self.span = width, round(window / width)
        self.buckets: dict[int, int] = {}

    def _inside(self, now: float) -> None:
        oldest = int(now // self.width) - self.span + 1
        self.buckets = {i: v for i, v in self.buckets.items() if i >= oldest}

    def add(self, tokens: int, now: float) -> int:
        self._inside(now)
        index = int(now // self.width)
        if tokens:
            self.buckets[index] = self.buckets.get(index, 0) + tokens
        return index

    def settle(self, index: int, reserved: int, charged: int, now: float) -> None:
        self._inside(now)
        if index <= int(now // self.width) - self.span:
            return
        value = self.buckets.get(index, 0) + charged - reserved
        if value > 0:
            self.buckets[index] = value
        else:
            self.buckets.pop(index, None)

    def used(self, now: float) -> int:
        self._inside(now)
        return sum(self.buckets.values())


# A step: how far the clock moves (mostly forward, within a bucket or across many, now and then
# back, as a wall clock may), then an admission's reservation, or the settlement of an earlier one.
STEP = st.tuples(
    st.one_of(st.floats(0, 3), st.floats(0, 4000), st.floats(-90, 0)),
    st.booleans(),
    st.integers(0, 5000),
    st.integers(0, 50),
)


@pytest.mark.parametrize("shape", [(60.0, 1.0), (86400.0, 60.0)], ids=["minute", "day"])
@settings(max_examples=150, deadline=None)
@given(steps=st.lists(STEP, max_size=80))
def test_a_window_pruned_once_per_bucket_counts_what_the_plain_rule_counts(
    shape: tuple[float, float], steps: list[tuple[float, bool, int, int]]
) -> None:
    window, plain = TokenWindow(*shape), PlainWindow(*shape)
    now = 1_800_000_000.0
    held: list[tuple[int, int]] = []  # (bucket, reserved) of admissions not yet settled
    for move, admit, tokens, pick in steps:
        now += move
        if admit or not held:
            index = window.add(tokens, now)
            assert plain.add(tokens, now) == index
            held.append((index, tokens))
        else:
            index, reserved = held.pop(pick % len(held))
            window.settle(index, reserved, tokens, now)
            plain.settle(index, reserved, tokens, now)
        assert window.used(now) == plain.used(now)
        allowed = max(1, plain.used(now))
        assert window.retry_after(allowed, now) == pytest.approx(
            token_retry(plain.buckets.items(), plain.used(now), allowed, window.span, window.width, now)
        )


def test_a_day_of_buckets_is_not_read_again_on_every_request() -> None:
    """A key busy all day holds 1,440 buckets in its day window; within one bucket's minute,
    requests add to the sum without reading the others again."""
    window = TokenWindow(86400.0, 60.0)
    now = 1_800_000_000.0
    for _ in range(1440):
        now += 60
        window.add(10, now)
    assert window.used(now) == 14400

    reads = 0
    buckets = window._buckets

    class Counted(dict[int, int]):
        def __iter__(self) -> Any:
            nonlocal reads
            reads += 1
            return super().__iter__()

    window._buckets = Counted(buckets)
    for _ in range(100):
        now += 0.1
        index = window.add(10, now)
        window.settle(index, 10, 12, now)
        window.used(now)
    assert reads == 0 and window.used(now) == 14400 + 100 * 12


USAGES = st.builds(
    Usage,
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.integers(0, 10**5),
    st.integers(0, 10**4),
)


@settings(max_examples=100, deadline=None)
@given(
    charges=st.lists(
        st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(["dense", "moe"]), USAGES), max_size=30
    )
)
def test_a_days_usage_is_the_sum_of_every_answer_charged_that_day(
    charges: list[tuple[str, str, Usage]],
) -> None:
    """The first answer of a key and preset in a day makes its counts; the next ones add to them in
    place. Either way every field of every answer is counted."""
    counters = LocalCounters(Clock())
    expected: dict[str, dict[str, dict[str, int]]] = {}
    for key, preset, usage in charges:
        run(counters.charge(key, preset, usage))
        fields = expected.setdefault(key, {}).setdefault(preset, dict.fromkeys(USAGE_FIELDS, 0))
        fields["requests"] += 1
        for name in USAGE_FIELDS[1:]:
            fields[name] += getattr(usage, name)
    assert run(counters.usage(1)) == expected
