"""The gateway's picture of one replica's prompt cache: which session holds which slot.

llama-server keeps one prompt per slot (docs/engines.md §13): a session's next turn is cheap only
in the slot that holds its previous prompt. The gateway pins a session's requests to that slot with
`id_slot` where the endpoint honours it (chat, completions and Responses; not Messages, whose
conversion drops the field: a streamed Messages request goes as chat instead, messages_chat.py),
and otherwise lets the engine choose: run with
`--slot-prompt-similarity 0` it takes the least recently used slot, saves what that slot held to its
host-memory cache (`--cache-ram`) and restores the best cached prompt for the request, so a session
that lost its slot comes back from RAM in milliseconds instead of a full prefill (measured).

The picture is kept from what the gateway sent and corrected from what the engine reports: the
cached tokens of each answer, and `GET /slots` after a request the engine placed itself (the slot
whose held tokens match the answer's is the one it used). vLLM has no slots: one shared block
cache per replica, so the picture there is only which sessions it served last (their prefix is
likely still cached) and the KV use the prober scrapes.

Plain state, no I/O: the prober and the request path feed it, the balancer reads `view()`.
Bounded: at most MAX_SESSIONS sessions per replica and MAX_SLOTS slots, whatever a client or a
replica sends.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from gateway.routing.balancer import CacheView

# Endpoints on which llama-server honours `id_slot` (measured on the installed build): chat and
# completions read it, Responses keeps it through its conversion to chat; Messages builds a new
# body from the fields it knows and drops it (docs/engines.md §13), so the request path sends a
# placed Messages stream to the chat endpoint (Endpoint.as_chat) and pins that.
PINNED_ENDPOINTS = frozenset({"chat", "completions", "responses"})
MAX_SESSIONS = 4096  # per replica: the oldest that hold no slot are forgotten first
MAX_SLOTS = 512  # a /slots answer longer than this is read as this many slots
# A slot's held tokens are the prompt plus the answer less one (the last sampled token is never
# evaluated; measured: 994 prompt + 4 answer tokens -> n_prompt_tokens 997 in GET /slots).
HELD_SLACK = 3
# A pinned answer that found less than this share of what the picture expected in its slot means
# the slot was overwritten behind the gateway's back (another client, an engine restart).
LOST_SHARE = 0.5


@dataclass
class Held:
    """One session's cache on one replica."""

    session: str  # the session key (a digest, pipeline/session.py)
    group: str  # its agent session: sub-agents share their parent's
    tokens: int = 0  # what the engine holds for it: the last prompt and answer
    last_used: float = 0.0
    slot: int | None = None  # the slot that holds it; None: in the engine's memory tier, or nowhere
    in_flight: int = 0
    began: float = 0.0  # when its last request was sent


class SlotPlan(NamedTuple):
    slot: int | None  # the id_slot to send; None lets the engine choose
    reason: str  # held | free | tier | uncertain | transient | unpinnable | unknown | shared (a metric label)


class Settled(NamedTuple):
    """What one answer told the picture."""

    expected: int  # the tokens the picture expected the engine to reuse
    cached: int  # the tokens the engine reports it reused
    lost: bool  # the slot did not hold what the picture said


def slot_file(replica: str, slot: int) -> str:
    """The file a slot is saved to in the engine's --slot-save-path: named by a digest of the
    replica's name and the slot number only (llama-server accepts plain file names, no paths)."""
    name = hashlib.blake2b(replica.encode(), digest_size=6).hexdigest()
    return f"fleet-{name}-slot{slot}.bin"


RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


@dataclass
class SlotStats:
    """Counters the metrics read at scrape time (ops/metrics.py), never reset."""

    plans: dict[str, int] = field(default_factory=dict)  # slot plans by reason
    lost: int = 0  # pinned answers that found their slot overwritten
    saves: int = 0
    save_failures: int = 0
    saved_tokens: int = 0
    save_seconds: float = 0.0
    restores: int = 0
    restore_failures: int = 0  # refused, or restored fewer tokens than saved
    restored_tokens: int = 0
    restore_seconds: float = 0.0
    # A session's turns after its first: cached / prompt tokens per answer, as a histogram.
    ratio_buckets: list[int] = field(default_factory=lambda: [0] * len(RATIO_BUCKETS))
    ratio_sum: float = 0.0
    ratio_count: int = 0
    session_prompt: int = 0  # tokens over those turns
    session_cached: int = 0

    def ratio(self, cached: int, prompt: int) -> None:
        if prompt <= 0:
            return
        value = min(1.0, cached / prompt)
        for index, bound in enumerate(RATIO_BUCKETS):
            if value <= bound:
                self.ratio_buckets[index] += 1
                break
        self.ratio_sum += value
        self.ratio_count += 1
        self.session_prompt += prompt
        self.session_cached += cached


