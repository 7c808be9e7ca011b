"""gateway/lru.py: the request path's bounded memories drop the least recently used entry first."""

from __future__ import annotations

from gateway.lru import Lru


def test_past_its_size_the_least_recently_used_entry_leaves() -> None:
    memory: Lru[str, int] = Lru(2)
    memory.put("a", 1)
    memory.put("b", 2)
    assert memory.get("a") == 1  # a use: "b" is now the least recent
    memory.put("c", 3)
    assert len(memory) == 2 and memory.get("b") is None
    assert memory.get("a") == 1 and memory.get("c") == 3


def test_putting_a_key_again_replaces_its_value_and_counts_as_a_use() -> None:
    memory: Lru[str, int] = Lru(2)
    memory.put("a", 1)
    memory.put("b", 2)
    memory.put("a", 10)
    memory.put("c", 3)
    assert memory.get("a") == 10 and memory.get("b") is None and len(memory) == 2
