"""Prometheus metrics, bound to an injected registry so every test and every app has its own.

Labels are bounded: preset, replica, engine, status class, route reason and small fixed sets of
kinds. A model name a client made up is never a label (it is `unknown`). State that already lives
elsewhere (replica health, in-flight counts, queue depth, cache ratios) is read at scrape time by a
collector instead of being mirrored by increments scattered through the code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.dialects.answer import Answer
from gateway.fleet.prober import BACKEND_COUNTERS, BACKEND_METRICS
from gateway.fleet.replicas import Fleet
from gateway.fleet.slots import RATIO_BUCKETS
from gateway.ops.exchange import Exchange
from gateway.ops.tally import Tallies, Tally

# A `_created` series beside every counter and histogram doubles the series count for nothing a
# dashboard here uses.
disable_created_metrics()  # type: ignore[no-untyped-call]

# LLM times: a cached first token in milliseconds, a long answer in tens of minutes.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 7200)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2.5)
RATE_BUCKETS = (1, 2.5, 5, 10, 15, 20, 25, 35, 50, 75, 100, 150, 200, 300, 500, 1000)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


# The families labelled by key name; see Metrics.without_keys.
KEY_FAMILIES = frozenset({"gateway_key_requests", "gateway_key_tokens", "gateway_key_limited"})

# Engine starts: a tiny model in under a second, a 27B on a GPU in minutes (15 with compilation).
LOAD_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 900)


class Metrics:
    """The gateway's own families (each request counted once, from its record, at its end) and
    the collectors that read the fleet's live state at scrape time."""

    def __init__(self, registry: CollectorRegistry, fleet: Callable[[], Fleet]) -> None:
        self.registry = registry
        per_replica = ["preset", "replica"]
        tallies = Tallies()
        self.requests = tallies.counter(
            "gateway_requests",
            "Requests answered, by preset, replica, engine, status class and route reason.",
            ["preset", "replica", "engine", "status", "route"],
        )
        # By endpoint, every request the gateway answered, those the edge turned away included
        # (401, 404, 405, 431): which wire formats are used, and which agents call what it lacks.
        self.endpoints = tallies.counter(
            "gateway_endpoint_requests",
            "Requests answered, by endpoint (wire format) and status class.",
            ["endpoint", "status"],
        )
        self.tools = tallies.counter(
            "gateway_mcp_tool_calls",
            "MCP tool calls that ran a request on the fleet, by tool and status class.",
            ["tool", "status"],
        )
        self.duration = tallies.histogram(
            "gateway_request_duration_seconds",
            "From the request's arrival to the last byte sent.",
            per_replica,
            LATENCY_BUCKETS,
        )
        self.ttft = tallies.histogram(
            "gateway_time_to_first_token_seconds",
            "From the request's arrival to the first token (content, reasoning or tool call) of a stream.",
            per_replica,
            TTFT_BUCKETS,
        )
        self.itl = tallies.histogram(
            "gateway_inter_token_latency_seconds",
            "Mean time between tokens of one streamed answer.",
            per_replica,
            ITL_BUCKETS,
        )
        self.decode_rate = tallies.histogram(
            "gateway_decode_tokens_per_second",
            "Completion tokens per second after the first token, per streamed answer.",
            per_replica,
            RATE_BUCKETS,
        )
        self.tokens = tallies.counter(
            "gateway_tokens",
            "Tokens as the replicas report them: prompt, cached (prompt tokens served from the prefix "
            "cache), completion, reasoning.",
            [*per_replica, "kind"],
        )
        self.overhead = tallies.histogram(
            "gateway_overhead_seconds",
            "Time the gateway itself spent before sending a request upstream (read, parse, route, rewrite).",
            ["preset"],
            OVERHEAD_BUCKETS,
        )
        self.retries = tallies.counter(
            "gateway_upstream_retries",
            "Retries on another replica, by reason.",
            ["preset", "reason"],
        )
        self.upstream_errors = tallies.counter(
            "gateway_upstream_errors", "Upstream failures by kind.", [*per_replica, "kind"]
        )
        self.ejections = tallies.counter(
            "gateway_ejections",
            "Replicas taken out of rotation by live traffic.",
            per_replica,
        )
        self.disconnects = tallies.counter(
            "gateway_client_disconnects",
            "Clients that left before their answer ended, by phase (waiting or streaming).",
            ["preset", "phase"],
        )
        self.rewrites = tallies.counter(
            "gateway_rewrites", "Request rewrites applied, by kind.", ["preset", "kind"]
        )
        self.thinking_trap = tallies.counter(
            "gateway_thinking_budget_exhausted",
            "Answers that ended on max_tokens with empty content after reasoning: the thinking trap.",
            per_replica,
        )
        self.picks = tallies.counter(
            "gateway_balancer_picks", "Balancer decisions by reason.", ["preset", "reason"]
        )
        self.prefix_volatile = tallies.counter(
            "gateway_prefix_volatile",
            "Requests whose system prompt held volatile content (timestamps, ids), by kind.",
            ["preset", "kind"],
        )
        self.prefix_churn = tallies.counter(
            "gateway_prefix_churn",
            "Requests whose prefix fingerprint differs from the same client's previous one.",
            ["preset"],
        )
        self.loads = tallies.counter(
            "gateway_replica_loads",
            "Starts of launched replicas, by outcome (ok: healthy in time; error: exited or timed out).",
            ["replica", "outcome"],
        )
        self.load_seconds = tallies.histogram(
            "gateway_replica_load_seconds",
            "From a launched replica's start to its first healthy /health.",
            ["replica"],
            LOAD_BUCKETS,
        )
        self.evictions = tallies.counter(
            "gateway_replica_evictions",
            "Idle launched replicas stopped to make room on their device for another.",
            ["replica"],
        )
        self.load_wait = tallies.histogram(
            "gateway_load_wait_seconds",
            "Time requests spent waiting for a launched replica to start.",
            ["preset"],
            LOAD_BUCKETS,
        )
        # Per key: labels are the configured key names (and `anonymous`), so they stay bounded.
        self.key_requests = tallies.counter(
            "gateway_key_requests",
            "Requests a key made past its limits, by key, preset, priority and status class.",
            ["key", "preset", "priority", "status"],
        )
        self.key_tokens = tallies.counter(
            "gateway_key_tokens",
            "Tokens per key and preset, as the replicas report them: prompt, cached, completion, reasoning.",
            ["key", "preset", "kind"],
        )
        self.key_limited = tallies.counter(
            "gateway_key_limited",
            "Requests refused because their key was over a limit (requests_per_minute, tokens_per_minute, "
            "tokens_per_day), or denied a preset (preset_not_allowed).",
            ["key", "limit"],
        )
        self.fallbacks = tallies.counter(
            "gateway_fallbacks",
            "Requests served by a fallback preset, by the preset asked for, the one that served, and why.",
            ["preset", "target", "reason"],
        )
        self.queue_wait = tallies.histogram(
            "gateway_queue_wait_seconds",
            "Time requests waited for a free place in their preset's queue, by priority.",
            ["preset", "priority"],
            LATENCY_BUCKETS,
        )
        self.redis_changes = tallies.counter(
            "gateway_redis_condition_changes",
            "Times the shared state's Redis became unreachable or reachable again.",
            ["condition"],
        )
        registry.register(tallies)
        self.supervisor: Any = None  # set by the gateway: the states of launched replicas
        registry.register(_FleetCollector(fleet))
        registry.register(_SessionCollector(fleet))
        registry.register(_StateCollector(lambda: self.supervisor))
        self.redis: Callable[[], str] = lambda: "local"  # set by the gateway: the counters' condition
        self.redis_round_trips: Callable[[], int] = lambda: 0  # set by the gateway
        registry.register(_RedisCollector(lambda: self.redis(), lambda: self.redis_round_trips()))
        # /metrics for a key that is not an admin: everything but the per-key series, which show
        # what every other key asks for and spends (GET /v1/usage shows a key its own).
        self.without_keys = CollectorRegistry(auto_describe=False)
        self.without_keys.register(_WithoutLabel(registry, "key", KEY_FAMILIES))

    def record_load(self, replica: str, outcome: str, seconds: float) -> None:
        self.loads.inc((replica, outcome))
        if outcome == "ok":
            self.load_seconds.observe((replica,), seconds)

    def record_redis(self, condition: str) -> None:
        self.redis_changes.inc((condition,))

    def record_eviction(self, replica: str) -> None:
        self.evictions.inc((replica,))

    def record(self, ex: Exchange) -> None:
        """One finished request, read from its record into every family it counts in."""
        preset, replica = ex.preset, ex.replica or "none"
        status = ex.status_class
        per_replica = (preset, replica)
        self.requests.inc((preset, replica, ex.engine or "none", status, ex.route or "none"))
        self.endpoints.inc((ex.endpoint, status))
        if ex.tool:
            self.tools.inc((ex.tool, status))
        self._record_key(ex, status)
        if ex.finished is not None:
            self.duration.observe(per_replica, ex.finished - ex.started)
        if ex.upstream_sent is not None:
            self.overhead.observe((preset,), ex.upstream_sent - ex.started)
        if ex.load_wait is not None:
            self.load_wait.observe((preset,), ex.load_wait)
        for kind, _ in ex.rewrites:
            self.rewrites.inc((preset, kind))
        for reason in ex.retries:
            self.retries.inc((preset, reason))
        if ex.pick_reason:
            self.picks.inc((preset, ex.pick_reason))
        for kind in ex.prefix_found:
            self.prefix_volatile.inc((preset, kind))
        if ex.prefix_churn:
            self.prefix_churn.inc((preset,))
        if ex.outcome == "client_disconnected":
            self.disconnects.inc((preset, ex.disconnect_phase or "waiting"))
        for name in ex.ejected:
            self.ejections.inc((preset, name))
        for kind in ex.upstream_errors:
            self.upstream_errors.inc((preset, ex.failed_replica or replica, kind))
        answer = ex.answer
        if not ex.replica:
            return
        _count_tokens(self.tokens, preset, replica, answer)
        if ex.first_token is not None:
            self.ttft.observe(per_replica, ex.first_token - ex.started)
            count = answer.completion_tokens or 0
            if ex.finished is not None and count > 1 and ex.finished > ex.first_token:
                decode = ex.finished - ex.first_token
                self.itl.observe(per_replica, decode / (count - 1))
                self.decode_rate.observe(per_replica, (count - 1) / decode)
        if answer.thinking_trap:
            self.thinking_trap.inc(per_replica)

    def _record_key(self, ex: Exchange, status: str) -> None:
        if ex.key_limit is not None:
            self.key_limited.inc((ex.key, ex.key_limit))
        if ex.fallback:
            self.fallbacks.inc((ex.fallback_from, ex.preset, ex.fallback_reason))
        if ex.queue_wait is not None:
            self.queue_wait.observe((ex.preset, ex.priority), ex.queue_wait)
        if not ex.admitted:
            return
        key, preset = ex.key, ex.preset
        self.key_requests.inc((key, preset, ex.priority, status))
        _count_tokens(self.key_tokens, key, preset, ex.answer)


