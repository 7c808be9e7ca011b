"""Replicas the gateway launches, with the simulator as the launched engine process.

Real processes (each `python -m gateway.simulator` in its own process group) on 127.0.0.1 ports,
the gateway in front of them over real sockets; every test ends with none of them left running.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from gateway.fleet.capacity import Occupant, plan_start
from gateway.fleet.supervisor import IDLE_AFTER, Supervisor, Unit
from tests.support.gateway_answers import data_events, metric
from tests.support.gateway_process import GatewayProcess, pids_serving, wait_until
from tests.support.harness import Running, eventually, run_gateway
from tests.support.rawhttp import free_port
from tests.support.servers import sim_replica

pytestmark = pytest.mark.slow


def sim(port: int, model: str, **flags: Any) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "gateway.simulator",
        "--engine",
        "llamacpp",
        "--port",
        str(port),
        "--model",
        model,
    ]
    for key, value in {"time-scale": 0, **flags}.items():
        argv += [f"--{key}", str(value)]
    return argv


def replica(name: str, port: int, cmd: list[str], extra: str = "") -> str:
    argv = ", ".join(f'"{arg}"' for arg in cmd)
    return (
        f'{{name: {name}, url: "http://127.0.0.1:{port}", engine: llamacpp, '
        f"launch: {{cmd: [{argv}], grace: 5, load_timeout: 20}}{extra}}}"
    )


def table(presets: dict[str, str], top: str = "devices: {gpu0: 48}", load: float = 20) -> str:
    body = "\n".join(
        f"  {name}: {{served_model: {name}, replicas: [{spec}]}}" for name, spec in presets.items()
    )
    first = next(iter(presets))
    return f"""
{top}
restarts: {{first_delay: 0.2, max_failures: 3, window: 60}}
defaults: {{timeouts: {{load: {load}}}}}
health: {{interval: 0.5, timeout: 1}}
presets:
{body}
routing: {{default: {first}}}
"""


def chat(
    gw: Running, model: str, stream: bool = False, timeout: float = 30, max_wait: float | None = None
) -> httpx2.Response:
    """`max_wait`: the client's own patience for a load (x-gateway-max-wait), over the preset's."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "stream": stream,
    }
    headers = {} if max_wait is None else {"x-gateway-max-wait": str(max_wait)}
    return httpx2.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=timeout)


def unit(gw: Running, name: str) -> Unit:
    return gw.gateway.supervisor.units[name]


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes (its parent has not reaped it yet).
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "\nState:\tZ" not in status.read_text()


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[Running, int, int]]:
    """Two presets, each needing 30 of the device's 48 GiB: only one fits at a time."""
    pa, pb = free_port(), free_port()
    routes = table(
        {
            "a": replica("a0", pa, sim(pa, "a"), ", uses: {gpu0: 30}"),
            "b": replica("b0", pb, sim(pb, "b"), ", uses: {gpu0: 30}"),
        }
    )
    with run_gateway(routes, state_dir=tmp_path) as gw:
        yield gw, pa, pb
        pids = [u.process.pid for u in gw.gateway.supervisor.units.values() if u.process]
    assert not [pid for pid in pids if alive(pid)], "a launched replica outlived the gateway"


def test_plan_evicts_idle_least_recently_used_first_and_never_a_serving_or_kept_one() -> None:
    devices = {"gpu0": 48.0}
    old = Occupant("old", {"gpu0": 20}, evictable=True, last_used=1)
    new = Occupant("new", {"gpu0": 20}, evictable=True, last_used=2)
    assert plan_start(devices, [old, new], {"gpu0": 10}).fits
    assert plan_start(devices, [old, new], {"gpu0": 20}).evict == ("old",)
    assert plan_start(devices, [old, new], {"gpu0": 40}).evict == ("old", "new")
    serving = Occupant("busy", {"gpu0": 40}, evictable=False, last_used=0)
    plan = plan_start(devices, [serving], {"gpu0": 30})
    assert not plan.fits and plan.holders == ("busy",)
    elsewhere = Occupant("other", {"gpu1": 24}, evictable=True, last_used=0)
    assert plan_start({**devices, "gpu1": 24}, [serving, elsewhere], {"gpu0": 30}).holders == ("busy",)


