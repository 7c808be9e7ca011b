"""The pure model of one replica: rendering, caching, budgets, text and wire shapes.

Nothing here sleeps or touches a socket, so every rule in docs/engines.md that the simulator models can be
checked with plain values. ``app.py`` adds the clock, the slots and HTTP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import random
import re
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from gateway.simulator import engine_quirks, misbehave, script
from gateway.simulator.output import Output
from gateway.types import Json

Engine = Literal["vllm", "llamacpp"]

_WORDS = "the a model token cache slot prefix block queue reply stream fleet gateway replica answer quick"
VOCAB = (*_WORDS.split(), "steady", "small", "bright", "river", "stone", "cloud", "light", "north", "field")
IMAGE_TOKENS = 256
THINK_OFF = "<think>\n\n</think>\n\n"
FINGERPRINT = "b11434-sim"
# Compiled once: the per-request path must stay lean when the simulator is a benchmark upstream.
_TOOL_WORDS = re.compile(r"\b(?:call|tool)\b", re.IGNORECASE)
_SAMPLE: dict[str, Any] = {"string": "example", "integer": 1, "number": 1.5, "boolean": True, "null": None}


@dataclass(frozen=True)
class SimConfig:
    """One simulated replica's configuration: its engine and served model, speeds, slots and
    context, cache geometry, what it answers and supports, and injected quirks. Validated on
    creation (`ValueError`); the CLI has a flag per field and `/sim/config` changes the speed knobs
    live."""

    engine: Engine
    model: str
    seed: int = 0
    slots: int = 4
    context: int = 32768
    prefill_tps: float = 5000.0
    decode_tps: float = 50.0
    time_scale: float = 1.0
    reasoning_tokens: int = 300
    answer_tokens: int = 24
    thinking_default: bool = True
    block_size: int = 16
    cache_blocks: int = 4096
    prompt_tokens_details: bool = True
    tool_parser: bool = True
    metrics: bool = True
    load_seconds: float = 0.0
    api_key: str | None = None
    chunk_tokens: int = 1
    embeddings: bool = False  # llama-server's --embeddings (vLLM: a pooling model) for /v1/embeddings
    reranking: bool = False  # llama-server's --reranking for /rerank and /v1/rerank
    summaries: bool = False  # an agent's compaction request gets a <summary> reply (script.summary)
    # engine_quirks.py: refuse tool schemas holding these keywords; drop images in tool results
    refuse_schema_keywords: tuple[str, ...] = ()
    drop_tool_images: bool = False
    misbehave: str = ""  # misbehave.py: how tool calls come out broken (comma-separated modes)

    def __post_init__(self) -> None:
        if self.engine not in ("vllm", "llamacpp"):
            raise ValueError(f"engine must be 'vllm' or 'llamacpp', not {self.engine!r}")
        if min(self.slots, self.context, self.block_size, self.cache_blocks, self.chunk_tokens) < 1:
            raise ValueError("slots, context, block_size, cache_blocks and chunk_tokens must be >= 1")
        if self.prefill_tps <= 0 or self.decode_tps <= 0:
            raise ValueError("prefill_tps and decode_tps must be > 0")
        if min(self.time_scale, self.load_seconds, self.reasoning_tokens, self.answer_tokens) < 0:
            raise ValueError("time_scale, load_seconds, reasoning_tokens and answer_tokens must be >= 0")
        misbehave.modes(self.misbehave)


class ApiError(Exception):
    """A refusal with the status and body the engine's own server would send."""

    def __init__(self, status: int, payload: Json) -> None:
        super().__init__(status, payload)
        self.status = status
        self.payload = payload


def vllm_error(status: int, message: str, etype: str, param: str | None = None) -> ApiError:
    return ApiError(status, {"error": {"message": message, "type": etype, "param": param, "code": status}})


def llama_error(status: int, message: str, etype: str, **extra: Any) -> ApiError:
    return ApiError(status, {"error": {"code": status, "message": message, "type": etype, **extra}})


def bad_request(cfg: SimConfig, message: str, param: str | None = None) -> ApiError:
    if cfg.engine == "vllm":
        return vllm_error(400, message, "BadRequestError", param)
    return llama_error(400, message, "invalid_request_error")


def server_error(cfg: SimConfig, status: int, message: str) -> Json:
    if cfg.engine == "vllm":
        etype = "ServiceUnavailableError" if status == 503 else "InternalServerError"
        return vllm_error(status, message, etype).payload
    return llama_error(status, message, "unavailable_error" if status == 503 else "server_error").payload


def n_tokens(data: bytes) -> int:
    """The stand-in tokenizer: one token per started 4-byte slice."""
    return (len(data) + 3) // 4


