"""The machine the run uses: pinned cores, the processes it starts, their CPU time and memory from
/proc, what else ran meanwhile, and the commit and CPU that the results are recorded with."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import resource
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.proxycost.constants import ROOT

MB = 1_000_000


class BenchError(Exception):
    pass


# The proxies (gateway, nginx) get the first core this process may use; the upstream, wrk and the
# Python clients the second. Without taskset or a second core nothing is pinned.
CORES = sorted(os.sched_getaffinity(0))[:2]
PINNED = len(CORES) == 2 and shutil.which("taskset") is not None


def pin(role: int) -> list[str]:
    """`taskset` for role 0 (the proxy's core) or 1 (everything else's)."""
    return ["taskset", "-c", str(CORES[role])] if PINNED else []


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Processes:
    """Every process the run starts; all of them are stopped in `close`, whatever happened."""

    def __init__(self) -> None:
        self.running: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        kwargs.setdefault("cwd", ROOT)  # where `python -m bench.NAME` and `-m gateway` find their packages
        process = subprocess.Popen(argv, start_new_session=True, **kwargs)
        self.running.append((name, process))
        return process

    def close(self) -> None:
        for _, process in reversed(self.running):
            if process.poll() is None:
                process.terminate()
        for _, process in reversed(self.running):
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        self.running.clear()


def http_get(port: int, path: str, timeout: float = 2.0) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n".encode())
        head = sock.recv(64)
    return int(head[9:12]) if head.startswith(b"HTTP/1.") else 0


def http_post_status(port: int, path: str, body: bytes, timeout: float = 10.0) -> int:
    """The status of one JSON POST with no other header."""
    head = f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    head += f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head.encode() + body)
        answer = sock.recv(64)
    return int(answer[9:12]) if answer.startswith(b"HTTP/1.") else 0


def wait_ready(port: int, path: str, process: subprocess.Popen[bytes], name: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise BenchError(f"{name} exited with status {process.returncode} before it was ready")
        with contextlib.suppress(OSError):
            if http_get(port, path) == 200:
                return
        if time.monotonic() > deadline:
            raise BenchError(f"{name} was not ready on port {port} after {timeout:g} s")
        time.sleep(0.1)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def core_ticks(core: int) -> tuple[int, int]:
    """(busy, total) clock ticks of one core since boot, from /proc/stat."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{core} "):
            user, nice, system, idle, iowait, irq, softirq, steal = (int(n) for n in line.split()[1:9])
            # irq and softirq (loopback traffic, mostly ours) are charged to no process: left out.
            busy = user + nice + system + steal
            return busy, busy + idle + iowait + irq + softirq
    raise BenchError(f"no cpu{core} in /proc/stat")


class CoreWatch:
    """The proxy's CPU time, and the share of its core that other processes took, from now on."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.cpu = cpu_seconds(pid)
        self.busy, self.total = core_ticks(CORES[0])

    def measure(self) -> tuple[float, float | None]:
        """(the proxy's CPU seconds, the others' share of its core; None when nothing is pinned)."""
        cpu = cpu_seconds(self.pid) - self.cpu
        busy, total = core_ticks(CORES[0])
        if not PINNED or total <= self.total:
            return cpu, None
        hz = os.sysconf("SC_CLK_TCK")
        return cpu, max(0.0, ((busy - self.busy) / hz - cpu) / ((total - self.total) / hz))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / MB
    raise BenchError(f"no VmRSS for process {pid}")


def raise_nofile() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@contextlib.contextmanager
def terminate_cleanly() -> Iterator[None]:
    """SIGTERM (a CI timeout) ends the run through `finally`, so no process is left behind."""

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Noise:
    """What else ran on the machine during the run: CPU time of all processes (/proc/stat) minus
    this run's own (itself and every child it waited for), and the VM's steal time."""

    def __init__(self) -> None:
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float, float]:
        fields = [int(n) for n in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        hz = os.sysconf("SC_CLK_TCK")
        user, nice, system, _idle, _iowait, _irq, _softirq, steal = fields[:8]
        times = os.times()
        own = times.user + times.system + times.children_user + times.children_system
        # irq and softirq (loopback traffic, mostly this run's) are charged to no process: left out.
        return (user + nice + system) / hz, steal / hz, own, time.monotonic()

    def report(self) -> dict[str, float]:
        busy, steal, own, now = self._sample()
        wall = now - self.start[3]
        foreign = max(0.0, (busy - self.start[0]) - (own - self.start[2]))
        return {
            "foreign_cpu_s": round(foreign, 1),
            "foreign_cores": round(foreign / wall, 3),
            "steal_s": round(steal - self.start[1], 1),
            "wall_s": round(wall, 1),
        }


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def git_commit() -> tuple[str, bool]:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown", False
    return sha or "unknown", bool(dirty)


def run_fields(bench: str, nproc: int, quick: bool) -> dict[str, object]:
    """What every benchmark's JSON lines start with: which run, when, on what, at which commit."""
    sha, dirty = git_commit()
    now = datetime.datetime.now(datetime.UTC)
    return {
        "bench": bench,
        "date": now.isoformat(timespec="seconds"),
        "run": now.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}",
        "machine": {"arch": platform.machine(), "nproc": nproc, "cpu": cpu_model()},
        "commit": sha,
        "dirty": dirty,
        "mode": "quick" if quick else "full",
    }
