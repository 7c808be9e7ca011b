"""bench/prefix in a reduced form against two real llama-server replicas.

Hit ratios come from the replicas' own accounting (`usage.prompt_tokens_details.cached_tokens`),
so they do not depend on the machine's speed; the bounds below leave room for the order in which
concurrent conversations happen to arrive.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.prefix import Scenario, run_scenario

SHAPE = {"conversations": 4, "turns": 3, "replicas": 2, "slots": 4, "words": 300}


def run(scenario: Scenario) -> dict[str, Any]:
    result = run_scenario(scenario, "llama", **SHAPE)
    assert result["errors"] == 0, result["error_kinds"]
    return result


@pytest.fixture(scope="module")
def results(tiny_gguf: object) -> dict[str, dict[str, Any]]:
    scenarios = {
        "ideal": Scenario("ideal", "direct", timestamp=False),
        "careless": Scenario("careless", "direct"),
        "moved": Scenario("moved", "gateway", policy="prefix_affinity", volatile="move"),
        "round_robin": Scenario("round_robin", "gateway", timestamp=False),
        "affinity": Scenario("affinity", "gateway", policy="prefix_affinity", timestamp=False),
    }
    return {name: run(scenario) for name, scenario in scenarios.items()}


def test_a_timestamp_first_in_the_system_prompt_defeats_the_cache(results: dict[str, dict[str, Any]]) -> None:
    assert results["ideal"]["hit_ratio"] > 0.3
    assert results["careless"]["hit_ratio"] < 0.05


def test_move_restores_the_hits_a_stable_prompt_gets(results: dict[str, dict[str, Any]]) -> None:
    assert results["moved"]["hit_ratio"] >= 0.7 * results["ideal"]["hit_ratio"]


def test_affinity_prefills_less_than_round_robin_and_spreads_the_load(
    results: dict[str, dict[str, Any]],
) -> None:
    assert results["affinity"]["prefilled_tokens"] < results["round_robin"]["prefilled_tokens"]
    assert results["affinity"]["max_replica_share"] <= 0.75  # 4 conversations: at worst 3 on one replica