def test_the_first_request_starts_its_replica_and_waits_for_it(two: tuple[Running, int, int]) -> None:
    gw, _, _ = two
    assert unit(gw, "a0").state == "stopped"
    answer = chat(gw, "a")
    assert answer.status_code == 200, answer.text
    assert unit(gw, "a0").state == "ready" and alive(unit(gw, "a0").process.pid)  # type: ignore[union-attr]
    entry = eventually(lambda: [e for e in gw.log_entries() if e.get("load_wait_ms")])
    assert entry and entry[0]["status"] == 200
    assert metric(gw.metrics(), "gateway_replica_loads_total", replica="a0", outcome="ok") == 1
    assert metric(gw.metrics(), "gateway_replica_state", replica="a0", state="ready") == 1
    again = chat(gw, "a")
    assert again.status_code == 200
    assert unit(gw, "a0").loads == 1  # the second request found it ready


def test_two_presets_on_one_device_are_swapped_on_demand(two: tuple[Running, int, int]) -> None:
    gw, _, _ = two
    assert chat(gw, "a").status_code == 200
    first = unit(gw, "a0").process
    assert chat(gw, "b").status_code == 200  # a is idle: evicted to make room
    assert unit(gw, "a0").state == "stopped" and unit(gw, "b0").state == "ready"
    assert first is not None and not alive(first.pid)
    assert chat(gw, "a").status_code == 200  # and back
    assert unit(gw, "b0").state == "stopped"
    assert metric(gw.metrics(), "gateway_replica_evictions_total", replica="a0") == 1
    assert metric(gw.metrics(), "gateway_replica_evictions_total", replica="b0") == 1


def test_a_serving_replica_is_not_evicted_and_the_other_request_gets_a_503_naming_it(tmp_path: Path) -> None:
    pa, pb = free_port(), free_port()
    slow = sim(pa, "a", **{"time-scale": 1, "decode-tps": 2})  # 8 tokens: a 4 s stream
    routes = table(
        {
            "a": replica("a0", pa, slow, ", uses: {gpu0: 30}"),
            "b": replica("b0", pb, sim(pb, "b"), ", uses: {gpu0: 30}"),
        },
        load=1,
    )
    with run_gateway(routes, state_dir=tmp_path) as gw, concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert chat(gw, "a", max_wait=30).status_code == 200  # started (its load is not timed here)
        streaming = pool.submit(chat, gw, "a", True)
        assert eventually(lambda: gw.gateway.fleet.pools["a"].replicas[0].in_flight == 1)
        refused = chat(gw, "b")
        assert refused.status_code == 503
        message = refused.json()["error"]["message"]
        assert "a0 (serving 1)" in message, message
        assert data_events(streaming.result(timeout=30).content)[-1] == "[DONE]"  # never cut
        assert unit(gw, "a0").state == "ready"
        time.sleep(IDLE_AFTER + 0.2)  # until a0 counts as idle (its last request just ended)
        # Idle now: a is evicted. The load itself is given time (a busy host starts it slowly).
        assert chat(gw, "b", timeout=30, max_wait=30).status_code == 200


def test_an_idle_replica_is_stopped_after_idle_unload(tmp_path: Path) -> None:
    port = free_port()
    routes = table({"a": replica("a0", port, sim(port, "a"), ", idle_unload: 1")})
    with run_gateway(routes, state_dir=tmp_path) as gw:
        assert chat(gw, "a").status_code == 200
        process = unit(gw, "a0").process
        assert wait_until(lambda: unit(gw, "a0").state == "stopped", 10)
        assert process is not None and not alive(process.pid)
        assert chat(gw, "a").status_code == 200  # and the next request starts it again
        assert unit(gw, "a0").loads == 2


def test_a_crashed_replica_is_restarted_and_serves_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    with run_gateway(table({"a": replica("a0", port, sim(port, "a"))}), state_dir=tmp_path) as gw:
        assert chat(gw, "a").status_code == 200
        first = unit(gw, "a0").process
        assert first is not None and first.pid is not None
        os.killpg(first.pid, signal.SIGKILL)
        assert wait_until(lambda: unit(gw, "a0").failures and unit(gw, "a0").state == "ready", 15)
        second = unit(gw, "a0").process
        assert second is not first and second is not None and alive(second.pid)
        assert "replica a0: exited with status -9" in caplog.text  # reported, never silent
        assert chat(gw, "a").status_code == 200


