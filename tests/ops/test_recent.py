"""gateway/ops/recent.py: the status page's last minutes of traffic: one sample per finished request
(time to first token, decode speed, tokens), warnings, bounded memory, and the figures over them."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.dialects.answer import Answer
from gateway.ops.exchange import Exchange, Outcome
from gateway.ops.recent import MAX_SAMPLES, MAX_WARNINGS, WINDOW, Recent, Sample, summarise


@dataclass
class Clock:
    """A clock the test moves by hand."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


def exchange(
    preset: str = "dense",
    *,
    status: int = 200,
    outcome: Outcome = "completed",
    started: float = 10.0,
    first_token: float | None = 10.5,
    finished: float | None = 12.5,
    completion: int | None = 41,
    prompt: int | None = 100,
    cached: int | None = 60,
    request_id: str = "r1",
) -> Exchange:
    ex = Exchange(request_id=request_id, endpoint="chat", started=started, preset=preset, replica="d0")
    ex.status = status
    ex.outcome = outcome
    ex.first_token, ex.finished = first_token, finished
    ex.answer = Answer(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)
    return ex


def sample(at: float = 0.0, ok: bool = True, ttft: float | None = None, **kw: float | int) -> Sample:
    decode = kw.get("decode_tps")
    return Sample(
        at=at,
        preset="dense",
        replica="d0",
        ok=ok,
        ttft=ttft,
        decode_tps=None if decode is None else float(decode),
        prompt_tokens=int(kw.get("prompt_tokens", 0)),
        cached_tokens=int(kw.get("cached_tokens", 0)),
    )


# --- one sample per request ---------------------------------------------------------------------


def test_a_finished_request_becomes_one_sample_with_its_timings_and_tokens() -> None:
    clock = Clock()
    recent = Recent(clock=clock, wall=lambda: 5.0)
    recent.record(exchange())
    [got] = recent.samples
    assert (got.at, got.preset, got.replica, got.ok) == (1000.0, "dense", "d0", True)
    assert got.ttft == 0.5
    # Decode speed over the tokens after the first: 40 tokens in the 2 s after the first token.
    assert got.decode_tps == 20.0
    assert (got.prompt_tokens, got.cached_tokens) == (100, 60)
    assert recent.total == 1 and list(recent.warnings) == []


def test_no_decode_speed_without_a_token_after_the_first_or_time_to_measure_it() -> None:
    recent = Recent(clock=Clock())
    recent.record(exchange(completion=1))
    recent.record(exchange(completion=None))
    recent.record(exchange(first_token=None))
    recent.record(exchange(finished=None))
    recent.record(exchange(first_token=12.5, finished=12.5))
    assert [s.decode_tps for s in recent.samples] == [None] * 5


def test_a_request_without_a_first_token_has_no_ttft_and_missing_counts_read_zero() -> None:
    recent = Recent(clock=Clock())
    recent.record(exchange(first_token=None, prompt=None, cached=None))
    [got] = recent.samples
    assert (got.ttft, got.prompt_tokens, got.cached_tokens) == (None, 0, 0)


def test_a_5xx_or_an_upstream_error_is_a_failed_sample_and_a_4xx_is_not() -> None:
    recent = Recent(clock=Clock())
    recent.record(exchange(status=503))
    recent.record(exchange(status=200, outcome="upstream_error"))  # a stream that broke off
    recent.record(exchange(status=429))
    recent.record(exchange(status=0, outcome="client_disconnected"))
    assert [s.ok for s in recent.samples] == [False, False, True, True]


def test_each_warning_a_request_carried_is_listed_with_the_wall_clock_time() -> None:
    recent = Recent(clock=Clock(), wall=lambda: 1_700_000_000.0)
    ex = exchange()
    ex.warnings = [("thinking_trap", "budget spent on reasoning"), ("prefix", "volatile date")]
    recent.record(ex)
    assert [(w.at, w.kind, w.preset, w.replica, w.message) for w in recent.warnings] == [
        (1_700_000_000.0, "thinking_trap", "dense", "d0", "budget spent on reasoning"),
        (1_700_000_000.0, "prefix", "dense", "d0", "volatile date"),
    ]


def test_an_upstream_error_is_a_warning_naming_its_code_and_request() -> None:
    recent = Recent(clock=Clock())
    ex = exchange(outcome="upstream_error", request_id="abc123")
    ex.error_code = "upstream_disconnected"
    recent.record(ex)
    recent.record(exchange(outcome="upstream_error", request_id="def456"))  # no code recorded
    assert [(w.kind, w.message) for w in recent.warnings] == [
        ("upstream_error", "upstream_disconnected (request abc123)"),
        ("upstream_error", "error (request def456)"),
    ]


# --- bounded memory -------------------------------------------------------------------------------


