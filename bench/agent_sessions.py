"""Long Claude Code and Codex sessions on a small context, with and without what the gateway and
`fleet-gateway connect` give them: `python -m bench.agent_sessions`.

    python -m bench.agent_sessions [--agents claude,codex] [--turns 10] [--context 65536]
                                   [--prefill-tps 1000] [--lines 3000] [--out FILE]

One session is the real CLI from `.agents/` (`scripts/install-agents`; scratch HOME, dummy key) for
`--turns` turns continued one after the other (`claude -p --continue`, `codex exec resume --last`),
each asking the scripted simulator for one shell command whose output (`seq`, `--lines` lines)
stays in the conversation, so the prompt grows until the agent compacts or overflows. Behind the
in-thread gateway: one simulated llama-server with a `--context` window, prefill at a fixed
`--prefill-tps` (its prefix cache spares what an earlier request of the session already prefilled),
and `summaries` on, so a compaction request gets a summary (gateway/simulator/script.py).

Each agent runs in three variants:

- `connect`: the settings `fleet-gateway connect claude|codex` prints for the running gateway (the
  preset's name as the model, its window and output budget), the keep-alive on;
- `bare`: only the base URL, the key and the preset's name: the agent assumes its default window
  (Claude Code 1M for a name it does not know, Codex 272k); the keep-alive on;
- `no-keepalive`: as `connect`, with `GATEWAY_KEEPALIVE_AFTER` far beyond any wait.

The agents' waiting limits are shortened in every variant, as a long queue or load would meet their
defaults: Claude Code `API_TIMEOUT_MS` (the wait for response headers) and
`CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS` at 10 s (the smallest it takes), Codex `stream_idle_timeout_ms`
at 4 s; the gateway's keep-alive opens a waiting stream after 1.5 s and beats every 2 s. Retries are
the agents' own defaults.

Reported per session: the turns completed before the first that failed (a session stops there),
the compactions (summary requests the replica answered), the overflow refusals, the requests the
agent abandoned (and sent again), the requests and prefilled tokens at the replica, and the wall
time; on stdout as a table and as JSON lines appended to `--out` (default
bench/results/agent_sessions.jsonl). No pass/fail bounds: this is a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx2

from bench.support.agents import AgentsMissing, base_env, claude_binary, codex_binary, run_turn
from bench.support.gateway import Running, run_gateway
from bench.support.servers import ThreadServer
from gateway.simulator import SimConfig, create_app
from gateway.simulator.script import ECHO, SUMMARY_CUES

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "agent_sessions.jsonl"
PRESET = "coder"
KEY_ENV = "FLEET_GATEWAY_KEY"  # the variable `connect` names for Codex's key
DUMMY_KEY = "dummy-key"
TURN_TIMEOUT = 300.0
VARIANTS = ("connect", "bare", "no-keepalive")
NO_KEEPALIVE = 1e6  # seconds: the gateway never opens a waiting stream itself
KEEPALIVE = {"keepalive_after": 1.5, "keepalive_every": 2.0}
# The agents' limits, shortened (see the module docstring).
CLAUDE_LIMITS = {"API_TIMEOUT_MS": "10000", "CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": "10000"}
CODEX_IDLE_MS = 4000


@dataclass
class Session:
    """One agent's session in one variant: what it got done and what it cost."""

    agent: str
    variant: str
    turns: int
    completed: int = 0  # turns completed before the first that failed
    failure: str = ""  # what the failed turn said, shortened
    compactions: int = 0
    overflows: int = 0  # the gateway's (or the engine's) context refusals
    abandoned: int = 0  # requests the agent gave up on before their answer, then sent again
    requests: int = 0  # the agent's requests to the gateway
    replica_requests: int = 0
    prefilled_tokens: int = 0
    seconds: float = 0.0
    abandoned_after: list[float] = field(default_factory=list)  # how long each abandoned request ran, s


# --- the agents -----------------------------------------------------------------------------------


def connect_output(agent: str, url: str) -> str:
    """What `fleet-gateway connect AGENT --url URL` prints for the running gateway."""
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "connect", agent, "--url", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=ROOT,
    )
    return done.stdout