def _count_tokens(counter: Tally, first: str, second: str, answer: Answer) -> None:
    """An answer's tokens by kind, under the two labels before the kind (preset and replica, or key
    and preset); a kind the answer does not report is not counted."""
    if answer.prompt_tokens:
        counter.inc((first, second, "prompt"), answer.prompt_tokens)
    if answer.cached_tokens:
        counter.inc((first, second, "cached"), answer.cached_tokens)
    if answer.completion_tokens:
        counter.inc((first, second, "completion"), answer.completion_tokens)
    if answer.reasoning_tokens:
        counter.inc((first, second, "reasoning"), answer.reasoning_tokens)


STATES = ("stopped", "starting", "ready", "stopping", "sleeping", "failed")


class _StateCollector(Collector):
    """One series per launched replica and state, 1 for the state it is in (none without launch)."""

    def __init__(self, supervisor: Callable[[], Any]) -> None:
        self._supervisor = supervisor

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "gateway_replica_state", "Lifecycle state of a launched replica.", labels=["replica", "state"]
        )
        supervisor = self._supervisor()
        for unit in supervisor.units.values() if supervisor is not None else ():
            for state in STATES:
                family.add_metric([unit.name, state], 1.0 if unit.state == state else 0.0)
        yield family


class _RedisCollector(Collector):
    """`gateway_redis_up`, read at scrape time; absent when no Redis is configured."""

    def __init__(self, condition: Callable[[], str], round_trips: Callable[[], int]) -> None:
        self.condition = condition
        self.round_trips = round_trips

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        condition = self.condition()
        if condition != "local":
            yield GaugeMetricFamily(
                "gateway_redis_up",
                "1 while the shared state's Redis answers, 0 while the gateway counts locally without it.",
                value=1 if condition == "ok" else 0,
            )
            yield CounterMetricFamily(
                "gateway_redis_round_trips",
                "Calls to the shared state's Redis, one script or pipeline each: a request makes two (its "
                "admission and its charge), a usage read one.",
                value=self.round_trips(),
            )


