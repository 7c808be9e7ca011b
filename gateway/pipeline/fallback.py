"""Preset fallback for one request: the preset-level partner of the Dispatcher (which retries
replicas within a preset), like Envoy's retry state beside its router.

It decides twice. Before anything is sent: the asked preset serves, unless it cannot now (down,
failed, loading longer than the client waits, full, or the prompt past its context), in which case
its first fallback that can takes the request. After a failure before the answer started: the
failure's class names its reason (`GatewayError.fallback`), and the next untried fallback that can
serve takes it. The rules are values in routing/fallback.py; this reads the pools and the supervisor.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from gateway.dialects.registry import Endpoint
from gateway.errors import BadRequest, ContextExceeded, FallbackReason, GatewayError
from gateway.fleet.replicas import Fleet, Pool
from gateway.ops.exchange import Exchange
from gateway.pipeline.attempts import Lifecycle
from gateway.routing.fallback import Standing, choose, header_value, why_not
from gateway.routing.route import serves
from gateway.routing.table import Preset
from gateway.team.keys import Identity

log = logging.getLogger("gateway.pipeline.fallback")


def patience(headers: dict[str, str]) -> float | None:
    """`x-gateway-max-wait: SECONDS`: how long the client will wait for a preset to load."""
    value = headers.get("x-gateway-max-wait")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise BadRequest(
            "x-gateway-max-wait must be a number of seconds",
            code="invalid_header",
            param="x-gateway-max-wait",
        ) from None
    if not math.isfinite(seconds) or seconds < 0:
        raise BadRequest(
            "x-gateway-max-wait must be 0 or more seconds", code="invalid_header", param="x-gateway-max-wait"
        )
    return seconds


def standing(pool: Pool, clock: Callable[[], float], lifecycle: Lifecycle | None) -> Standing:
    """What the pool can do now, read from its replicas and the supervisor."""
    now = clock()
    failed, loadable, expected = lifecycle.outlook(pool) if lifecycle else (False, False, None)
    stopped = set(lifecycle.unavailable(pool)) if lifecycle else set()
    usable = [r for r in pool.replicas if r.name not in stopped]
    available = any(r.health.available(now) for r in usable)
    free = any(r.in_flight < r.limit for r in usable) or pool.queued < pool.preset.limits.queue
    return Standing(available, free, failed, loadable, expected, smallest_context(pool))


def smallest_context(pool: Pool) -> int | None:
    """The smallest context among the pool's replicas, where any is known."""
    contexts = [r.context for r in pool.replicas if r.context]
    return min(contexts) if contexts else None


class Fallbacks:
    """Which preset serves this request, and which takes it when that one cannot."""

    def __init__(
        self,
        fleet: Fleet,
        preset: Preset,
        endpoint: Endpoint,
        identity: Identity,
        *,
        forbidden: bool,
        clock: Callable[[], float],
        lifecycle: Lifecycle | None,
    ) -> None:
        self.fleet, self.clock, self.lifecycle = fleet, clock, lifecycle
        # The presets it may fall back to, in the table's order: ones its key may use and that
        # serve its endpoint; none when the client says `x-gateway-fallback: none`.
        found = () if forbidden else (fleet.table.presets.get(name) for name in preset.fallback)
        self.options = [p for p in found if p is not None and identity.allows(p.name) and serves(p, endpoint)]
        self.tried = [preset.name]

    @property
    def left(self) -> bool:
        """Whether a fallback not yet tried remains."""
        return any(p.name not in self.tried for p in self.options)

    def before_sending(self, ex: Exchange, preset: Preset, tokens: int, patience: float | None) -> Preset:
        """The preset that should take the request before anything is sent: the asked one, or its
        first fallback that can serve when the asked one cannot. A prompt past the context with no
        fallback is refused here, before any GPU time."""
        if not self.options:
            # Nothing to fall back to: only a prompt past the context is decided here (refused
            # before any GPU time); whatever else stands in the way, the preset answers itself.
            context = smallest_context(self.fleet.pools[preset.name])
            if context is not None and tokens > context:
                raise self._past_context(preset, tokens, context)
            return preset
        found = self._standing(preset.name)
        reason = why_not(found, tokens, preset.timeouts.load if patience is None else patience)
        if reason is None:
            return preset
        target = self._choose(reason, tokens)
        if target is not None:
            return self._move(ex, preset, target, reason)
        if reason == "context" and found.context is not None:
            raise self._past_context(preset, tokens, found.context)
        return preset  # no fallback can take it: the preset's own answer (a wait, a 429, a 503)

    def _past_context(self, preset: Preset, tokens: int, context: int) -> ContextExceeded:
        tail = "; none of its fallbacks can take it" if self.options else ""
        return ContextExceeded(
            f"The prompt is about {tokens} tokens (estimated from its text), more than preset "
            f"'{preset.name}' holds: its context is {context} tokens{tail}. Shorten the prompt "
            "or ask for a preset with a longer context",
            prompt_tokens=tokens,
            context=context,
        )

    def after(self, ex: Exchange, preset: Preset, error: GatewayError, tokens: int) -> Preset | None:
        """The preset that takes the request after `error` (before its answer started), or None."""
        reason = error.fallback
        if reason is None or not self.left:
            return None
        target = self._choose(reason, tokens)
        return None if target is None else self._move(ex, preset, target, reason)

    def _standing(self, name: str) -> Standing:
        return standing(self.fleet.pools[name], self.clock, self.lifecycle)

    def _choose(self, reason: FallbackReason, tokens: int) -> str | None:
        pools = self.fleet.pools
        standings = [(p.name, self._standing(p.name)) for p in self.options if p.name in pools]
        return choose(standings, reason, tokens, skip=self.tried)

    def _move(self, ex: Exchange, preset: Preset, target: str, reason: FallbackReason) -> Preset:
        chosen = self.fleet.table.presets[target]
        self.tried.append(chosen.name)
        ex.fallback = ex.fallback or header_value(preset.name, target, reason)
        ex.fallback_reason = ex.fallback_reason or reason
        ex.fallback_from = ex.fallback_from or preset.name
        ex.preset, ex.outcome, ex.error_code = chosen.name, "completed", None
        log.info("request %s falls back %s -> %s (%s)", ex.request_id, preset.name, target, reason)
        return chosen
