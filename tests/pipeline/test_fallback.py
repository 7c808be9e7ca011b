"""gateway/pipeline/fallback.py: which preset serves one request, read from a real fleet's pools
(and a scripted supervisor where launched replicas matter): before anything is sent, and after a
failure whose class names its reason; the client's `x-gateway-max-wait` patience."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from gateway.dialects.registry import BY_NAME, Endpoint
from gateway.errors import (
    BadRequest,
    ContextExceeded,
    GatewayError,
    LoadTimeout,
    NoUpstream,
    QueueFull,
    RateLimited,
    ReplicaFailed,
    UpstreamServerError,
)
from gateway.fleet.replicas import Fleet, Pool
from gateway.ops.exchange import Exchange
from gateway.pipeline.fallback import Fallbacks, patience, smallest_context, standing
from gateway.routing.table import Preset, parse_table
from gateway.team.keys import OPEN, Identity

# Queues of 0 and one place per replica, so one running request makes a preset full.
TABLE = """
defaults: {max_tokens: 512, min_max_tokens: 0, limits: {max_in_flight: 1, queue: 0}}
presets:
  dense:
    served_model: dense-served
    fallback: [moe, small]
    replicas: [{name: d0, url: "http://dense.test:1", engine: vllm}]
  moe:
    served_model: moe-served
    replicas: [{name: m0, url: "http://moe.test:1", engine: llamacpp}]
  small:
    served_model: small-served
    replicas: [{name: s0, url: "http://small.test:1", engine: vllm}]
  lone:
    served_model: lone-served
    replicas: [{name: l0, url: "http://lone.test:1", engine: vllm}]
  vectors:
    served_model: vectors-served
    embeddings: true
    fallback: [dense, vectors2]
    replicas: [{name: v0, url: "http://vectors.test:1", engine: vllm}]
  vectors2:
    served_model: vectors2-served
    embeddings: true
    replicas: [{name: w0, url: "http://vectors2.test:1", engine: vllm}]
routing: {default: dense}
"""

NOW = 100.0
CHAT = BY_NAME["chat"]


def clock() -> float:
    return NOW


Outlook = tuple[bool, bool, float | None]


@dataclass
class Supervisor:
    """The supervisor as the request path sees it: per preset, its launched replicas' outlook
    (all failed, must load, expected seconds) and the ones that are stopped."""

    outlooks: dict[str, Outlook] = field(default_factory=dict)
    stopped: dict[str, list[str]] = field(default_factory=dict)

    async def ensure(
        self, pool: Pool, deadline: float, notify: Callable[[float], Awaitable[None]] | None = None
    ) -> float:
        return 0.0

    def unavailable(self, pool: Pool) -> list[str]:
        return self.stopped.get(pool.preset.name, [])

    def outlook(self, pool: Pool) -> Outlook:
        return self.outlooks.get(pool.preset.name, (False, False, None))


class Setup:
    """A fleet over the table above with every replica usable, and the exchange of one request."""

    def __init__(self, lifecycle: Supervisor | None = None) -> None:
        self.fleet = Fleet(parse_table(TABLE), clock=clock)
        self.lifecycle = lifecycle
        self.ex = Exchange(request_id="r1", endpoint="chat", started=NOW, preset="dense")

    def preset(self, name: str) -> Preset:
        return self.fleet.table.presets[name]

    def down(self, *names: str) -> None:
        for name in names:
            for replica in self.fleet.pools[name].replicas:
                replica.health.on_stopped("stopped")

    def full(self, *names: str) -> None:
        for name in names:
            for replica in self.fleet.pools[name].replicas:
                replica.in_flight = replica.limit

    def context(self, name: str, tokens: int) -> None:
        for replica in self.fleet.pools[name].replicas:
            replica.context = tokens

    def fallbacks(
        self,
        asked: str = "dense",
        identity: Identity = OPEN,
        endpoint: Endpoint = CHAT,
        forbidden: bool = False,
    ) -> Fallbacks:
        return Fallbacks(
            self.fleet,
            self.preset(asked),
            endpoint,
            identity,
            forbidden=forbidden,
            clock=clock,
            lifecycle=self.lifecycle,
        )


# --- the client's patience --------------------------------------------------------------------


def test_no_max_wait_header_means_the_presets_own_load_timeout() -> None:
    assert patience({}) is None


@pytest.mark.parametrize(("value", "seconds"), [("2.5", 2.5), ("0", 0.0), ("30", 30.0), (" 7 ", 7.0)])
def test_max_wait_is_read_as_seconds(value: str, seconds: float) -> None:
    assert patience({"x-gateway-max-wait": value}) == seconds


@pytest.mark.parametrize("value", ["soon", "", "1e", "-1", "nan", "inf", "-inf"])
def test_a_max_wait_that_is_not_a_finite_positive_number_is_a_400_naming_the_header(value: str) -> None:
    with pytest.raises(BadRequest) as raised:
        patience({"x-gateway-max-wait": value})
    assert raised.value.status == 400
    assert (raised.value.code, raised.value.param) == ("invalid_header", "x-gateway-max-wait")


# --- what a pool can do now -------------------------------------------------------------------


def test_a_pool_with_a_healthy_replica_and_a_free_place_stands_ready() -> None:
    setup = Setup()
    found = standing(setup.fleet.pools["moe"], clock, None)
    assert (found.available, found.free, found.failed, found.loadable, found.context) == (
        True,
        True,
        False,
        False,
        None,
    )


def test_a_pool_whose_only_replica_the_supervisor_stopped_is_not_available() -> None:
    setup = Setup(Supervisor(stopped={"moe": ["m0"]}))
    assert not standing(setup.fleet.pools["moe"], clock, setup.lifecycle).available


def test_a_pool_with_every_place_taken_and_no_queue_is_not_free() -> None:
    setup = Setup()
    setup.full("moe")
    found = standing(setup.fleet.pools["moe"], clock, None)
    assert found.available and not found.free


def test_the_smallest_known_context_among_the_replicas_is_the_pools() -> None:
    table = parse_table(
        """
