"""How many tokens a request is: the prompt's estimate, the engine's count where the estimate is
too close to the context to trust, and what a key's token limits reserve for it at admission.

The gateway estimates a prompt at four characters a token (pipeline/walk.py): close for English
and code, off by a quarter either way for other text. Near the context's end that is the difference
between an answer and an overflow, so there the engine counts: Messages on both engines with
`/v1/messages/count_tokens`; chat on vLLM with `/tokenize` (it renders the messages with the chat
template itself) and on llama-server with `/apply-template` then `/tokenize`. Responses bodies have
no counting endpoint on these builds: their estimate stands, and the engine's own refusal is
translated when it comes. A count that fails for any reason leaves the estimate in place.
"""

from __future__ import annotations

import contextlib
from typing import Any

import orjson

from gateway.caught import Caught, raise_again
from gateway.dialects.registry import Endpoint
from gateway.fleet.replicas import Pool, Replica
from gateway.pipeline.rewrite import budget_key
from gateway.routing.table import Preset
from gateway.team.keys import Identity
from gateway.upstream import Timeouts, UpstreamClient, UpstreamError

# The estimate is trusted this far from the context: beyond, it is clearly in or clearly out.
TRUST = 0.25
COUNT_TIMEOUT = 10.0
_LIMIT = 64 * 1024 * 1024  # a token list of a long prompt is a few MiB of JSON
_CHAT_KEYS = ("messages", "tools", "chat_template_kwargs")  # what the chat template renders


# Of a request's token budget, what its reservation counts before the answer says: budgets are
# generous brakes (8192 by default, 64000 from Claude Code) that answers rarely use up.
RESERVED_BUDGET = 4096


def reservation(
    identity: Identity, prompt: int, body: dict[str, Any], endpoint: Endpoint, preset: Preset
) -> int:
    """The tokens to reserve against a key's token limits at admission: the prompt as estimated and
    a capped share of the budget; nothing for a key without a token limit."""
    limits = identity.limits
    if limits.tokens_per_minute is None and limits.tokens_per_day is None:
        return 0
    if not endpoint.budget:
        return prompt
    key = budget_key(body, endpoint)
    return prompt + min(body[key] if key is not None else preset.max_tokens, RESERVED_BUDGET)


async def prompt_tokens(
    client: UpstreamClient, pool: Pool, endpoint: Endpoint, body: dict[str, Any], estimate: int, now: float
) -> int | None:
    """The engine's count of the prompt where the estimate is too near the pool's context to decide,
    else None (the estimate stands)."""
    contexts = [r.context for r in pool.replicas if r.context]
    if not contexts or not near(estimate, min(contexts)):
        return None
    return await count(client, pool, endpoint, body, now)


def near(estimate: int, context: int | None) -> bool:
    """Whether the estimate is within TRUST of the context, where only the engine's count decides."""
    return context is not None and (1 - TRUST) * context <= estimate <= (1 + TRUST) * context


async def count(
    client: UpstreamClient, pool: Pool, endpoint: Endpoint, body: dict[str, Any], now: float
) -> int | None:
    """The engine's count of the request's prompt on one available replica, or None."""
    replica = next((r for r in pool.replicas if r.health.available(now)), None)
    if replica is None:
        return None
    with contextlib.suppress(UpstreamError, orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        if endpoint.name in ("messages", "count_tokens"):
            # vLLM checks the model name against its own (the client's is an agent's alias).
            asked = {**body, "model": pool.preset.served_model}
            found = await _post(client, replica, "/v1/messages/count_tokens", asked)
            return int(found["input_tokens"])
        if endpoint.name == "chat":
            chat: dict[str, Any] = {k: body[k] for k in _CHAT_KEYS if k in body}
            if replica.engine == "vllm":
                found = await _post(client, replica, "/tokenize", {"model": pool.preset.served_model, **chat})
                return int(found["count"])
            prompt = (await _post(client, replica, "/apply-template", chat))["prompt"]
            return len((await _post(client, replica, "/tokenize", {"content": prompt}))["tokens"])
    return None


async def _post(client: UpstreamClient, replica: Replica, path: str, payload: dict[str, Any]) -> Any:
    headers = [("content-type", "application/json")]
    key = replica.api_key()
    if key:
        headers.append(("authorization", f"Bearer {key}"))
    timeouts = Timeouts(connect=COUNT_TIMEOUT, first_byte=COUNT_TIMEOUT, idle=COUNT_TIMEOUT)
    response = await client.send(replica.url + path, headers, orjson.dumps(payload), timeouts)
    caught: Caught[BaseException] | None = None
    try:
        data = await response.read(_LIMIT)
    except BaseException as error:
        caught = Caught(error)
    await response.close()
    raise_again(caught)
    if response.status != 200:
        raise ValueError(f"count answered {response.status}")
    return orjson.loads(data)
