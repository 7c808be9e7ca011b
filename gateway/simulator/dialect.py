"""What a simulated replica answers, in each engine's dialect: responses, SSE chunks, model cards, metrics."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import orjson

from gateway.simulator import engine
from gateway.simulator.engine import FINGERPRINT, Prepared, SimConfig
from gateway.simulator.output import Output
from gateway.types import Json


@dataclass(frozen=True)
class Reply:
    """Everything a response needs once the prompt is prefilled."""

    rid: str
    created: int
    prep: Prepared
    out: Output
    cached_tokens: int


def same_shape(cfg: SimConfig, status: int, payload: Json) -> Json:
    return payload


@dataclass(frozen=True)
class Wire:
    """One generating endpoint: how its bytes become a Prepared, and a Reply becomes its answer."""

    prepare: Callable[[SimConfig, bytes, str | None], Prepared]
    response: Callable[[SimConfig, Reply], Json]
    stream: Callable[[SimConfig, Reply], Iterable[tuple[int, bytes]]]
    id_prefix: str
    # Reshapes an error body the engine would send in its usual shape (vLLM's Messages endpoint).
    error_shape: Callable[[SimConfig, int, Json], Json] = same_shape


@dataclass(frozen=True)
class Answer:
    """An endpoint that answers at once (tokenize, embeddings...): the body's JSON, or an ApiError."""

    respond: Callable[[SimConfig, bytes, str | None], Json | list[Json]]
    error_shape: Callable[[SimConfig, int, Json], Json] = same_shape


def chunks(words: tuple[str, ...], step: int) -> Iterator[tuple[int, str]]:
    """(tokens, text) groups of at most ``step`` words; every group but the first has its leading space."""
    for i in range(0, len(words), step):
        group = words[i : i + step]
        yield len(group), (" " if i else "") + " ".join(group)


def usage(cfg: SimConfig, r: Reply) -> Json:
    prompt, done = r.prep.prompt_tokens, r.out.completion_tokens
    details: Json | None = {"cached_tokens": r.cached_tokens}
    if cfg.engine == "vllm" and not cfg.prompt_tokens_details:
        details = None
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + done,
        "completion_tokens": done,
        "prompt_tokens_details": details,
    }


def timings(cfg: SimConfig, r: Reply) -> Json:
    """llama-server's `timings`, from the simulated rates (not the scaled wall clock)."""
    prompt_n, predicted = r.prep.prompt_tokens - r.cached_tokens, r.out.completion_tokens
    prompt_ms, predicted_ms = prompt_n / cfg.prefill_tps * 1000, predicted / cfg.decode_tps * 1000
    return {
        "cache_n": r.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": 1000 / cfg.prefill_tps,
        "prompt_per_second": cfg.prefill_tps,
        "predicted_n": predicted,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": 1000 / cfg.decode_tps,
        "predicted_per_second": cfg.decode_tps,
    }


def _content(cfg: SimConfig, out: Output) -> str | None:
    if out.tool_call is not None or (not out.answered and cfg.engine == "vllm"):
        return None  # vLLM's reasoning parser yields no content when </think> never came
    return " ".join(out.content)


def _envelope(cfg: SimConfig, r: Reply, obj: str, choices: list[Json]) -> Json:
    if cfg.engine == "vllm":
        return {"id": r.rid, "object": obj, "created": r.created, "model": cfg.model, "choices": choices}
    return {
        "choices": choices,
        "created": r.created,
        "id": r.rid,
        "model": cfg.model,
        "system_fingerprint": FINGERPRINT,
        "object": obj,
    }


