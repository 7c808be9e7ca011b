"""Active health probes: `/health` for readiness, `/v1/models` for the context length and served names,
llama-server's `/props` and `/slots` for its slots and what they hold (fleet/slots.py).

The side-effecting half of health: it asks the replicas and feeds the answers to the pure state
machine in `health.py`. Readiness is `/health` 200 only: vLLM refuses connections while starting,
llama-server answers 503 "Loading model" (and 200 on `/v1/models` at the same time).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import orjson

from gateway.fleet.health import Probe
from gateway.fleet.replicas import Fleet, Replica
from gateway.types import ReadBytes
from gateway.upstream import HeaderTimeout, IdleTimeout, UpstreamClient, UpstreamError

log = logging.getLogger("gateway.fleet.prober")

MODELS_EVERY = 12  # re-read /v1/models every this many probe cycles: a replica may be restarted bigger


class Prober:
    def __init__(
        self,
        fleet: Callable[[], Fleet],
        client: UpstreamClient,
        clock: Callable[[], float] = time.monotonic,
        active: Callable[[Replica], bool] = lambda replica: True,
    ) -> None:
        self._fleet = fleet
        self._client = client
        self._clock = clock
        self.active = active  # a launched replica that is not running is not probed (fleet/supervisor.py)
        self.cycles = 0

    async def run(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self._fleet().table.health.interval)

    async def probe_all(self) -> None:
        replicas = [r for r in self._fleet().replicas() if self.active(r)]
        await asyncio.gather(*(self.probe(replica) for replica in replicas))
        self.cycles += 1

    async def probe(self, replica: Replica) -> Probe:
        config = replica.health.config
        started = self._clock()
        result: Probe
        try:
            status, _ = await self._client.get(replica.url + "/health", _auth(replica), config.timeout)
            result = "ok" if status == 200 else "fail"
        except (HeaderTimeout, IdleTimeout):
            result = "timeout"
        except UpstreamError:
            result = "fail"
        replica.probe_latency = self._clock() - started
        before = replica.health.status
        replica.health.on_probe(result, self._clock())
        if replica.health.status is not before:
            level = logging.INFO if replica.health.status.value == "up" else logging.WARNING
            log.log(
                level,
                "replica %s is %s (%s)",
                replica.name,
                replica.health.status.value,
                replica.health.last_reason,
            )
        if result == "ok" and (replica.context is None or self.cycles % MODELS_EVERY == 0):
            await self.read_models(replica)
            if replica.engine == "llamacpp":
                await self.read_props(replica)
        if result == "ok" and config.scrape_metrics:
            await self.read_metrics(replica)
        if (
            result == "ok"
            and replica.engine == "llamacpp"
            and (replica.cache.sessions or replica.cache.stale)
        ):
            # Corrects the picture after anything the gateway did not send (a restart, another client).
            await read_slots(self._client, replica)
        return result

    async def _fetch(self, replica: Replica, path: str) -> ReadBytes | None:
        """The body of a 200 answer to a GET, or None (a failure here is not a health signal)."""
        try:
            status, body = await self._client.get(
                replica.url + path, _auth(replica), replica.health.config.timeout
            )
        except UpstreamError:
            return None
        return body if status == 200 else None

    async def _fetch_json(self, replica: Replica, path: str) -> Any:
        body = await self._fetch(replica, path)
        try:
            return None if body is None else orjson.loads(body)
        except orjson.JSONDecodeError:
            return None

    async def read_props(self, replica: Replica) -> None:
        payload = await self._fetch_json(replica, "/props")
        slots = payload.get("total_slots") if isinstance(payload, dict) else None
        if isinstance(slots, int) and slots > 0:
            replica.slots = slots
            replica.cache.resize(slots)

    async def read_metrics(self, replica: Replica) -> None:
        # llama-server without --metrics answers 501: nothing to read, nothing wrong.
        body = await self._fetch(replica, "/metrics")
        if body is not None:
            replica.backend_metrics = parse_backend_metrics(body.decode("utf-8", "replace"))

    async def read_models(self, replica: Replica) -> None:
        ids, context = parse_models(await self._fetch_json(replica, "/v1/models"))
        replica.served_ids = ids or replica.served_ids
        replica.context = context or replica.context


def parse_models(payload: Any) -> tuple[tuple[str, ...], int | None]:
    """Served names and context length from either dialect of `/v1/models`."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        return (), None
    ids: list[str] = []
    context: int | None = None
    for card in data:
        if not isinstance(card, dict):
            continue
        if isinstance(card.get("id"), str):
            ids.append(card["id"])
        meta = card.get("meta")
        for value in (card.get("max_model_len"), meta.get("n_ctx") if isinstance(meta, dict) else None):
            if isinstance(value, int) and value > 0 and context is None:
                context = value
    return tuple(ids), context


# The replicas' own load and cache figures worth seeing beside the gateway's: their name here, and
# how label sets combine (a ratio is the highest, a count the sum; counters stay counters).
BACKEND_METRICS: dict[str, tuple[str, str]] = {
    "vllm:num_requests_waiting": ("requests_waiting", "sum"),
    "vllm:num_requests_running": ("requests_running", "sum"),
    "vllm:kv_cache_usage_perc": ("kv_cache_usage_ratio", "max"),
    "vllm:prefix_cache_queries_total": ("prefix_cache_queries_tokens", "counter"),
    "vllm:prefix_cache_hits_total": ("prefix_cache_hits_tokens", "counter"),
    "llamacpp:requests_deferred": ("requests_waiting", "sum"),
    "llamacpp:requests_processing": ("requests_running", "sum"),
    "llamacpp:prompt_tokens_total": ("prompt_tokens_processed", "counter"),
    "llamacpp:prompt_tokens_cached_total": ("prompt_tokens_cached", "counter"),
    # Average prefill speed: what a session's uncached prompt costs there (routing/balancer.py).
    "llamacpp:prompt_tokens_seconds": ("prompt_tokens_per_second", "max"),
}
BACKEND_COUNTERS = frozenset(key for key, how in BACKEND_METRICS.values() if how == "counter")


def parse_backend_metrics(text: str) -> dict[str, float]:
    """The few figures of BACKEND_METRICS from Prometheus text."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        known = BACKEND_METRICS.get(name)
        if known is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[-1])
        except ValueError:
            continue
        key, how = known
        if key not in found:
            found[key] = value
        else:
            found[key] = max(found[key], value) if how == "max" else found[key] + value
    return found


SLOTS_TIMEOUT = 2.0
SLOTS_LIMIT = 4 * 1024 * 1024  # a /slots answer is about 2 KiB per slot


async def read_slots(client: UpstreamClient, replica: Replica, timeout: float = SLOTS_TIMEOUT) -> bool:
    """llama-server's `GET /slots` into the replica's slot picture; False when it could not be read
    (then the next request of a session is left to the engine to place)."""
    try:
        status, body = await client.get(replica.url + "/slots", _auth(replica), timeout)
    except UpstreamError:
        return False
    if status != 200 or len(body) > SLOTS_LIMIT:
        return False
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    replica.cache.observe(payload)
    return True


def _auth(replica: Replica) -> list[tuple[str, str]]:
    key = replica.api_key()
    return [("authorization", f"Bearer {key}")] if key else []