def test_a_crash_loop_ends_failed_with_its_reason_and_log_lines(tmp_path: Path) -> None:
    port = free_port()
    crash = [
        sys.executable,
        "-c",
        "import sys; print('engine boom: no CUDA device', flush=True); sys.exit(3)",
    ]
    with run_gateway(table({"a": replica("a0", port, crash)}), state_dir=tmp_path) as gw:
        answer = chat(gw, "a")
        assert answer.status_code == 503, answer.text
        message = answer.json()["error"]["message"]
        assert "failed" in message and "exited with status 3" in message and "engine boom" in message, message
        assert answer.json()["error"]["code"] == "replica_failed"
        assert unit(gw, "a0").state == "failed" and len(unit(gw, "a0").failures) == 3
        ready = httpx2.get(gw.url + "/ready", timeout=5)
        assert ready.status_code == 503 and ready.json()["not_ready"] == ["a"]
        view = httpx2.get(gw.url + "/admin/replicas", timeout=5).json()["replicas"]
        assert view[0]["state"] == "failed" and "engine boom" in view[0]["log_tail"]
        page = httpx2.get(gw.url + "/ui/state", timeout=5).json()
        life = page["presets"][0]["replicas"][0]["lifecycle"]
        assert life["state"] == "failed" and "engine boom" in life["log_tail"]  # the status page's data


def test_a_port_held_by_another_process_is_an_error_not_an_adoption(tmp_path: Path) -> None:
    squatter = sim_replica("llamacpp", "a")
    try:
        routes = table({"a": replica("a0", squatter.port, sim(squatter.port, "a"))})
        with run_gateway(routes, state_dir=tmp_path) as gw:
            assert unit(gw, "a0").state == "failed"
            answer = chat(gw, "a")
            assert answer.status_code == 503
            assert "port is in use" in answer.json()["error"]["message"]
            assert httpx2.get(squatter.url + "/sim/stats", timeout=5).json()["requests"] == 0
    finally:
        squatter.stop()


def test_preload_starts_with_the_gateway_and_ready_stays_200_for_on_demand_presets(tmp_path: Path) -> None:
    pa, pb = free_port(), free_port()
    routes = table({"a": replica("a0", pa, sim(pa, "a")), "b": replica("b0", pb, sim(pb, "b"))}).replace(
        "restarts:", "preload: [a]\nrestarts:"
    )
    with run_gateway(routes, state_dir=tmp_path) as gw:
        assert wait_until(lambda: unit(gw, "a0").state == "ready", 15)
        assert unit(gw, "b0").state == "stopped"
        assert httpx2.get(gw.url + "/ready", timeout=5).status_code == 200  # b loads on demand


def test_admin_start_and_stop_and_ps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.tools.ps import ps_command

    port = free_port()
    with run_gateway(
        table({"a": replica("a0", port, sim(port, "a"), ", uses: {gpu0: 30}")}), state_dir=tmp_path
    ) as gw:
        started = httpx2.post(gw.url + "/admin/replicas/a0/start", timeout=30)
        assert started.status_code == 200 and started.json()["state"] == "ready"
        assert ps_command(gw.url, None) == 0
        out = capsys.readouterr().out
        assert "a0" in out and "ready" in out and "gpu0:30" in out
        stopped = httpx2.post(gw.url + "/admin/replicas/a0/stop", timeout=30)
        assert stopped.status_code == 200 and stopped.json()["state"] == "stopped"
        assert httpx2.post(gw.url + "/admin/replicas/nope/start", timeout=5).status_code == 404


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_no_engine_outlives_the_gateway_after_sigterm_or_sigkill(tmp_path: Path, sig: int) -> None:
    port = free_port()
    routes_file = tmp_path / "routes.yaml"
    routes_file.write_text(
        table({"a": replica("a0", port, sim(port, "a"))}).replace("restarts:", "preload: [a]\nrestarts:")
    )
    gateway = GatewayProcess(routes_file, free_port(), GATEWAY_STATE_DIR=str(tmp_path)).start()
    try:
        assert wait_until(lambda: pids_serving(port, b"gateway.simulator"), 15), gateway.output()
        pids = pids_serving(port, b"gateway.simulator")
        gateway.signal(sig)
        assert gateway.wait(20) is not None
        # SIGTERM: the gateway stops what it started; SIGKILL: the kernel's parent-death signal does.
        assert wait_until(lambda: not [p for p in pids if alive(p)], 10), (sig, pids)
    finally:
        gateway.stop()
        for pid in pids_serving(port, b"gateway.simulator"):
            os.kill(pid, signal.SIGKILL)