presets:
  two:
    served_model: two
    replicas:
      - {name: a, url: "http://a.test:1", engine: vllm}
      - {name: b, url: "http://b.test:1", engine: vllm}
      - {name: c, url: "http://c.test:1", engine: vllm}
routing: {default: two}
"""
    )
    pool = Fleet(table, clock=clock).pools["two"]
    assert smallest_context(pool) is None
    pool.replicas[0].context, pool.replicas[1].context = 8192, 4096  # the third is not known yet
    assert smallest_context(pool) == 4096


# --- before anything is sent --------------------------------------------------------------------


def test_a_preset_that_can_serve_keeps_the_request_and_the_record_says_no_fallback() -> None:
    setup = Setup()
    chosen = setup.fallbacks().before_sending(setup.ex, setup.preset("dense"), 10, None)
    assert chosen.name == "dense"
    assert (setup.ex.preset, setup.ex.fallback, setup.ex.fallback_reason) == ("dense", "", "")


def test_a_preset_with_no_available_replica_moves_to_its_first_fallback_as_down() -> None:
    setup = Setup()
    setup.down("dense")
    chosen = setup.fallbacks().before_sending(setup.ex, setup.preset("dense"), 10, None)
    ex = setup.ex
    assert chosen.name == "moe"
    assert (ex.preset, ex.fallback, ex.fallback_reason, ex.fallback_from) == (
        "moe",
        "dense->moe (down)",
        "down",
        "dense",
    )


def test_a_full_preset_moves_to_the_first_fallback_that_has_room() -> None:
    setup = Setup()
    setup.full("dense", "moe")
    chosen = setup.fallbacks().before_sending(setup.ex, setup.preset("dense"), 10, None)
    assert chosen.name == "small"
    assert setup.ex.fallback == "dense->small (full)"


def test_a_prompt_past_the_context_moves_to_a_fallback_whose_context_holds_it() -> None:
    setup = Setup()
    setup.context("dense", 1000)
    setup.context("moe", 1500)  # first in the list, but still too short
    setup.context("small", 8000)
    chosen = setup.fallbacks().before_sending(setup.ex, setup.preset("dense"), 2000, None)
    assert chosen.name == "small"
    assert (setup.ex.fallback_reason, setup.ex.fallback) == ("context", "dense->small (context)")


def test_a_prompt_past_every_context_is_refused_with_the_numbers_before_sending() -> None:
    setup = Setup()
    for name in ("dense", "moe", "small"):
        setup.context(name, 1000)
    with pytest.raises(ContextExceeded) as raised:
        setup.fallbacks().before_sending(setup.ex, setup.preset("dense"), 2000, None)
    error = raised.value
    assert (error.prompt_tokens, error.context, error.status) == (2000, 1000, 400)
    assert "none of its fallbacks can take it" in error.message
    assert setup.ex.fallback == ""


def test_a_preset_without_fallbacks_refuses_a_prompt_past_its_context() -> None:
    setup = Setup()
    setup.context("lone", 1000)
    with pytest.raises(ContextExceeded) as raised:
        setup.fallbacks("lone").before_sending(setup.ex, setup.preset("lone"), 1001, None)
    assert (raised.value.prompt_tokens, raised.value.context) == (1001, 1000)
    assert "fallbacks" not in raised.value.message


def test_a_preset_without_fallbacks_answers_for_itself_when_it_is_down() -> None:
    setup = Setup()
    setup.down("lone")
    fallbacks = setup.fallbacks("lone")
    assert fallbacks.before_sending(setup.ex, setup.preset("lone"), 10, None).name == "lone"
    assert not fallbacks.left and setup.ex.fallback == ""


def test_no_fallback_when_the_client_forbids_it() -> None:
    setup = Setup()
    setup.down("dense")
    fallbacks = setup.fallbacks(forbidden=True)
    assert fallbacks.options == [] and not fallbacks.left
    assert fallbacks.before_sending(setup.ex, setup.preset("dense"), 10, None).name == "dense"
    assert fallbacks.after(setup.ex, setup.preset("dense"), NoUpstream("none"), 10) is None
    assert setup.ex.fallback == ""


def test_a_forbidden_fallback_still_refuses_a_prompt_past_the_context() -> None:
    setup = Setup()
    setup.context("dense", 1000)
    setup.context("moe", 8000)
    with pytest.raises(ContextExceeded):
        setup.fallbacks(forbidden=True).before_sending(setup.ex, setup.preset("dense"), 2000, None)


def test_a_preset_the_key_may_not_use_is_never_a_fallback() -> None:
    setup = Setup()
    setup.down("dense")
    bob = Identity("bob", presets=frozenset({"dense", "small"}))
    fallbacks = setup.fallbacks(identity=bob)
    assert [p.name for p in fallbacks.options] == ["small"]
    assert fallbacks.before_sending(setup.ex, setup.preset("dense"), 10, None).name == "small"


def test_a_preset_that_does_not_serve_the_endpoint_is_never_a_fallback() -> None:
    setup = Setup()
    setup.down("vectors")
    fallbacks = setup.fallbacks("vectors", endpoint=BY_NAME["embeddings"])
    assert [p.name for p in fallbacks.options] == ["vectors2"]  # dense has no embeddings
    assert fallbacks.before_sending(setup.ex, setup.preset("vectors"), 10, None).name == "vectors2"


def test_no_fallback_that_can_serve_leaves_the_request_with_its_preset() -> None:
    setup = Setup()
    setup.down("dense", "moe", "small")
    assert setup.fallbacks().before_sending(setup.ex, setup.preset("dense"), 10, None).name == "dense"
    assert setup.ex.fallback == ""


def test_a_load_longer_than_the_clients_patience_moves_to_a_ready_fallback() -> None:
    setup = Setup(Supervisor(outlooks={"dense": (False, True, 30.0)}))
    chosen = setup.fallbacks().before_sending(setup.ex, setup.preset("dense"), 10, 5.0)
    assert chosen.name == "moe" and setup.ex.fallback_reason == "loading"


def test_without_a_patience_header_the_presets_load_timeout_is_waited() -> None:
    setup = Setup(Supervisor(outlooks={"dense": (False, True, 30.0)}))  # well within the 600 s default
    assert setup.fallbacks().before_sending(setup.ex, setup.preset("dense"), 10, None).name == "dense"


def test_a_preset_whose_launched_replicas_all_failed_moves_on_as_failed() -> None:
    setup = Setup(Supervisor(outlooks={"dense": (True, False, None)}))
    chosen = setup.fallbacks().before_sending(setup.ex, setup.preset("dense"), 10, None)
    assert chosen.name == "moe" and setup.ex.fallback_reason == "failed"


def test_a_fallback_that_must_load_is_taken_only_for_a_longer_context() -> None:
    supervisor = Supervisor(outlooks={"moe": (False, True, None)})
    setup = Setup(supervisor)
    setup.down("dense")
    # Down: a target that would have to start first does not count; small answers now.
    assert setup.fallbacks().before_sending(setup.ex, setup.preset("dense"), 10, None).name == "small"
    again = Setup(supervisor)
    again.context("dense", 1000)
    again.context("moe", 8000)
    again.context("small", 500)
    assert again.fallbacks().before_sending(again.ex, again.preset("dense"), 2000, None).name == "moe"


# --- after a failure before the answer started ----------------------------------------------------


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (NoUpstream("no replica"), "down"),
        (QueueFull("queue full"), "full"),
        (ReplicaFailed("crash loop"), "failed"),
        (LoadTimeout("still loading"), "loading"),
        (ContextExceeded("too long", prompt_tokens=10, context=5), "context"),
    ],
    ids=["down", "full", "failed", "loading", "context"],
)
def test_a_failure_whose_class_names_a_reason_moves_to_the_next_fallback(
    error: GatewayError, reason: str
) -> None:
    setup = Setup()
    setup.ex.outcome, setup.ex.error_code = "upstream_error", error.code
    chosen = setup.fallbacks().after(setup.ex, setup.preset("dense"), error, 10)
    assert chosen is not None and chosen.name == "moe"
    ex = setup.ex
    assert (ex.fallback, ex.fallback_reason, ex.preset) == (f"dense->moe ({reason})", reason, "moe")
    assert (ex.outcome, ex.error_code) == ("completed", None)  # the fallback's answer decides these


@pytest.mark.parametrize(
    "error",
    [UpstreamServerError("500"), RateLimited("limit", code="requests_per_minute"), BadRequest("bad")],
    ids=["server-error", "key-limit", "bad-request"],
)
def test_a_failure_that_names_no_reason_is_not_taken_over(error: GatewayError) -> None:
    setup = Setup()
    assert setup.fallbacks().after(setup.ex, setup.preset("dense"), error, 10) is None
    assert setup.ex.preset == "dense" and setup.ex.fallback == ""


def test_each_fallback_is_tried_once_and_then_there_is_none_left() -> None:
    setup = Setup()
    fallbacks = setup.fallbacks()
    left = [fallbacks.left]
    first = fallbacks.after(setup.ex, setup.preset("dense"), NoUpstream("x"), 10)
    left.append(fallbacks.left)
    assert first is not None and first.name == "moe"
    second = fallbacks.after(setup.ex, first, NoUpstream("x"), 10)
    left.append(fallbacks.left)
    assert second is not None and second.name == "small"
    assert fallbacks.after(setup.ex, second, NoUpstream("x"), 10) is None
    assert left == [True, True, False]
    assert fallbacks.tried == ["dense", "moe", "small"]


def test_the_record_keeps_the_first_move_and_the_preset_that_served_last() -> None:
    setup = Setup()
    fallbacks = setup.fallbacks()
    moe = fallbacks.after(setup.ex, setup.preset("dense"), NoUpstream("x"), 10)
    assert moe is not None
    fallbacks.after(setup.ex, moe, QueueFull("x"), 10)
    ex = setup.ex
    assert (ex.fallback, ex.fallback_reason, ex.fallback_from, ex.preset) == (
        "dense->moe (down)",
        "down",
        "dense",
        "small",
    )


def test_a_fallback_chosen_before_sending_is_not_tried_again_after_a_failure() -> None:
    setup = Setup()
    setup.down("dense")
    fallbacks = setup.fallbacks()
    moe = fallbacks.before_sending(setup.ex, setup.preset("dense"), 10, None)
    assert moe.name == "moe"
    after = fallbacks.after(setup.ex, moe, NoUpstream("x"), 10)
    assert after is not None and after.name == "small"


def test_an_engines_context_refusal_moves_past_a_fallback_too_short_for_the_counted_prompt() -> None:
    setup = Setup()
    setup.context("moe", 3000)
    setup.context("small", 16000)
    refusal = ContextExceeded("too long", prompt_tokens=5000, context=4096)
    chosen = setup.fallbacks().after(setup.ex, setup.preset("dense"), refusal, 5000)
    assert chosen is not None and chosen.name == "small"
    assert setup.ex.fallback == "dense->small (context)"


def test_a_failure_with_no_fallback_able_to_serve_moves_nowhere() -> None:
    setup = Setup()
    setup.down("moe")
    setup.full("small")
    assert setup.fallbacks().after(setup.ex, setup.preset("dense"), NoUpstream("x"), 10) is None
    assert setup.ex.fallback == "" and setup.ex.preset == "dense"
