"""Which agent session a request belongs to: pure, from its headers and body.

A session is the unit whose prompt grows turn by turn and whose prefix cache the fleet keeps
(`policy: session`, routing/balancer.py and fleet/slots.py). The agents name their sessions:

- Claude Code sends `X-Claude-Code-Session-Id` on every request of a session, and on a
  sub-agent's requests also `x-claude-code-agent-id` and `x-claude-code-parent-agent-id` (read from
  the 2.1.332 CLI): a sub-agent has its own system prompt and history, so it is a session of its
  own, grouped with its parent's. `x-claude-code-request-class: auxiliary` marks side requests
  (titles and the like) whose prompt is not the conversation's. `metadata.user_id` carries the same
  session id as JSON (tests/fixtures/agents/).
- Codex sends `session-id` and `thread-id` (a sub-agent runs in a thread of its own) and the same
  ids in `x-codex-turn-metadata`; `prompt_cache_key` is the session id.
- opencode sends `x-session-affinity`; other clients `x-session-id`.

Without a name, the session is the digest of its stable prefix: system prompt, tools and first user
turn, which later turns only extend. Only digests are kept: a session name is the client's text and
never reaches a log, a metric or the status page in clear.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

# Header names as the agents send them (compared lower case: the edge lowers header names).
CLAUDE_SESSION = "x-claude-code-session-id"
CLAUDE_AGENT = "x-claude-code-agent-id"
CLAUDE_PARENT = "x-claude-code-parent-agent-id"
CLAUDE_CLASS = "x-claude-code-request-class"
CODEX_SESSION = "session-id"
CODEX_THREAD = "thread-id"
OTHER_SESSIONS = ("x-session-affinity", "x-session-id")
# Claude Code's request classes whose prompt is not the conversation's own (read from the CLI:
# main, subagent, workflow, compaction, auxiliary, side_reply). A compaction request replays the
# conversation, so it shares the session's cache and is not transient.
TRANSIENT_CLASSES = frozenset({"auxiliary"})
DIGEST_BYTES = 8  # 16 hex characters: enough to tell a fleet's sessions apart, too short to reverse
MAX_ID = 256  # longer identifiers are digested as their first MAX_ID characters


@dataclass(frozen=True)
class Session:
    """One request's session, as digests only.

    `key` names the conversation whose cache is kept (one slot on llama-server); `group` names the
    agent session it belongs to: a sub-agent has its own key and its parent's group, so that it
    can be placed beside its parent. `source` says what named it (a bounded metric label).
    `transient`: a side request of the session whose prompt is not the conversation's; placed with
    the session but never given a slot of its own."""

    key: str
    group: str
    source: str
    transient: bool = False


def digest(*parts: str) -> str:
    hashed = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for part in parts:
        hashed.update(part[:MAX_ID].encode("utf-8", "replace"))
        hashed.update(b"\x00")
    return hashed.hexdigest()


def session_of(body: dict[str, Any], headers: dict[str, str]) -> Session | None:
    """The request's session, or None for a body without a conversation (embeddings, a bare
    completion prompt)."""
    named = _named(body, headers)
    if named is not None:
        return named
    root = stable_prefix(body)
    if root is None:
        return None
    return Session(root, root, "prefix")


def _named(body: dict[str, Any], headers: dict[str, str]) -> Session | None:
    claude = headers.get(CLAUDE_SESSION) or _claude_metadata_session(body)
    if claude:
        agent = headers.get(CLAUDE_AGENT, "")
        transient = headers.get(CLAUDE_CLASS, "").strip().lower() in TRANSIENT_CLASSES
        group = digest("claude", claude)
        if agent:
            return Session(digest("claude", claude, "agent", agent), group, "claude_agent", transient)
        return Session(group, group, "claude", transient)
    codex = headers.get(CODEX_SESSION)
    thread = headers.get(CODEX_THREAD)
    if codex or thread:
        root = codex or thread or ""
        group = digest("codex", root)
        if thread and thread != root:
            return Session(digest("codex", root, "thread", thread), group, "codex_thread")
        return Session(group, group, "codex")
    for name in OTHER_SESSIONS:
        value = headers.get(name)
        if value:
            key = digest("header", value)
            return Session(key, key, "header")
    cache_key = body.get("prompt_cache_key")
    if isinstance(cache_key, str) and cache_key:
        key = digest("prompt_cache_key", cache_key)
        return Session(key, key, "prompt_cache_key")
    return None


def _claude_metadata_session(body: dict[str, Any]) -> str | None:
    """Claude Code's `metadata.user_id` is a JSON string holding `session_id`."""
    metadata = body.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    if not isinstance(user_id, str) or not user_id.startswith("{") or len(user_id) > 4096:
        return None
    try:
        parsed = orjson.loads(user_id)
    except orjson.JSONDecodeError:
        return None
    session = parsed.get("session_id") if isinstance(parsed, dict) else None
    return session if isinstance(session, str) and session else None


def stable_prefix(body: dict[str, Any]) -> str | None:
    """The digest of what a conversation's later turns do not change: the system prompt (`system`,
    `instructions` or leading system/developer messages), the tools, and the first user turn."""
    items = body.get("messages")
    if not isinstance(items, list):
        items = body.get("input") if isinstance(body.get("input"), list) else None
    if items is None:
        return None
    # XXH3, 64 bits (DIGEST_BYTES): the same digest in every gateway process, at memory speed over
    # an agent's 40 KB of system prompt and tools (BLAKE2 took 50 us for them). The digest only
    # places a session; a session's name, which is the client's own text, is digested with BLAKE2.
    hashed = xxhash.xxh3_64()
    for lead in ("system", "instructions"):
        if body.get(lead):
            hashed.update(orjson.dumps(body[lead]))
    if body.get("tools") is not None:
        hashed.update(orjson.dumps(body["tools"]))
    seen_user = False
    for item in items:
        hashed.update(orjson.dumps(item))
        if isinstance(item, dict) and item.get("role") == "user":
            seen_user = True
            break
    return hashed.hexdigest() if seen_user else None
