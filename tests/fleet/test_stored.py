"""gateway/fleet/stored.py: where a stored Responses answer lives, and that it is its own key's
only (an admin excepted), within a bound per key and in all."""

from __future__ import annotations

from gateway.fleet.stored import MAX_ID, NOBODY, OPEN_OWNER, Owner, StoredResponses, Where
from tests.support.asgi import http_scope

ALICE, BOB, ROOT = Owner("key:alice"), Owner("key:bob"), Owner("key:root", admin=True)


def test_an_id_is_found_by_its_own_key_and_by_an_admin_only() -> None:
    stored = StoredResponses()
    stored.remember("resp_1", "m", "r0", ALICE)
    assert stored.find("resp_1", ALICE) == Where("m", "r0")
    assert stored.find("resp_1", BOB) is None  # as for an id the gateway never saw
    assert stored.find("resp_1", NOBODY) is None
    assert stored.find("resp_1", ROOT) == Where("m", "r0")


def test_another_keys_id_is_foreign_and_an_unknown_one_is_not() -> None:
    stored = StoredResponses()
    stored.remember("resp_1", "m", "r0", ALICE)
    assert stored.foreign("resp_1", BOB)
    assert not stored.foreign("resp_1", ALICE) and not stored.foreign("resp_1", ROOT)
    assert not stored.foreign("resp_never_seen", BOB)


def test_another_key_can_neither_forget_nor_take_over_an_id() -> None:
    stored = StoredResponses()
    stored.remember("resp_1", "m", "r0", ALICE)
    stored.forget("resp_1", BOB)
    stored.remember("resp_1", "m", "r1", BOB)  # a replica that hands out the same id again
    assert stored.find("resp_1", ALICE) == Where("m", "r0")
    stored.forget("resp_1", ALICE)
    assert stored.find("resp_1", ALICE) is None and len(stored) == 0


def test_an_admin_may_forget_any_id() -> None:
    stored = StoredResponses()
    stored.remember("resp_1", "m", "r0", ALICE)
    stored.forget("resp_1", ROOT)
    assert stored.find("resp_1", ALICE) is None and stored.owned(ALICE) == 0


def test_a_key_keeps_at_most_its_bound_and_its_oldest_go_first() -> None:
    stored = StoredResponses(size=100, per_owner=3)
    for n in range(5):
        stored.remember(f"a{n}", "m", "r0", ALICE)
    stored.remember("b0", "m", "r0", BOB)
    assert [stored.find(f"a{n}", ALICE) is not None for n in range(5)] == [False, False, True, True, True]
    assert stored.owned(ALICE) == 3 and stored.find("b0", BOB) is not None  # bob's are his own bound


def test_the_whole_map_is_bounded_and_its_oldest_go_first() -> None:
    stored = StoredResponses(size=4, per_owner=100)
    for n in range(6):
        stored.remember(f"x{n}", "m", "r0", ALICE if n % 2 else BOB)
    assert len(stored) == 4
    assert stored.find("x0", ROOT) is None and stored.find("x1", ROOT) is None
    assert stored.owned(ALICE) + stored.owned(BOB) == 4


def test_ids_past_the_length_limit_are_never_kept() -> None:
    stored = StoredResponses()
    stored.remember("r" * (MAX_ID + 1), "m", "r0", ALICE)
    stored.remember("", "m", "r0", ALICE)
    assert len(stored) == 0 and stored.find("r" * (MAX_ID + 1), ALICE) is None


def test_the_owner_is_read_from_the_scope_and_nobody_without_one() -> None:
    scope = http_scope("/v1/responses")
    assert Owner.of(scope) == NOBODY
    scope["gateway.owner"] = ALICE
    assert Owner.of(scope) == ALICE


def test_without_an_owner_the_map_behaves_as_before_owners() -> None:
    # The proxy's calls that pass no owner yet: one owner for all, as on an open gateway.
    stored = StoredResponses()
    stored.remember("resp_1", "m", "r0")
    assert stored.find("resp_1") == Where("m", "r0") and stored.find("resp_1", OPEN_OWNER) == Where("m", "r0")
    stored.forget("resp_1")
    assert len(stored) == 0
