"""gateway/mcp/sessions.py: whose each MCP session is, the per-key and total caps, and which idle
session makes way for a new one (pure: the time is an argument)."""

from __future__ import annotations

from gateway.fleet.stored import Owner
from gateway.mcp.sessions import SessionBook


def opened(book: SessionBook, owner: str, session_id: str, now: float) -> None:
    """A session opened and its opening request ended, as the gate reports it."""
    admission = book.admit(owner, now)
    assert admission.refused is None
    book.opened(owner, session_id, now)
    book.end(session_id, now)


def test_a_key_past_its_cap_replaces_its_own_least_recently_used_idle_session() -> None:
    book = SessionBook(per_key=2, total=100, idle=1800)
    opened(book, "key:a", "a1", 0)
    opened(book, "key:a", "a2", 1)
    book.begin("a1", 2)  # a1 used again: a2 is now the least recently used
    book.end("a1", 3)
    admission = book.admit("key:a", 4)
    assert admission.evict == ("a2",) and admission.refused is None
    assert not book.visible("a2", Owner("key:a"))


def test_a_key_whose_sessions_are_all_busy_is_refused_and_another_key_is_not() -> None:
    book = SessionBook(per_key=2, total=100, idle=1800)
    for sid in ("a1", "a2"):
        opened(book, "key:a", sid, 0)
        book.begin(sid, 1)  # an open GET stream, a tool call running
    assert book.admit("key:a", 2).refused == "key"
    assert book.admit("key:b", 2).refused is None
    assert book.visible("a1", Owner("key:a")) and book.visible("a2", Owner("key:a"))


def test_sessions_being_opened_count_against_the_cap() -> None:
    book = SessionBook(per_key=2, total=100, idle=1800)
    assert book.admit("key:a", 0).refused is None
    assert book.admit("key:a", 0).refused is None
    assert book.admit("key:a", 0).refused == "key"  # two initialize calls still in flight


def test_the_total_cap_replaces_the_oldest_idle_session_of_any_key() -> None:
    book = SessionBook(per_key=10, total=3, idle=1800)
    opened(book, "key:a", "a1", 0)
    opened(book, "key:b", "b1", 1)
    opened(book, "key:b", "b2", 2)
    book.begin("a1", 3)  # busy: not the one to go
    admission = book.admit("key:c", 4)
    assert admission.evict == ("b1",) and admission.refused is None


def test_the_total_cap_refuses_when_every_session_is_busy() -> None:
    book = SessionBook(per_key=10, total=2, idle=1800)
    for sid in ("a1", "b1"):
        opened(book, "key:" + sid[0], sid, 0)
        book.begin(sid, 1)
    assert book.admit("key:c", 2).refused == "total"


def test_a_session_is_visible_to_its_key_and_to_an_admin_only() -> None:
    book = SessionBook(per_key=10, total=10, idle=1800)
    opened(book, "key:a", "a1", 0)
    assert book.visible("a1", Owner("key:a"))
    assert not book.visible("a1", Owner("key:b"))
    assert not book.visible("a1", Owner("anon:0123"))
    assert book.visible("a1", Owner("key:root", admin=True))
    assert not book.visible("unknown", Owner("key:root", admin=True))


def test_sessions_idle_past_the_timeout_are_closed_at_the_next_admission() -> None:
    book = SessionBook(per_key=10, total=10, idle=60)
    opened(book, "key:a", "old", 0)
    opened(book, "key:a", "busy", 0)
    book.begin("busy", 1)  # in flight since 1: never idle, however long it runs
    opened(book, "key:a", "recent", 50)
    admission = book.admit("key:b", 100)
    assert admission.evict == ("old",)
    assert book.visible("busy", Owner("key:a")) and book.visible("recent", Owner("key:a"))


def test_a_failed_opening_gives_its_place_back() -> None:
    book = SessionBook(per_key=1, total=10, idle=1800)
    assert book.admit("key:a", 0).refused is None
    book.opened("key:a", None, 0)  # the initialize was refused: nothing established
    assert book.held("key:a") == 0
    assert book.admit("key:a", 1).refused is None


def test_a_forgotten_session_frees_its_place() -> None:
    book = SessionBook(per_key=1, total=10, idle=1800)
    opened(book, "key:a", "a1", 0)
    book.begin("a1", 1)
    book.forget("a1")  # its client ended it (DELETE)
    assert book.admit("key:a", 2).evict == ()
    assert len(book) == 0


def test_an_owner_may_be_given_its_own_cap() -> None:
    # An open gateway's one local user: the total is its cap, not one key's share.
    book = SessionBook(per_key=1, total=3, idle=1800)
    opened(book, "open", "o1", 0)
    book.begin("o1", 1)
    assert book.admit("open", 2).refused == "key"
    assert book.admit("open", 2, per_key=3).refused is None
