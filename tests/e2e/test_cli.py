"""The command line: check, check --probe, serve (with --wait), demo, python -m gateway."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import openai
import pytest

from gateway.cli import main
from gateway.simulator import SimConfig, create_app
from tests.support.harness import eventually
from tests.support.servers import ThreadServer, free_port

ROOT = Path(__file__).resolve().parents[2]
FLEET_GATEWAY = [sys.executable, "-m", "gateway"]


def test_check_prints_the_resolved_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(ROOT / "routes.yaml")]) == 0
    out = capsys.readouterr().out
    assert "OK, 5 presets" in out and "dense  ->  Qwen3.6-27B-AWQ" in out and "code -> dense" in out


def test_check_reports_a_broken_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "routes.yaml"
    broken.write_text((ROOT / "routes.yaml").read_text().replace("engine: llamacpp", "engine: llama"))
    assert main(["check", str(broken)]) == 2
    err = capsys.readouterr().err
    assert str(broken) in err and "presets.swift.replicas[0].engine" in err


@pytest.fixture
def replica() -> Iterator[ThreadServer]:
    server = ThreadServer(
        create_app(SimConfig(engine="vllm", model="served", context=2048, time_scale=0))
    ).start()
    yield server
    server.stop()


def write_table(path: Path, url: str, served: str = "served") -> Path:
    path.write_text(
        f"""
presets:
  p:
    served_model: {served}
    replicas: [{{name: r0, url: "{url}", engine: vllm}}]
routing: {{default: p}}
"""
    )
    return path


def test_check_probe_reports_each_replica(
    tmp_path: Path, replica: ThreadServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", "--probe", str(write_table(tmp_path / "ok.yaml", replica.url))]) == 0
    out = capsys.readouterr().out
    assert "r0" in out and "200" in out and "served" in out and "2048" in out and "OK" in out


def test_check_probe_fails_on_a_wrong_model_name(
    tmp_path: Path, replica: ThreadServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["check", "--probe", str(write_table(tmp_path / "bad.yaml", replica.url, served="other"))]) == 1
    )
    assert "not other (vLLM would answer 404)" in capsys.readouterr().out


def test_check_probe_fails_on_an_unreachable_replica(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = write_table(tmp_path / "down.yaml", f"http://127.0.0.1:{free_port()}")
    assert main(["check", "--probe", str(table)]) == 1
    assert "unreachable" in capsys.readouterr().out


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*FLEET_GATEWAY, *args],
        env={**os.environ, "GATEWAY_LOG_LEVEL": "warning", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )


def stop(process: subprocess.Popen[bytes]) -> str:
    process.send_signal(signal.SIGTERM)
    try:
        out, _ = process.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        out, _ = process.communicate()
    return out.decode(errors="replace")


def listening(port: int) -> bool:
    try:
        return httpx2.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx2.HTTPError:
        return False


def test_serve_wait_holds_start_up_until_a_replica_is_ready(tmp_path: Path) -> None:
    replica_port, port = free_port(), free_port()
    table = write_table(tmp_path / "routes.yaml", f"http://127.0.0.1:{replica_port}")
    gateway = start("serve", "--routes", str(table), "--port", str(port), "--wait", "20")
    try:
        time.sleep(1.5)
        assert not listening(port)  # the replica is not there yet: the gateway is still starting
        late = ThreadServer(
            create_app(SimConfig(engine="vllm", model="served", time_scale=0)), port=replica_port
        ).start()
        try:
            assert eventually(lambda: listening(port), timeout=15)
            assert httpx2.get(f"http://127.0.0.1:{port}/ready").status_code == 200  # ready at once
        finally:
            late.stop()
    finally:
        stop(gateway)


def test_serve_without_wait_starts_and_reports_not_ready(tmp_path: Path) -> None:
    port = free_port()
    table = write_table(tmp_path / "routes.yaml", f"http://127.0.0.1:{free_port()}")
    gateway = start("serve", "--routes", str(table), "--port", str(port))
    try:
        assert eventually(lambda: listening(port), timeout=15)
        ready = httpx2.get(f"http://127.0.0.1:{port}/ready")
        assert ready.status_code == 503 and ready.json()["not_ready"] == ["p"]
    finally:
        stop(gateway)


def test_serve_refuses_a_broken_table(tmp_path: Path) -> None:
    broken = tmp_path / "routes.yaml"
    broken.write_text("presets: {}\nrouting: {default: x}\n")
    result = subprocess.run(
        [*FLEET_GATEWAY, "serve", "--routes", str(broken)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2 and "routing.default" in result.stderr


@pytest.mark.slow
def test_the_demo_serves_the_example_fleet() -> None:
    """The README's first command: the demo answers an OpenAI client on every preset."""
    port = free_port()
    demo = start("demo", "--port", str(port))
    try:
        assert eventually(lambda: listening(port), timeout=30)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        for model in ("coder", "bulk", "vl", "extract", "swift"):
            reply = client.chat.completions.with_raw_response.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=64
            )
            assert reply.http_response.status_code == 200
        chunks = list(
            client.chat.completions.create(
                model="coder", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=32
            )
        )
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    finally:
        out = stop(demo)
    assert f"http://127.0.0.1:{port}" in out and "curl" in out


def test_version() -> None:
    result = subprocess.run([*FLEET_GATEWAY, "--version"], capture_output=True, text=True, timeout=30)
    assert result.stdout.startswith("fleet-gateway ")