def response(cfg: SimConfig, r: Reply) -> Json:
    """The non-streaming body."""
    out, vllm = r.out, cfg.engine == "vllm"
    choice: Json
    if r.prep.kind == "chat":
        msg: Json = {"role": "assistant", "content": _content(cfg, out)}
        reasoning = " ".join(out.reasoning)
        calls = [out.tool_call] if out.tool_call else []
        if vllm:
            msg.update(refusal=None, annotations=None, audio=None, function_call=None, tool_calls=calls)
            msg["reasoning"] = reasoning or None
        else:
            if reasoning:
                msg["reasoning_content"] = reasoning
            if calls:
                msg["tool_calls"] = calls
        choice = {"index": 0, "message": msg, "logprobs": None, "finish_reason": out.finish_reason}
        obj = "chat.completion"
    else:
        choice = dict(index=0, text=" ".join(out.content), logprobs=None, finish_reason=out.finish_reason)
        obj = "text_completion"
    if vllm:
        choice["stop_reason"] = None
        choice["token_ids" if obj == "chat.completion" else "prompt_logprobs"] = None
    body = _envelope(cfg, r, obj, [choice])
    body["usage"] = usage(cfg, r)
    if vllm:
        body.update(service_tier=None, system_fingerprint=None, kv_transfer_params=None)
        if obj == "chat.completion":
            body.update(prompt_logprobs=None, prompt_token_ids=None)
    else:
        body["timings"] = timings(cfg, r)
    return body


def _pieces(cfg: SimConfig, r: Reply) -> Iterator[tuple[int, Json]]:
    """(tokens, delta) groups of at most chunk_tokens tokens, never mixing reasoning and content."""
    field = "reasoning" if cfg.engine == "vllm" else "reasoning_content"
    step = cfg.chunk_tokens
    for name, words in ((field, r.out.reasoning), ("content", r.out.content)):
        for i in range(0, len(words), step):
            text = " ".join(words[i : i + step])
            yield len(words[i : i + step]), {name: text if i == 0 else " " + text}
    if r.out.tool_call is not None:
        yield r.out.tool_tokens, {"tool_calls": [{"index": 0, **r.out.tool_call}]}


def _sse(data: Json) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def stream_events(cfg: SimConfig, r: Reply) -> Iterator[tuple[int, bytes]]:
    """(tokens generated before this event, SSE event bytes), ending with ``data: [DONE]``."""
    vllm, chat = cfg.engine == "vllm", r.prep.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"
    finish = r.out.finish_reason

    def choice(delta: Json, reason: str | None) -> Json:
        if not chat:
            c: Json = dict(index=0, text=delta.get("content", ""), logprobs=None, finish_reason=reason)
            if vllm:
                c["stop_reason"] = None
            return c
        c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        if vllm and reason is not None:
            c["stop_reason"] = None
        return c

    if chat:
        first = _envelope(cfg, r, obj, [choice({"role": "assistant", "content": "" if vllm else None}, None)])
        if vllm:
            first["prompt_token_ids"] = None
        yield 0, _sse(first)
    groups = list(_pieces(cfg, r))
    for i, (count, delta) in enumerate(groups):
        # vLLM puts finish_reason on the chunk of the last token; llama-server sends an empty one after.
        reason = finish if vllm and i == len(groups) - 1 else None
        yield count, _sse(_envelope(cfg, r, obj, [choice(delta, reason)]))
    tail: list[Json] = []
    if not vllm or not groups:
        tail.append(_envelope(cfg, r, obj, [choice({}, finish)]))
    if r.prep.include_usage:
        tail.append({**_envelope(cfg, r, obj, []), "usage": usage(cfg, r)})
    if tail and not vllm:
        tail[-1]["timings"] = timings(cfg, r)
    for event in tail:
        yield 0, _sse(event)
    yield 0, DONE


# --- info and metrics --------------------------------------------------------------------------------


def vllm_models(cfg: SimConfig, created: int) -> Json:
    perm = {"id": "modelperm-sim", "object": "model_permission", "created": created, "allow_sampling": True}
    card: Json = {"id": cfg.model, "object": "model", "created": created, "owned_by": "vllm"}
    card.update(root=f"/models/{cfg.model}", parent=None, max_model_len=cfg.context, permission=[perm])
    return {"object": "list", "data": [card]}