def test_the_supervisor_leaves_replicas_without_launch_alone() -> None:
    replica_server = sim_replica("vllm", "m")
    try:
        routes = f"""
presets:
  m: {{served_model: m, replicas: [{{name: r0, url: "{replica_server.url}", engine: vllm}}]}}
routing: {{default: m}}
"""
        with run_gateway(routes) as gw:
            supervisor: Supervisor = gw.gateway.supervisor
            assert supervisor.units == {}
            assert chat(gw, "m").status_code == 200
    finally:
        replica_server.stop()


def test_a_streaming_client_hears_loading_comments_then_its_answer(tmp_path: Path) -> None:
    port = free_port()
    loading = sim(port, "a", **{"load-seconds": 3})  # llama-server answers 503 'Loading model' meanwhile
    with run_gateway(table({"a": replica("a0", port, loading)}), state_dir=tmp_path) as gw:
        response = chat(gw, "a", stream=True)
        assert response.status_code == 200
        text = response.text
        comments = [line for line in text.splitlines() if line.startswith(": loading a, ")]
        assert comments, text[:500]  # the first after 1 s, then every 5 s
        assert text.index(comments[0]) < text.index("data: ")  # before the replica's first byte
        assert data_events(response.content)[-1] == "[DONE]"
        entry = eventually(lambda: [e for e in gw.log_entries() if e.get("load_wait_ms")])
        assert entry and entry[0]["load_wait_ms"] >= 1000


def test_a_stream_whose_replica_fails_to_load_ends_with_one_error_event(tmp_path: Path) -> None:
    port = free_port()
    crash = [sys.executable, "-c", "import sys, time; time.sleep(0.6); print('no CUDA device'); sys.exit(3)"]
    with run_gateway(table({"a": replica("a0", port, crash)}), state_dir=tmp_path) as gw:
        response = chat(gw, "a", stream=True)
        assert response.status_code == 200  # opened by the loading comments
        assert ": loading a, " in response.text
        errors = [e for e in data_events(response.content) if e.startswith("{")]
        assert len(errors) == 1 and "replica_failed" in errors[0] and "no CUDA device" in errors[0], errors
        assert "[DONE]" not in response.text


def test_a_non_streaming_client_waits_silently(tmp_path: Path) -> None:
    port = free_port()
    loading = sim(port, "a", **{"load-seconds": 2})
    with run_gateway(table({"a": replica("a0", port, loading)}), state_dir=tmp_path) as gw:
        response = chat(gw, "a")
        assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"]
        assert not response.text.startswith(":")


def test_requests_that_keep_coming_for_the_resident_preset_are_served_before_a_swap(tmp_path: Path) -> None:
    """The swap scheduler: b's request waits while a keeps being asked for (a0 is neither idle nor
    resident for min_resident), up to b's max_wait; then a0 drains and b starts. One swap, not one
    per request."""
    pa, pb = free_port(), free_port()
    slow_a = sim(pa, "a", **{"time-scale": 1, "decode-tps": 40})  # 8 tokens: 0.2 s per answer
    routes = table(
        {
            "a": replica("a0", pa, slow_a, ", uses: {gpu0: 30}"),
            "b": replica("b0", pb, sim(pb, "b"), ", uses: {gpu0: 30}"),
        }
    ).replace("defaults: {timeouts:", "defaults: {min_resident: 30, max_wait: 3, timeouts:")
    with run_gateway(routes, state_dir=tmp_path) as gw:
        assert chat(gw, "a").status_code == 200
        stop = threading.Event()
        served: list[int] = []

        def keep_asking_for_a() -> None:
            while not stop.is_set() and len(served) < 200:
                served.append(chat(gw, "a").status_code)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            pool.submit(keep_asking_for_a)
            time.sleep(0.5)
            before_b = len(served)
            answer = chat(gw, "b", timeout=30)
            during_b = len(served) - before_b
            stop.set()
        assert answer.status_code == 200
        assert during_b >= 2, during_b  # a kept being served while b waited
        assert unit(gw, "a0").evictions == 1  # one swap for b
        wait = [
            e["load_wait_ms"] for e in gw.log_entries() if e.get("preset") == "b" and e.get("load_wait_ms")
        ]
        assert wait and wait[0] >= 3000  # b waited its max_wait before a0 drained
        assert set(served) == {200}  # a's requests after the swap waited for a0's restart, none failed


