"""The simulated prefix caches: vLLM's hash-chained blocks and llama-server's per-slot prompts."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from gateway.simulator.engine import n_tokens


class BlockCache:
    """vLLM's hash-chained full blocks in an LRU; hits are whole blocks, at most n-1 tokens."""

    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def match_and_insert(self, prompt: bytes, salt: str | None = None) -> int:
        """The prompt's cached tokens (whole blocks of the salted hash chain, at most all but one
        token), after which every full block of it is inserted as most recently used and the oldest
        evicted past capacity."""
        size = 4 * self.block_size
        count = n_tokens(prompt)
        parent = hash(("salt", salt))
        hashes = []
        for i in range(count // self.block_size):
            parent = hash((parent, prompt[i * size : (i + 1) * size]))
            hashes.append(parent)
        hits = 0
        for h in hashes[: (count - 1) // self.block_size]:
            if h not in self.blocks:
                break
            hits += 1
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return hits * self.block_size

    def reset(self) -> None:
        self.blocks.clear()


def common_tokens(a: bytes, b: bytes) -> int:
    """Tokens shared by two byte strings: whole equal 4-byte slices (a partial last one only if equal)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # binary search over memcmp'd prefixes: fast for long prompts
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return n_tokens(a) if lo == len(a) == len(b) else lo // 4


class SlotCache:
    """llama-server's one cached token list per slot; an idle slot is chosen by longest common prefix."""

    def __init__(self, slots: int) -> None:
        self.data = [b""] * slots
        self.used = [0] * slots
        self.tick = 0

    def pick(self, idle: Iterable[int], prompt: bytes) -> tuple[int, int]:
        """(slot, cached tokens): the best LCP among idle slots, else the least recently used one."""
        shared, _, neg = max((common_tokens(self.data[s], prompt), -self.used[s], -s) for s in idle)
        best = -neg  # ties: least recently used, then the lowest id
        self.tick += 1
        self.used[best] = self.tick
        return best, min(shared, max(n_tokens(prompt) - 1, 0))

    def store(self, slot: int, data: bytes) -> None:
        self.data[slot] = data

    def reset(self) -> None:
        self.data = [b""] * len(self.data)
        self.used = [0] * len(self.used)


# --- wire shapes -------------------------------------------------------------------------------------
