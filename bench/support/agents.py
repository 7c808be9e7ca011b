"""Run the real coding-agent CLIs (Claude Code and Codex) headless against a given base URL.

The CLIs live in a project-local npm prefix, ``.agents/`` (made by ``scripts/install-agents``);
this module only runs them as subprocesses, so it needs nothing beyond the standard library.

Each turn runs with a scratch ``HOME`` (:class:`AgentHome`: ``HOME`` plus a ``project/`` working
directory inside it) and an environment built from scratch, so nothing from the caller's
environment (API keys, proxies, ``~/.claude``, ``~/.codex``) leaks into a test. The process runs in
its own process group, which is killed on timeout and swept after a normal exit.

Overrides, for a machine that already has the CLIs elsewhere:

* ``FLEET_CLAUDE_CODE``: path to a ``claude`` binary;
* ``FLEET_CODEX``: path to a ``codex`` binary (the npm launcher needs ``node`` on ``PATH``).

What the agents send and accept, as captured from claude-code 2.1.332 and codex 0.171.0 (request
fixtures in ``tests/fixtures/agents/``):

* Claude Code: ``POST /v1/messages?beta=true`` with ``x-api-key`` (``ANTHROPIC_API_KEY``) or
  ``Authorization: Bearer`` (``ANTHROPIC_AUTH_TOKEN``), ``anthropic-version: 2023-06-01``, an
  ``anthropic-beta`` list and ``X-Claude-Code-Session-Id``; a ``HEAD /api/hello`` first unless
  ``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC`` is set (it is, here). The SSE stream needs ``event:``
  lines, ``message_start``, ``content_block_start`` and ``content_block_stop`` (a missing start makes
  it retry once with ``stream: false``); a ``tool_use`` block's input must come as
  ``input_json_delta`` (input in ``content_block_start`` is ignored).
* Codex: ``POST {base_url}/responses`` with ``Authorization: Bearer $env_key``; the stream needs
  ``response.output_item.done`` (the final text is taken from its item, not from the deltas) and
  ``response.completed`` whose ``response`` has an ``id``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

REPO = Path(__file__).resolve().parents[2]
AGENTS = REPO / ".agents"
BIN = AGENTS / "node_modules" / ".bin"
INSTALL_COMMAND = "scripts/install-agents"
# Written by scripts/install-agents as the last step of a successful install (it holds the
# package specs); a prefix without it is half-built and must not be trusted.
MARKER = AGENTS / ".fleet-installed"

DEFAULT_TIMEOUT = 120.0
DUMMY_KEY = "dummy-key"
CODEX_PROVIDER = "fleet"
CODEX_KEY_ENV = "FLEET_KEY"

# What Claude Code 2.1.332 sends when no model is configured, and for --model sonnet / haiku; the
# small/background model is the haiku one unless ANTHROPIC_SMALL_FAST_MODEL or
# ANTHROPIC_DEFAULT_HAIKU_MODEL is set.
CLAUDE_DEFAULT_MODEL = "claude-opus-5-5"
CLAUDE_MODEL_ALIASES = {"opus": "claude-opus-5-5", "sonnet": "claude-sonnet-5-5", "haiku": "claude-haiku-5-5"}
# What Codex 0.171.0 sends when config.toml names no model; that model gets the "lite" request
# form (header x-openai-internal-codex-responses-lite, tools in an input item of type
# additional_tools, shell reached through the freeform `exec` JavaScript tool).
CODEX_DEFAULT_MODEL = "gpt-6.2-sol"


class AgentsMissing(RuntimeError):
    """A CLI is not installed; the message says how to install it."""


def _missing(what: str, override: str) -> AgentsMissing:
    return AgentsMissing(
        f"{what} is not installed. Run `{INSTALL_COMMAND}` from the repository root (or set {override})."
    )


def _binary(name: str, override: str) -> Path:
    if value := os.environ.get(override):
        path = Path(value)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise AgentsMissing(f"{override}={value} is not an executable file")
        return path
    path = BIN / name
    if not MARKER.is_file() or not (path.exists() and os.access(path, os.X_OK)):
        raise _missing(f"{name} (.agents/node_modules/.bin/{name})", override)
    return path


def claude_binary() -> Path:
    return _binary("claude", "FLEET_CLAUDE_CODE")


def codex_binary() -> Path:
    return _binary("codex", "FLEET_CODEX")


def require_agents() -> None:
    """Raise :class:`AgentsMissing` unless both CLIs are installed."""
    claude_binary()
    codex_binary()


def versions() -> dict[str, str]:
    """``--version`` of each CLI, e.g. ``{"claude": "2.1.332 (Claude Code)", "codex": "codex-cli
    0.171.0"}``."""
    out = {}
    for name, binary in (("claude", claude_binary()), ("codex", codex_binary())):
        done = subprocess.run(
            [str(binary), "--version"],
            capture_output=True,
            text=True,
            timeout=60,
            env=base_env(Path(tempfile.gettempdir())),
            check=True,
        )
        out[name] = done.stdout.strip()
    return out


class AgentHome:
    """A scratch ``HOME`` with a ``project/`` working directory inside it, removed on exit.

    Reuse one instance for several turns to get several sessions of the same user in the same
    project (Claude Code keeps its device id in ``~/.claude.json``, Codex its installation id in
    ``~/.codex``). Set ``FLEET_KEEP_AGENT_HOME=1`` to keep the directory for inspection.
    """

    def __init__(self, parent: Path | None = None, *, git: bool = False) -> None:
        if parent is not None:
            parent.mkdir(parents=True, exist_ok=True)
        self.home = Path(tempfile.mkdtemp(prefix="agent-home-", dir=parent))
        self.project = self.home / "project"
        self.project.mkdir()
        if git:
            # Claude Code then adds a gitStatus <system-reminder> to the first user message.
            subprocess.run(["git", "init", "-q", str(self.project)], check=True)

    @property
    def codex_home(self) -> Path:
        return self.home / ".codex"

    def close(self) -> None:
        if not os.environ.get("FLEET_KEEP_AGENT_HOME"):
            shutil.rmtree(self.home, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def base_env(home: Path) -> dict[str, str]:
    env = {
        # PATH from the caller: the Codex launcher needs node, the agents' shell tools need bash.
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "HOME": str(home),
        "TERM": "dumb",
        "LANG": "C.UTF-8",
        "NO_COLOR": "1",
    }
    if Path("/bin/bash").is_file():
        env["SHELL"] = "/bin/bash"
    return env


def claude_env(
    base_url: str,
    home: AgentHome,
    *,
    api_key: str = DUMMY_KEY,
    bearer: bool = False,
    model: str | None = None,
    small_model: str | None = None,
    max_retries: int | None = 0,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment for one Claude Code run against ``base_url`` (no trailing ``/v1``).

    ``bearer`` sends the key as ``Authorization: Bearer`` (``ANTHROPIC_AUTH_TOKEN``) instead of
    ``x-api-key`` (``ANTHROPIC_API_KEY``). ``model`` and ``small_model`` set ``ANTHROPIC_MODEL`` and
    ``ANTHROPIC_SMALL_FAST_MODEL``. ``max_retries`` sets ``CLAUDE_CODE_MAX_RETRIES`` (None: the
    CLI's default, which retries errors with backoff for minutes).
    """
    env = base_env(home.home)
    env["ANTHROPIC_BASE_URL"] = base_url.rstrip("/")
    env["ANTHROPIC_AUTH_TOKEN" if bearer else "ANTHROPIC_API_KEY"] = api_key
    # No HEAD /api/hello probe, telemetry, error reporting or update checks: only /v1/messages.
    env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] = "1"
    env["DISABLE_TELEMETRY"] = "1"
    env["DISABLE_AUTOUPDATER"] = "1"
    env["DISABLE_ERROR_REPORTING"] = "1"
    if model is not None:
        env["ANTHROPIC_MODEL"] = model
    if small_model is not None:
        env["ANTHROPIC_SMALL_FAST_MODEL"] = small_model
    if max_retries is not None:
        env["CLAUDE_CODE_MAX_RETRIES"] = str(max_retries)
    env.update(extra or {})
    return env


def _toml_value(value: object) -> str:
    # JSON's string escapes are a subset of TOML basic strings'.
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def write_codex_config(
    home: AgentHome,
    base_url: str,
    *,
    model: str | None = "coder",
    provider: str = CODEX_PROVIDER,
    env_key: str = CODEX_KEY_ENV,
    max_retries: int | None = 0,
    stream_idle_timeout_ms: int | None = None,
    extra: Mapping[str, object] | None = None,
    extra_provider: Mapping[str, object] | None = None,
) -> Path:
    """Write ``$CODEX_HOME/config.toml`` declaring a custom Responses provider at ``base_url``.

    ``base_url`` includes ``/v1`` (Codex posts to ``{base_url}/responses``). ``model=None`` leaves
    the model out, so Codex sends its default (:data:`CODEX_DEFAULT_MODEL`) in the "lite" form.
    ``max_retries`` sets the provider's ``request_max_retries`` and ``stream_max_retries`` (None:
    Codex's defaults, which retry a broken stream 5 times with backoff).
    """
    top: dict[str, object] = {"model_provider": provider}
    if model is not None:
        top["model"] = model
    top.update(extra or {})
    prov: dict[str, object] = {
        "name": provider,
        "base_url": base_url.rstrip("/"),
        "wire_api": "responses",
        "env_key": env_key,
    }
    if max_retries is not None:
        prov["request_max_retries"] = max_retries
        prov["stream_max_retries"] = max_retries
    if stream_idle_timeout_ms is not None:
        prov["stream_idle_timeout_ms"] = stream_idle_timeout_ms
    prov.update(extra_provider or {})
    lines = [f"{key} = {_toml_value(value)}" for key, value in top.items()]
    lines += ["", f"[model_providers.{provider}]"]
    lines += [f"{key} = {_toml_value(value)}" for key, value in prov.items()]
    home.codex_home.mkdir(parents=True, exist_ok=True)
    path = home.codex_home / "config.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def codex_env(
    home: AgentHome,
    *,
    api_key: str = DUMMY_KEY,
    env_key: str = CODEX_KEY_ENV,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    env = base_env(home.home)
    env["CODEX_HOME"] = str(home.codex_home)
    env[env_key] = api_key
    env.update(extra or {})
    return env


@dataclass(frozen=True)
class AgentRun:
    """One finished CLI run. ``returncode`` is negative (killed by that signal) after a timeout."""

    command: list[str]
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False
    duration: float = 0.0
    cwd: str = ""
    env: dict[str, str] = field(default_factory=dict, repr=False)

    def __iter__(self) -> Iterator[int | str]:  # returncode, stdout, stderr = run
        return iter((self.returncode, self.stdout, self.stderr))

    def json(self) -> Any:
        """stdout parsed as JSON (Claude Code's ``--output-format json`` result object)."""
        return json.loads(self.stdout)

    def events(self) -> list[dict[str, Any]]:
        """stdout's JSON lines as objects (Codex's ``--json`` events); other lines are skipped."""
        found = []
        for line in self.stdout.splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict):
                    found.append(event)
        return found

    def describe(self) -> str:
        status = f"timed out, killed ({self.returncode})" if self.timed_out else f"exit {self.returncode}"
        return (
            f"{Path(self.command[0]).name} {status} after {self.duration:.1f}s\n"
            f"--- stdout (tail)\n{self.stdout[-3000:]}\n--- stderr (tail)\n{self.stderr[-3000:]}"
        )


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def run_turn(
    command: Sequence[str],
    env: Mapping[str, str],
    cwd: Path,
    timeout: float = DEFAULT_TIMEOUT,
) -> AgentRun:
    """Run ``command`` in its own process group with stdin closed; kill the group on timeout."""
    started = time.monotonic()
    process = subprocess.Popen(
        list(command),
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    timed_out = False
    try:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(process.pid)
            try:
                out, err = process.communicate(timeout=10)
            except subprocess.TimeoutExpired:  # a grandchild left the group and holds the pipes
                process.kill()
                out, err = b"", b""
    finally:
        # Sweep whatever the CLI left behind in its group (shell tools, helpers), on any exit.
        _kill_group(process.pid)
        if process.poll() is None:
            process.kill()
            process.wait()
    return AgentRun(
        command=list(command),
        returncode=process.returncode,
        stdout=out.decode(errors="replace"),
        stderr=err.decode(errors="replace"),
        timed_out=timed_out,
        duration=time.monotonic() - started,
        cwd=str(cwd),
        env=dict(env),
    )


def run_claude(
    base_url: str,
    prompt: str,
    home: AgentHome,
    *,
    model: str | None = None,
    allowed_tools: Sequence[str] = (),
    args: Sequence[str] = (),
    timeout: float = DEFAULT_TIMEOUT,
    **env_options: Any,
) -> AgentRun:
    """One headless Claude Code turn: ``claude -p PROMPT --output-format json`` in ``home.project``.

    ``model`` is passed as ``--model`` (an alias such as ``sonnet`` or a full name); ``env_options``
    go to :func:`claude_env`. Read-only shell commands (``echo``) run without permission; anything
    else needs ``allowed_tools=("Bash",)`` (``--dangerously-skip-permissions`` is refused as root
    unless ``IS_SANDBOX=1`` is set).
    """
    command = [str(claude_binary()), "-p", prompt, "--output-format", "json"]
    if model is not None:
        command += ["--model", model]
    if allowed_tools:
        command += ["--allowedTools", *allowed_tools]
    command += list(args)
    return run_turn(command, claude_env(base_url, home, **env_options), home.project, timeout)


def run_codex(
    base_url: str,
    prompt: str,
    home: AgentHome,
    *,
    model: str | None = "coder",
    sandbox: str = "workspace-write",
    json_events: bool = False,
    args: Sequence[str] = (),
    timeout: float = DEFAULT_TIMEOUT,
    config: Mapping[str, Any] | None = None,
    api_key: str = DUMMY_KEY,
) -> AgentRun:
    """One headless Codex turn: ``codex exec --skip-git-repo-check --sandbox SANDBOX PROMPT``.

    Writes the config first (:func:`write_codex_config`, with ``config`` as extra keyword
    arguments). ``codex exec`` never asks for approval; ``workspace-write`` lets the shell tool
    write in the project (the bundled bubblewrap works as root in a container), ``read-only`` is
    Codex's default. stdout holds the final message, or JSONL events with ``json_events``.
    """
    write_codex_config(home, base_url, model=model, **dict(config or {}))
    command = [str(codex_binary()), "exec", "--skip-git-repo-check", "--sandbox", sandbox]
    command += ["--color", "never"]
    if json_events:
        command.append("--json")
    command += [*args, prompt]
    return run_turn(command, codex_env(home, api_key=api_key), home.project, timeout)


def main(argv: Sequence[str] | None = None) -> int:
    """Self-check: one turn of each agent against a server that fakes both APIs.

    ``python -m bench.support.agents http://127.0.0.1:PORT`` (Claude Code gets the URL, Codex the URL
    plus ``/v1``). Prints each run and exits non-zero when one failed.
    """
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("base_url")
    parser.add_argument("--prompt", default="say ok")
    parser.add_argument("--codex-model", default="coder")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT)
    ns = parser.parse_args(argv)
    print(versions())
    failed = 0
    with AgentHome() as home:
        runs = [
            run_claude(ns.base_url, ns.prompt, home, timeout=ns.timeout),
            run_codex(ns.base_url + "/v1", ns.prompt, home, model=ns.codex_model, timeout=ns.timeout),
        ]
    for run in runs:
        print(run.describe())
        failed |= run.returncode != 0
    return failed


if __name__ == "__main__":
    sys.exit(main())
