"""gateway/routing/fallback.py: why a preset hands a request on, which fallback takes it, and how an
engine's context refusal is read (pure values, no fleet)."""

from __future__ import annotations

import pytest

from gateway.errors import FallbackReason
from gateway.routing.fallback import (
    Standing,
    can_take,
    choose,
    context_error,
    context_numbers,
    header_value,
    why_not,
)

READY = Standing(available=True, free=True)
DOWN = Standing(available=False, free=True)
FULL = Standing(available=True, free=False)
FAILED = Standing(available=False, free=False, failed=True)


def loadable(expected: float | None = None, context: int | None = None) -> Standing:
    """A preset of launched replicas none of which serves yet: a request would start one."""
    return Standing(available=False, free=False, loadable=True, expected_load=expected, context=context)


# --- why a preset hands a request on -------------------------------------------------------------


def test_a_ready_preset_serves_the_request_itself() -> None:
    assert why_not(READY, prompt_tokens=100, patience=10.0) is None
    assert why_not(READY, prompt_tokens=None, patience=10.0) is None


@pytest.mark.parametrize(
    ("standing", "reason"),
    [
        (DOWN, "down"),
        (FULL, "full"),
        (FAILED, "failed"),
        (Standing(available=True, free=True, context=100), "context"),
    ],
    ids=["down", "full", "failed", "context"],
)
def test_each_state_that_cannot_serve_names_its_reason(standing: Standing, reason: FallbackReason) -> None:
    assert why_not(standing, prompt_tokens=101, patience=10.0) == reason


def test_a_prompt_that_fits_exactly_is_not_past_the_context() -> None:
    fits = Standing(available=True, free=True, context=100)
    assert why_not(fits, prompt_tokens=100, patience=10.0) is None


def test_an_unknown_prompt_size_or_context_never_reads_as_past_the_context() -> None:
    assert why_not(Standing(available=True, free=True, context=100), None, 10.0) is None
    assert why_not(Standing(available=True, free=True, context=None), 10**9, 10.0) is None


def test_past_the_context_wins_over_every_other_reason() -> None:
    small_and_down = Standing(available=False, free=False, failed=True, context=10)
    assert why_not(small_and_down, prompt_tokens=11, patience=10.0) == "context"


def test_a_failed_preset_hands_on_even_when_it_would_load() -> None:
    failed = Standing(available=False, free=False, failed=True, loadable=True, expected_load=1.0)
    assert why_not(failed, prompt_tokens=1, patience=10.0) == "failed"


def test_a_load_longer_than_the_clients_patience_hands_on_as_loading() -> None:
    assert why_not(loadable(expected=30.0), prompt_tokens=1, patience=10.0) == "loading"


def test_a_load_within_the_clients_patience_is_waited_for() -> None:
    assert why_not(loadable(expected=10.0), prompt_tokens=1, patience=10.0) is None


def test_a_load_of_unknown_length_is_waited_for() -> None:
    # Never measured: start it and wait; the wait running out falls back later.
    assert why_not(loadable(expected=None), prompt_tokens=1, patience=0.0) is None


# --- which target can take it --------------------------------------------------------------------


def test_a_ready_target_takes_a_request_for_any_reason() -> None:
    for reason in ("down", "failed", "loading", "full", "context"):
        assert can_take(READY, reason, prompt_tokens=10)


@pytest.mark.parametrize("standing", [DOWN, FULL, FAILED], ids=["down", "full", "failed"])
def test_a_target_that_cannot_serve_now_takes_nothing(standing: Standing) -> None:
    assert not can_take(standing, "down", prompt_tokens=10)


def test_a_target_whose_context_is_too_small_takes_nothing() -> None:
    small = Standing(available=True, free=True, context=50)
    assert not can_take(small, "context", prompt_tokens=51)
    assert not can_take(small, "down", prompt_tokens=51)
    assert can_take(small, "down", prompt_tokens=50)


def test_a_target_that_must_load_first_takes_only_a_prompt_past_the_context() -> None:
    # A longer context is worth a load; the other reasons want an answer now.
    waiting = loadable(expected=5.0, context=10_000)
    assert can_take(waiting, "context", prompt_tokens=5000)
    for reason in ("down", "failed", "loading", "full"):
        assert not can_take(waiting, reason, prompt_tokens=5000)


def test_a_loadable_target_too_small_for_the_prompt_takes_nothing() -> None:
    assert not can_take(loadable(context=1000), "context", prompt_tokens=5000)


def test_choose_takes_the_first_candidate_that_can_serve_in_the_tables_order() -> None:
    candidates = [("moe", FULL), ("small", READY), ("swift", READY)]
    assert choose(candidates, "down", prompt_tokens=10) == "small"


def test_choose_skips_presets_already_tried() -> None:
    candidates = [("moe", READY), ("small", READY)]
    assert choose(candidates, "down", prompt_tokens=10, skip=["moe"]) == "small"
    assert choose(candidates, "down", prompt_tokens=10, skip=["moe", "small"]) is None


def test_choose_prefers_a_longer_context_for_a_prompt_past_the_first() -> None:
    candidates = [("short", Standing(True, True, context=100)), ("long", Standing(True, True, context=1000))]
    assert choose(candidates, "context", prompt_tokens=500) == "long"


def test_no_fallback_is_chosen_when_none_is_configured_or_none_can_serve() -> None:
    assert choose([], "down", prompt_tokens=10) is None
    assert choose([("moe", DOWN), ("small", FAILED)], "down", prompt_tokens=10) is None


def test_the_header_names_both_presets_and_the_reason() -> None:
    assert header_value("dense", "moe", "full") == "dense->moe (full)"


# --- an engine's context refusal -----------------------------------------------------------------


VLLM_REFUSAL = (
    b'{"error": {"message": "This model\'s maximum context length is 4096 tokens. However, your prompt '
    b'contains 5000 input tokens, which exceeds this limit.", "type": "BadRequestError", "code": 400}}'
)
LLAMA_REFUSAL = (
    b'{"error": {"code": 400, "message": "the request exceeds the available context size, try '
    b'increasing it", "type": "exceed_context_size_error", "n_prompt_tokens": 9000, "n_ctx": 8192}}'
)


@pytest.mark.parametrize("body", [VLLM_REFUSAL, LLAMA_REFUSAL], ids=["vllm", "llamacpp"])
def test_each_engines_400_for_a_long_prompt_is_a_context_error(body: bytes) -> None:
    assert context_error(400, body)


@pytest.mark.parametrize("status", [200, 413, 422, 500])
def test_the_same_words_under_another_status_are_not_a_context_error(status: int) -> None:
    assert not context_error(status, VLLM_REFUSAL)


def test_another_400_is_not_a_context_error() -> None:
    assert not context_error(400, b'{"error": {"message": "max_tokens must be at least 1"}}')


def test_the_context_words_past_the_first_64_kib_are_not_read() -> None:
    assert not context_error(400, b" " * 65536 + VLLM_REFUSAL)


def test_vllms_numbers_are_read_as_prompt_then_context() -> None:
    assert context_numbers(VLLM_REFUSAL) == (5000, 4096)


def test_llama_servers_numbers_are_read_from_its_fields() -> None:
    assert context_numbers(LLAMA_REFUSAL) == (9000, 8192)


def test_a_refusal_that_does_not_give_both_numbers_gives_none() -> None:
    assert context_numbers(b"This model's maximum context length is 4096 tokens.") is None
    assert context_numbers(b'{"n_prompt_tokens": 9000}') is None
    assert context_numbers(b"") is None