# --- rendering ---------------------------------------------------------------------------------------


def _image(part: Json) -> str:
    ref = part.get("image_url", part.get("image", ""))
    url = ref.get("url", "") if isinstance(ref, dict) else ref
    # Same image -> same bytes (a cache hit), like vLLM's multimodal hashes; 1024 bytes = 256 tokens.
    digest = hashlib.blake2b(str(url).encode(), digest_size=32).hexdigest()
    return "<image>" + digest * (IMAGE_TOKENS * 4 // len(digest))


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict):
                continue
            ptype = part.get("type")
            if ptype == "text":
                out.append(str(part.get("text", "")))
            elif ptype in ("image_url", "input_image", "image"):
                out.append(_image(part))
        return "".join(out)
    return str(content)


def _tool_json(cfg: SimConfig, tool: Any) -> str:
    # Both engines rebuild the wrapper (its key order never matters) but keep `parameters` as sent.
    fn = tool.get("function") if isinstance(tool, dict) else None
    fn = fn if isinstance(fn, dict) else {}
    desc = fn.get("description", None if cfg.engine == "vllm" else "")
    inner: Json = {"name": fn.get("name"), "description": desc, "parameters": fn.get("parameters")}
    if cfg.engine == "vllm" and "strict" in fn:
        inner["strict"] = fn["strict"]
    return json.dumps({"type": "function", "function": inner}, ensure_ascii=False)


def _call_text(call: Any) -> str:
    fn = call.get("function", {}) if isinstance(call, dict) else {}
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        # vLLM json.loads the arguments before rendering, so their whitespace never reaches the prompt.
        with contextlib.suppress(ValueError):
            args = json.loads(args)
    return "\n<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)


def render_chat(cfg: SimConfig, messages: list[Json], tools: list[Any], thinking: bool) -> str:
    """The prompt a Qwen-style ChatML template would render: the system message with the tools
    block, each turn (assistant tool calls as `<tool_call>` text, tool results as user turns), the
    open assistant turn, and an empty think block when thinking is off."""
    parts: list[str] = []
    block = ""
    if tools:
        block = "\n\n# Tools\n\n<tools>" + "".join("\n" + _tool_json(cfg, t) for t in tools) + "\n</tools>"
    rest = messages
    if messages and messages[0].get("role") == "system":
        parts.append(f"<|im_start|>system\n{_text(messages[0].get('content'))}{block}<|im_end|>\n")
        rest = messages[1:]
    elif block:
        parts.append(f"<|im_start|>system\n{block.lstrip()}<|im_end|>\n")
    for msg in rest:
        role, content = msg.get("role"), _text(msg.get("content"))
        calls = msg.get("tool_calls")
        if role == "assistant" and isinstance(calls, list):
            content += "".join(_call_text(c) for c in calls)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    if not thinking:
        parts.append(THINK_OFF)
    return "".join(parts)


def _thinking(cfg: SimConfig, body: Json) -> bool:
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and "enable_thinking" in kwargs:
        value = kwargs["enable_thinking"]
        if isinstance(value, bool):
            return value
        if cfg.engine == "llamacpp" and isinstance(value, str):
            raise bad_request(cfg, 'invalid type for "enable_thinking" (expected boolean, got string)')
        # vLLM hands a string to the template, whose `is false` test never matches it: the default wins.
        return cfg.thinking_default
    effort = body.get("reasoning_effort")
    if effort == "none":
        return False
    if effort is not None and cfg.engine == "vllm":
        return True
    return cfg.thinking_default


def _pick_tool(cfg: SimConfig, body: Json, messages: list[Json], guess: bool = True) -> Json | None:
    tools = body.get("tools")
    if not tools:
        return None
    choice = body.get("tool_choice", "auto")
    if choice == "none":
        return None
    if cfg.engine == "vllm" and not cfg.tool_parser:
        if choice == "auto":
            raise bad_request(
                cfg, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
            )
        raise bad_request(cfg, "tool_choice other than 'none' requires --tool-call-parser to be set")
    if isinstance(choice, dict):
        wanted = (choice.get("function") or {}).get("name")
        for tool in tools:
            if isinstance(tool, dict) and (tool.get("function") or {}).get("name") == wanted:
                return tool
        raise bad_request(cfg, f"Tool '{wanted}' has not been passed in `tools`.", "tool_choice")
    if choice == "required":
        return tools[0] if isinstance(tools[0], dict) else None
    users = [m for m in messages if m.get("role") == "user"]
    if guess and users and _TOOL_WORDS.search(script.strip_markers(_text(users[-1].get("content")))):
        return tools[0] if isinstance(tools[0], dict) else None
    return None


