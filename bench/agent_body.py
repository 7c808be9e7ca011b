"""What the gateway's own steps cost on an agent's request, against other revisions.

    python -m bench.agent_body [--against REV ...] [--compiled REV ...] [--rounds N] [--requests N]
                               [--instructions] [--out FILE]

`bench.gateway` measures the gateway with a small chat body; an agent's request is 20-70k tokens,
and the steps that read the whole body (parse, depth, estimate, prefix fingerprint, encode) cost in
proportion to it. This runs the gateway's ASGI app in process, with an upstream client that answers
at once (no sockets, no server: what is left is the gateway's own Python), in five cases: the
captured Claude Code request of tests/fixtures/agents (50 KB, `POST /v1/messages`) to a vLLM replica
and to a llama-server one (which the gateway asks for a stream and whose tool schemas it fixes), the
same request 150 tool rounds into its session (290 KB: every step that reads the history reads 300
turns), and the bench's small chat body (`POST /v1/chat/completions`), sent without a key and with
`bench.gateway --with-team`'s named key (a team's limits and counters). Each contender is this
checkout or a revision built by bench/proxycost/revisions.py (`--against`; `--compiled`: built as
the Docker image ships it, compiled with mypyc), in a process of its own
pinned to core 0, alternated round by round; the result is the median CPU time per request and
each revision's ratio.

`--instructions` counts instead the instructions each request executes, under valgrind's callgrind
(instrumentation switched on only around the measured requests): slow (each contender takes a few
seconds per case under valgrind), and nearly the same count on every run of the same code (within
about 1 %), where CPU time on a shared machine moves by 10-20 % from one run to the next. One round
of 400 requests is its default.

Results: a table on stdout and JSON lines appended to bench/results/agent_body.jsonl (or --out).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.proxycost.bodies import SMALL_BODY
from bench.proxycost.host import terminate_cleanly
from bench.proxycost.routes import TEAM_KEY, routes_yaml
from bench.proxycost.side_by_side import arguments, contenders, race, report

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "agents" / "claude-code-messages-tool-result.json"
RESULTS = ROOT / "bench" / "results" / "agent_body.jsonl"
LONG_TURNS = 150  # tool rounds in the long session's history

# Run in the contender's own interpreter: it imports only that revision's `gateway`.
CHILD = r"""
import asyncio, gc, json, sys, time
routes, body_path, path, n, unserved, counting, key = sys.argv[1:8]
counting = counting == "instructions"
from gateway.settings import Settings
from gateway.app import build_gateway, create_app
try:
    from gateway.routing.table import parse_table
    from gateway.ops.accesslog import AccessLog
except ImportError:  # revisions from before the packages (fe992d9 and older)
    from gateway.table import parse_table
    from gateway.accesslog import AccessLog

