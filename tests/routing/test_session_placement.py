"""routing/balancer.py's `policy: session`: placement by cost over plain values (no sockets)."""

from __future__ import annotations

from collections import Counter

from gateway.routing.balancer import CacheView, ReplicaView, choose, cost
from gateway.routing.table import parse_table

SLOTS = 4


def view(
    name: str,
    *,
    sessions: int = 0,
    free: int = SLOTS,
    home: bool = False,
    cached: int = 0,
    displaced: int = 0,
    in_flight: int = 0,
    slots: int | None = SLOTS,
    group_here: bool = False,
    kv_usage: float | None = None,
    available: bool = True,
) -> ReplicaView:
    cache = CacheView(slots, sessions, free, home, cached, displaced, group_here, kv_usage, 1000.0, 2.0)
    return ReplicaView(name, available, in_flight, SLOTS + 2, cache)


def test_eight_new_sessions_on_two_replicas_of_four_slots_split_four_and_four() -> None:
    held = Counter({"a": 0, "b": 0})
    for ticket in range(8):
        fleet = [view(name, sessions=held[name], free=SLOTS - held[name]) for name in ("a", "b")]
        first = choose("session", fleet, ticket=ticket, key="s", tokens=5000).order[0]
        held[first] += 1
    assert held == {"a": 4, "b": 4}


def test_no_replica_takes_more_sessions_than_slots_while_another_has_a_free_slot() -> None:
    # `a` is faster for this prompt in every other respect, but it has no free slot.
    full = view("a", sessions=SLOTS, free=0, displaced=100)
    roomy = view("b", sessions=3, free=1, in_flight=3)
    pick = choose("session", [full, roomy], ticket=0, key="s", tokens=5000)
    assert pick.order[0] == "b" and pick.reason == "session_new"


def test_a_known_session_goes_back_to_its_replica() -> None:
    home = view("b", sessions=4, free=0, home=True, cached=20000, in_flight=3)
    other = view("a", sessions=1, free=3)
    for ticket in range(4):
        pick = choose("session", [other, home], ticket=ticket, key="s", tokens=21000)
        assert pick.order == ("b", "a") and pick.reason == "session_home"


def test_a_known_session_moves_only_when_its_wait_exceeds_a_prefill_elsewhere() -> None:
    # Seven requests in flight on a four-slot replica, four of them queued ahead of it: a wait of
    # one 2 s round, against a 1 s prefill of its 1,000 tokens on an idle replica.
    queued = view("b", home=True, cached=900, in_flight=SLOTS + 3, free=0)
    idle = view("a")
    assert choose("session", [idle, queued], ticket=0, key="s", tokens=1000).reason == "session_moved"
    # Its 50,000 cached tokens cost 50 s to prefill elsewhere: it waits at home.
    long = view("b", home=True, cached=50000, in_flight=SLOTS + 3, free=0)
    assert choose("session", [idle, long], ticket=0, key="s", tokens=50100).order[0] == "b"


def test_home_is_where_most_of_the_session_is_cached() -> None:
    stale = view("a", home=True, cached=3000)
    fresh = view("b", home=True, cached=9000)
    for ticket in range(4):
        assert choose("session", [stale, fresh], ticket=ticket, key="s", tokens=9500).order[0] == "b"


def test_a_new_session_displaces_the_smaller_session_when_every_slot_is_taken() -> None:
    big = view("a", sessions=SLOTS, free=0, displaced=40000)
    small = view("b", sessions=SLOTS, free=0, displaced=2000)
    assert cost(big, 5000) > cost(small, 5000)
    assert choose("session", [big, small], ticket=0, key="s", tokens=5000).order[0] == "b"


def test_new_sessions_beyond_the_slots_spread_over_the_replicas_memory() -> None:
    crowded = view("a", sessions=7, free=0)
    lighter = view("b", sessions=5, free=0)
    for ticket in range(4):
        assert choose("session", [crowded, lighter], ticket=ticket, key="s", tokens=5000).order[0] == "b"


def test_a_sub_agent_goes_beside_its_parent_when_costs_tie() -> None:
    parent = view("b", sessions=1, free=3, group_here=True)
    for ticket in range(4):
        assert (
            choose("session", [view("a", sessions=1, free=3), parent], ticket=ticket, key="s").order[0] == "b"
        )


def test_bounded_load_still_gives_way_when_a_whole_round_queues_at_home() -> None:
    home = view("b", home=True, cached=80000, in_flight=2 * SLOTS + 2, free=0)
    assert choose("session", [view("a"), home], ticket=0, key="s", tokens=80000).reason == "session_overload"
    within = view("b", home=True, cached=80000, in_flight=SLOTS + 1, free=0)
    assert choose("session", [view("a"), within], ticket=0, key="s", tokens=80000).reason == "session_home"


def test_on_vllm_a_new_session_avoids_a_replica_whose_kv_cache_is_full() -> None:
    full = view("a", slots=None, free=0, kv_usage=0.97)
    roomy = view("b", slots=None, free=0, kv_usage=0.2)
    for ticket in range(4):
        assert choose("session", [full, roomy], ticket=ticket, key="s", tokens=8000).order[0] == "b"


def test_an_unavailable_home_is_not_picked_first() -> None:
    down = view("b", home=True, cached=50000, available=False)
    pick = choose("session", [down, view("a")], ticket=0, key="s", tokens=50000)
    assert pick.order == ("a", "b") and pick.reason == "session_new"


def test_without_cache_views_the_session_policy_keys_by_prefix_affinity() -> None:
    plain = [ReplicaView("a", True, 0, 8), ReplicaView("b", True, 0, 8)]
    first = choose("session", plain, ticket=0, key="conversation-1")
    assert first.reason == "affinity"
    assert all(
        choose("session", plain, ticket=t, key="conversation-1").order == first.order for t in range(5)
    )


def test_a_preset_may_choose_the_session_policy() -> None:
    table = parse_table(
        """
presets:
  agents:
    served_model: m
    policy: session
    replicas: [{name: r0, url: "http://127.0.0.1:9100", engine: llamacpp}]
routing: {default: agents}
"""
    )
    assert table.presets["agents"].policy == "session"
