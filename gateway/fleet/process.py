"""One engine process the gateway launched: started in its own process group, logged to a file,
stopped by its group, and never outliving the gateway.

The child asks the kernel for SIGKILL when its parent dies (Linux `PR_SET_PDEATHSIG`), so a
gateway that is itself SIGKILLed leaves no engine holding a GPU; a `docker run` child's container
still needs its `stop` command, which is why docker launches should use `--rm` and a `--name`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections import deque
from pathlib import Path

from gateway.routing.table import Launch

LOG_BYTES = 16 * 1024 * 1024  # one log file per replica; the previous one is kept as `.1`
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def rotate(path: Path) -> None:
    """Keep one previous log; a log past LOG_BYTES is rotated at the next start."""
    if path.exists() and path.stat().st_size > LOG_BYTES:
        path.replace(path.with_suffix(path.suffix + ".1"))


def tail(path: Path, lines: int = 20, limit: int = 4096) -> str:
    """The last lines of a replica's log, for a failed replica's 503 and the status page."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - limit))
            data = handle.read()
    except OSError:
        return ""
    kept = deque(data.decode("utf-8", "replace").splitlines(), maxlen=lines)
    return "\n".join(kept)


class EngineProcess:
    """One launched engine process: `start` runs its command in a new process group that dies with
    the gateway, appending output to its rotated log; `stop` runs the launch's stop command or
    signals the group, killing it after the grace period. Owned by the supervisor's unit for the
    replica."""

    def __init__(self, name: str, launch: Launch, log_path: Path) -> None:
        self.name = name
        self.launch = launch
        self.log_path = log_path
        self.process: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        rotate(self.log_path)
        env = {**os.environ, **self.launch.env}
        with self.log_path.open("ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                *self.launch.cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: stopped as a whole
                preexec_fn=_die_with_parent,
            )

    async def wait(self) -> int:
        assert self.process is not None
        return await self.process.wait()

    async def stop(self) -> None:
        """The launch's `stop` command, or SIGTERM to the group; SIGKILL to the group after `grace`."""
        process = self.process
        if process is None or process.returncode is not None:
            return
        if self.launch.stop:
            with contextlib.suppress(OSError):
                stopper = await asyncio.create_subprocess_exec(
                    *self.launch.stop,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopper.wait(), self.launch.grace)
        self._signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), self.launch.grace)
        except TimeoutError:
            self._signal(signal.SIGKILL)
            await process.wait()
        self._signal(signal.SIGKILL)  # anything the engine left in its group

    def _signal(self, sig: int) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)