class _WithoutLabel(Collector):
    """Another registry's families less those labelled by `label` (a family with no series yet
    is known by its name)."""

    def __init__(self, registry: CollectorRegistry, label: str, names: frozenset[str]) -> None:
        self.registry, self.label, self.names = registry, label, names

    def describe(self) -> list[Metric]:
        return []  # names are not reserved twice: these are the other registry's own

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if family.name not in self.names and not any(self.label in s.labels for s in family.samples):
                yield family


class _FleetCollector(Collector):
    def __init__(self, fleet: Callable[[], Fleet]) -> None:
        self._fleet = fleet

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        fleet = self._fleet()
        now = fleet.clock()
        labels = ["preset", "replica", "engine"]
        up = GaugeMetricFamily(
            "gateway_replica_up", "1 when the replica's /health probes pass.", labels=labels
        )
        ejected = GaugeMetricFamily(
            "gateway_replica_ejected", "1 while live-traffic failures keep the replica out.", labels=labels
        )
        in_flight = GaugeMetricFamily(
            "gateway_in_flight", "Requests in flight to the replica.", labels=labels
        )
        probe = GaugeMetricFamily(
            "gateway_replica_probe_latency_seconds", "Latency of the last /health probe.", labels=labels
        )
        context = GaugeMetricFamily(
            "gateway_replica_context_tokens",
            "Context length reported by the replica's /v1/models.",
            labels=labels,
        )
        hit_ratio = GaugeMetricFamily(
            "gateway_prefix_cache_hit_ratio",
            "Cached prompt tokens / prompt tokens, as the replica reported them since the gateway started.",
            labels=labels,
        )
        backend: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for key in sorted({key for key, _ in BACKEND_METRICS.values()}):
            family = CounterMetricFamily if key in BACKEND_COUNTERS else GaugeMetricFamily
            help_text = f"The replica's own {key.replace('_', ' ')}, from its /metrics."
            backend[key] = family(f"gateway_backend_{key}", help_text, labels=labels)
        queue = GaugeMetricFamily(
            "gateway_queue_depth", "Requests waiting for a free replica.", labels=["preset"]
        )
        panic = GaugeMetricFamily(
            "gateway_panic_mode",
            "1 when every replica of the preset looks down and all are tried anyway.",
            labels=["preset"],
        )
        for name, pool in fleet.pools.items():
            queue.add_metric([name], pool.queued)
            panic.add_metric([name], 1.0 if pool.panic() else 0.0)
            for replica in pool.replicas:
                values = [name, replica.name, replica.engine]
                up.add_metric(values, 1.0 if replica.health.ready(now) else 0.0)
                ejected.add_metric(values, 1.0 if replica.health.ejected(now) else 0.0)
                in_flight.add_metric(values, replica.in_flight)
                if replica.probe_latency is not None:
                    probe.add_metric(values, replica.probe_latency)
                if replica.context is not None:
                    context.add_metric(values, replica.context)
                if replica.prompt_tokens:
                    hit_ratio.add_metric(values, replica.cached_tokens / replica.prompt_tokens)
                for key, value in replica.backend_metrics.items():
                    backend[key].add_metric(values, value)
        yield from (up, ejected, in_flight, probe, context, hit_ratio, queue, panic, *backend.values())


