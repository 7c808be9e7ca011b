"""Compare upstream HTTP clients: CPU time per request, in the client process, against the instant upstream.

    python -m bench.clients [--requests N]      # from the repository root

The client runs pinned to core 0 and the upstream to core 1 (when taskset exists), one process per
client and concurrency, so the numbers are side by side from one run. Results: a table and JSON lines.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the children run as `python -m bench.*` from here
BODY = b'{"model":"m","messages":[{"role":"user","content":"hello"}]}'
HEADERS = {"content-type": "application/json"}
KINDS = ("httpx2-post", "httpx2-stream", "httpx-aiohttp", "aiohttp", "lean")
# The packages each client needs; a client whose packages are missing gets no row
# (`pip install -e '.[bench]'` adds httpx and httpx-aiohttp).
NEEDS = {"httpx-aiohttp": ("httpx", "httpx_aiohttp", "aiohttp"), "aiohttp": ("aiohttp",)}


def installed(kind: str) -> bool:
    return all(importlib.util.find_spec(module) is not None for module in NEEDS.get(kind, ()))


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _measure(kind: str, url: str, concurrency: int, requests: int) -> dict[str, float]:
    if kind.startswith("httpx2"):
        import httpx2

        client = httpx2.AsyncClient(
            limits=httpx2.Limits(max_connections=None, max_keepalive_connections=None)
        )
        if kind == "httpx2-post":

            async def one() -> None:
                response = await client.post(url, content=BODY, headers=HEADERS)
                await response.aread()
        else:

            async def one() -> None:
                response = await client.send(
                    client.build_request("POST", url, content=BODY, headers=HEADERS), stream=True
                )
                async for _ in response.aiter_raw():
                    pass
                await response.aclose()

        close = client.aclose
    elif kind == "httpx-aiohttp":
        import aiohttp
        import httpx
        from httpx_aiohttp import AiohttpTransport

        transport = AiohttpTransport(
            client=lambda: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        )
        wrapped = httpx.AsyncClient(transport=transport)

        async def one() -> None:
            response = await wrapped.post(url, content=BODY, headers=HEADERS)
            await response.aread()

        close = wrapped.aclose
    elif kind == "lean":
        # Through the gateway's own interface, as the gateway would call it (GATEWAY_HTTP_CLIENT=lean).
        from gateway.upstream import Timeouts, create_client

        lean = create_client("lean")
        headers = list(HEADERS.items())
        timeouts = Timeouts(connect=5.0, first_byte=None, idle=None)

        async def one() -> None:
            response = await lean.send(url, headers, BODY, timeouts)
            async for _ in response.chunks():
                pass
            await response.close()

        close = lean.aclose
    else:
        import aiohttp

        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)

        async def one() -> None:
            async with session.post(url, data=BODY, headers=HEADERS) as response:
                async for _ in response.content.iter_any():
                    pass

        close = session.close

    async def worker(count: int) -> None:
        for _ in range(count):
            await one()

    await asyncio.gather(*(worker(50) for _ in range(min(concurrency, 8))))  # warm the pool
    wall, cpu = time.perf_counter(), _cpu()
    await asyncio.gather(*(worker(requests // concurrency) for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - wall, _cpu() - cpu
    await close()
    done = requests // concurrency * concurrency
    return {"cpu_ms_per_request": round(cpu / done * 1000, 4), "requests_per_s": round(done / wall)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.clients", description=__doc__)
    parser.add_argument("--requests", type=int, default=6400)
    parser.add_argument("--port", type=int, default=19997)
    parser.add_argument("--child", nargs=3, metavar=("KIND", "URL", "CONCURRENCY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import uvloop

        kind, url, concurrency = args.child
        print(json.dumps(uvloop.run(_measure(kind, url, int(concurrency), args.requests))))
        return
    pin = ["taskset", "-c"] if shutil.which("taskset") and (os.cpu_count() or 1) > 1 else []
    upstream = subprocess.Popen(
        [*(pin and [*pin, "1"]), sys.executable, "-m", "bench.instant_upstream", str(args.port)], cwd=ROOT
    )
    try:
        time.sleep(1.0)
        url = f"http://127.0.0.1:{args.port}/v1/chat/completions"
        print(f"{'client':16} {'clients':>7} {'cpu ms/req':>10} {'req/s':>8}")
        missing = [kind for kind in KINDS if not installed(kind)]
        if missing:
            print(f"not installed, no row: {', '.join(missing)}", file=sys.stderr)
        for concurrency in (1, 64):
            for kind in (kind for kind in KINDS if kind not in missing):
                command = [*(pin and [*pin, "0"]), sys.executable, "-m", "bench.clients"]
                out = subprocess.run(
                    [*command, "--requests", str(args.requests), "--child", kind, url, str(concurrency)],
                    capture_output=True,
                    text=True,
                    check=True,
                    cwd=ROOT,
                )
                result = json.loads(out.stdout.strip().splitlines()[-1])
                cpu, rate = result["cpu_ms_per_request"], result["requests_per_s"]
                print(f"{kind:16} {concurrency:7} {cpu:10.3f} {rate:8}")
                print(
                    json.dumps({"bench": "clients", "client": kind, "concurrency": concurrency, **result}),
                    file=sys.stderr,
                )
    finally:
        upstream.terminate()


if __name__ == "__main__":
    main()