def test_the_samples_are_bounded_and_the_oldest_go_first() -> None:
    clock = Clock(now=0.0)
    recent = Recent(clock=clock)
    for index in range(MAX_SAMPLES + 10):
        clock.now = float(index)
        recent.record(exchange())
    assert len(recent.samples) == MAX_SAMPLES
    assert recent.samples[0].at == 10.0 and recent.samples[-1].at == float(MAX_SAMPLES + 9)
    assert recent.total == MAX_SAMPLES + 10  # the count since start is not bounded by the ring


def test_the_warnings_are_bounded_and_the_latest_are_kept() -> None:
    recent = Recent(clock=Clock())
    for index in range(MAX_WARNINGS + 5):
        ex = exchange()
        ex.warnings = [("note", f"warning {index}")]
        recent.record(ex)
    assert len(recent.warnings) == MAX_WARNINGS
    assert recent.warnings[0].message == "warning 5"
    assert recent.warnings[-1].message == f"warning {MAX_WARNINGS + 4}"


# --- the window and the figures -------------------------------------------------------------------


def test_the_window_holds_only_the_samples_of_the_last_window_seconds() -> None:
    clock = Clock(now=0.0)
    recent = Recent(clock=clock)
    for at in (0.0, 50.0, 100.0):
        clock.now = at
        recent.record(exchange())
    clock.now = 100.0 + WINDOW - 50.0
    assert [s.at for s in recent.window()] == [50.0, 100.0]  # 50.0 is exactly at the horizon
    clock.now = 100.0 + WINDOW + 1.0
    assert recent.window() == []
    assert len(recent.samples) == 3  # the ring keeps them; only the window reads past them


def test_decode_speeds_are_the_mean_per_preset_over_the_window() -> None:
    clock = Clock(now=0.0)
    recent = Recent(clock=clock)
    recent.record(
        exchange("dense", completion=101, first_token=0.0, finished=1.0)
    )  # 100/s, leaves the window
    clock.now = WINDOW
    recent.record(exchange("dense", completion=21, first_token=0.0, finished=1.0))  # 20/s
    recent.record(exchange("dense", completion=31, first_token=0.0, finished=3.0))  # 10/s
    recent.record(exchange("moe", completion=8, first_token=0.0, finished=3.0))  # 7/3 = 2.333/s
    recent.record(exchange("small", completion=1))  # no speed: absent
    clock.now = WINDOW + 1.0
    assert recent.decode_speeds() == {"dense": 15.0, "moe": 2.3}


def test_the_summary_of_no_samples_has_no_figures() -> None:
    assert summarise([]) == {
        "requests": 0,
        "rate_per_s": 0.0,
        "error_ratio": None,
        "ttft_p50_ms": None,
        "ttft_p95_ms": None,
        "decode_tps": None,
        "cache_hit_ratio": None,
    }


def test_the_rate_counts_only_the_last_seconds_and_the_rest_counts_every_sample() -> None:
    samples = [sample(at=at) for at in (0.0, 30.0, 70.0, 90.0, 100.0)]
    figures = summarise(samples, seconds=60.0, now=100.0)
    assert figures["requests"] == 5
    assert figures["rate_per_s"] == round(3 / 60, 3)  # 70, 90 and 100 are within 60 s of now


def test_without_now_the_rate_is_counted_back_from_the_latest_sample() -> None:
    samples = [sample(at=at) for at in (0.0, 5.0, 10.0)]
    assert summarise(samples, seconds=5.0)["rate_per_s"] == round(2 / 5, 3)


def test_ttft_percentiles_are_read_from_the_sorted_times_in_milliseconds() -> None:
    ttfts = [0.01 * n for n in range(20, 0, -1)]  # 0.20 down to 0.01 s, unsorted on purpose
    figures = summarise([sample(ttft=t) for t in ttfts] + [sample(ttft=None)])
    assert figures["ttft_p50_ms"] == 110.0
    assert figures["ttft_p95_ms"] == 200.0


def test_error_ratio_decode_speed_and_cache_hits_over_the_samples() -> None:
    samples = [
        sample(ok=True, decode_tps=30.0, prompt_tokens=100, cached_tokens=80),
        sample(ok=False, prompt_tokens=300, cached_tokens=0),
        sample(ok=True, decode_tps=10.0, prompt_tokens=0, cached_tokens=0),
        sample(ok=True),
    ]
    figures = summarise(samples)
    assert figures["error_ratio"] == 0.25
    assert figures["decode_tps"] == 20.0
    assert figures["cache_hit_ratio"] == 0.2


def test_no_cache_hit_ratio_without_prompt_tokens() -> None:
    assert summarise([sample(cached_tokens=0)])["cache_hit_ratio"] is None
