"""The real `fleet-gateway serve` as a child process, with what the tests feed it (a routes.yaml, a
chat body) and what can be watched from outside it (its memory, its sockets, conditions to poll).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tests.support.fault_records import now
from tests.support.rawhttp import LOOPBACK, http_request

REPO = Path(__file__).resolve().parents[2]


def routes_yaml(
    replicas: Sequence[tuple[str, str]],
    *,
    preset: str = "m",
    timeouts: dict[str, float] | None = None,
    retries: dict[str, float] | None = None,
    limits: dict[str, float] | None = None,
    health: dict[str, float] | None = None,
    policy: str = "round_robin",
    params: dict[str, Any] | None = None,
    api_key_env: str | None = None,
    extra_presets: dict[str, Any] | None = None,
) -> str:
    """A routes.yaml (JSON is YAML) with one preset `m` over the given (name, url) replicas.

    Test defaults keep every wait short and every probe quiet: the first probe round runs at start,
    the next only after `health.interval`, so a test controls when health state changes.
    """
    members = []
    for name, url in replicas:
        member: dict[str, Any] = {"name": name, "url": url, "engine": "vllm"}
        if api_key_env:
            member["api_key_env"] = api_key_env
        members.append(member)
    spec: dict[str, Any] = {
        "served_model": "m",
        "aliases": ["alias-m"],
        "policy": policy,
        "min_max_tokens": 0,
        "timeouts": {"connect": 1, "first_byte": 5, "idle": 5, "read": 20, **(timeouts or {})},
        "retries": {"attempts": 2, **(retries or {})},
        "limits": {"max_in_flight": 64, "queue": 32, "queue_timeout": 5, **(limits or {})},
        "replicas": members,
    }
    if params:
        spec["params"] = params
    presets = {preset: spec, **(extra_presets or {})}
    table = {
        "health": {"interval": 60, "timeout": 1, **(health or {})},
        "presets": presets,
        "routing": {"default": preset},
    }
    return json.dumps(table, indent=1)


def chat_body(
    *, stream: bool = False, model: str = "m", content: str = "hello", **extra: Any
) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "stream": stream, **extra}


def established(port_a: int, port_b: int) -> bool:
    """Whether an ESTABLISHED TCP socket joins these two local ports (Linux /proc/net/tcp)."""
    pair = {port_a, port_b}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as lines:
            next(lines, None)
            for line in lines:
                fields = line.split()
                local, remote, state = fields[1], fields[2], fields[3]
                if (
                    state == "01"
                    and {int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)} == pair
                ):
                    return True
    return False


def rss_bytes(pid: int | None = None) -> int:
    with open(f"/proc/{pid or 'self'}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def wait_until(predicate: Callable[[], bool], timeout: float, step: float = 0.02) -> bool:
    """Poll a condition that has no event to wait on, within a bounded time."""
    deadline = now() + timeout
    while not predicate():
        if now() > deadline:
            return False
        time.sleep(step)
    return True


class GatewayProcess:
    """The real `fleet-gateway serve` as a child process: for signals (SIGTERM drain, SIGHUP reload)."""

    def __init__(self, routes: Path, port: int, **env: str) -> None:
        self.routes = routes
        self.port = port
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.output_path = routes.with_suffix(".out")

    @property
    def address(self) -> tuple[str, int]:
        return (LOOPBACK, self.port)

    def start(self, timeout: float = 20.0) -> GatewayProcess:
        binary = Path(sys.executable).parent / "fleet-gateway"
        # Only the settings this test chose: a GATEWAY_* variable of the developer's shell must not leak in.
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        env.update({"GATEWAY_LOG_LEVEL": "info", **self.env})
        with open(self.output_path, "wb") as out:
            self.proc = subprocess.Popen(
                [str(binary), "serve", "--routes", str(self.routes), "--port", str(self.port)],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        ok = wait_until(self._answers, timeout, step=0.05)
        if not ok:
            self.stop()
            raise RuntimeError(f"fleet-gateway did not start:\n{self.output()}")
        return self

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"fleet-gateway exited with {self.proc.returncode}:\n{self.output()}")
        try:
            return http_request(self.address, "GET", "/health", timeout=1).status == 200
        except OSError:
            return False

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def output(self) -> str:
        return self.output_path.read_text(errors="replace") if self.output_path.exists() else ""


def pids_serving(port: int, program: bytes) -> list[int]:
    """Live processes whose command line names `program` and this port (a launched engine)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            status = (entry / "status").read_text()
        except OSError:
            continue
        if any(program in arg for arg in argv) and str(port).encode() in argv and "\nState:\tZ" not in status:
            found.append(int(entry.name))
    return found
