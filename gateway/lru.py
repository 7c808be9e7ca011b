"""A mapping bounded to a number of entries, the least recently used leaving first: the request
path's memories of what clients resend (image descriptions, volatile spans, tool lists) hold at
most this much whatever the clients send."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Lru(Generic[K, V]):
    """`get` counts as a use; `put` past `entries` drops the least recently used entry."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.entries:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)
