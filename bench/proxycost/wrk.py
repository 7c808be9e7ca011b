"""wrk: its Lua scripts, a run, and the figures parsed from its output."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from bench.proxycost.host import BenchError, pin

_WRK_UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


@dataclass
class WrkResult:
    requests: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    non_2xx: int
    socket_errors: int
    cpu_s: float | None = None  # the proxy's CPU time during the run (utime + stime)
    others: float | None = None  # cores' worth of CPU that other processes took on the proxy's core

    @property
    def errors(self) -> int:
        return self.non_2xx + self.socket_errors

    @property
    def cpu_ms_per_request(self) -> float | None:
        return None if self.cpu_s is None else self.cpu_s * 1000 / max(1, self.requests)

    @property
    def core(self) -> float | None:
        """The share of its core the proxy got: about 1.0 when it was the bottleneck and alone."""
        return None if self.cpu_s is None else self.cpu_s / self.seconds


def wrk_script(tmp: Path, name: str, body: bytes, headers: dict[str, str] | None = None) -> Path:
    """A POST of `body` with its content type and `headers` (the team's key), on every request."""
    text = body.decode()
    assert "]==]" not in text
    lines = ['wrk.method = "POST"', 'wrk.headers["Content-Type"] = "application/json"']
    for header, value in (headers or {}).items():
        assert not {'"', "\\", "\n"} & set(header + value)  # a plain Lua string literal
        lines.append(f'wrk.headers["{header}"] = "{value}"')
    path = tmp / f"{name}.lua"
    path.write_text("\n".join([*lines, f"wrk.body = [==[{text}]==]", ""]))
    return path


def run_wrk(url: str, script: Path, connections: int, seconds: int) -> WrkResult:
    argv = [*pin(1), "wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--timeout", "5s", "--latency"]
    out = subprocess.run(
        [*argv, "-s", str(script), url], capture_output=True, text=True, timeout=seconds + 30, check=False
    )
    if out.returncode != 0:
        raise BenchError(f"wrk failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    return parse_wrk(out.stdout)


def parse_wrk(text: str) -> WrkResult:
    def latency(percent: str) -> float:
        found = re.search(rf"^\s+{percent}%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
        if not found:
            raise BenchError(f"no {percent}% line in wrk's output:\n{text}")
        return float(found.group(1)) * _WRK_UNITS[found.group(2)]

    done = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m)", text)
    rate = re.search(r"Requests/sec:\s+([\d.]+)", text)
    if not done or not rate:
        raise BenchError(f"unexpected wrk output:\n{text}")
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}[done.group(3)]
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    sockets = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    return WrkResult(
        requests=int(done.group(1)),
        seconds=float(done.group(2)) * scale,
        rps=float(rate.group(1)),
        p50_ms=latency("50"),
        p99_ms=latency("99"),
        non_2xx=int(non_2xx.group(1)) if non_2xx else 0,
        socket_errors=sum(int(n) for n in sockets.groups()) if sockets else 0,
    )