def tool_arguments(tool: Json) -> str:
    """A plausible value for every required property, by its schema type."""
    params = (tool.get("function") or {}).get("parameters") or {}
    props = params.get("properties") or {}
    args: Json = {}
    for name in params.get("required") or []:
        spec = props.get(name) or {}
        if spec.get("enum"):
            args[name] = spec["enum"][0]
            continue
        kind = spec.get("type", "string")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "null")
        args[name] = [] if kind == "array" else {} if kind == "object" else _SAMPLE.get(kind, "example")
    return json.dumps(args, ensure_ascii=False)


# --- request preparation -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Prepared:
    """A request as the simulated engine accepted it: its kind, stream and usage options, rendered
    prompt and its token count, thinking, token budget, the tool it will call, cache salt, and the
    script or metadata its answer needs."""

    kind: Literal["chat", "completion"]
    stream: bool
    include_usage: bool
    prompt: bytes
    prompt_tokens: int
    thinking: bool
    budget: int
    tool: Json | None
    cache_salt: str | None
    script: script.Script | None = None
    meta: Json = dataclasses.field(default_factory=dict)  # what a dialect keeps for its answer


def _int_field(cfg: SimConfig, body: Json, name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low or value > 2**31 - 1:
        if cfg.engine == "vllm":
            raise vllm_error(400, f"{name} must be an integer >= {low}, got {value!r}.", "Bad Request", name)
        raise bad_request(cfg, f'"{name}" must be an integer in [{low}, 2147483647]')
    return value


def _budget(cfg: SimConfig, body: Json, prompt_tokens: int) -> int:
    ctx = cfg.context
    if cfg.engine == "vllm":
        mct = _int_field(cfg, body, "max_completion_tokens", 1)
        limit = mct if mct is not None else _int_field(cfg, body, "max_tokens", 1)
        if limit is not None and limit > ctx:
            raise bad_request(cfg, f"max_tokens={limit} cannot be greater than max_model_len={ctx}.")
        if prompt_tokens >= ctx:
            raise bad_request(
                cfg,
                f"This model's maximum context length is {ctx} tokens. However, your prompt contains "
                f"{prompt_tokens} input tokens, which exceeds this limit even without any output tokens. "
                "Please reduce the length of the input prompt.",
                "input_tokens",
            )
    else:
        limit = None
        for name in ("n_predict", "max_completion_tokens", "max_tokens"):
            if body.get(name) is not None:
                limit = _int_field(cfg, body, name, -1)
                break
        if prompt_tokens >= ctx:
            raise llama_error(
                400,
                f"request ({prompt_tokens} tokens) exceeds the available context size ({ctx} tokens), "
                "try increasing it",
                "exceed_context_size_error",
                n_prompt_tokens=prompt_tokens,
                n_ctx=ctx,
            )
    room = ctx - prompt_tokens
    # vLLM 0.32 clamps to the room left; llama-server stops at a full context with "length".
    return room if limit is None or limit < 0 else min(limit, room)


def _is_json(content_type: str | None) -> bool:
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == "application/json"


def parse(cfg: SimConfig, raw: bytes, content_type: str | None) -> Json:
    """The request body as a JSON object, refused as the configured engine refuses what is not one."""
    vllm = cfg.engine == "vllm"
    if vllm and not _is_json(content_type):
        raise vllm_error(400, "Unsupported Media Type: Only 'application/json' is allowed", "Bad Request")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if vllm:
            raise vllm_error(400, f"JSON decode error: {exc}", "Bad Request", "body") from None
        raise bad_request(cfg, f"Failed to parse the request body as JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(cfg, "The request body must be a JSON object", "body")
    return body


def prepare(
    cfg: SimConfig, kind: Literal["chat", "completion"], raw: bytes, content_type: str | None
) -> Prepared:
    """Validate a request as the configured engine does and render its prompt; raise ApiError if refused."""
    return prepare_body(cfg, kind, parse(cfg, raw, content_type))


def prepare_body(
    cfg: SimConfig,
    kind: Literal["chat", "completion"],
    body: Json,
    meta: Json | None = None,
    guess_tools: bool = True,
) -> Prepared:
    """``prepare`` for a parsed body (other dialects convert theirs to a chat body first).

    `guess_tools`: a chat request whose last user message says "call" or "tool" gets a call of its
    first tool. Agents' requests (Messages, Responses) are full of both words in their reminders:
    there only the scripted marker asks for a tool, or Claude Code would spawn subagents forever.
    """
    vllm = cfg.engine == "vllm"
    stream = body.get("stream") is True
    options = body.get("stream_options")
    if vllm and options is not None and not stream:
        raise vllm_error(
            400, "Value error, Stream options can only be defined when `stream=True`.", "Bad Request", "body"
        )
    model = body.get("model")
    if vllm and model not in (None, "", cfg.model):
        raise vllm_error(
            404, f"The model `{model}` does not exist. Valid aliases: {cfg.model}.", "NotFoundError", "model"
        )
    tool = scripted = None
    thinking = False
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise bad_request(cfg, "'messages' is required and must be a list of objects", "body.messages")
        tools = body.get("tools") or []
        if not isinstance(tools, list):
            raise bad_request(cfg, "'tools' must be a list", "body.tools")
        if refusal := engine_quirks.refused_schema(cfg.engine, cfg.refuse_schema_keywords, tools):
            raise bad_request(cfg, refusal)
        if cfg.drop_tool_images:
            messages = engine_quirks.without_tool_images(messages)
        kwargs = body.get("chat_template_kwargs")
        if vllm and (body.get("chat_template") or (isinstance(kwargs, dict) and "chat_template" in kwargs)):
            raise bad_request(
                cfg,
                "Chat template is passed with request, but --trust-request-chat-template is not set. "
                "Refused request with untrusted chat template.",
            )
        thinking = _thinking(cfg, body)
        tool = _pick_tool(cfg, body, messages, guess_tools)
        scripted = script.summary(messages) if cfg.summaries else None
        scripted = scripted or script.detect(messages, tools, body.get("tool_choice", "auto"))
        scripted = scripted or script.structured(body)
        prompt = render_chat(cfg, messages, tools, thinking).encode()
    else:
        raw_prompt = body.get("prompt")
        if isinstance(raw_prompt, str):
            prompt = raw_prompt.encode()
        elif isinstance(raw_prompt, list) and raw_prompt and all(isinstance(p, str) for p in raw_prompt):
            prompt = "".join(raw_prompt).encode()
        elif isinstance(raw_prompt, list) and raw_prompt and all(type(p) is int for p in raw_prompt):
            # Token ids: exactly one 4-byte slice each, so counts match what the client sent.
            prompt = b"".join((p & 0xFFFFFFFF).to_bytes(4, "little") for p in raw_prompt)
        else:
            raise bad_request(cfg, "'prompt' is required: a string, a list of strings or token ids", "prompt")
    count = n_tokens(prompt)
    salt = body.get("cache_salt") if vllm else None
    return Prepared(
        kind=kind,
        stream=stream,
        include_usage=isinstance(options, dict) and options.get("include_usage") is True,
        prompt=prompt,
        prompt_tokens=count,
        thinking=thinking,
        budget=_budget(cfg, body, count),
        tool=tool,
        cache_salt=salt if isinstance(salt, str) else None,
        script=scripted,
        meta=meta or {},
    )


# --- generation --------------------------------------------------------------------------------------


def generate(cfg: SimConfig, prep: Prepared, counter: int) -> Output:
    """Deterministic output for request number ``counter``: reasoning first, charged to the budget."""
    budget = prep.budget
    n_reason = min(cfg.reasoning_tokens, budget) if prep.thinking else 0
    left = budget - n_reason
    call: Json | None = None
    tool_tokens = n_content = 0
    echo: tuple[str, ...] = ()
    plan = prep.script
    if plan is None and prep.tool is not None:
        plan = script.Script(
            name=(prep.tool.get("function") or {}).get("name"), arguments=tool_arguments(prep.tool)
        )
    if prep.thinking and cfg.reasoning_tokens > 0 and left <= 0:
        finish = "length"  # the "thinking ate max_tokens" trap
    elif plan is not None and plan.echo is not None:
        pieces = plan.echo.split(" ")  # joined again with single spaces: the text comes back exactly
        echo = tuple(pieces[:left])
        finish = "stop" if len(echo) == len(pieces) else "length"
    elif plan is not None:
        name, args = plan.name, plan.arguments
        need = n_tokens(f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'.encode())
        if need <= left:
            call = {
                "id": f"call_{counter}",
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            tool_tokens, finish = need, "tool_calls"
        else:
            finish = "length"
    else:
        n_content = min(cfg.answer_tokens, left)
        finish = "stop" if n_content == cfg.answer_tokens else "length"
    words = random.Random(cfg.seed * 2**32 + counter).choices(VOCAB, k=n_reason + n_content)
    content = echo or tuple(words[n_reason:])
    answered = call is None and (finish == "stop" or len(content) > 0)
    return Output(tuple(words[:n_reason]), content, call, tool_tokens, finish, answered)
