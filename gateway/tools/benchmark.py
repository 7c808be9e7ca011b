"""`fleet-gateway bench`: measure every preset of a gateway (or models of any OpenAI endpoint).

Per preset, one request after another (streamed, temperature 0, `ignore_eos` so a model that would stop
early still decodes the whole budget; engines without it ignore the field):

1. decode: a short prompt, `decode_tokens` tokens. Its usage also calibrates tokens per word, since
   the target's tokenizer is unknown here.
2. cold: a ~`prompt_tokens` prompt, TTFT. The text is deterministic so that runs compare, which means
   only the first run after an engine start finds it uncached; `cold_cached_tokens` shows when not.
3. repeat: the same prompt again: TTFT with the prefix cache at work, and decode with that context.
4. parallel: `parallel` streams at once: aggregate and per-request decode rates.
5. tool call: a `tools` request that asks for a call: a parsed `tool_calls` array with JSON arguments?
6. image (vision presets): a PNG of known digits drawn here: does the answer contain them?

Each preset's result is appended as one JSON line. benchreport.py holds the parts that need no network:
the inputs, the record's facts, the file, `--compare`, the progress line.
The client is httpx2, not the gateway's upstream client: this is a user of the endpoint, not the proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import httpx2

from gateway import __version__
from gateway.routing.table import TableError, load_table
from gateway.tools.benchreport import (
    IMAGE_TEXT,
    TOOL,
    TOOL_PROMPT,
    BenchError,
    Progress,
    append_record,
    chat_body,
    check_tool,
    compare,
    decode_messages,
    gpu_info,
    http_error,
    image_messages,
    long_messages,
    model_context,
    parallel_messages,
    preset_settings,
    summary_line,
)
from gateway.types import Json

DEFAULT_URL = "http://127.0.0.1:18000"
COLD_NOTE = "valid only on the first run after an engine start"
FULL = {"decode_tokens": 256, "prompt_tokens": 16000, "parallel": 4}
QUICK = {"decode_tokens": 32, "prompt_tokens": 1000, "parallel": 2}
CONTEXT_MARGIN = 64  # chat-template tokens and the error of the tokens-per-word estimate
TOKENS_PER_WORD_GUESS = 1.4  # English words with a BPE tokenizer; replaced by the measured ratio
TOKEN_FIELDS = ("content", "reasoning_content", "reasoning", "tool_calls")


@dataclass(frozen=True)
class Options:
    """One bench run's settings from the command line: the target and its key, the routing table,
    which presets, the output file, the sizes of the timed requests, and the checks' budget and
    timeout."""

    url: str = DEFAULT_URL
    api_key: str | None = None
    routes: Path | None = None
    presets: tuple[str, ...] = ()
    out: Path = Path("bench-results.jsonl")
    parallel: int = FULL["parallel"]
    decode_tokens: int = FULL["decode_tokens"]
    prompt_tokens: int = FULL["prompt_tokens"]
    quick: bool = False
    check_tokens: int = 512  # budget of the tool and image checks: room for a thinking model's preamble
    timeout: float = 600.0  # longest silence on one request: a 16k prefill on a slow engine takes a while


@dataclass
class Target:
    """One preset (or model) to measure: the name the requests carry, what its replicas serve,
    whether it reads images, its settings from the routing table, and its replicas with their
    contexts."""

    name: str  # the `model` the requests carry
    served_model: str | None
    vision: bool
    settings: Json | None
    replicas: list[Json] = field(default_factory=list)

    @property
    def context(self) -> int | None:
        known = [r["context"] for r in self.replicas if isinstance(r.get("context"), int)]
        return min(known) if known else None


@dataclass
class Sample:
    """One timed, streamed request as measured by the bench: start and end, time to first token,
    decode rate, token counts, and the replica and rewrites the gateway reported."""

    started: float
    ended: float = 0.0
    ttft_s: float | None = None
    decode_tps: float | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    replica: str | None = None
    rewrites: str = ""


# --- the client --------------------------------------------------------------------------------------


def _transport_error(exc: Exception) -> BenchError:
    return BenchError(f"{type(exc).__name__}: {exc or 'no detail'}")


class Client:
    """The bench's HTTP client for one endpoint, sending the key as a bearer token: JSON GETs, whole
    chat completions and timed streams. Transport failures, non-200 answers and non-JSON replies
    raise `BenchError`."""

    def __init__(self, http: httpx2.AsyncClient, base: str, api_key: str | None) -> None:
        self.http = http
        self.base = base
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}

    async def get_json(self, url: str, headers: dict[str, str] | None = None) -> Any:
        try:
            response = await self.http.get(
                url, headers=self.headers if headers is None else headers, timeout=15
            )
        except httpx2.HTTPError as exc:
            raise _transport_error(exc) from None
        if response.status_code != 200:
            raise http_error(response.status_code, response.content)
        try:
            return response.json()
        except ValueError:
            raise BenchError(f"{url} did not answer JSON") from None

    async def complete(self, body: Json) -> tuple[Json, str | None]:
        """One whole chat completion: the answer as a JSON object and the replica that served it
        (from `x-gateway-replica`, None without a gateway); raises `BenchError` on any failure."""
        try:
            response = await self.http.post(
                self.base + "/v1/chat/completions", json=body, headers=self.headers
            )
        except httpx2.HTTPError as exc:
            raise _transport_error(exc) from None
        if response.status_code != 200:
            raise http_error(response.status_code, response.content)
        try:
            data = response.json()
        except ValueError:
            raise BenchError("the answer is not JSON") from None
        if not isinstance(data, dict):
            raise BenchError("the answer is not a JSON object")
        return data, response.headers.get("x-gateway-replica")

    async def stream(self, body: Json, on_token: Callable[[], None] | None = None) -> Sample:
        """TTFT: to the first content, reasoning or tool-call delta. Decode rate: the tokens after the
        first over the time from the first to the last (the usage chunk counts them exactly)."""
        sample = Sample(started=time.perf_counter())
        first = last = None
        chunks = 0
        usage: Json = {}
        try:
            url = self.base + "/v1/chat/completions"
            async with self.http.stream("POST", url, json=body, headers=self.headers) as response:
                sample.replica = response.headers.get("x-gateway-replica")
                sample.rewrites = response.headers.get("x-gateway-rewrites", "")
                if response.status_code != 200:
                    raise http_error(response.status_code, await response.aread())
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators and `:` keep-alive comments
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if not isinstance(event, dict):
                        continue
                    if "error" in event:
                        raise BenchError(f"error in the stream: {http_error(200, data.encode())}")
                    now = time.perf_counter()
                    for choice in event.get("choices") or []:
                        delta = choice.get("delta") or {}
                        if any(delta.get(key) for key in TOKEN_FIELDS):
                            first = now if first is None else first
                            last = now
                            chunks += 1
                            if on_token is not None:
                                on_token()
                    if isinstance(event.get("usage"), dict):
                        usage = event["usage"]
        except httpx2.HTTPError as exc:
            raise _transport_error(exc) from None
        except ValueError as exc:
            raise BenchError(f"a stream event is not JSON: {exc}") from None
        sample.ended = time.perf_counter()
        if first is None or last is None:
            raise BenchError("the stream ended without a single token")
        tokens = usage.get("completion_tokens")
        sample.completion_tokens = tokens if isinstance(tokens, int) else chunks
        sample.prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details")
        sample.cached_tokens = details.get("cached_tokens") if isinstance(details, dict) else None
        sample.ttft_s = round(first - sample.started, 6)
        if sample.completion_tokens > 1 and last > first:
            sample.decode_tps = round((sample.completion_tokens - 1) / (last - first), 2)
        return sample


async def _replica_models(client: Client, name: str, engine: str, url: str, key_env: str | None) -> Json:
    key = os.environ.get(key_env) if key_env else None
    headers = {"authorization": f"Bearer {key}"} if key else {}
    entry: Json = {"name": name, "engine": engine, "url": url, "models": None}
    try:
        entry["models"] = await client.get_json(url + "/v1/models", headers)
    except BenchError as exc:
        entry["error"] = str(exc)
    return entry


async def discover(client: Client, opts: Options) -> tuple[list[Target], str | None]:
    """The presets to bench and the target gateway's version (None when the target is no gateway)."""
    version = None
    replicas_by_preset: dict[str, list[Json]] = {}
    try:
        state = await client.get_json(client.base + "/ui/state")
    except BenchError:
        state = None  # not a gateway (or an older one): the record says less, the bench still runs
    if isinstance(state, dict) and isinstance(state.get("presets"), list):
        version = state.get("version")
        for preset in state["presets"]:
            replicas_by_preset[preset.get("name")] = [
                {k: r.get(k) for k in ("name", "engine", "context", "state")} | {"models": None}
                for r in preset.get("replicas") or []
            ]
    if opts.routes is not None:
        table = load_table(opts.routes)
        unique = {r.name: r for p in table.presets.values() for r in p.replicas}
        answers = await asyncio.gather(
            *(_replica_models(client, r.name, r.engine, r.url, r.api_key_env) for r in unique.values())
        )
        by_name = {entry["name"]: entry for entry in answers}
        targets = []
        for preset in table.presets.values():
            replicas = [dict(by_name[r.name]) for r in preset.replicas]
            for entry in replicas:
                entry["context"] = model_context(entry["models"], preset.served_model)
            # A `discover` preset lists no replicas in the table; the gateway knows which it found.
            replicas = replicas or replicas_by_preset.get(preset.name, [])
            settings = preset_settings(preset)
            targets.append(Target(preset.name, preset.served_model, preset.vision, settings, replicas))
    else:
        models = await client.get_json(client.base + "/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        cards = [c for c in data or [] if isinstance(c, dict) and c.get("id")]
        if any("served_model" in c for c in cards):  # a gateway: presets (alias cards carry `preset`)
            targets = [
                Target(
                    c["id"],
                    c.get("served_model"),
                    bool(c.get("vision")),
                    None,
                    replicas_by_preset.get(c["id"], []),
                )
                for c in cards
                if "served_model" in c
            ]
        else:  # a plain OpenAI endpoint: every model it lists
            host = urlsplit(client.base).netloc
            targets = []
            for card in cards:
                modalities = (card.get("architecture") or {}).get("input_modalities") or []
                owner = card.get("owned_by")
                entry = {
                    "name": host,
                    "engine": owner if owner in ("vllm", "llamacpp") else None,
                    "url": client.base,
                    "models": models,
                    "context": model_context(models, card["id"]),
                }
                targets.append(Target(card["id"], card["id"], "image" in modalities, None, [entry]))
    if opts.presets:
        known = {t.name: t for t in targets}
        unknown = [name for name in opts.presets if name not in known]
        if unknown:
            raise BenchError(f"unknown preset(s) {', '.join(unknown)}; the target has: {', '.join(known)}")
        targets = [known[name] for name in opts.presets]
    if not targets:
        raise BenchError(f"{client.base} lists no models to bench")
    return targets, version if isinstance(version, str) else None


# --- the run -----------------------------------------------------------------------------------------

RAISED = re.compile(r"max(?:_completion)?_tokens=(\d+)->(\d+)")


def _steps(target: Target) -> int:
    return 6 if target.vision else 5


def _tool_error(exc: BenchError) -> str:
    text = str(exc)
    if "enable-auto-tool-choice" in text or "tool-call-parser" in text:
        text += " (a vLLM replica needs --enable-auto-tool-choice --tool-call-parser <parser> for tools)"
    return text


class Bench:
    """Measures one target after another with a shared client and progress line: decode, cold and
    repeated long prompt, parallel streams, a tool call and, for vision presets, an image."""

    def __init__(self, client: Client, opts: Options, progress: Progress) -> None:
        self.client, self.opts, self.progress = client, opts, progress

    async def timed(self, target: Target, messages: list[Json], label: str) -> Sample:
        """One streamed request, its tokens counted on the progress line."""
        count = 0

        def tick() -> None:
            nonlocal count
            count += 1
            self.progress.detail(f"{label}: {count} tokens")

        body = chat_body(target.name, messages, self.opts.decode_tokens)
        return await self.client.stream(body, tick)

    async def preset(self, target: Target, base: Json) -> Json:
        """Runs every step for one target and returns its JSON record (`base` plus results, the
        replica of each step, notes and per-step errors); a failed decode ends the record there with
        `error`, since every other step would fail the same way."""
        opts, progress = self.opts, self.progress
        results: Json = {
            "decode_tps": None,
            "decode_tokens": None,
            "cold_ttft_s": None,
            "cold_ttft_note": COLD_NOTE,
            "cold_cached_tokens": None,
            "cold_ttft_valid": None,
            "prompt_tokens": None,
            "repeat_ttft_s": None,
            "cached_tokens_on_repeat": None,
            "decode_tps_with_context": None,
            "parallel": None,
            "tool_call": None,
            "image": None,
            "errors": {},
        }
        served: Json = {}
        notes: list[str] = []
        record = {**base, "results": results, "served_by": served, "notes": notes, "error": None}
        errors: Json = results["errors"]

        progress.start(f"{target.name}: decode {opts.decode_tokens} tokens")
        messages = decode_messages()
        try:
            decode = await self.timed(target, messages, "decode")
        except BenchError as exc:
            # Nothing answers: the other steps would only fail the same way, each after its timeout.
            record["error"] = f"decode: {exc}"
            progress.advance(_steps(target))
            return record
        progress.advance()
        results.update(decode_tps=decode.decode_tps, decode_tokens=decode.completion_tokens)
        served["decode"] = decode.replica
        for low, high in {m.groups() for m in RAISED.finditer(decode.rewrites)}:
            notes.append(
                f"the gateway raised max_tokens {low}->{high} (the preset's min_max_tokens): "
                f"each timed request decoded {high} tokens, not {opts.decode_tokens}"
            )

        words = len(messages[0]["content"].split())
        per_word = decode.prompt_tokens / words if decode.prompt_tokens else TOKENS_PER_WORD_GUESS
        tokens = opts.prompt_tokens
        context = target.context
        if context is not None and tokens > context - opts.decode_tokens - CONTEXT_MARGIN:
            tokens = max(context - opts.decode_tokens - CONTEXT_MARGIN, 64)
            notes.append(
                f"long prompt clamped to ~{tokens} tokens: the smallest replica context is {context}"
            )

        progress.start(f"{target.name}: cold TTFT, ~{tokens}-token prompt")
        long: list[Json] | None = None
        try:
            cold, long = await self.long_prompt(target, tokens, per_word, notes)
        except BenchError as exc:
            errors["cold"] = str(exc)
        else:
            valid = None
            if cold.cached_tokens is not None and cold.prompt_tokens:
                valid = cold.cached_tokens * 10 < cold.prompt_tokens
            results.update(
                cold_ttft_s=cold.ttft_s,
                cold_cached_tokens=cold.cached_tokens,
                cold_ttft_valid=valid,
                prompt_tokens=cold.prompt_tokens,
            )
            served["cold"] = cold.replica
            if valid is False:
                notes.append(
                    f"cold TTFT is not cold: {cold.cached_tokens} of {cold.prompt_tokens} prompt tokens were "
                    f"already cached (this prompt ran since the engine started); restart it for a cold number"
                )
        progress.advance()

        progress.start(f"{target.name}: repeat TTFT, decode with the context loaded")
        if long is None:
            errors["repeat"] = "skipped: the cold request failed"
        else:
            try:
                repeat = await self.timed(target, long, "repeat")
            except BenchError as exc:
                errors["repeat"] = str(exc)
            else:
                results.update(
                    repeat_ttft_s=repeat.ttft_s,
                    cached_tokens_on_repeat=repeat.cached_tokens,
                    decode_tps_with_context=repeat.decode_tps,
                )
                served["repeat"] = repeat.replica
                if repeat.cached_tokens is None:
                    notes.append(
                        "the engine reports no cached tokens (usage.prompt_tokens_details is missing; "
                        "vLLM needs --enable-prompt-tokens-details)"
                    )
                if repeat.replica and served.get("cold") and repeat.replica != served["cold"]:
                    notes.append(
                        f"the repeat went to {repeat.replica}, the cold request to {served['cold']}: "
                        "a cache on another replica cannot help (policy prefix_affinity keeps them together)"
                    )
        progress.advance()

        progress.start(f"{target.name}: {opts.parallel} parallel streams")
        try:
            results["parallel"], served["parallel"] = await self.parallel(target)
        except BenchError as exc:
            errors["parallel"] = str(exc)
        progress.advance()

        progress.start(f"{target.name}: tool call")
        body = chat_body(
            target.name, [{"role": "user", "content": TOOL_PROMPT}], opts.check_tokens, timed=False
        )
        body["tools"] = [TOOL]
        try:
            answer, served["tool_call"] = await self.client.complete(body)
        except BenchError as exc:
            results["tool_call"] = {"ok": False, "detail": _tool_error(exc)}
        else:
            ok, detail = check_tool(answer)
            results["tool_call"] = {"ok": ok, "detail": detail}
        progress.advance()

        if target.vision:
            progress.start(f"{target.name}: image check")
            results["image"] = await self.image(target, served)
            progress.advance()
        return record

    async def long_prompt(
        self, target: Target, tokens: int, per_word: float, notes: list[str]
    ) -> tuple[Sample, list[Json]]:
        """The cold request; once more, shorter, when the error names a smaller context."""
        for attempt in (1, 2):
            words = max(int(tokens / per_word), 16)
            messages = long_messages(target.name, words)
            try:
                return await self.timed(target, messages, "cold"), messages
            except BenchError as exc:
                room = None if exc.context is None else exc.context - self.opts.decode_tokens - CONTEXT_MARGIN
                if attempt == 2 or room is None or room < 64:
                    raise
                if exc.prompt_tokens:  # the engine counted this prompt: a better ratio than the estimate
                    per_word = exc.prompt_tokens / words
                # Aim below the room, so that the estimate's error does not cause a second miss.
                tokens = int(min(tokens, room) * 0.8)
                notes.append(
                    f"the long prompt did not fit a context of {exc.context}: retried with ~{tokens}"
                )
        raise AssertionError("unreachable")

    async def parallel(self, target: Target) -> tuple[Json, list[str | None]]:
        """Runs `parallel` streams at once: the aggregate and per-request decode rates, token count
        and wall time, with the replica of each stream. Raises `BenchError` when any stream
        fails."""
        n = self.opts.parallel
        count = 0

        def tick() -> None:
            nonlocal count
            count += 1
            self.progress.detail(f"parallel: {count} tokens")

        bodies = [chat_body(target.name, parallel_messages(i, n), self.opts.decode_tokens) for i in range(n)]
        outcomes = await asyncio.gather(
            *(self.client.stream(b, tick) for b in bodies), return_exceptions=True
        )
        samples = [s for s in outcomes if isinstance(s, Sample)]
        failed = [e for e in outcomes if not isinstance(e, Sample)]
        if failed:
            raise BenchError(f"{len(failed)} of {n} streams failed: {failed[0]}")
        wall = max(s.ended for s in samples) - min(s.started for s in samples)
        tokens = sum(s.completion_tokens or 0 for s in samples)
        rates = [s.decode_tps for s in samples if s.decode_tps is not None]
        result = {
            "n": n,
            "aggregate_tps": round(tokens / wall, 2) if wall > 0 else None,
            "per_request_tps": round(sum(rates) / len(rates), 2) if rates else None,
            "per_request_tps_min": min(rates) if rates else None,
            "completion_tokens": tokens,
            "wall_s": round(wall, 6),
        }
        return result, [s.replica for s in samples]

    async def image(self, target: Target, served: Json) -> Json:
        body = chat_body(target.name, image_messages(), self.opts.check_tokens, timed=False)
        try:
            answer, served["image"] = await self.client.complete(body)
        except BenchError as exc:
            return {"ok": False, "answer": None, "expected": IMAGE_TEXT, "error": str(exc)}
        message = ((answer.get("choices") or [{}])[0]).get("message") or {}
        text = str(
            message.get("content") or message.get("reasoning_content") or message.get("reasoning") or ""
        )
        ok = IMAGE_TEXT in re.sub(r"[\s,.'-]", "", text)
        return {"ok": ok, "answer": text[:200], "expected": IMAGE_TEXT}


def _base_url(url: str) -> str:
    """The server root: people paste an SDK's base_url, which ends in /v1."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def _run(opts: Options, gpu: Json | None, stream: TextIO | None) -> list[Json]:
    timeout = httpx2.Timeout(opts.timeout, connect=10.0)
    limits = httpx2.Limits(max_connections=max(opts.parallel, 4) + 4)
    # trust_env off: a proxy between the bench and the target would be measured too.
    async with httpx2.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as http:
        client = Client(http, _base_url(opts.url), opts.api_key)
        targets, version = await discover(client, opts)
        progress = Progress(sum(_steps(t) for t in targets), stream)
        bench = Bench(client, opts, progress)
        records = []
        for target in targets:
            base: Json = {
                "time": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
                "gateway_version": version,
                "bench_version": __version__,
                "target": client.base,
                "preset": target.name,
                "served_model": target.served_model,
                "vision": target.vision,
                "replicas": target.replicas,
                "settings": target.settings,
                "options": {
                    "decode_tokens": opts.decode_tokens,
                    "prompt_tokens": opts.prompt_tokens,
                    "parallel": opts.parallel,
                    "quick": opts.quick,
                },
                "gpu": gpu,
            }
            end = progress.done + _steps(target)
            try:
                record = await bench.preset(target, base)
            except Exception as exc:  # a bug or a surprise answer: record it, go on with the next preset
                record = {**base, "results": None, "served_by": {}, "notes": [], "error": repr(exc)}
            progress.done = end
            append_record(opts.out, record)
            records.append(record)
        progress.close()
        return records


def run_bench(opts: Options, stream: TextIO | None = None) -> list[Json]:
    """Bench every selected preset, appending each record to `opts.out`; progress goes to `stream`.

    Raises BenchError (or TableError) when there is nothing to bench: the target lists no models,
    a named preset is unknown, the routing table is invalid.
    """
    return asyncio.run(_run(opts, gpu_info(), stream))


def options_from_args(args: argparse.Namespace) -> Options:
    scale = QUICK if args.quick else FULL
    return Options(
        url=args.url,
        api_key=args.api_key,
        routes=args.routes,
        presets=tuple(args.preset or ()),
        out=args.out,
        parallel=args.parallel or scale["parallel"],
        decode_tokens=args.decode_tokens or scale["decode_tokens"],
        prompt_tokens=args.prompt_tokens or scale["prompt_tokens"],
        quick=args.quick,
        check_tokens=64 if args.quick else Options.check_tokens,
    )


def bench_command(args: argparse.Namespace) -> int:
    """0: every preset measured; 1: some preset failed entirely; 2: nothing could be benched."""
    if args.compare:
        try:
            print(compare(*args.compare), end="")
        except (OSError, ValueError) as exc:
            print(f"fleet-gateway bench: {exc}", file=sys.stderr)
            return 2
        return 0
    opts = options_from_args(args)
    try:
        records = run_bench(opts, sys.stderr)
    except (BenchError, TableError) as exc:
        print(f"fleet-gateway bench: {exc}", file=sys.stderr)
        return 2
    for record in records:
        print(summary_line(record))
    failed = [r["preset"] for r in records if r.get("error")]
    print(
        f"{len(records)} result lines appended to {opts.out}"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0
