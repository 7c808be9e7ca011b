from gateway.fleet.health import HealthState, Status
from gateway.routing.table import Health

CONFIG = Health(
    interval=5,
    timeout=2,
    healthy_threshold=2,
    unhealthy_threshold=3,
    eject_after=3,
    eject_base=30,
    eject_max=300,
)


def test_first_good_probe_makes_a_new_replica_ready_at_once() -> None:
    state = HealthState(CONFIG)
    assert state.available(0) and not state.ready(0)  # unknown: usable (fail-open), not ready
    state.on_probe("ok", 0)
    assert state.ready(0)


def test_first_failed_probe_marks_a_new_replica_down() -> None:
    state = HealthState(CONFIG)
    state.on_probe("fail", 0)  # vLLM refusing connections, llama-server 503 while loading
    assert state.status is Status.DOWN and not state.available(0)


def test_thresholds_prevent_flapping() -> None:
    state = HealthState(CONFIG)
    state.on_probe("ok", 0)
    flips_before = state.transitions
    for i in range(40):  # alternating 200/503: never three failures or two successes in a row
        state.on_probe("ok" if i % 2 else "fail", i * 5)
    assert state.transitions == flips_before and state.status is Status.UP


def test_down_after_unhealthy_threshold_and_back_after_healthy_threshold() -> None:
    state = HealthState(CONFIG)
    state.on_probe("ok", 0)
    state.on_probe("fail", 5)
    state.on_probe("fail", 10)
    assert state.status is Status.UP
    state.on_probe("fail", 15)
    assert state.status is Status.DOWN
    state.on_probe("ok", 20)
    assert state.status is Status.DOWN
    state.on_probe("ok", 25)
    assert state.status is Status.UP


def test_probe_timeouts_are_ignored_while_live_traffic_succeeds() -> None:
    state = HealthState(CONFIG)
    state.on_probe("ok", 0)
    for t in (5, 10, 15, 20):
        state.on_outcome("success", t - 1)
        state.on_probe("timeout", t)
    assert state.status is Status.UP
    for t in (40, 45, 50):  # no live success lately: timeouts count
        state.on_probe("timeout", t)
    assert state.status is Status.DOWN


def test_client_errors_never_eject() -> None:
    state = HealthState(CONFIG)
    state.on_probe("ok", 0)
    for _ in range(50):
        assert state.on_outcome("client_error", 1) is False
    assert state.available(1)


def test_connect_failures_take_the_replica_down_until_probes_pass() -> None:
    state = HealthState(CONFIG)
    state.on_probe("ok", 0)
    assert not state.on_outcome("connect_error", 1)
    assert not state.on_outcome("connect_error", 1)
    assert state.on_outcome("connect_error", 1)
    assert not state.available(1)
    state.on_probe("ok", 5)
    state.on_probe("ok", 10)
    assert state.ready(10)


def test_server_errors_eject_with_a_backoff_that_doubles_and_is_capped() -> None:
    state = HealthState(CONFIG)
    state.on_probe("ok", 0)
    durations = []
    now = 0.0
    for _ in range(6):
        for _ in range(3):
            state.on_outcome("server_error", now)
        assert state.ejected(now)
        durations.append(state.ejected_until - now)
        now = state.ejected_until
        assert state.available(now)
    assert durations == [30, 60, 120, 240, 300, 300]


def test_probes_do_not_cut_a_5xx_ejection_short() -> None:
    state = HealthState(CONFIG)
    state.on_probe("ok", 0)
    for _ in range(3):
        state.on_outcome("server_error", 1)
    for t in (5, 10, 15):
        state.on_probe("ok", t)
    assert not state.available(15) and state.available(31)


def test_a_success_resets_the_failure_streak() -> None:
    state = HealthState(CONFIG)
    state.on_probe("ok", 0)
    for _ in range(10):
        state.on_outcome("server_error", 1)
        state.on_outcome("server_error", 1)
        state.on_outcome("success", 1)
    assert state.available(1)


def test_a_long_quiet_spell_forgives_earlier_ejections() -> None:
    state = HealthState(CONFIG)
    state.on_probe("ok", 0)
    for _ in range(3):
        state.on_outcome("server_error", 0)
    later = state.ejected_until + 1000
    for _ in range(3):
        state.on_outcome("server_error", later)
    assert state.ejected_until - later == 30