@pytest.mark.anyio
async def test_a_delegation_over_mcp_reports_the_load_as_progress(tmp_path: Path) -> None:
    from mcp.client.session import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    port = free_port()
    loading = sim(port, "a", **{"load-seconds": 2})
    seen: list[str] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append(message or "")

    with run_gateway(table({"a": replica("a0", port, loading)}), state_dir=tmp_path) as gw:
        async with (
            httpx2.AsyncClient(timeout=60) as http,
            streamable_http_client(gw.url + "/mcp", http_client=http) as (read, write),
            ClientSession(read, write) as client,
        ):
            await client.initialize()
            result = await client.call_tool(
                "delegate",
                {"task": "x", "preset": "a", "prompt": "hi", "max_tokens": 8},
                progress_callback=on_progress,
            )
    assert not result.is_error, result.content
    assert any(m.startswith("loading a, ") for m in seen), seen
    assert result.structured_content is not None and result.structured_content["replica"] == "a0"


def test_a_vllm_with_sleep_sleeps_to_make_room_and_wakes_instead_of_a_cold_start(tmp_path: Path) -> None:
    pa, pb = free_port(), free_port()
    vllm = [sys.executable, "-m", "gateway.simulator", "--engine", "vllm", "--port", str(pa), "--model", "a"]
    vllm += ["--time-scale", "0"]
    sleeper = (
        f'{{name: a0, url: "http://127.0.0.1:{pa}", engine: vllm, '
        f"launch: {{cmd: [{', '.join(repr(x) for x in vllm)}], sleep: true, grace: 5}}, uses: {{gpu0: 30}}}}"
    ).replace("'", '"')
    routes = table({"a": sleeper, "b": replica("b0", pb, sim(pb, "b"), ", uses: {gpu0: 30}")})
    with run_gateway(routes, state_dir=tmp_path) as gw:
        assert chat(gw, "a").status_code == 200
        pid = unit(gw, "a0").process.pid  # type: ignore[union-attr]
        time.sleep(IDLE_AFTER + 0.2)
        assert chat(gw, "b").status_code == 200  # a0 sleeps to make room: alive, its device freed
        assert unit(gw, "a0").state == "sleeping" and alive(pid)
        assert httpx2.get(f"http://127.0.0.1:{pa}/is_sleeping", timeout=5).json() == {"is_sleeping": True}
        time.sleep(IDLE_AFTER + 0.2)
        assert chat(gw, "a").status_code == 200  # woken, not started again
        assert unit(gw, "a0").state == "ready" and unit(gw, "a0").process.pid == pid  # type: ignore[union-attr]
        assert unit(gw, "a0").reason.startswith("woke in")
        assert httpx2.get(f"http://127.0.0.1:{pa}/is_sleeping", timeout=5).json() == {"is_sleeping": False}
        assert metric(gw.metrics(), "gateway_replica_state", replica="b0", state="stopped") == 1


def test_a_replica_refusal_after_loading_comments_is_one_error_event_with_its_message(tmp_path: Path) -> None:
    port = free_port()
    keyed = sim(port, "a", **{"load-seconds": 2, "api-key": "engine-only-key"})  # the gateway sends none
    with run_gateway(table({"a": replica("a0", port, keyed)}), state_dir=tmp_path) as gw:
        response = chat(gw, "a", stream=True)
        assert response.status_code == 200 and ": loading a, " in response.text
        errors = [e for e in data_events(response.content) if e.startswith("{")]
        assert len(errors) == 1 and '"401"' in errors[0], errors
        assert "engine-only-key" not in response.text
