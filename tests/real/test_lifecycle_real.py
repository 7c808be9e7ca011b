"""Launched replicas against real llama-server processes that the gateway itself launches.

The tiny GGUF loads in well under a second, so each start is real but short: a cold start on the
first request, two presets sharing one device swapped on demand, idle unload, a SIGKILLed replica
restarted, a crash loop (a model file that does not exist) ending `failed` with llama-server's own
words, and no llama-server left behind when the gateway stops.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from tests.support.gateway_process import GatewayProcess, pids_serving, wait_until
from tests.support.harness import Running, eventually, run_gateway
from tests.support.rawhttp import free_port

from .backends import VllmServer, llama_server_binary


def launch(name: str, port: int, model: Path, extra: str = "") -> str:
    binary = llama_server_binary()
    argv = [
        str(binary),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-c",
        "4096",
        "-np",
        "1",
    ]
    cmd = ", ".join(f'"{a}"' for a in argv)
    env = f'{{LD_LIBRARY_PATH: "{binary.parent}"}}'
    return (
        f'{{name: {name}, url: "http://127.0.0.1:{port}", engine: llamacpp, '
        f"launch: {{cmd: [{cmd}], env: {env}, grace: 5, load_timeout: 60}}{extra}}}"
    )


def table(presets: dict[str, str]) -> str:
    body = "\n".join(f"  {n}: {{served_model: tiny, replicas: [{spec}]}}" for n, spec in presets.items())
    return f"""
devices: {{gpu0: 48}}
restarts: {{first_delay: 0.2, max_failures: 3, window: 60}}
defaults: {{min_max_tokens: 0, timeouts: {{load: 60}}}}
health: {{interval: 0.5, timeout: 1}}
presets:
{body}
routing: {{default: {next(iter(presets))}}}
"""


def chat(gw: Running, model: str) -> httpx2.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return httpx2.post(gw.url + "/v1/chat/completions", json=body, timeout=120)


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "\nState:\tZ" not in status.read_text()


@pytest.fixture
def swap(tiny_gguf: Path, tmp_path: Path) -> Iterator[Running]:
    pa, pb = free_port(), free_port()
    routes = table(
        {
            "dense": launch("dense0", pa, tiny_gguf, ", uses: {gpu0: 30}"),
            "moe": launch("moe0", pb, tiny_gguf, ", uses: {gpu0: 30}, idle_unload: 2"),
        }
    )
    with run_gateway(routes, state_dir=tmp_path) as gw:
        yield gw
        pids = [u.process.pid for u in gw.gateway.supervisor.units.values() if u.process is not None]
    assert not [pid for pid in pids if alive(pid)], "a llama-server outlived the gateway"


def test_cold_start_swap_and_idle_unload_with_real_llama_server(swap: Running) -> None:
    gw = swap
    units = gw.gateway.supervisor.units
    answer = chat(gw, "dense")
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"] is not None
    cold = units["dense0"].last_load
    assert cold is not None and units["dense0"].state == "ready"
    assert chat(gw, "moe").status_code == 200  # dense is idle: evicted for moe
    assert units["dense0"].state == "stopped" and units["moe0"].state == "ready"
    assert eventually(lambda: units["moe0"].state == "stopped", timeout=15)  # idle_unload: 2
    assert chat(gw, "dense").status_code == 200
    print(f"lifecycle (real): llama-server cold start {cold:.2f} s through the gateway")


def test_a_sigkilled_llama_server_is_restarted(tiny_gguf: Path, tmp_path: Path) -> None:
    port = free_port()
    with run_gateway(table({"m": launch("m0", port, tiny_gguf)}), state_dir=tmp_path) as gw:
        unit = gw.gateway.supervisor.units["m0"]
        assert chat(gw, "m").status_code == 200
        first = unit.process
        assert first is not None and first.pid is not None
        os.killpg(first.pid, signal.SIGKILL)
        assert eventually(lambda: unit.failures and unit.state == "ready", timeout=30)
        assert unit.process is not first
        assert chat(gw, "m").status_code == 200


def test_a_llama_server_that_cannot_load_ends_failed_with_its_log(tmp_path: Path) -> None:
    port = free_port()
    missing = tmp_path / "no-such-model.gguf"
    with run_gateway(table({"m": launch("m0", port, missing)}), state_dir=tmp_path) as gw:
        answer = chat(gw, "m")
        assert answer.status_code == 503
        error = answer.json()["error"]
        assert error["code"] == "replica_failed"
        assert "exited with status" in error["message"] and "Last log lines" in error["message"], error
        assert gw.gateway.supervisor.units["m0"].state == "failed"


def test_a_stream_that_arrives_while_a_launched_vllm_loads_hears_loading_then_its_answer(
    tiny_hf: Path, tmp_path: Path
) -> None:
    """vLLM refuses connections while it builds its engine (20-30 s on CPU): the streaming client
    gets `: loading` comments on an open stream, then the answer, from a vLLM the gateway started."""
    port = free_port()
    spec = VllmServer(tiny_hf, "tiny", port=port, cpu=1)  # only for its command line and environment
    env = {k: v for k, v in spec.environment().items() if k.startswith(("VLLM_", "HF_", "TRANSFORMERS_"))}
    cmd = ", ".join(json.dumps(a) for a in spec.command())
    replica = (
        f'{{name: v0, url: "http://127.0.0.1:{port}", engine: vllm, '
        f"launch: {{cmd: [{cmd}], env: {json.dumps(env)}, grace: 10, load_timeout: 300}}}}"
    )
    routes = table({"v": replica}).replace("timeouts: {load: 60}", "timeouts: {load: 300}")
    with run_gateway(routes, state_dir=tmp_path) as gw:
        body = {
            "model": "v",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
        }
        with httpx2.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=300) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line]
        unit = gw.gateway.supervisor.units["v0"]
        pid = unit.process.pid if unit.process is not None else None
        cold = unit.last_load
    loading = [line for line in lines if line.startswith(": loading v, ")]
    assert loading, lines[:5]
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert lines.index(loading[0]) < first_data
    assert lines[-1] == "data: [DONE]"
    assert not alive(pid), "the launched vLLM outlived the gateway"
    print(f"lifecycle (real): launched vLLM cold start {cold:.1f} s, {len(loading)} loading comments")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_no_llama_server_outlives_the_gateway(tiny_gguf: Path, tmp_path: Path, sig: int) -> None:
    port = free_port()
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        table({"m": launch("m0", port, tiny_gguf)}).replace("restarts:", "preload: [m]\nrestarts:")
    )
    gateway = GatewayProcess(routes, free_port(), GATEWAY_STATE_DIR=str(tmp_path)).start()
    try:
        assert wait_until(lambda: pids_serving(port, b"llama-server"), 30), gateway.output()
        pids = pids_serving(port, b"llama-server")
        gateway.signal(sig)
        assert gateway.wait(30) is not None
        assert wait_until(lambda: not [p for p in pids if alive(p)], 15), (sig, pids)
    finally:
        gateway.stop()
        for pid in pids_serving(port, b"llama-server"):
            os.kill(pid, signal.SIGKILL)
