"""gateway/fleet/slots.py: the gateway's picture of a replica's slots, over plain values."""

from __future__ import annotations

import re

from gateway.fleet.slots import MAX_SESSIONS, PINNED_ENDPOINTS, SlotMap, SlotPlan, slot_file

A, B, C = "a" * 16, "b" * 16, "c" * 16


def slots(count: int = 2) -> SlotMap:
    cache = SlotMap()
    cache.resize(count)
    return cache


def turn(
    cache: SlotMap, session: str, *, pinnable: bool = True, prompt: int = 100, cached: int = 0
) -> SlotPlan:
    plan = cache.plan(session, pinnable=pinnable)
    cache.begin(session, session, plan, 0.0)
    cache.settle(session, plan, prompt, cached, 8, 1.0)
    return plan


def entry(
    slot: int, task: int | None = None, tokens: int | None = None, busy: bool = False
) -> dict[str, object]:
    out: dict[str, object] = {"id": slot, "is_processing": busy}
    if task is not None:
        out.update(id_task=task, n_prompt_tokens=tokens)
    return out


def test_messages_is_the_one_agent_endpoint_whose_own_path_cannot_be_pinned() -> None:
    # (a placed Messages session goes as chat instead: dialects/messages_chat.py)
    assert {"chat", "responses"} <= PINNED_ENDPOINTS and "messages" not in PINNED_ENDPOINTS


def test_a_new_session_takes_a_free_slot_and_its_next_turns_are_pinned_there() -> None:
    cache = slots()
    assert turn(cache, A) == SlotPlan(0, "free")
    assert turn(cache, B) == SlotPlan(1, "free")
    assert turn(cache, A, prompt=150, cached=107) == SlotPlan(0, "held")
    assert cache.holders == [A, B]


def test_without_a_free_slot_the_engine_places_the_session_and_slots_says_where() -> None:
    cache = slots()
    turn(cache, A)
    turn(cache, B)
    assert turn(cache, C, prompt=200) == SlotPlan(None, "tier")
    assert cache.stale
    # The engine took slot 1, the least recently used: it holds C's prompt and answer less one.
    cache.observe([entry(0, 1, 107), entry(1, 9, 207)])
    assert (cache.holders, cache.stale) == ([A, C], False)
    held = cache.held(B)
    assert held is not None and held.slot is None  # in the engine's memory tier
    assert cache.plan(B, pinnable=True) == SlotPlan(None, "tier")


def test_an_endpoint_that_cannot_pin_is_left_to_the_engine_and_learned_from_slots() -> None:
    cache = slots()
    assert turn(cache, A, pinnable=False) == SlotPlan(None, "unpinnable")
    cache.observe([entry(0), entry(1, 3, 107)])
    assert cache.holders == [None, A]
    assert cache.plan(A, pinnable=False) == SlotPlan(None, "unpinnable")


def test_a_pinned_answer_that_finds_its_slot_overwritten_is_counted_lost_and_corrected() -> None:
    cache = slots()
    turn(cache, A, prompt=4000)
    plan = cache.plan(A, pinnable=True)
    cache.begin(A, A, plan, 2.0)
    settled = cache.settle(A, plan, 4200, 12, 8, 3.0)
    assert settled is not None and settled.lost and settled.expected == 4008
    assert cache.stats.lost == 1
    assert cache.holders[0] == A  # it holds A now: the re-prefill put it there


def test_a_slot_that_ran_a_task_the_gateway_did_not_send_holds_no_session_of_its_own() -> None:
    cache = slots()
    turn(cache, A)
    cache.observe([entry(0, 1, 107), entry(1)])
    assert cache.holders == [A, None]
    cache.observe([entry(0, 5, 33), entry(1)])  # another client's 30-token request
    assert cache.holders == [None, None]


def test_a_slot_whose_request_is_on_its_way_is_not_judged_by_slots() -> None:
    cache = slots()
    plan = cache.plan(A, pinnable=True)
    cache.begin(A, A, plan, 0.0)
    cache.observe([entry(0), entry(1)])  # the engine has not started it yet: the slot looks empty
    assert cache.holders[0] == A


def test_an_engine_restarted_behind_the_gateways_back_empties_the_picture() -> None:
    cache = slots()
    turn(cache, A)
    turn(cache, B)
    cache.observe([entry(0), entry(1)])
    assert cache.holders == [None, None]
    assert cache.plan(A, pinnable=True) == SlotPlan(0, "free")


