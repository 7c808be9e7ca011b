"""Run ASGI apps on real sockets on 127.0.0.1 for the tests.

Each server gets its own thread and event loop, so a test can talk to it with a plain
synchronous client (the official ``openai`` package, ``httpx2``) exactly as a user would.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ThreadServer:
    """A uvicorn server on 127.0.0.1 in a background thread."""

    def __init__(self, app: Any, port: int | None = None, **config: Any) -> None:
        self.port = port or free_port()
        config.setdefault("log_level", "warning")
        config.setdefault("lifespan", "on")
        self.config = uvicorn.Config(app, host="127.0.0.1", port=self.port, **config)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())
        self.loop.close()

    def start(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def call(self, coro: Any, timeout: float = 10) -> Any:
        """Run a coroutine on the server's own loop (to inspect or change its state)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@contextlib.contextmanager
def serve(app: Any, port: int | None = None, **config: Any) -> Iterator[ThreadServer]:
    server = ThreadServer(app, port=port, **config).start()
    try:
        yield server
    finally:
        server.stop()


def sim_replica(engine: str, model: str, **knobs: Any) -> ThreadServer:
    """One simulated replica on 127.0.0.1, started; instant unless `time_scale` says otherwise."""
    from gateway.simulator import SimConfig, create_app

    config = SimConfig(engine=engine, model=model, **{"time_scale": 0, **knobs})  # type: ignore[arg-type]
    return ThreadServer(create_app(config)).start()