@dataclass
class SlotMap:
    """One replica's slots and sessions, as the gateway believes them to be."""

    slots: int | None = None
    holders: list[str | None] = field(default_factory=list)  # the session key per slot
    sessions: OrderedDict[str, Held] = field(default_factory=OrderedDict)  # least recently used first
    # Sessions the engine placed itself, waiting for GET /slots to say where: key -> held tokens.
    pending: dict[str, int] = field(default_factory=dict)
    stale: bool = False  # a request the engine placed has ended: read /slots before the next plan
    unplaced: int = 0  # requests of ours in flight that the engine placed itself: slots unknown
    # Sessions placed here whose request still waits for a place (a full replica): key -> requests.
    arriving: dict[str, int] = field(default_factory=dict)
    tasks: dict[int, int] = field(default_factory=dict)  # slot -> id_task last seen in /slots
    # Before a stop: the sessions saved to files, by slot, to restore after the next start.
    saved: dict[int, tuple[str, str, int]] = field(default_factory=dict)  # slot -> (session, group, tokens)
    stats: SlotStats = field(default_factory=SlotStats)
    turn_seconds: float | None = None  # a moving average of its session requests' durations

    # --- the picture ----------------------------------------------------------------------------

    def resize(self, slots: int) -> None:
        """The replica's slot count (llama-server `/props` total_slots); a change clears the slots."""
        slots = max(0, min(slots, MAX_SLOTS))
        if slots == self.slots:
            return
        self.slots = slots
        self.holders = [None] * slots
        self.tasks.clear()
        for held in self.sessions.values():
            held.slot = None

    def held(self, session: str) -> Held | None:
        return self.sessions.get(session)

    def free_slots(self) -> list[int]:
        return [i for i, holder in enumerate(self.holders) if holder is None]

    def in_slots(self) -> int:
        return sum(holder is not None for holder in self.holders)

    def lru_slot(self) -> int | None:
        """The slot whose session was used longest ago, among those not in flight."""
        best: tuple[float, int] | None = None
        for index, holder in enumerate(self.holders):
            held = self.sessions.get(holder) if holder is not None else None
            if held is None:
                return index
            if held.in_flight:
                continue
            if best is None or held.last_used < best[0]:
                best = (held.last_used, index)
        return None if best is None else best[1]

    def view(
        self,
        session: str | None,
        group: str | None,
        kv_usage: float | None = None,
        prefill_rate: float | None = None,
    ) -> CacheView:
        held = self.sessions.get(session) if session is not None else None
        # A new session placed here that still waits for a place is one of its sessions already:
        # else every newcomer during the wait would be placed as if it had not come.
        count = len(self.sessions)
        if self.arriving:
            count += sum(key not in self.sessions for key in self.arriving)
        # Room for a new session: slots beyond the sessions it holds. Not the empty slots of the
        # picture: a session the engine placed itself (Messages) has a slot before GET /slots says which.
        free = max(0, (self.slots or 0) - count)
        displaced = 0
        if self.slots and not free and (held is None or held.slot is None):
            victim = self.lru_slot()
            holder = self.holders[victim] if victim is not None else None
            victim_held = self.sessions.get(holder) if holder is not None else None
            displaced = victim_held.tokens if victim_held is not None else 0
        group_here = group is not None and any(h.group == group for h in self.sessions.values())
        return CacheView(
            self.slots,
            count,
            free,
            held is not None,
            held.tokens if held is not None else 0,
            displaced,
            group_here,
            kv_usage,
            prefill_rate,
            self.turn_seconds,
        )

    # --- one request ----------------------------------------------------------------------------

    def plan(self, session: str, *, pinnable: bool, transient: bool = False) -> SlotPlan:
        """Where this session's request should go on this replica."""
        if not self.slots:
            return SlotPlan(None, "unknown")
        if transient:
            return SlotPlan(None, "transient")
        if self.unplaced or self.stale:
            # A request the engine placed itself may hold any slot now, this session's included. A
            # pinned request is never saved to the host cache before it overwrites its slot
            # (measured), so pinning now could destroy another session's only copy: let the engine
            # choose, which saves the slot it takes first.
            return SlotPlan(None, "uncertain")
        held = self.sessions.get(session)
        if held is not None and held.slot is not None and self.holders[held.slot] == session:
            return SlotPlan(held.slot if pinnable else None, "held" if pinnable else "unpinnable")
        if not pinnable:
            return SlotPlan(None, "unpinnable")
        free = self.free_slots()
        if free:
            return SlotPlan(free[0], "free")
        # No free slot: the engine picks its least recently used one and restores this session
        # from its memory tier (a pinned slot is never restored from it, measured).
        return SlotPlan(None, "tier")

    def arrive(self, session: str) -> None:
        """A request of `session` was placed here and waits for a place: counted until `arrived`."""
        self.arriving[session] = self.arriving.get(session, 0) + 1

    def arrived(self, session: str) -> None:
        """Its wait is over: admitted (then `begin` holds the session) or given up."""
        left = self.arriving.pop(session, 0) - 1
        if left > 0:
            self.arriving[session] = left

    def begin(self, session: str, group: str, plan: SlotPlan, now: float) -> None:
        self.stats.plans[plan.reason] = self.stats.plans.get(plan.reason, 0) + 1
        if plan.slot is None and self.slots and plan.reason != "unknown":
            self.unplaced += 1
        if plan.reason == "transient":
            return  # a side request: no cache of its own to keep
        held = self._touch(session, group, now)
        held.in_flight += 1
        held.began = now
        if plan.slot is not None:
            self._assign(plan.slot, session)

    def settle(
        self,
        session: str,
        plan: SlotPlan,
        prompt: int | None,
        cached: int | None,
        completion: int | None,
        now: float,
    ) -> Settled | None:
        """After the answer (or its failure: no counts): the session's tokens, and a correction
        where the engine reused less than the picture expected."""
        placed_by_engine = plan.slot is None and bool(self.slots) and plan.reason != "unknown"
        if placed_by_engine:
            # It may hold any slot now (an answer that failed may have run too): GET /slots says
            # which before the next plan.
            self.unplaced = max(0, self.unplaced - 1)
            self.stale = True
        if plan.reason == "transient":
            return None
        held = self.sessions.get(session)
        if held is None:
            return None
        held.in_flight = max(0, held.in_flight - 1)
        held.last_used = now
        if prompt is None:
            return None
        took = max(0.0, now - held.began)
        self.turn_seconds = took if self.turn_seconds is None else 0.8 * self.turn_seconds + 0.2 * took
        expected = min(held.tokens, prompt) if held.slot is not None else 0
        found = cached or 0
        lost = plan.slot is not None and expected > 0 and found < LOST_SHARE * expected
        if lost:
            self.stats.lost += 1
        if held.tokens > 0:  # a turn after the session's first on this replica
            self.stats.ratio(found, prompt)
        held.tokens = prompt + (completion or 0)
        if placed_by_engine:
            self.pending[session] = max(0, held.tokens - 1)  # matched to its slot by GET /slots
        return Settled(expected, found, lost)

    def _touch(self, session: str, group: str, now: float) -> Held:
        held = self.sessions.get(session)
        if held is None:
            held = self.sessions[session] = Held(session, group, last_used=now)
            self._forget_oldest()
        else:
            self.sessions.move_to_end(session)
            held.last_used = now
        return held

    def _assign(self, slot: int, session: str | None) -> None:
        if not 0 <= slot < len(self.holders):
            return
        previous = self.holders[slot]
        if previous is not None and previous != session and previous in self.sessions:
            self.sessions[previous].slot = None  # pushed out: in the memory tier, if the engine has one
        if session is not None:
            held = self.sessions.get(session)
            moved = held is not None and held.slot is not None and held.slot != slot
            if moved and held is not None and held.slot is not None and self.holders[held.slot] == session:
                self.holders[held.slot] = None  # a session holds one slot
            if held is not None:
                held.slot = slot
        self.holders[slot] = session

    def _forget_oldest(self) -> None:
        while len(self.sessions) > MAX_SESSIONS:
            oldest = next(
                (key for key, held in self.sessions.items() if held.slot is None and not held.in_flight),
                None,
            )
            if oldest is None:
                return
            del self.sessions[oldest]
            self.pending.pop(oldest, None)

    # --- what the engine says -------------------------------------------------------------------

    def observe(self, payload: Any) -> None:
        """Correct the picture from llama-server's GET /slots: a slot that ran a new task since the
        last look holds the pending session whose tokens match, or something the gateway did not
        send (then it holds no session of ours); a slot that never ran a task holds nothing (an
        engine restarted behind the gateway's back)."""
        if not isinstance(payload, list):
            return
        entries = [entry for entry in payload[:MAX_SLOTS] if isinstance(entry, dict)]
        if len(entries) != self.slots:
            self.resize(len(entries))
        for index, entry in enumerate(entries):
            slot = entry.get("id", index)
            if not isinstance(slot, int) or not 0 <= slot < len(self.holders):
                continue
            holder = self.holders[slot]
            held = self.sessions.get(holder) if holder is not None else None
            if held is not None and held.in_flight:
                continue  # its own request is on its way, running or being relayed: look again later
            if entry.get("is_processing") is True:
                continue
            task, held_tokens = entry.get("id_task"), entry.get("n_prompt_tokens")
            if not isinstance(task, int) or not isinstance(held_tokens, int):
                self._assign(slot, None)  # empty: nothing ran in it since the engine started
                self.tasks.pop(slot, None)
                continue
            if self.tasks.get(slot) == task:
                continue
            self.tasks[slot] = task
            match = self._pending_match(held_tokens)
            if match is not None:
                del self.pending[match]
                self._assign(slot, match)
            elif held is None or abs(held.tokens - 1 - held_tokens) > HELD_SLACK:
                # A task the gateway cannot name ran here (another client, a side request).
                self._assign(slot, None)
        self.pending.clear()  # what did not match was moved again or went to the memory tier
        self.stale = False

    def _pending_match(self, held_tokens: int) -> str | None:
        for session, tokens in self.pending.items():
            if abs(tokens - held_tokens) <= HELD_SLACK:
                return session
        return None

    def clear(self) -> None:
        """The engine stopped: its slots and memory tier are gone."""
        self.holders = [None] * (self.slots or 0)
        self.tasks.clear()
        self.pending.clear()
        self.stale = False
        self.unplaced = 0
        self.sessions.clear()

    # --- saved across a stop --------------------------------------------------------------------

    def to_save(self) -> Iterator[tuple[int, str, str, int]]:
        """(slot, session, group, tokens) for each slot that holds a session, before a stop."""
        for index, holder in enumerate(self.holders):
            held = self.sessions.get(holder) if holder is not None else None
            if held is not None and held.tokens > 0:
                yield index, held.session, held.group, held.tokens

    def restored(self, slot: int, session: str, group: str, tokens: int, now: float) -> None:
        held = self._touch(session, group, now)
        held.tokens = tokens
        self._assign(slot, session)

    def rows(self, now: float) -> list[dict[str, Any]]:
        """Per slot, for the status page and `ps`: the session's short digest, tokens, idle seconds."""
        out: list[dict[str, Any]] = []
        for index, holder in enumerate(self.holders):
            held = self.sessions.get(holder) if holder is not None else None
            out.append(
                {
                    "slot": index,
                    "session": held.session[:8] if held is not None else None,
                    "tokens": held.tokens if held is not None else 0,
                    "idle_s": round(max(0.0, now - held.last_used), 1) if held is not None else None,
                    "busy": bool(held is not None and held.in_flight),
                }
            )
        return out

    def tier(self) -> int:
        """Sessions the replica holds outside its slots (its memory tier, as far as the gateway knows);
        0 for an engine without slots."""
        if not self.slots:
            return 0
        return sum(1 for held in self.sessions.values() if held.slot is None)