def test_a_changed_slot_count_starts_a_new_picture() -> None:
    cache = slots()
    turn(cache, A)
    cache.observe([entry(0), entry(1), entry(2)])
    assert cache.slots == 3 and cache.holders == [None, None, None]


def test_a_transient_request_keeps_no_slot_and_marks_the_picture_for_a_look() -> None:
    cache = slots()
    plan = cache.plan(A, pinnable=True, transient=True)
    assert plan == SlotPlan(None, "transient")
    cache.begin(A, A, plan, 0.0)
    cache.settle(A, plan, 50, 0, 8, 1.0)
    assert cache.held(A) is None and cache.stale


def test_unknown_slot_counts_leave_the_engine_to_choose() -> None:
    assert SlotMap().plan(A, pinnable=True) == SlotPlan(None, "unknown")


def test_sessions_per_replica_are_bounded() -> None:
    cache = slots(1)
    for index in range(MAX_SESSIONS + 50):
        key = f"{index:016x}"
        cache.begin(key, key, SlotPlan(None, "tier"), float(index))
        cache.settle(key, SlotPlan(None, "tier"), 10, 0, 1, float(index))
    assert len(cache.sessions) == MAX_SESSIONS
    assert len(cache.pending) <= MAX_SESSIONS


def test_a_slots_answer_of_any_size_is_read_within_bounds() -> None:
    cache = slots()
    cache.observe([entry(i) for i in range(100_000)])
    assert cache.slots == 512
    cache.observe("not a list")
    cache.observe([{"id": "zero"}, {"id": -1}, 5])
    assert cache.slots is not None and cache.slots <= 512


def test_the_slots_to_save_before_a_stop_come_back_with_their_sessions() -> None:
    cache = slots()
    turn(cache, A, prompt=4000)
    turn(cache, B, prompt=6000)
    assert list(cache.to_save()) == [(0, A, A, 4008), (1, B, B, 6008)]
    cache.clear()
    assert cache.held(A) is None and cache.holders == [None, None]
    cache.restored(1, B, B, 6008, 5.0)
    assert cache.plan(B, pinnable=True) == SlotPlan(1, "held")


def test_slot_files_are_plain_names_that_say_nothing_of_the_session() -> None:
    name = slot_file("gpu0-dense:8080", 3)
    assert re.fullmatch(r"fleet-[0-9a-f]{12}-slot3\.bin", name)
    assert slot_file("gpu0-dense:8080", 3) != slot_file("gpu1-dense:8080", 3)


def test_the_status_rows_show_short_digests_tokens_and_idle_time() -> None:
    cache = slots()
    turn(cache, A, prompt=4000)
    rows = cache.rows(now=11.0)
    assert rows[0] == {"slot": 0, "session": A[:8], "tokens": 4008, "idle_s": 10.0, "busy": False}
    assert rows[1]["session"] is None and cache.tier() == 0


def test_the_hit_ratio_counts_a_sessions_turns_after_its_first() -> None:
    cache = slots()
    turn(cache, A, prompt=1000, cached=0)
    turn(cache, A, prompt=2000, cached=1000)
    turn(cache, A, prompt=3000, cached=2990)
    stats = cache.stats
    assert stats.ratio_count == 2
    assert (stats.session_prompt, stats.session_cached) == (5000, 3990)
    assert stats.ratio_buckets[2] == 1 and stats.ratio_buckets[-1] == 1  # 0.5 and 0.997


def test_no_session_is_pinned_while_a_request_the_engine_placed_may_hold_its_slot() -> None:
    cache = slots()
    turn(cache, A)
    turn(cache, B)
    cache.observe([entry(0, 1, 107), entry(1, 2, 107)])
    plan = cache.plan(C, pinnable=True)
    cache.begin(C, C, plan, 2.0)  # in flight: the engine took some slot, maybe A's
    assert cache.plan(A, pinnable=True) == SlotPlan(None, "uncertain")
    cache.settle(C, plan, 100, 0, 8, 3.0)
    assert cache.plan(A, pinnable=True) == SlotPlan(None, "uncertain")  # stale until GET /slots
    cache.observe([entry(0, 9, 107), entry(1, 2, 107)])  # C went to slot 0, A's
    assert cache.plan(A, pinnable=True) == SlotPlan(None, "tier")
    assert cache.plan(B, pinnable=True) == SlotPlan(1, "held")
