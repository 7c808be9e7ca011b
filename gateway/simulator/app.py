"""The HTTP side of a simulated replica: routes, slots with a FIFO queue, the clock, disconnects, hooks."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.simulator import cache, dialect, engine, extras, messages, misbehave, responses
from gateway.simulator.dialect import Wire
from gateway.simulator.engine import SimConfig
from gateway.types import Json

FAILURES = (None, "500", "503", "hang", "close")
KNOBS = ("time_scale", "decode_tps", "prefill_tps", "reasoning_tokens", "answer_tokens")
LLAMA_PUBLIC = frozenset({"/v1/health", "/v1/models"})
# llama-server checks the key on every path but a few; the simulator on /v1/ and these.
LLAMA_GUARDED = frozenset(
    {
        "/responses",
        "/tokenize",
        "/detokenize",
        "/infill",
        "/embedding",
        "/embeddings",
        "/rerank",
        "/reranking",
    }
)
LOADING = engine.llama_error(503, "Loading model", "unavailable_error").payload
Header = tuple[bytes, bytes]
Shape = Callable[[SimConfig, int, Json], Json]
Run = Callable[[bytes, Scope, Send], Awaitable[None]]


async def _send_json(send: Send, status: int, obj: Any, extra: Sequence[Header] = ()) -> None:
    body = orjson.dumps(obj)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status, media_type="application/json")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


async def _read_body(receive: Receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class SlotPool:
    """Concurrent sequences; a freed slot goes straight to the oldest waiter (FIFO, no barging)."""

    def __init__(self, slots: int, choose: Callable[[list[int], bytes], tuple[int, int]]) -> None:
        self.slots = slots
        self.idle = list(range(slots))
        self.choose = choose
        self.waiters: deque[tuple[asyncio.Future[tuple[int, int]], bytes]] = deque()

    @property
    def running(self) -> int:
        return self.slots - len(self.idle)

    async def acquire(self, prompt: bytes) -> tuple[int, int]:
        """(slot, the chooser's cached-token count)."""
        if self.idle and not self.waiters:
            return self._take(prompt)
        future: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
        entry = (future, prompt)
        self.waiters.append(entry)
        try:
            return await entry[0]
        except asyncio.CancelledError:
            if entry[0].done() and not entry[0].cancelled():
                self.release(entry[0].result()[0])  # handed a slot in the same tick it was cancelled
            else:
                with contextlib.suppress(ValueError):
                    self.waiters.remove(entry)
            raise

    def _take(self, prompt: bytes) -> tuple[int, int]:
        slot, cached = self.choose(self.idle, prompt)
        self.idle.remove(slot)
        return slot, cached

    def release(self, slot: int) -> None:
        self.idle.append(slot)
        while self.waiters and self.idle:
            future, prompt = self.waiters.popleft()
            if not future.done():
                future.set_result(self._take(prompt))


def _any_slot(idle: list[int], prompt: bytes) -> tuple[int, int]:
    return idle[-1], 0


@dataclasses.dataclass
class Counters:
    """A simulated replica's running totals, read by its metrics and `/sim/stats` and zeroed by
    `/sim/reset`."""

    requests: int = 0
    completed: int = 0
    aborted: int = 0
    errors: int = 0
    injected: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0


class Replica:
    """State of one replica plus its request handlers."""

    def __init__(self, config: SimConfig) -> None:
        self.cfg = config
        self.vllm = config.engine == "vllm"
        self.fail: str | None = None
        self.fail_count: int | None = None
        self.counters = Counters()
        self.bodies: deque[str] = deque(maxlen=32)
        self.headers: deque[dict[str, str]] = deque(maxlen=32)
        self.counter = 0
        self.in_flight = 0
        self.kv_tokens = 0
        self.blocks = cache.BlockCache(config.block_size, config.cache_blocks)
        self.slot_cache = cache.SlotCache(config.slots)
        self.pool = SlotPool(config.slots, _any_slot if self.vllm else self.slot_cache.pick)
        self.responses = responses.Store(config)
        self.created = int(time.time())
        self.ready_at = time.monotonic() + config.load_seconds
        self.sleeping = False  # vLLM's sleep mode (`--enable-sleep-mode`, dev-mode endpoints)

    def loading(self) -> bool:
        # vLLM has no such phase on the wire: serve_sim simply binds the socket late.
        return not self.vllm and time.monotonic() < self.ready_at

    async def sleep(self, seconds: float) -> None:
        delay = seconds * self.cfg.time_scale  # read live so /sim/config applies mid-request
        await asyncio.sleep(delay if delay > 0 else 0)

    def take_fail(self) -> str | None:
        fail = self.fail
        if fail is not None and self.fail_count is not None:
            self.fail_count -= 1
            if self.fail_count <= 0:
                self.fail = self.fail_count = None
        return fail

    async def inject(self, fail: str, scope: Scope, receive: Receive, send: Send, shape: Shape) -> None:
        self.counters.injected += 1
        if fail in ("500", "503"):
            status = int(fail)
            extra = [(b"retry-after", b"1")] if status == 503 else []
            payload = shape(self.cfg, status, engine.server_error(self.cfg, status, "injected failure"))
            await _send_json(send, status, payload, extra)
            return
        if fail == "close":
            # Raising would make uvicorn answer 500; closing its transport drops the connection bare.
            transport = getattr(getattr(scope.get("sim.server_send"), "__self__", None), "transport", None)
            if transport is None:
                raise ConnectionAbortedError("injected close (server without a reachable transport)")
            transport.close()
        await _wait_disconnect(receive)

    async def answer(self, answer: dialect.Answer, raw: bytes, scope: Scope, send: Send) -> None:
        try:
            body = answer.respond(self.cfg, raw, _header(scope, b"content-type"))
        except engine.ApiError as exc:
            self.counters.errors += 1
            await _send_json(send, exc.status, answer.error_shape(self.cfg, exc.status, exc.payload))
            return
        self.counters.completed += 1
        await _send_json(send, 200, body)

    async def generate(self, wire: Wire, raw: bytes, scope: Scope, send: Send) -> None:
        """Serves one generation request as the configured engine would: refusals in its error
        shape, then a slot taken (queued when all are busy), prefill and decode paced by the
        configured speeds, the prefix cache consulted and updated, and the answer sent whole or
        streamed, with vLLM's headers before the slot and llama-server's after it."""
        cfg = self.cfg
        try:
            prep = wire.prepare(cfg, raw, _header(scope, b"content-type"))
        except engine.ApiError as exc:
            self.counters.errors += 1
            await _send_json(send, exc.status, wire.error_shape(cfg, exc.status, exc.payload))
            return
        self.counter += 1
        out = misbehave.output(cfg.misbehave, engine.generate(cfg, prep, self.counter))
        rid = wire.id_prefix + os.urandom(16).hex()
        slot, kv = -1, 0
        self.in_flight += 1
        try:
            # vLLM sends headers before the engine runs; llama-server only once the first result is in.
            if prep.stream and self.vllm:
                await self._start_sse(send)
            slot, cached = await self.pool.acquire(prep.prompt)
            if self.vllm:
                cached = self.blocks.match_and_insert(prep.prompt, prep.cache_salt)
            else:
                self.slot_cache.store(slot, prep.prompt)
            self.counters.prompt_tokens += prep.prompt_tokens
            self.counters.cached_tokens += cached
            kv = prep.prompt_tokens + out.completion_tokens  # reserved whole: close enough for a gauge
            self.kv_tokens += kv
            await self.sleep((prep.prompt_tokens - cached) / self.cfg.prefill_tps)
            reply = dialect.Reply(rid, int(time.time()), prep, out, cached)
            if prep.stream:
                if not self.vllm:
                    await self._start_sse(send)
                for count, event in misbehave.stream(cfg.misbehave, wire.stream(cfg, reply)):
                    await self._decode(count)
                    await send({"type": "http.response.body", "body": event, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                await self._decode(out.completion_tokens)
                await _send_json(send, 200, misbehave.whole(cfg.misbehave, wire.response(cfg, reply)))
            self.counters.completed += 1
            if not self.vllm:
                self.slot_cache.store(slot, prep.prompt + out.text().encode())
        finally:
            self.in_flight -= 1
            self.kv_tokens -= kv
            if slot >= 0:
                self.pool.release(slot)

    async def _decode(self, tokens: int) -> None:
        # Chunk by chunk even without a stream, so knob changes and token counters show up live.
        while tokens > 0:
            step = tokens if self.cfg.time_scale == 0 else min(tokens, self.cfg.chunk_tokens)
            await self.sleep(step / self.cfg.decode_tps)
            tokens -= step
            self.counters.generation_tokens += step

    async def _start_sse(self, send: Send) -> None:
        ctype = b"text/event-stream; charset=utf-8" if self.vllm else b"text/event-stream"
        headers = [(b"content-type", ctype), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

    # --- plain endpoints -------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return Response(status_code=200) if self.vllm else _json({"status": "ok"})

    async def sleep_mode(self, request: Request) -> Response:
        """POST /sleep?level=1 and /wake_up, GET /is_sleeping, as vLLM's dev-mode server has them."""
        if request.url.path == "/is_sleeping":
            return _json({"is_sleeping": self.sleeping})
        self.sleeping = request.url.path == "/sleep"
        return Response(status_code=200)

    async def version(self, request: Request) -> Response:
        return _json({"version": "0.32.0"})

    async def load(self, request: Request) -> Response:
        return _json({"server_load": self.in_flight})

    async def models(self, request: Request) -> Response:
        if self.vllm:
            return _json(dialect.vllm_models(self.cfg, self.created))
        return _json(dialect.llama_models(self.cfg, self.created, self.loading()))

    async def props(self, request: Request) -> Response:
        return _json(dialect.llama_props(self.cfg))

    async def slots(self, request: Request) -> Response:
        """llama-server's `GET /slots`: each slot's context size and whether it is busy; with
        `fail_on_no_slot=1`, a 503 when no slot is idle."""
        if request.query_params.get("fail_on_no_slot") == "1" and not self.pool.idle:
            return _json(engine.llama_error(503, "no slot available", "unavailable_error").payload, 503)
        busy = set(range(self.cfg.slots)) - set(self.pool.idle)
        return _json(
            [
                {
                    "id": i,
                    "id_task": -1,
                    "n_ctx": self.cfg.context,
                    "speculative": False,
                    "is_processing": i in busy,
                }
                for i in range(self.cfg.slots)
            ]
        )

    async def metrics(self, request: Request) -> Response:
        """`GET /metrics` in the engine's own Prometheus names (running and waiting requests, KV and
        prefix cache use, prompt and generated tokens); a llama-server started without `metrics`
        answers 501."""
        c, cfg, running, waiting = self.counters, self.cfg, self.pool.running, len(self.pool.waiters)
        if self.vllm:
            text = dialect.prometheus(
                {
                    "vllm:num_requests_running": running,
                    "vllm:num_requests_waiting": waiting,
                    "vllm:kv_cache_usage_perc": min(
                        1.0, self.kv_tokens / (cfg.cache_blocks * cfg.block_size)
                    ),
                    "vllm:prefix_cache_queries": c.prompt_tokens,
                    "vllm:prefix_cache_hits": c.cached_tokens,
                    "vllm:prompt_tokens": c.prompt_tokens,
                    "vllm:prompt_tokens_cached": c.cached_tokens,
                    "vllm:generation_tokens": c.generation_tokens,
                },
                dialect.vllm_labels(cfg),
            )
        elif not cfg.metrics:
            message = "This server does not support metrics endpoint. Start it with `--metrics`"
            return _json(engine.llama_error(501, message, "not_supported_error").payload, 501)
        else:
            evaluated = c.prompt_tokens - c.cached_tokens
            text = dialect.prometheus(
                {
                    "llamacpp:prompt_tokens": evaluated,
                    "llamacpp:prompt_seconds": evaluated / cfg.prefill_tps,
                    "llamacpp:prompt_tokens_cached": c.cached_tokens,
                    "llamacpp:tokens_predicted": c.generation_tokens,
                    "llamacpp:tokens_predicted_seconds": c.generation_tokens / cfg.decode_tps,
                    "llamacpp:requests_processing": running,
                    "llamacpp:requests_deferred": waiting,
                }
            )
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    # --- /sim/ hooks -----------------------------------------------------------------------------------

    def knobs(self) -> dict[str, Any]:
        knobs = {k: getattr(self.cfg, k) for k in KNOBS}
        return {**knobs, "fail": self.fail, "fail_count": self.fail_count, "misbehave": self.cfg.misbehave}

    async def sim_stats(self, request: Request) -> Response:
        stats = dataclasses.asdict(self.counters)
        stats.update(in_flight=self.in_flight, running=self.pool.running, queued=len(self.pool.waiters))
        stats.update(last_bodies=list(self.bodies), last_headers=list(self.headers), config=self.knobs())
        return _json(stats)

    async def sim_reset(self, request: Request) -> Response:
        self.counters = Counters()
        self.bodies.clear()
        self.headers.clear()
        self.counter = 0
        self.blocks.reset()
        self.slot_cache.reset()
        self.responses.reset()
        return _json({"ok": True})

    async def sim_config(self, request: Request) -> Response:
        """`POST /sim/config`: changes the speed knobs, the failure to inject (and how many times)
        and the misbehaviour modes from a JSON object; answers 400 for an unknown or ill-typed knob,
        else the knobs now in force."""
        try:
            patch = orjson.loads(await request.body())
            if not isinstance(patch, dict):
                raise ValueError("expected a JSON object")
            unknown = set(patch) - {*KNOBS, "fail", "fail_count", "misbehave"}
            if unknown:
                raise ValueError(f"unknown knobs: {sorted(unknown)}")
            if patch.get("fail") not in FAILURES:
                raise ValueError(f"fail must be one of {list(FAILURES)}")
            count = patch.get("fail_count")
            if count is not None and (type(count) is not int or count < 1):
                raise ValueError("fail_count must be a positive integer or null")
            for key in KNOBS:
                if key in patch and (type(patch[key]) not in (int, float)):
                    raise ValueError(f"{key} must be a number")
            changes = {k: type(getattr(self.cfg, k))(v) for k, v in patch.items() if k in KNOBS}
            if "misbehave" in patch:
                if not isinstance(patch["misbehave"], str):
                    raise ValueError("misbehave must be a string of comma-separated modes")
                changes["misbehave"] = patch["misbehave"]
            cfg = dataclasses.replace(self.cfg, **changes)
        except ValueError as exc:
            return _json({"error": str(exc)}, 400)
        self.cfg = cfg
        if "fail" in patch:
            self.fail = patch["fail"]
        if "fail" in patch or "fail_count" in patch:
            self.fail_count = count if self.fail is not None else None
        return _json(self.knobs())


class _Endpoint:
    """A raw ASGI endpoint: the body is read and recorded, a failure maybe injected, then ``run`` races the
    client's disconnect (generation is aborted, and its slot freed, when the client leaves)."""

    def __init__(self, replica: Replica, run: Run, shape: Shape = dialect.same_shape) -> None:
        self.replica, self.run, self.shape = replica, run, shape

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rep = self.replica
        raw = await _read_body(receive)
        if raw is None:
            return
        rep.counters.requests += 1
        rep.bodies.append(raw.decode("utf-8", "replace"))
        rep.headers.append({k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]})
        fail = rep.take_fail()
        if fail is not None:
            await rep.inject(fail, scope, receive, send, self.shape)
            return
        run = asyncio.ensure_future(self.run(raw, scope, send))
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait((run, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not run.done():
                # The client left (or the server is stopping): abort the sequence, which frees its slot.
                rep.counters.aborted += 1
                run.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await run
        if not run.cancelled():
            run.result()


class _Gate:
    """What both servers check before routing: the loading phase (llama-server) and the API key."""

    def __init__(self, app: ASGIApp, replica: Replica) -> None:
        self.app, self.replica = app, replica
        denied = engine.llama_error(401, "Invalid API Key", "authentication_error").payload
        self.denied = {"error": "Unauthorized"} if replica.vllm else denied

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rep, path = self.replica, scope.get("path", "")
        if scope["type"] == "http" and not path.startswith("/sim/"):
            # Deliberately NOT like llama-server: /v1/models answers 200 while loading (a trap for gateways).
            if rep.loading() and path not in ("/v1/models", "/models"):
                await _send_json(send, 503, LOADING)
                return
            if rep.sleeping and path.startswith("/v1/") and path != "/v1/models":
                # Asleep, its weights are off the device: nothing can be generated until /wake_up.
                await _send_json(send, 503, {"error": {"message": "the engine is sleeping", "code": 503}})
                return
            key = rep.cfg.api_key
            guarded = path.startswith("/v1/") and (rep.vllm or path not in LLAMA_PUBLIC)
            guarded = guarded or (not rep.vllm and path in LLAMA_GUARDED)
            if key and guarded and not self._allowed(scope, key):
                await _send_json(send, 401, self.denied)
                return
        await self.app(scope, receive, send)

    def _allowed(self, scope: Scope, key: str) -> bool:
        if _header(scope, b"authorization") == f"Bearer {key}":
            return True
        # llama-server also takes Anthropic's header (its value with or without "Bearer ").
        given = None if self.replica.vllm else _header(scope, b"x-api-key")
        return given is not None and given.removeprefix("Bearer ") == key


class _SimApp(Starlette):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Starlette wraps `send`; keep the server's own one so an injected "close" can reach its transport.
        scope["sim.server_send"] = send
        await super().__call__(scope, receive, send)


def create_app(config: SimConfig) -> Starlette:
    """One replica as an ASGI app; its state is ``app.state.replica``."""
    rep = Replica(config)

    def gen(wire: Wire) -> _Endpoint:
        return _Endpoint(rep, lambda raw, scope, send: rep.generate(wire, raw, scope, send), wire.error_shape)

    def ans(wire: dialect.Answer) -> _Endpoint:
        return _Endpoint(rep, lambda raw, scope, send: rep.answer(wire, raw, scope, send), wire.error_shape)

    chat, completion = gen(dialect.CHAT), gen(dialect.COMPLETION)
    answer_responses = gen(rep.responses.wire)
    post = ["POST"]
    routes = [
        Route("/sim/stats", rep.sim_stats),
        Route("/sim/reset", rep.sim_reset, methods=post),
        Route("/sim/config", rep.sim_config, methods=post),
        Route("/health", rep.health),
        Route("/v1/models", rep.models),
        Route("/metrics", rep.metrics),
        Route("/v1/chat/completions", chat, methods=post),
        Route("/v1/completions", completion, methods=post),
        Route("/v1/messages", gen(messages.WIRE), methods=post),
        Route("/v1/messages/count_tokens", ans(messages.COUNT_TOKENS), methods=post),
        Route("/v1/responses", answer_responses, methods=post),
        Route("/v1/responses/{response_id}", rep.responses.get, methods=["GET"]),
        Route("/v1/responses/{response_id}", rep.responses.delete, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/cancel", rep.responses.cancel, methods=post),
        Route("/v1/embeddings", ans(extras.EMBEDDINGS), methods=post),
        Route("/tokenize", ans(extras.TOKENIZE), methods=post),
        Route("/detokenize", ans(extras.DETOKENIZE), methods=post),
    ]
    if config.engine == "vllm":
        routes += [
            Route("/ping", rep.health, methods=["GET", "POST"]),
            Route("/version", rep.version),
            Route("/load", rep.load),
            Route("/sleep", rep.sleep_mode, methods=post),
            Route("/wake_up", rep.sleep_mode, methods=post),
            Route("/is_sleeping", rep.sleep_mode),
        ]
    else:
        routes += [
            Route("/v1/health", rep.health),
            Route("/models", rep.models),
            Route("/props", rep.props),
            Route("/slots", rep.slots),
            Route("/apply-template", ans(extras.APPLY_TEMPLATE), methods=post),
            Route("/chat/completions", chat, methods=post),
            Route("/completions", completion, methods=post),
            Route("/responses", answer_responses, methods=post),
            Route("/infill", gen(extras.INFILL), methods=post),
            *(Route(p, ans(extras.LLAMA_EMBEDDINGS), methods=post) for p in ("/embedding", "/embeddings")),
            *(
                Route(p, ans(extras.RERANK), methods=post)
                for p in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking")
            ),
        ]

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        if rep.vllm:
            return _json({"detail": exc.detail if isinstance(exc, HTTPException) else "Error"}, status)
        return _json(engine.llama_error(status, "File Not Found", "not_found_error").payload, status)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        rep.ready_at = time.monotonic() + rep.cfg.load_seconds  # loading starts when the server does
        yield

    app = _SimApp(
        routes=routes,
        middleware=[Middleware(_Gate, replica=rep)],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )
    app.state.replica = rep
    return app


class _QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Several replicas share the caller's loop (the demo); signals belong to the caller.
        yield


class SimServer:
    """A replica served by uvicorn in the current event loop."""

    def __init__(self, config: SimConfig, host: str, port: int, log_level: str) -> None:
        self.config, self.host, self.port = config, host, port
        self.app = create_app(config)
        ucfg = uvicorn.Config(
            self.app, host=host, port=port, log_level=log_level, access_log=False, timeout_graceful_shutdown=1
        )
        self.server = _QuietServer(ucfg)
        self.task: asyncio.Task[None] = asyncio.get_running_loop().create_task(self._run())

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def replica(self) -> Replica:
        rep: Replica = self.app.state.replica
        return rep

    async def _run(self) -> None:
        if self.config.engine == "vllm" and self.config.load_seconds > 0:
            # vLLM builds the engine before it listens: clients get "connection refused", never a 503.
            await asyncio.sleep(self.config.load_seconds)
        try:
            await self.server.serve()
        except SystemExit:  # uvicorn exits the process when it cannot bind; keep the caller's loop alive
            raise OSError(f"simulator could not listen on {self.url}") from None

    async def wait_listening(self, limit: float = 30.0) -> None:
        deadline = time.monotonic() + limit
        while not self.server.started:
            if self.task.done():
                self.task.result()
                raise RuntimeError(f"simulator on {self.url} stopped before listening")
            if time.monotonic() > deadline:
                raise TimeoutError(f"simulator on {self.url} did not start listening")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.server.should_exit = True
        if not self.server.started:
            self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def serve_sim(
    config: SimConfig, port: int, host: str = "127.0.0.1", *, log_level: str = "warning"
) -> SimServer:
    """Start a replica in the running loop; ``await server.stop()`` ends it.

    Returns once it listens, except for a vLLM replica with ``load_seconds``: that one binds late (as
    vLLM does), so this returns at once and ``wait_listening()`` waits for the end of the load phase.
    """
    sim = SimServer(config, host, port, log_level)
    if config.engine != "vllm" or config.load_seconds <= 0:
        await sim.wait_listening()
    return sim