CHAT = json.dumps({"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}}).encode()
MESSAGE = json.dumps({"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
    "content": [{"type": "text", "text": "hello"}], "stop_reason": "end_turn", "stop_sequence": None,
    "usage": {"input_tokens": 12, "output_tokens": 3}}).encode()
ANSWER = MESSAGE if path == "/v1/messages" else CHAT
# What llama-server streams for a Messages request: the gateway asks it for whole answers as a stream.
EVENTS = [
    {"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
        "model": "m", "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 12, "output_tokens": 0}}},
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hello"}},
    {"type": "content_block_stop", "index": 0},
    {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"output_tokens": 3}},
    {"type": "message_stop"},
]
STREAM = b"".join(b"event: %s\ndata: %s\n\n" % (e["type"].encode(), json.dumps(e).encode()) for e in EVENTS)

class Answer:
    status = 200
    def __init__(self, stream):
        self.stream = stream
        self.headers = {"content-type": "text/event-stream" if stream else "application/json"}
    async def read(self, limit=None):
        return STREAM if self.stream else ANSWER
    async def chunks(self):
        yield STREAM if self.stream else ANSWER
    async def close(self):
        pass

class Instant:
    async def send(self, url, headers, body, timeouts, method="POST"):
        return Answer(b'"stream":true' in body)
    async def get(self, url, headers, timeout):
        return 200, b"{}"
    async def aclose(self):
        pass

body = open(body_path, "rb").read()
log = AccessLog(enabled=True, flush_interval=0.2, stream=open("/dev/null", "wb"))
gateway = build_gateway(Settings(), parse_table(routes, "bench"), client=Instant(), access_log=log)
app = create_app(gateway)
headers = [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
           (b"anthropic-version", b"2023-06-01"), (b"content-length", str(len(body)).encode())]
if key:
    headers.append((b"authorization", b"Bearer " + key.encode()))

async def one():
    scope = {"type": "http", "http_version": "1.1", "method": "POST", "path": path,
             "raw_path": path.encode(), "query_string": b"", "headers": headers,
             "client": ("127.0.0.1", 5555), "server": ("127.0.0.1", 8000), "scheme": "http",
             "root_path": "", "state": {}}
    sent = False
    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)
    async def send(message):
        if message["type"] == "http.response.start" and message["status"] == 404:
            raise SystemExit(int(unserved))  # a revision from before this endpoint
        if message["type"] == "http.response.start" and message["status"] != 200:
            raise SystemExit(f"{path} was answered {message['status']}")
    await app(scope, receive, send)

def instrument(state):
    # callgrind counts only while instrumentation is on (valgrind --instr-atstart=no)
    import os, subprocess
    subprocess.run(["callgrind_control", "-i", state, str(os.getpid())], capture_output=True, check=True)

async def run():
    for _ in range(200):
        await one()
    gc.collect(); gc.freeze(); gc.set_threshold(20_000, 20, 20)  # as the gateway's server does
    if counting:
        instrument("on")
    start = time.process_time()
    async def worker(count):
        for _ in range(count):
            await one()
    await asyncio.gather(*(worker(int(n) // 16) for _ in range(16)))
    elapsed = time.process_time() - start
    if counting:
        instrument("off")
    print(json.dumps({"us": elapsed / (int(n) // 16 * 16) * 1e6, "requests": int(n) // 16 * 16}))

import uvloop
uvloop.run(run())
"""


def long_session(captured: dict[str, Any], turns: int = LONG_TURNS) -> dict[str, Any]:
    """The captured request `turns` tool rounds later: each round the assistant's text and a `Read`
    call, and the file it read (30 lines) in the user turn's `tool_result`, as Claude Code sends its
    history; then the user's next line. About 290 KB and 300 turns at the default."""
    history = list(captured["messages"][:2])
    for i in range(turns):
        call = f"toolu_{i:024d}"
        history.append(
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "text",
                        "text": f"Step {i}: I will read the next module and check what it does.",
                    },
                    {
                        "type": "tool_use",
                        "id": call,
                        "name": "Read",
                        "input": {"file_path": f"/src/app/module_{i}.py"},
                    },
                ],
            }
        )
        history.append(
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": call,
                        "content": "    def handle(self, request):  # code\n" * 30,
                    }
                ],
            }
        )
    history.append({"role": "user", "content": [{"type": "text", "text": "go on"}]})
    return {**captured, "messages": history}


def bodies(scratch: Path) -> list[tuple[str, str, Path, str, str]]:
    """(name, path, file, routes, key) of each case: the agent's body to a vLLM replica and to a
    llama-server one (whose tool schemas the gateway fixes, and which it asks for a stream), the same
    request deep into a session (every step that reads the history reads 300 turns), and the small
    chat body, open and sent with a named key that has every limit (`bench.gateway --with-team`'s)."""
    captured = json.loads(FIXTURE.read_text())["body"]
    agent = scratch / "agent.json"
    agent.write_bytes(json.dumps({**captured, "model": "bench", "stream": False}).encode())
    session = scratch / "session.json"
    session.write_bytes(json.dumps({**long_session(captured), "model": "bench", "stream": False}).encode())
    small = scratch / "small.json"
    small.write_bytes(SMALL_BODY)
    # No socket is opened: the upstream client answers in process.
    vllm = routes_yaml(18999, 18997)
    llamacpp = vllm.replace('"engine": "vllm"', '"engine": "llamacpp"')
    keyed = routes_yaml(18999, 18997, team=True)
    return [
        ("claude code, 50 KB", "/v1/messages", agent, vllm, ""),
        ("claude code, 50 KB, llama.cpp", "/v1/messages", agent, llamacpp, ""),
        (f"claude code, {LONG_TURNS} turns later", "/v1/messages", session, vllm, ""),
        ("small chat", "/v1/chat/completions", small, vllm, ""),
        ("small chat, named key", "/v1/chat/completions", small, keyed, TEAM_KEY),
    ]


UNSERVED = 3  # the child's exit status when the revision has no such endpoint (404)


def measure(
    python: str, routes: str, body: Path, path: str, requests: int, instructions: bool = False, key: str = ""
) -> float | None:
    """CPU microseconds per request (or, with `instructions`, instructions per request), or None for
    a revision without the endpoint; `key`: sent as a bearer token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env["PYTHONPATH"] = ""  # the contender's own package, not this checkout's
    env["PYTHONHASHSEED"] = "0"  # the same dict and set layouts on every run: the same count
    child = [python, "-c", CHILD, routes, str(body), path, str(requests), str(UNSERVED)]
    mode = "instructions" if instructions else "time"
    with tempfile.TemporaryDirectory() as scratch:
        if instructions:
            out_file = str(Path(scratch) / "callgrind.out")
            valgrind = [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={out_file}",
            ]
            command = [*valgrind, *child, mode, key]
        else:
            command = ["taskset", "-c", "0", *child, mode, key]
        out = subprocess.run(
            command, capture_output=True, text=True, timeout=1800, env=env, cwd="/", check=False
        )
    if out.returncode == UNSERVED:
        return None
    if out.returncode != 0:
        raise SystemExit(f"{python} on {path}: {out.stderr.strip()[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if not instructions:
        return float(result["us"])
    collected = re.search(r"Collected : (\d+)", out.stderr)
    if collected is None:
        raise SystemExit(f"{python} on {path}: no instruction count from callgrind: {out.stderr[-2000:]}")
    return int(collected.group(1)) / int(result["requests"])


def main() -> None:
    parser = arguments(__doc__, requests=3200, out=RESULTS)
    parser.add_argument(
        "--instructions", action="store_true", help="count instructions under valgrind instead of CPU time"
    )
    # Unset, they depend on what is measured: a count is the same on every run, and valgrind runs
    # the interpreter some fifty times slower, so one round of 400 requests (was: the CPU run's 5 x
    # 3,200, over a quarter of an hour).
    parser.set_defaults(rounds=None, requests=None)
    args = parser.parse_args()
    if args.rounds is None:
        args.rounds = 1 if args.instructions else 5
    if args.requests is None:
        args.requests = 400 if args.instructions else 3200
    if args.instructions and shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (callgrind) on the PATH")
    racers = contenders(args.against, args.compiled)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for label, path, body, routes, key in bodies(Path(scratch)):

            def one(
                python: str, routes: str = routes, body: Path = body, path: str = path, key: str = key
            ) -> float | None:
                return measure(python, routes, body, path, args.requests, args.instructions, key)

            medians, samples = race(racers, args.rounds, one)
            rows.append((label, medians, samples))
    what = "Instructions" if args.instructions else "CPU"
    report(
        rows,
        [name for name, _ in racers],
        title=f"{what} per request in process, median of {args.rounds} rounds (lower is better)",
        column="body",
        unit="" if args.instructions else " us",
        decimals=0,
        figure="instructions" if args.instructions else "cpu_us",
        out=args.out,
    )


if __name__ == "__main__":
    with terminate_cleanly():  # a child measuring when SIGTERM comes is killed by subprocess.run
        main()