def claude_settings(url: str, variant: str) -> dict[str, str]:
    if variant == "bare":
        return {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_MODEL": PRESET}
    env = {}
    for line in connect_output("claude", url).splitlines():
        if line.startswith("export "):
            for pair in shlex.split(line)[1:]:
                name, _, value = pair.partition("=")
                env[name] = value
    env.pop("ANTHROPIC_AUTH_TOKEN", None)  # a placeholder; the dummy key is set below
    return env


def codex_config(url: str, variant: str) -> str:
    if variant == "bare":
        text = "\n".join(
            [
                f'model = "{PRESET}"',
                'model_provider = "fleet"',
                "",
                "[model_providers.fleet]",
                'name = "Fleet Gateway"',
                f'base_url = "{url}/v1"',
                'wire_api = "responses"',
                f'env_key = "{KEY_ENV}"',
            ]
        )
    else:
        text = connect_output("codex", url)
    # The provider table is the printed file's last: the idle limit goes into it.
    text += f"\nstream_idle_timeout_ms = {CODEX_IDLE_MS}\n"
    provider = tomllib.loads(text)["model_providers"]["fleet"]
    if provider.get("stream_idle_timeout_ms") != CODEX_IDLE_MS or provider.get("env_key") != KEY_ENV:
        raise SystemExit(f"unexpected Codex configuration from connect:\n{text}")
    return text


def turn_prompt(agent: str, turn: int, lines: int) -> str:
    command = f"seq {turn * 1_000_000} {turn * 1_000_000 + lines}"
    if agent == "claude":
        return f"Turn {turn}: run this [[tool Bash {json.dumps({'command': command})}]]"
    return f"Turn {turn}: run this [[tool exec_command {json.dumps({'cmd': command})}]]"


def claude_turn(home: Path, url: str, variant: str, prompt: str, first: bool) -> tuple[bool, str]:
    env = base_env(home)
    env.update(claude_settings(url, variant))
    env.update(
        ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY=DUMMY_KEY, CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1"
    )
    env.update(DISABLE_TELEMETRY="1", DISABLE_AUTOUPDATER="1", DISABLE_ERROR_REPORTING="1", **CLAUDE_LIMITS)
    command = [str(claude_binary()), "-p", prompt, "--output-format", "json"]
    command += ["--allowedTools", "Bash", *([] if first else ["--continue"])]
    done = run_turn(command, env, home / "project", TURN_TIMEOUT)
    try:
        result = json.loads(done.stdout)
    except ValueError:
        return False, (done.stderr or done.stdout)[-200:]
    text = str(result.get("result", ""))
    return done.returncode == 0 and not result.get("is_error") and text.startswith(ECHO), text[:200]


def codex_turn(home: Path, url: str, variant: str, prompt: str, first: bool) -> tuple[bool, str]:
    codex_home = home / ".codex"
    if first:
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(codex_config(url, variant))
    env = base_env(home)
    env.update({"CODEX_HOME": str(codex_home), KEY_ENV: DUMMY_KEY})
    command = [str(codex_binary()), "exec", "--skip-git-repo-check", "--sandbox"]
    command += [
        "workspace-write",
        "--color",
        "never",
        "--json",
        *([] if first else ["resume", "--last"]),
        prompt,
    ]
    done = run_turn(command, env, home / "project", TURN_TIMEOUT)
    events = []
    for line in done.stdout.splitlines():
        with contextlib.suppress(ValueError):
            events.append(json.loads(line))
    items = [e.get("item", {}) for e in events if isinstance(e, dict) and e.get("type") == "item.completed"]
    answers = [str(i.get("text", "")) for i in items if i.get("type") == "agent_message"]
    failures = [str(e.get("message", "")) for e in events if isinstance(e, dict) and e.get("type") == "error"]
    ok = done.returncode == 0 and bool(answers) and answers[-1].startswith(ECHO)
    return ok, (answers[-1] if ok else (failures[-1] if failures else done.stderr[-200:]))[:200]


# --- one session ----------------------------------------------------------------------------------


def table(url: str) -> str:
    return f"""
defaults: {{max_tokens: 8192, min_max_tokens: 0, params: {{temperature: 0}}}}
presets:
  {PRESET}:
    served_model: tiny
    replicas: [{{name: r0, url: "{url}", engine: llamacpp}}]
routing: {{default: {PRESET}}}
"""


@contextlib.contextmanager
def fleet(context: int, prefill_tps: float, keepalive: bool) -> Iterator[tuple[Running, ThreadServer]]:
    config = SimConfig(
        engine="llamacpp",
        model="tiny",
        context=context,
        prefill_tps=prefill_tps,
        decode_tps=500.0,
        reasoning_tokens=20,
        summaries=True,
    )
    sim = ThreadServer(create_app(config)).start()
    settings = dict(KEEPALIVE) if keepalive else {**KEEPALIVE, "keepalive_after": NO_KEEPALIVE}
    try:
        # Prompts in the (in-memory) access log: how a compaction request is told from a turn.
        with run_gateway(table(sim.url), log_prompts=True, **settings) as gw:
            wait_for_context(gw.url)
            yield gw, sim
    finally:
        sim.stop()


def wait_for_context(url: str) -> None:
    """Until the catalogue reports the replica's context (the first probe), which `connect` reads."""
    for _ in range(200):
        cards = httpx2.get(url + "/v1/models", timeout=5).json().get("data", [])
        if any(card.get("context_length") for card in cards):
            return
        time.sleep(0.05)
    raise SystemExit("the gateway's catalogue never reported the replica's context")


def asks_for_a_summary(entry: dict[str, Any]) -> bool:
    prompt = entry.get("prompt")
    return (
        isinstance(prompt, list) and bool(prompt) and any(c in json.dumps(prompt[-1]) for c in SUMMARY_CUES)
    )


def session(agent: str, variant: str, ns: argparse.Namespace) -> Session:
    found = Session(agent, variant, ns.turns)
    endpoint = "messages" if agent == "claude" else "responses"
    turn_of = claude_turn if agent == "claude" else codex_turn
    home = Path(tempfile.mkdtemp(prefix="agent-session-"))
    (home / "project").mkdir()
    started = time.monotonic()
    try:
        with fleet(ns.context, ns.prefill_tps, keepalive=variant != "no-keepalive") as (gw, sim):
            for turn in range(ns.turns):
                ok, said = turn_of(home, gw.url, variant, turn_prompt(agent, turn, ns.lines), turn == 0)
                if not ok:
                    found.failure = said.replace("\n", " ")
                    break
                found.completed += 1
            found.seconds = time.monotonic() - started
            time.sleep(0.2)  # the last request is recorded just after its last byte
            log = [e for e in gw.log_entries() if e.get("endpoint") == endpoint]
            stats = httpx2.get(sim.url + "/sim/stats", timeout=5).json()
    finally:
        shutil.rmtree(home, ignore_errors=True)
    found.requests = len(log)
    found.compactions = sum(1 for e in log if asks_for_a_summary(e) and e.get("outcome") == "completed")
    found.overflows = sum(1 for e in log if e.get("error_code") == "context_length_exceeded")
    gone = [e for e in log if e.get("outcome") == "client_disconnected"]
    found.abandoned = len(gone)
    found.abandoned_after = [round(float(e.get("duration_ms") or 0) / 1000, 1) for e in gone]
    found.replica_requests = int(stats["requests"])
    found.prefilled_tokens = int(stats["prompt_tokens"]) - int(stats["cached_tokens"])
    return found


# --- report ---------------------------------------------------------------------------------------

COLUMNS = (
    ("agent", "agent"),
    ("variant", "variant"),
    ("turns", "completed"),
    ("compactions", "compactions"),
    ("overflows", "overflows"),
    ("abandoned", "abandoned"),
    ("requests", "requests"),
    ("replica", "replica_requests"),
    ("prefilled", "prefilled_tokens"),
    ("seconds", "seconds"),
)


def render(sessions: Sequence[Session]) -> str:
    rows = [[label for label, _ in COLUMNS]]
    for s in sessions:
        values = asdict(s)
        cells = []
        for _, key in COLUMNS:
            value = values[key]
            if key == "completed":
                value = f"{s.completed}/{s.turns}"
            elif isinstance(value, float):
                value = f"{value:.0f}"
            cells.append(str(value))
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    failures = [
        f"- {s.agent}, {s.variant}: turn {s.completed} failed: {s.failure}" for s in sessions if s.failure
    ]
    return "\n".join(lines + (["", *failures] if failures else []))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.agent_sessions", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--agents", default="claude,codex", help="comma-separated: claude, codex")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS)
    )
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--context", type=int, default=65536, help="the replica's context, in tokens")
    parser.add_argument("--prefill-tps", type=float, default=1000.0, help="the replica's prefill rate")
    parser.add_argument("--lines", type=int, default=3000, help="lines of command output per turn")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ns = parser.parse_args(argv)
    agents = [a for a in ns.agents.split(",") if a]
    variants = [v.strip() for v in ns.variants.split(",") if v.strip()]
    unknown = sorted({*agents} - {"claude", "codex"}) + sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown agents or variants: {unknown}")
    try:
        for agent in agents:
            claude_binary() if agent == "claude" else codex_binary()
    except AgentsMissing as missing:
        raise SystemExit(str(missing)) from None
    sessions = []
    for agent in agents:
        for variant in variants:
            sessions.append(found := session(agent, variant, ns))
            print(
                f"{agent}, {variant}: {found.completed}/{found.turns} turns in {found.seconds:.0f} s",
                flush=True,
            )
    print()
    print(
        f"{ns.turns} turns of {ns.lines} output lines, context {ns.context} tokens, "
        f"prefill {ns.prefill_tps:g} tokens/s"
    )
    print(render(sessions))
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    with ns.out.open("a") as out:
        for s in sessions:
            line = {**asdict(s), "context": ns.context, "prefill_tps": ns.prefill_tps, "lines": ns.lines}
            out.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
