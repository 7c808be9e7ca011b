"""Prefix-cache hygiene: volatile content in system prompts, the prefix fingerprint, the affinity key.

vLLM and llama.cpp reuse a cached prompt prefix only when it is identical token for token; one
timestamp or request id in a system prompt makes every request a full prefill (a 16k prompt: 3.9 s
instead of 0.08 s). This module finds such spans in the leading system/developer messages and,
as the preset says, reports them (`warn`), moves them to the end of the last user message
(`move`: the model still sees them, the prefix stays stable) or removes them (`strip`).

Pure: functions of the body; the detection result is cached by the text's hash because agents
resend the same system prompt on every call. `PrefixStep`, at the end, is the request path's step:
it applies the preset's mode, records what it found and logs a volatile system prompt once per
client and prompt.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import xxhash

from gateway.lru import Lru
from gateway.ops.exchange import Exchange
from gateway.pipeline.walk import ToolsJson
from gateway.routing.balancer import POLICIES
from gateway.routing.table import Preset

log = logging.getLogger("gateway.pipeline.prefix")

_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.?"
_DAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*\.?"
_TIME = r"\d{1,2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:\s?[AaPp]\.?[Mm]\.?)?(?:\s?(?:Z|UTC|GMT|[+-]\d{2}:?\d{2}))?"
# A short label before a value ("Current time: ", "request_id=") moves with it.
_LABEL = r"(?:\b[A-Za-z][\w-]*(?:[ _][A-Za-z][\w-]*){0,3}\s*[:=]\s*)?"

# Order matters: the first kind to claim a span keeps it.
_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("uuid", re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b")),
    (
        "timestamp",  # ISO 8601 with a time
        re.compile(
            r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2}|\s?UTC)?(?!\d)"
        ),
    ),
    (
        "timestamp",  # RFC 2822 and `date`/ctime output
        re.compile(
            rf"\b{_DAY},?\s+(?:\d{{1,2}}\s+{_MONTH}|{_MONTH}\s+\d{{1,2}})\s+(?:\d{{4}}\s+{_TIME}|{_TIME}(?:\s+[A-Z]{{3,4}})?\s+\d{{4}})"
        ),
    ),
    ("timestamp", re.compile(rf"\b\d{{1,2}}/\d{{1,2}}/\d{{2,4}},?\s+{_TIME}")),
    ("timestamp", re.compile(rf"\b{_MONTH}\s+\d{{1,2}},?\s+\d{{4}},?\s+(?:at\s+)?{_TIME}")),
    ("date", re.compile(r"\b\d{4}-\d{2}-\d{2}\b")),
    ("date", re.compile(rf"\b(?:{_DAY},?\s+)?{_MONTH}\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{4}}\b")),
    ("date", re.compile(rf"\b(?:{_DAY},?\s+)?\d{{1,2}}(?:st|nd|rd|th)?\s+{_MONTH},?\s+\d{{4}}\b")),
    ("date", re.compile(r"\b\d{1,2}[/.]\d{1,2}[/.]\d{4}\b")),
    ("time", re.compile(r"\b\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?(?:\s?(?:Z|UTC|GMT|[+-]\d{2}:?\d{2}))?\b")),
    (
        "epoch",  # only in context: a bare ten-digit number may be anything
        re.compile(
            r"(?i)\b(?:time|timestamp|epoch|ts|now|date|at|generated|created|updated|issued)"
            r"(?:[_ ]?(?:ms|millis|seconds|secs|s))?\W{0,3}(\d{10}|\d{13})\b"
        ),
    ),
    ("hex", re.compile(r"\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{16,}\b")),
    ("nonce", re.compile(r"(?<![\w/+-])[A-Za-z0-9+/_-]{20,}={0,2}(?![\w/+=-])")),
)
_EPOCH_SECONDS = (1_000_000_000, 4_000_000_000)
_LABEL_BEFORE = re.compile(_LABEL + r"$")
_TIDY_SPACE = re.compile(r"[ \t]{2,}")
_TIDY_BEFORE = re.compile(r"[ \t]+([.,;:!?])")
_TIDY_REPEAT = re.compile(r"([.,;:!?])(?:[ \t]*[.,;:!?])+")
SYSTEM_ROLES = ("system", "developer")
TEXT_PARTS = ("text", "input_text")  # chat and Messages; Responses
CACHE_SIZE = 512


@dataclass(frozen=True)
class Span:
    start: int
    end: int
    kind: str


@dataclass
class PrefixReport:
    kinds: list[str] = field(default_factory=list)  # what was found, in order, without repeats
    moved: list[str] = field(default_factory=list)  # the labelled values taken out (move)
    fingerprint: str = ""
    # The fingerprint with the volatile spans left out: the same on every call of a client whose
    # prompt carries a fresh timestamp, so that its warning is logged once, not on every request.
    template: str = ""
    affinity_key: str | None = None


def find_volatile(text: str) -> list[Span]:
    """Volatile spans in `text`, without overlaps, in order."""
    spans: list[Span] = []
    taken: list[tuple[int, int]] = []
    for kind, pattern in _PATTERNS:
        for match in pattern.finditer(text):
            start, end = match.span()
            if any(start < e and s < end for s, e in taken):
                continue
            if kind == "epoch" and not _plausible_epoch(match.group(1)):
                continue
            if kind == "epoch":
                start = match.start(1)
            if kind == "nonce" and not _random_looking(match.group(0)):
                continue
            taken.append((start, end))
            spans.append(Span(start, end, kind))
    return sorted(spans, key=lambda s: s.start)


def _plausible_epoch(digits: str) -> bool:
    value = int(digits)
    low, high = _EPOCH_SECONDS
    return low <= value < high or low * 1000 <= value < high * 1000


def _random_looking(token: str) -> bool:
    # A nonce has digits, both cases and high entropy; identifiers and words do not.
    if not (
        any(c.isdigit() for c in token)
        and any(c.isupper() for c in token)
        and any(c.islower() for c in token)
    ):
        return False
    counts = Counter(token)
    entropy = -sum(n / len(token) * math.log2(n / len(token)) for n in counts.values())
    return entropy >= 4.0


class VolatileCache:
    """Detection results by text, LRU: agents resend the same system prompt on every call. The
    text with its spans cut out is kept too, made on first use (a 16k-token prompt with a date:
    180 us per request to cut again)."""

    def __init__(self, size: int = CACHE_SIZE) -> None:
        self._entries: Lru[bytes, _Found] = Lru(size)

    def spans(self, text: str) -> list[Span]:
        return self._found(text).spans

    def cut(self, text: str) -> tuple[str, list[str]]:
        """`text` without its volatile spans, and what was taken (see `_cut`)."""
        found = self._found(text)
        if found.cut is None:
            found.cut = _cut(text, found.spans)
        return found.cut

    def _found(self, text: str) -> _Found:
        key = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
        found = self._entries.get(key)
        if found is None:
            found = _Found(find_volatile(text))
            self._entries.put(key, found)
        return found


class _Found:
    __slots__ = ("cut", "spans")

    def __init__(self, spans: list[Span]) -> None:
        self.spans = spans
        self.cut: tuple[str, list[str]] | None = None


def apply(
    body: dict[str, Any],
    mode: str,
    preset: str,
    cache: VolatileCache,
    session: str | None,
    keyed: bool = True,
    tools_json: ToolsJson | None = None,
) -> PrefixReport:
    """Detect (and for move/strip, cut) volatile spans; then fingerprint the prefix and key the session."""
    report = PrefixReport()
    view = _View(body)
    messages = view.messages
    if messages is None:
        return report
    leading = _leading_system(messages)
    last_user = _last_user(messages)
    masked: dict[int, Any] = {}  # leading messages without their volatile spans, when left in place
    if mode != "off":
        cut = mode == "strip" or (mode == "move" and last_user is not None)
        for index in leading:
            message = shown = messages[index]
            for path, text in _texts(message):
                spans = cache.spans(text)
                if not spans:
                    continue
                for span in spans:
                    if span.kind not in report.kinds:
                        report.kinds.append(span.kind)
                new_text, taken = cache.cut(text)
                if cut:
                    message = _replace(message, path, new_text)
                    messages = view.set(index, message)
                    report.moved.extend(taken)
                else:
                    masked[index] = shown = _replace(shown, path, new_text)
    # Keyed before anything is appended to the last user message: on the first turn that message is
    # also the first, and the key must not change when the conversation grows.
    if keyed:
        report.affinity_key = session or _conversation_key(messages)
    if mode == "move" and report.moved and last_user is not None:
        messages = view.set(last_user, _append(messages[last_user], "[" + "; ".join(report.moved) + "]"))
    if mode != "move":
        report.moved = []
    tools = body.get("tools")
    listed = tools_json.of(tools) if tools_json is not None else None
    report.fingerprint = fingerprint(preset, [messages[i] for i in leading], tools, listed)
    report.template = (
        fingerprint(preset, [masked.get(i, messages[i]) for i in leading], tools, listed)
        if masked
        else report.fingerprint
    )
    view.write_back()
    return report


class _View:
    """Each dialect's prompt as one list of role messages, the system prompt first.

    Chat: `messages`. Anthropic Messages: the top-level `system` as a leading system message, then
    `messages`. Responses: `instructions` likewise, then the `input` items. Only what a rule
    replaced is written back; every other value stays the object the client sent.
    """

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.lead: str | None = None  # the top-level key held as messages[0]
        self.key = "messages"
        self.changed = False
        items = body.get("messages")
        if not isinstance(items, list) and isinstance(body.get("input"), list):
            self.key, items = "input", body["input"]
        self.messages: list[Any] | None = None
        if not isinstance(items, list):
            return
        for lead in ("system", "instructions"):
            # A tuple of types: `str | list` would be made again on every call.
            if isinstance(body.get(lead), (str, list)) and body[lead]:
                self.lead = lead
                self.messages = [{"role": "system", "content": body[lead]}, *items]
                return
        self.messages = items

    def set(self, index: int, message: Any) -> list[Any]:
        """Replace one message. The list is copied on the first change: it belongs to the parsed
        request, which a fallback to another preset starts again from."""
        assert self.messages is not None
        if not self.changed and self.lead is None:
            self.messages = list(self.messages)
        self.changed = True
        self.messages[index] = message
        return self.messages

    def write_back(self) -> None:
        """Into the body (the rewrite's copy of the request's top level), only when changed."""
        if not self.changed or self.messages is None:
            return
        if self.lead is None:
            self.body[self.key] = self.messages
            return
        self.body[self.lead] = self.messages[0]["content"]
        self.body[self.key] = self.messages[1:]


def fingerprint(preset: str, system: list[Any], tools: Any, tools_data: bytes | None = None) -> str:
    """A short, stable hash of what should not change between a client's calls.

    XXH3, not a cryptographic hash: the fingerprint only says whether a client's prefix changed
    (the churn metric, one warning per prompt), and nothing is decided by it that a forged
    collision could turn. It hashes an agent's system prompt and tools (40 KB) in about 1 us, where
    SHA-256 took 26 with the CPU's SHA instructions; serialising them is the rest of its cost, and
    `tools_data` is the tools' JSON where the body's walk made it already."""
    digest = xxhash.xxh3_128(preset.encode())
    for message in system:
        digest.update(orjson.dumps(message))
    if tools is not None:
        digest.update(orjson.dumps(tools) if tools_data is None else tools_data)
    return digest.hexdigest()[:12]


def _conversation_key(messages: list[Any]) -> str:
    # The conversation's root: its leading system messages and first user message. Later turns
    # only append, so every turn of one conversation maps to the same replica, and every gateway
    # computes the same key without sharing state (XXH3 with its fixed default seed: the key only
    # chooses a replica, so it needs no cryptographic hash, and it hashes long prompts at memory speed).
    digest = xxhash.xxh3_64()
    for message in messages:
        digest.update(orjson.dumps(message))
        if isinstance(message, dict) and message.get("role") == "user":
            break
    return digest.hexdigest()


def _leading_system(messages: list[Any]) -> list[int]:
    """The indexes of the system messages the prompt starts with."""
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in SYSTEM_ROLES:
            return list(range(index))
    return list(range(len(messages)))


def _last_user(messages: list[Any]) -> int | None:
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if isinstance(message, dict) and message.get("role") == "user":
            return index
    return None


def _texts(message: dict[str, Any]) -> Iterator[tuple[int | None, str]]:
    content = message.get("content")
    if isinstance(content, str):
        yield None, content
    elif isinstance(content, list):
        for index, part in enumerate(content):
            if (
                isinstance(part, dict)
                and part.get("type") in TEXT_PARTS
                and isinstance(part.get("text"), str)
            ):
                yield index, part["text"]


def _replace(message: dict[str, Any], path: int | None, text: str) -> dict[str, Any]:
    # Copies, never edits in place: the original may be shared (hypothesis, tests, caches).
    if path is None:
        return {**message, "content": text}
    parts = list(message["content"])
    parts[path] = {**parts[path], "text": text}
    return {**message, "content": parts}


def _append(message: dict[str, Any], line: str) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": f"{content}\n\n{line}"}
    if isinstance(content, list):
        responses = any(isinstance(part, dict) and part.get("type") == "input_text" for part in content)
        part = {"type": "input_text" if responses else "text", "text": line}
        return {**message, "content": [*content, part]}
    return message


def _cut(text: str, spans: list[Span]) -> tuple[str, list[str]]:
    """Remove each span (with a short label before it); return the text and what was taken.

    Only the lines a span touches change: they lose the span and the separators it leaves, and
    disappear when nothing else was on them. Every other line keeps its bytes.
    """
    taken: list[str] = []
    lines: list[str] = []
    offset = 0
    for line in text.split("\n"):
        end = offset + len(line)
        inside = [s for s in spans if offset <= s.start and s.end <= end]
        if not inside:
            lines.append(line)
        else:
            kept, position = [], offset
            for span in inside:
                start = span.start
                label = _LABEL_BEFORE.search(text, position, start)
                if label is not None and label.group(0):
                    start = label.start()
                kept.append(text[position:start])
                taken.append(text[start : span.end].strip())
                position = span.end
            kept.append(text[position:end])
            rest = _TIDY_SPACE.sub(" ", "".join(kept))
            rest = _TIDY_REPEAT.sub(r"\1", _TIDY_BEFORE.sub(r"\1", rest)).strip(" \t,;")
            if rest.strip(" \t.,;:-"):
                lines.append(rest)
        offset = end + 1
    return "\n".join(lines), taken


class ChurnTracker:
    """Each client's last prefix fingerprint per preset, bounded (LRU): a change is "prefix churn".

    A client here is its API key (hashed) or address, plus the session it names: one agent host
    runs many sessions with different prompts, which is not churn.
    """

    def __init__(self, size: int = 10_000) -> None:
        self._size = size
        self._last: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._reported: OrderedDict[tuple[str, str], None] = OrderedDict()

    def observe(self, client: str, preset: str, fingerprint: str) -> bool:
        """True when this client's fingerprint for the preset differs from its previous one."""
        key = (client, preset)
        previous = self._last.get(key)
        self._last[key] = fingerprint
        self._last.move_to_end(key)
        if len(self._last) > self._size:
            self._last.popitem(last=False)
        return previous is not None and previous != fingerprint

    def first_report(self, client: str, fingerprint: str) -> bool:
        """True once per client and fingerprint: a warning worth one log line, not one per request."""
        key = (client, fingerprint)
        if key in self._reported:
            return False
        self._reported[key] = None
        if len(self._reported) > self._size:
            self._reported.popitem(last=False)
        return True