def llama_models(cfg: SimConfig, created: int, loading: bool) -> Json:
    meta: Json = {
        "vocab_type": 2,
        "n_vocab": 151936,
        "n_ctx": cfg.context,
        "n_ctx_train": max(cfg.context, 40960),
    }
    meta.update(n_embd=1024, n_params=596049920, size=639446688, ftype=7)
    modalities = {"input_modalities": ["text"], "output_modalities": ["text"]}
    entry: Json = {"id": cfg.model, "aliases": [cfg.model], "tags": [], "object": "model"}
    entry.update(
        architecture=modalities, created=created, owned_by="llamacpp", meta=None if loading else meta
    )
    ollama = {"name": cfg.model, "model": cfg.model, "type": "model", "capabilities": ["completion"]}
    return {"models": [ollama], "object": "list", "data": [entry]}


def llama_props(cfg: SimConfig) -> Json:
    return {
        "default_generation_settings": {"id": 0, "n_ctx": cfg.context, "params": {"n_predict": -1}},
        "total_slots": cfg.slots,
        "model_alias": cfg.model,
        "model_path": f"/models/{cfg.model}.gguf",
        "chat_template": "{# ChatML, Qwen3-style enable_thinking #}",
        "chat_template_caps": {"supports_tools": True, "supports_system_role": True},
        "modalities": {"vision": False, "audio": False},
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "build_info": FINGERPRINT,
        "is_sleeping": False,
    }


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


_METRICS = {  # name: (type, help); counters get the `_total` suffix on the sample line
    "vllm:num_requests_running": ("gauge", "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("gauge", "Number of requests waiting to be processed."),
    "vllm:kv_cache_usage_perc": ("gauge", "KV-cache usage. 1 means 100 percent usage."),
    "vllm:prefix_cache_queries": ("counter", "Prefix cache queries, in terms of number of queried tokens."),
    "vllm:prefix_cache_hits": ("counter", "Prefix cache hits, in terms of number of cached tokens."),
    "vllm:prompt_tokens": ("counter", "Number of prefill tokens processed."),
    "vllm:prompt_tokens_cached": ("counter", "Number of cached prompt tokens (local prefix cache)."),
    "vllm:generation_tokens": ("counter", "Number of generation tokens processed."),
    "llamacpp:prompt_tokens": ("counter", "Number of prompt tokens processed."),
    "llamacpp:prompt_seconds": ("counter", "Prompt process time"),
    "llamacpp:prompt_tokens_cached": ("counter", "Number of prompt tokens served from the cache."),
    "llamacpp:tokens_predicted": ("counter", "Number of generation tokens processed."),
    "llamacpp:tokens_predicted_seconds": ("counter", "Predict process time"),
    "llamacpp:requests_processing": ("gauge", "Number of requests processing."),
    "llamacpp:requests_deferred": ("gauge", "Number of requests deferred."),
}


def prometheus(values: dict[str, float], labels: str = "") -> str:
    lines = []
    for name, value in values.items():
        kind, text = _METRICS[name]
        suffix = "_total" if kind == "counter" else ""
        lines += [f"# HELP {name}{suffix} {text}", f"# TYPE {name}{suffix} {kind}"]
        lines.append(f"{name}{suffix}{labels} {float(value)}")
    return "\n".join(lines) + "\n"


def vllm_labels(cfg: SimConfig) -> str:
    return f'{{engine="0",model_name="{_label(cfg.model)}"}}'


def _prepare_chat(cfg: SimConfig, raw: bytes, content_type: str | None) -> Prepared:
    return engine.prepare(cfg, "chat", raw, content_type)


def _prepare_completion(cfg: SimConfig, raw: bytes, content_type: str | None) -> Prepared:
    return engine.prepare(cfg, "completion", raw, content_type)


CHAT = Wire(_prepare_chat, response, stream_events, "chatcmpl-")
COMPLETION = Wire(_prepare_completion, response, stream_events, "cmpl-")
