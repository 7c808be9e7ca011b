from collections import Counter

import pytest

from gateway.routing.balancer import ReplicaView, choose


def views(*specs: tuple[str, bool, int]) -> list[ReplicaView]:
    return [ReplicaView(name, available, in_flight, 64) for name, available, in_flight in specs]


def test_round_robin_is_fair_over_three_replicas() -> None:
    fleet = views(("a", True, 0), ("b", True, 0), ("c", True, 0))
    firsts = Counter(choose("round_robin", fleet, ticket=t).order[0] for t in range(300))
    assert firsts == {"a": 100, "b": 100, "c": 100}


def test_round_robin_skips_an_unavailable_replica_evenly() -> None:
    fleet = views(("a", True, 0), ("b", False, 0), ("c", True, 0))
    firsts = Counter(choose("round_robin", fleet, ticket=t).order[0] for t in range(300))
    assert firsts == {"a": 150, "c": 150}


def test_unavailable_replicas_come_last_as_a_fallback() -> None:
    pick = choose("round_robin", views(("a", False, 0), ("b", True, 0)), ticket=0)
    assert pick.order == ("b", "a") and pick.reason == "round_robin"


def test_all_down_is_panic_mode_and_still_tries_them_all() -> None:
    pick = choose("round_robin", views(("a", False, 0), ("b", False, 0)), ticket=1)
    assert pick.reason == "panic" and sorted(pick.order) == ["a", "b"]


def test_least_busy_prefers_the_emptiest_and_rotates_ties() -> None:
    assert choose("least_busy", views(("a", True, 5), ("b", True, 1)), ticket=0).order[0] == "b"
    firsts = {
        choose("least_busy", views(("a", True, 0), ("b", True, 0)), ticket=t).order[0] for t in range(4)
    }
    assert firsts == {"a", "b"}


def test_affinity_is_stable_for_a_key_and_spreads_keys() -> None:
    fleet = views(("a", True, 0), ("b", True, 0), ("c", True, 0))
    assert len({choose("prefix_affinity", fleet, ticket=t, key="conv-1").order[0] for t in range(20)}) == 1
    spread = Counter(choose("prefix_affinity", fleet, ticket=0, key=f"k{i}").order[0] for i in range(600))
    assert min(spread.values()) > 120  # rendezvous hashing spreads keys roughly evenly


def test_affinity_moves_only_the_keys_of_a_removed_replica() -> None:
    full = views(("a", True, 0), ("b", True, 0), ("c", True, 0))
    without_c = views(("a", True, 0), ("b", True, 0))
    for i in range(300):
        before = choose("prefix_affinity", full, ticket=0, key=f"k{i}").order[0]
        after = choose("prefix_affinity", without_c, ticket=0, key=f"k{i}").order[0]
        if before != "c":
            assert after == before


def test_affinity_escapes_an_overloaded_replica() -> None:
    key = "conv"
    home = choose("prefix_affinity", views(("a", True, 0), ("b", True, 0)), ticket=0, key=key).order[0]
    other = "b" if home == "a" else "a"
    busy = views((home, True, 6), (other, True, 0))
    pick = choose("prefix_affinity", busy, ticket=0, key=key)
    assert pick.order[0] == other and pick.reason == "affinity_overload"
    mild = views((home, True, 2), (other, True, 1))
    assert choose("prefix_affinity", mild, ticket=0, key=key).order[0] == home


@pytest.mark.parametrize("policy", ["round_robin", "least_busy", "prefix_affinity"])
def test_every_policy_returns_every_candidate_once(policy: str) -> None:
    fleet = views(("a", True, 3), ("b", False, 0), ("c", True, 1))
    pick = choose(policy, fleet, ticket=7, key="x")  # type: ignore[arg-type]
    assert sorted(pick.order) == ["a", "b", "c"] and pick.order[-1] == "b"


def test_affinity_without_a_key_falls_back_to_round_robin() -> None:
    pick = choose("prefix_affinity", views(("a", True, 0), ("b", True, 0)), ticket=1, key=None)
    assert pick.reason == "round_robin" and pick.order[0] == "b"