class _SessionCollector(Collector):
    """Agent sessions and their caches (`policy: session`, fleet/slots.py), read from each
    replica's slot picture at scrape time. Where a session was placed and why is
    gateway_balancer_picks_total (session_home, session_new, session_moved, session_overload)."""

    def __init__(self, fleet: Callable[[], Fleet]) -> None:
        self._fleet = fleet

    def collect(self) -> Iterator[Metric]:
        labels = ["replica"]
        plans = CounterMetricFamily(
            "gateway_session_slot_plans",
            "Session requests by how their slot was chosen: held (pinned to the slot holding the "
            "session), free (pinned to an empty slot), tier (left to the engine to restore from its "
            "memory), uncertain (the engine placed a request whose slot is not known yet), unpinnable "
            "(an endpoint that cannot pin), transient, shared (vLLM), unknown (slots not read).",
            labels=["replica", "reason"],
        )
        lost = CounterMetricFamily(
            "gateway_session_slot_lost",
            "Pinned session requests that found less than half the expected prompt in their slot.",
            labels=labels,
        )
        saves = CounterMetricFamily(
            "gateway_session_slot_saves",
            "Slots saved before a stop, by outcome.",
            labels=["replica", "outcome"],
        )
        restores = CounterMetricFamily(
            "gateway_session_slot_restores",
            "Saved slots restored after a start, by outcome (failed: refused, or under 90% of the tokens).",
            labels=["replica", "outcome"],
        )
        moved_tokens = CounterMetricFamily(
            "gateway_session_slot_tokens", "Tokens saved and restored.", labels=["replica", "action"]
        )
        moved_seconds = CounterMetricFamily(
            "gateway_session_slot_seconds",
            "Seconds spent saving and restoring slots.",
            labels=["replica", "action"],
        )
        held = GaugeMetricFamily(
            "gateway_session_slots",
            "Slots by whether they hold an agent session.",
            labels=["replica", "state"],
        )
        tier = GaugeMetricFamily(
            "gateway_session_tier_sessions",
            "Sessions the replica holds outside its slots, in its memory tier as far as the gateway knows.",
            labels=labels,
        )
        ratio = HistogramMetricFamily(
            "gateway_session_cache_hit_ratio",
            "Per answer of an agent session after its first turn on a replica: cached / prompt tokens.",
            labels=labels,
        )
        for replica in self._fleet().replicas():
            cache, name = replica.cache, replica.name
            stats = cache.stats
            for reason, count in sorted(stats.plans.items()):
                plans.add_metric([name, reason], count)
            lost.add_metric([name], stats.lost)
            saves.add_metric([name, "ok"], stats.saves)
            saves.add_metric([name, "failed"], stats.save_failures)
            restores.add_metric([name, "ok"], stats.restores)
            restores.add_metric([name, "failed"], stats.restore_failures)
            moved_tokens.add_metric([name, "save"], stats.saved_tokens)
            moved_tokens.add_metric([name, "restore"], stats.restored_tokens)
            moved_seconds.add_metric([name, "save"], stats.save_seconds)
            moved_seconds.add_metric([name, "restore"], stats.restore_seconds)
            if cache.slots:
                busy = cache.in_slots()
                held.add_metric([name, "held"], busy)
                held.add_metric([name, "free"], cache.slots - busy)
            tier.add_metric([name], cache.tier())
            cumulative, buckets = 0, []
            for bound, count in zip(RATIO_BUCKETS, stats.ratio_buckets, strict=True):
                cumulative += count
                buckets.append((repr(bound), cumulative))
            buckets.append(("+Inf", stats.ratio_count))
            ratio.add_metric([name], buckets, stats.ratio_sum)
        yield from (plans, lost, saves, restores, moved_tokens, moved_seconds, held, tier, ratio)
