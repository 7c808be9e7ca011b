"""Streams through the gateway while real llama-server replicas are SIGKILLed: how each one ended.

    python -m bench.killcut [--streams 2000] [--clients 12] [--max-tokens 400] [--every 2.5]

Three llama-server replicas on the tiny GGUF (built locally, as tests/real does), the gateway in
process in front of them, `--clients` threads streaming one request after another. Every `--every`
seconds the next replica is SIGKILLed and started again on its port. Each stream is classed by its
last `data:` line: `done` ([DONE]), `error_event` (the gateway's error event after a cut),
`truncated` (neither: a silent cut) or `failed_before_bytes`.
Outcomes are counts, not a bound: a slow machine runs fewer streams per kill.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import threading
import time
from pathlib import Path

from bench.proxycost.host import run_fields

CHAT = "/v1/chat/completions"


def main() -> None:
    from bench.support.engines import LlamaServer, ensure_gguf
    from bench.support.gateway import run_gateway
    from bench.support.streams import kill_routes, stream_once

    parser = argparse.ArgumentParser(prog="python -m bench.killcut", description=__doc__)
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--every", type=float, default=2.5, help="seconds between kills")
    parser.add_argument("--limit", type=float, default=600, help="seconds at most")
    parser.add_argument("--out", type=Path, default=Path("bench-results.jsonl"))
    args = parser.parse_args()

    model = ensure_gguf()
    servers = [LlamaServer(model, slots=4, name=f"killcut-{i}").__enter__() for i in range(3)]
    outcomes: collections.Counter[str] = collections.Counter()
    lock, stop = threading.Lock(), threading.Event()
    kills = 0
    started = time.monotonic()
    try:
        with run_gateway(kill_routes([s.url for s in servers])) as gw:

            def client() -> None:
                while not stop.is_set():
                    outcome = stream_once(gw.url, args.max_tokens)
                    with lock:
                        outcomes[outcome] += 1
                        if sum(outcomes.values()) >= args.streams:
                            stop.set()

            with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
                futures = [pool.submit(client) for _ in range(args.clients)]
                victim = 0
                while not stop.wait(args.every) and time.monotonic() - started < args.limit:
                    servers[victim].kill()
                    kills += 1
                    servers[victim].start()  # on the same port; probes bring it back into the pool
                    victim = (victim + 1) % len(servers)
                stop.set()
                for future in futures:
                    future.result(timeout=120)
            cut = collections.Counter(
                str(e.get("error_code")) for e in gw.log_entries() if e.get("outcome") != "completed"
            )
    finally:
        for server in servers:
            server.__exit__(None, None, None)
    record = {
        **run_fields("killcut", 1, False),
        "streams": sum(outcomes.values()),
        "outcomes": dict(outcomes),
        "kills": kills,
        "seconds": round(time.monotonic() - started, 1),
        "not_completed_by_error_code": dict(cut),
        "settings": {"clients": args.clients, "max_tokens": args.max_tokens, "every": args.every},
    }
    print(json.dumps(record))
    with args.out.open("a") as out:
        out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