# Headers by which agents name their session: the prefix-affinity key where present, so every turn
# of one agent session reaches the replica that holds its prefix.
SESSION_HEADERS = ("x-session-id", "x-claude-code-session-id", "session-id", "x-session-affinity")


def session_name(body: dict[str, Any], headers: dict[str, str]) -> str | None:
    """The client's own name for its session, where it gives one."""
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            return value
    for key in ("prompt_cache_key", "user"):
        value = body.get(key)
        if isinstance(value, str) and value:
            return value
    metadata = body.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    return user_id if isinstance(user_id, str) and user_id else None


def short_digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=6).hexdigest()


class PrefixStep:
    """Volatile content, the prefix fingerprint and churn, for one request after its rewrite."""

    def __init__(self) -> None:
        self.volatile = VolatileCache()
        self.churn = ChurnTracker()

    def apply(
        self,
        body: dict[str, Any],
        ex: Exchange,
        spec: Preset,
        headers: dict[str, str],
        tools_json: ToolsJson | None = None,
    ) -> str:
        """Applies the preset's mode to `body` (the rewrite's own copy) and returns the affinity key;
        `tools_json`: the parsed tool list's JSON (walk.py), read where the body still holds it."""
        session = session_name(body, headers)
        preset, mode = spec.name, spec.prefix.volatile
        keyed = POLICIES[spec.policy].needs_key
        report = apply(body, mode, preset, self.volatile, session, keyed, tools_json)
        ex.prefix, ex.prefix_found = report.fingerprint, report.kinds
        if report.kinds and mode in ("move", "strip"):
            action = "moved" if report.moved else "stripped" if mode == "strip" else "found"
            ex.rewrites.append((f"prefix_{action}", f"prefix={action}:" + "+".join(report.kinds)))
        # A session name is the client's own text, of any length and content: only a short hash
        # of it is kept (churn tracking) or logged (no forged lines, no e-mail address in logs).
        client = ex.client_id + (f"/s:{short_digest(session)}" if session else "")
        ex.prefix_churn = self.churn.observe(client, preset, report.fingerprint)
        if report.kinds and self.churn.first_report(client, report.template):
            effect = (
                "the gateway keeps it out of the prefix"
                if mode in ("move", "strip")
                else "its prefix cache cannot hit"
            )
            log.warning(
                "volatile content (%s) in the system prompt of client %s, preset %s (prefix %s): "
                "%s; see docs/prefix-cache.md",
                ",".join(report.kinds),
                client,
                preset,
                report.template,
                effect,
            )
        return report.affinity_key or ""
