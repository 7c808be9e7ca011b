"""The endpoints beside generation: embeddings, tokenize/detokenize, llama-server's infill and rerank.

Tokens are the stand-in tokenizer's 4-byte slices (``engine.n_tokens``), read as little-endian integers,
the same ids ``/v1/completions`` takes as a prompt; the last slice is padded with zero bytes, which
detokenizing drops. Embeddings (dimension 8) and rerank scores are deterministic from the text.
"""

from __future__ import annotations

import base64
import hashlib
import math
import os
import struct
import time
from collections.abc import Iterator
from typing import Any

import orjson

from gateway.simulator import dialect, engine
from gateway.simulator.dialect import Answer, Reply, Wire
from gateway.simulator.engine import Prepared, SimConfig
from gateway.types import Json

DIM = 8


def tokenize(data: bytes) -> list[int]:
    return [int.from_bytes(data[i : i + 4].ljust(4, b"\0"), "little") for i in range(0, len(data), 4)]


def detokenize(tokens: list[int]) -> str:
    data = b"".join((t & 0xFFFFFFFF).to_bytes(4, "little") for t in tokens)
    return data.rstrip(b"\0").decode("utf-8", "replace")


def _ids(cfg: SimConfig, value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise engine.bad_request(cfg, f'"{name}" must be a list of token ids', name)
    return value


# --- tokenize / detokenize ---------------------------------------------------------------------------


def _tokenize(cfg: SimConfig, raw: bytes, content_type: str | None) -> Json:
    body = engine.parse(cfg, raw, content_type)
    if cfg.engine == "llamacpp":
        content = body.get("content", "")
        data = content.encode() if isinstance(content, str) else b""
        tokens = tokenize(data)
        if body.get("with_pieces") is True:
            return {"tokens": [{"id": t, "piece": detokenize([t])} for t in tokens]}
        return {"tokens": tokens}
    if isinstance(body.get("messages"), list):
        messages = [m for m in body["messages"] if isinstance(m, dict)]
        tools = body.get("tools") if isinstance(body.get("tools"), list) else []
        data = engine.render_chat(cfg, messages, tools or [], engine._thinking(cfg, body)).encode()
    elif isinstance(body.get("prompt"), str):
        data = body["prompt"].encode()
    else:
        raise engine.bad_request(cfg, "'prompt' or 'messages' is required", "prompt")
    tokens = tokenize(data)
    return {"count": len(tokens), "max_model_len": cfg.context, "tokens": tokens, "token_strs": None}


def _apply_template(cfg: SimConfig, raw: bytes, content_type: str | None) -> Json:
    """llama-server's `/apply-template`: the chat messages rendered into the prompt text."""
    body = engine.parse(cfg, raw, content_type)
    messages = [m for m in body.get("messages") or () if isinstance(m, dict)]
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    return {"prompt": engine.render_chat(cfg, messages, tools or [], engine._thinking(cfg, body))}


def _detokenize(cfg: SimConfig, raw: bytes, content_type: str | None) -> Json:
    body = engine.parse(cfg, raw, content_type)
    text = detokenize(_ids(cfg, body.get("tokens", []), "tokens"))
    return {"prompt": text} if cfg.engine == "vllm" else {"content": text}


# --- embeddings --------------------------------------------------------------------------------------


def vector(text: str) -> list[float]:
    """A unit vector of DIM floats that depends on the text alone."""
    digest = hashlib.blake2b(text.encode(), digest_size=4 * DIM).digest()
    raw = [v / 2**31 - 1.0 for v in struct.unpack(f"<{DIM}I", digest)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]


def _inputs(cfg: SimConfig, value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    if isinstance(value, list) and value and all(type(v) is int for v in value):
        return [detokenize(value)]
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return [detokenize(_ids(cfg, v, "input")) for v in value]
    raise engine.bad_request(cfg, '"input" must be a string, an array of strings or of token ids', "input")


def _no_embeddings(cfg: SimConfig) -> engine.ApiError:
    if cfg.engine == "vllm":
        return engine.vllm_error(404, "The model does not support Embeddings API", "NotFoundError")
    message = "This server does not support embeddings. Start it with `--embeddings`"
    return engine.llama_error(501, message, "not_supported_error")


def _embeddings(cfg: SimConfig, raw: bytes, content_type: str | None) -> Json:
    if not cfg.embeddings:
        raise _no_embeddings(cfg)
    body = engine.parse(cfg, raw, content_type)
    texts = _inputs(cfg, body.get("input"))
    as_base64 = body.get("encoding_format") == "base64"
    data = []
    for i, text in enumerate(texts):
        vec: Any = vector(text)
        if as_base64:
            vec = base64.b64encode(struct.pack(f"<{DIM}f", *vec)).decode()
        data.append({"object": "embedding", "index": i, "embedding": vec})
    count = sum(engine.n_tokens(t.encode()) for t in texts)
    out: Json = {"object": "list", "data": data, "model": cfg.model}
    out["usage"] = {"prompt_tokens": count, "total_tokens": count}
    if cfg.engine == "vllm":
        out = {"id": "embd-" + os.urandom(16).hex(), "created": int(time.time()), **out}
    return out


def _llama_embeddings(cfg: SimConfig, raw: bytes, content_type: str | None) -> list[Json]:
    """llama-server's own ``/embeddings``: a bare list, one pooled row per input."""
    if not cfg.embeddings:
        raise _no_embeddings(cfg)
    body = engine.parse(cfg, raw, content_type)
    texts = _inputs(cfg, body.get("content", body.get("input")))
    return [{"index": i, "embedding": [vector(t)]} for i, t in enumerate(texts)]


# --- rerank (llama-server) ---------------------------------------------------------------------------


def score(query: str, document: str) -> float:
    """The share of the query's words the document has, plus a small text-derived tie-breaker."""
    words = set(query.lower().split())
    hits = len(words & set(document.lower().split())) / len(words) if words else 0.0
    tie = hashlib.blake2b(f"{query}\0{document}".encode(), digest_size=2).digest()
    return round(0.9 * hits + 0.1 * int.from_bytes(tie, "little") / 65536, 6)


def _rerank(cfg: SimConfig, raw: bytes, content_type: str | None) -> Json:
    if not cfg.reranking:
        message = "This server does not support reranking. Start it with `--reranking`"
        raise engine.llama_error(501, message, "not_supported_error")
    body = engine.parse(cfg, raw, content_type)
    query, docs = body.get("query"), body.get("documents", body.get("texts"))
    if not isinstance(query, str):
        raise engine.bad_request(cfg, '"query" must be provided')
    if not isinstance(docs, list) or not docs:
        raise engine.bad_request(cfg, '"documents" must be a non-empty string array')
    texts = [d.get("text", "") if isinstance(d, dict) else str(d) for d in docs]
    results = [{"index": i, "relevance_score": score(query, t)} for i, t in enumerate(texts)]
    results.sort(key=lambda r: -float(r["relevance_score"]))
    top_n = body.get("top_n")
    if type(top_n) is int and top_n > 0:
        results = results[:top_n]
    count = sum(engine.n_tokens(f"{query}{t}".encode()) for t in texts)
    usage = {"prompt_tokens": count, "total_tokens": count}
    return {"model": cfg.model, "object": "list", "usage": usage, "results": results}


# --- infill (llama-server) ---------------------------------------------------------------------------


def _infill_prepare(cfg: SimConfig, raw: bytes, content_type: str | None) -> Prepared:
    body = engine.parse(cfg, raw, content_type)
    for name in ("input_prefix", "input_suffix"):
        if not isinstance(body.get(name), str):
            raise engine.bad_request(cfg, f'"{name}" is required and must be a string')
    extra = body.get("input_extra") or []
    if not isinstance(extra, list):
        raise engine.bad_request(
            cfg, '"input_extra" must be an array of {"filename": string, "text": string}'
        )
    files = "".join(
        f"<|file_sep|>{c.get('filename', '')}\n{c.get('text', '')}" for c in extra if isinstance(c, dict)
    )
    prompt = body.get("prompt") if isinstance(body.get("prompt"), str) else ""
    prefix, suffix = body["input_prefix"], body["input_suffix"]
    text = f"{files}<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>{prompt}"
    data = text.encode()
    count = engine.n_tokens(data)
    return Prepared(
        kind="completion",
        stream=body.get("stream") is True,
        include_usage=False,
        prompt=data,
        prompt_tokens=count,
        thinking=False,
        budget=engine._budget(cfg, body, count),
        tool=None,
        cache_salt=None,
        meta={"prompt": text},
    )


def _infill_body(cfg: SimConfig, r: Reply) -> Json:
    text = " ".join(r.out.content)
    return {
        "index": 0,
        "content": text,
        "tokens": [],
        "stop": True,
        "model": cfg.model,
        "tokens_predicted": r.out.completion_tokens,
        "tokens_evaluated": r.prep.prompt_tokens,
        "generation_settings": {"n_predict": r.prep.budget},
        "prompt": r.prep.meta["prompt"],
        "has_new_line": "\n" in text,
        "truncated": False,
        "stop_type": "eos" if r.out.finish_reason == "stop" else "limit",
        "stopping_word": "",
        "tokens_cached": r.cached_tokens,
        "timings": dialect.timings(cfg, r),
    }


def _infill_stream(cfg: SimConfig, r: Reply) -> Iterator[tuple[int, bytes]]:
    # llama-server's own (non-OpenAI) stream: bare `data:` chunks, the last one whole, no [DONE].
    done = 0
    for count, text in dialect.chunks(r.out.content, cfg.chunk_tokens):
        done += count
        chunk = {"index": 0, "content": text, "tokens": [], "stop": False, "tokens_predicted": done}
        yield count, b"data: " + orjson.dumps(chunk) + b"\n\n"
    yield 0, b"data: " + orjson.dumps({**_infill_body(cfg, r), "content": ""}) + b"\n\n"


TOKENIZE = Answer(_tokenize)
DETOKENIZE = Answer(_detokenize)
APPLY_TEMPLATE = Answer(_apply_template)
EMBEDDINGS = Answer(_embeddings)
LLAMA_EMBEDDINGS = Answer(_llama_embeddings)
RERANK = Answer(_rerank)
INFILL = Wire(_infill_prepare, _infill_body, _infill_stream, "infill-")
