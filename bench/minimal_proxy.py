"""The reference Python proxy the performance issue measured: what a hop costs with no features.

A deliberately minimal starlette app on uvicorn with uvloop and httptools, aiohttp as the upstream
client (unlimited connector) and orjson: it parses the JSON body, serialises it again and relays the
answer, streaming or not. No routing, no rewriting, no metrics, no logs, no limits, no retries.

Its figures on the issue's machine (6,800 requests/s at 64 clients, 2,600 streams/s at 32, +0.37 ms
at one client, +0.52 ms to the first token) are what the gateway's targets were set against; run side
by side with the gateway it tells how fast this machine is, so that a slower host is not mistaken
for a slower gateway. `python -m bench.gateway` starts it as the `minimal` contender.

    python -m bench.minimal_proxy PORT UPSTREAM_PORT HOLD_PORT

`/hold/...` goes to the holding upstream (the memory test's open streams), everything else to the
instant one.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route


def build(upstream: int, hold: int) -> Starlette:
    session: dict[str, aiohttp.ClientSession] = {}

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0)
        session["client"] = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None)
        )
        yield
        await session["client"].close()

    async def health(_: Request) -> Response:
        return Response(b"ok")

    async def relay(request: Request) -> Response:
        path = request.url.path
        port = upstream
        if path.startswith("/hold/"):
            port, path = hold, path.removeprefix("/hold")
        body = orjson.dumps(orjson.loads(await request.body()))
        answer = await session["client"].post(
            f"http://127.0.0.1:{port}{path}", data=body, headers={"content-type": "application/json"}
        )
        content_type = answer.headers.get("content-type", "application/json")
        if content_type.startswith("text/event-stream"):

            async def chunks() -> AsyncIterator[bytes]:
                try:
                    async for chunk in answer.content.iter_any():
                        yield chunk
                finally:
                    answer.release()

            return StreamingResponse(chunks(), status_code=answer.status, media_type=content_type)
        data = await answer.read()
        answer.release()
        return Response(data, status_code=answer.status, media_type=content_type)

    routes = [Route("/health", health), Route("/{path:path}", relay, methods=["POST"])]
    return Starlette(routes=routes, lifespan=lifespan)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.minimal_proxy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("port", type=int)
    parser.add_argument("upstream", type=int)
    parser.add_argument("hold", type=int)
    args = parser.parse_args()
    uvicorn.run(
        build(args.upstream, args.hold),
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
        backlog=4096,
    )


if __name__ == "__main__":
    main()
