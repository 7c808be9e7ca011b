"""Images inside tool results, in each wire format's shapes: found, replaced by text, or moved.

Claude Code's `Read` of a screenshot answers with a `tool_result` holding an `image` block
(`source.type: base64`); Codex's `view_image` with a `function_call_output` whose `output` list
holds `{type: input_image, image_url: "data:..."}`; an OpenAI chat client with a `role: tool`
message holding an `image_url` part. Measured on the engines the tests install (text-only models,
so an accepted shape reaches the engine's "no images" refusal: llama-server's 500 "image input is
not supported", vLLM's 400 "... is not a multimodal model"): llama-server parses an image in every
one of these places and in a user message after them; vLLM parses them in chat and Messages, but
refuses Codex's `input_image` in a `function_call_output` before that (400, `detail` is required
there: "validation error for ResponseInputImageParam"), and parses it in a user message after the
tool output. A chat template that renders a tool message's text only drops its images silently.

Pure: the request step (pipeline/tool_images.py) decides what each image becomes. The rules are
copy-on-write: a list or object is copied before it changes, the client's body stays as it came.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

# One image in a tool result, as the step sees it: its URL (a `data:` URL for an inline image,
# possibly still the gateway's placeholder for a long string set aside, pipeline/blobs.py).
Image = str
MOVED_NOTE = "The tool's images follow in the next message."
IMAGES_FOLLOW = "Images returned by the tool call above:"


@dataclass(frozen=True)
class _Shape:
    """Where one wire format keeps tool results and how it writes an image and a text part."""

    items: str  # the body's list of turns
    is_result: Callable[[Any], bool]  # a turn (or block) that is a tool result
    parts_key: str  # where a result keeps its parts
    image: Callable[[Any], Image | None]  # an image part's URL, None for any other part
    text: Callable[[str], dict[str, Any]]  # a text part


def _chat_image(part: Any) -> Image | None:
    if not isinstance(part, dict) or part.get("type") != "image_url":
        return None
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    return url if isinstance(url, str) else ""


def _responses_image(part: Any) -> Image | None:
    if not isinstance(part, dict) or part.get("type") != "input_image":
        return None
    url = part.get("image_url")
    return url if isinstance(url, str) else ""


def _anthropic_image(part: Any) -> Image | None:
    if not isinstance(part, dict) or part.get("type") != "image":
        return None
    source = part.get("source")
    if not isinstance(source, dict):
        return ""
    if source.get("type") == "base64":
        return f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    url = source.get("url")
    return url if isinstance(url, str) else ""


CHAT = _Shape(
    "messages",
    lambda m: isinstance(m, dict) and m.get("role") == "tool",
    "content",
    _chat_image,
    lambda text: {"type": "text", "text": text},
)
RESPONSES = _Shape(
    "input",
    lambda i: isinstance(i, dict) and i.get("type") in ("function_call_output", "custom_tool_call_output"),
    "output",
    _responses_image,
    lambda text: {"type": "input_text", "text": text},
)
# Messages: a tool result is a block inside a user turn, not a turn of its own.
ANTHROPIC = _Shape(
    "messages",
    lambda b: isinstance(b, dict) and b.get("type") == "tool_result",
    "content",
    _anthropic_image,
    lambda text: {"type": "text", "text": text},
)


def _results(body: dict[str, Any]) -> Iterator[tuple[_Shape, int, int | None, dict[str, Any]]]:
    """(shape, turn index, block index in a Messages turn or None, the tool result) for each.

    The shapes' `is_result` written out here: this reads every turn of every request whose preset
    handles tool images, and a call per turn and block was most of its cost."""
    messages = body.get("messages")
    if isinstance(messages, list):
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                continue
            role = message.get("role")
            if role == "tool":  # CHAT.is_result
                yield CHAT, index, None, message
            elif role == "user" and isinstance(content := message.get("content"), list):
                for block_index, block in enumerate(content):
                    if isinstance(block, dict) and block.get("type") == "tool_result":  # ANTHROPIC's
                        yield ANTHROPIC, index, block_index, block
    items = body.get("input")
    if isinstance(items, list):
        for index, item in enumerate(items):
            if RESPONSES.is_result(item):
                yield RESPONSES, index, None, item


def tool_images(body: dict[str, Any]) -> list[Image]:
    """Every image inside a tool result, in order (the same image may appear more than once)."""
    found: list[Image] = []
    for shape, _, _, result in _results(body):
        parts = result.get(shape.parts_key)
        if isinstance(parts, list):
            found += [url for url in map(shape.image, parts) if url is not None]
    return found


def replace_images(body: dict[str, Any], texts: Mapping[Image, str]) -> int:
    """Each tool-result image whose URL is in `texts` becomes a text part saying it; returns how many."""
    replaced = 0
    turns: dict[str, list[Any]] = {}
    for shape, index, block_index, result in list(_results(body)):
        parts = result.get(shape.parts_key)
        if not isinstance(parts, list):
            continue
        new_parts: list[Any] = []
        for part in parts:
            url = shape.image(part)
            if url is not None and url in texts:
                new_parts.append(shape.text(texts[url]))
                replaced += 1
            else:
                new_parts.append(part)
        if len(new_parts) == len(parts) and all(a is b for a, b in zip(new_parts, parts, strict=True)):
            continue
        _put(body, turns, shape, index, block_index, {**result, shape.parts_key: new_parts})
    for key, items in turns.items():
        body[key] = items
    return replaced


def _put(
    body: dict[str, Any],
    turns: dict[str, list[Any]],
    shape: _Shape,
    index: int,
    block_index: int | None,
    result: dict[str, Any],
) -> None:
    """Puts a changed tool result in place, copying the turn list (and a Messages turn) first."""
    if shape.items not in turns:
        turns[shape.items] = list(body[shape.items])
    items = turns[shape.items]
    if block_index is None:
        items[index] = result
        return
    turn = items[index]
    content = list(turn["content"])
    content[block_index] = result
    items[index] = {**turn, "content": content}


def move_images(body: dict[str, Any]) -> int:
    """For a model that sees images: each image leaves its tool result for the place every engine
    and template reads images, a user turn. In chat and Responses a user message follows the run of
    tool results it came from; in Messages the images follow the turn's `tool_result` blocks in the
    same user turn (Anthropic wants the results first). Returns how many moved."""
    moved = 0
    for key in ("messages", "input"):
        items = body.get(key)
        if not isinstance(items, list):
            continue
        out: list[Any] = []
        pending: list[Any] = []  # images of the current run of chat / Responses tool results
        shape = CHAT if key == "messages" else RESPONSES
        for item in items:
            if shape.is_result(item):
                item, images = _split(shape, item)
                pending += images
                moved += len(images)
            else:
                if pending:
                    out.append(_user_turn(shape, pending))
                    pending = []
                if key == "messages" and isinstance(item, dict) and item.get("role") == "user":
                    item, images = _split_anthropic(item)
                    moved += len(images)
            out.append(item)
        if pending:
            out.append(_user_turn(shape, pending))
        if len(out) != len(items) or any(a is not b for a, b in zip(out, items, strict=True)):
            body[key] = out
    return moved


def _split(shape: _Shape, result: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """The result without its image parts (a note in their place), and the image parts."""
    parts = result.get(shape.parts_key)
    if not isinstance(parts, list):
        return result, []
    images = [part for part in parts if shape.image(part) is not None]
    if not images:
        return result, []
    kept = [part for part in parts if shape.image(part) is None]
    return {**result, shape.parts_key: [*kept, shape.text(MOVED_NOTE)]}, images


def _user_turn(shape: _Shape, images: list[Any]) -> dict[str, Any]:
    content = [shape.text(IMAGES_FOLLOW), *images]
    if shape is RESPONSES:
        return {"type": "message", "role": "user", "content": content}
    return {"role": "user", "content": content}


def _split_anthropic(turn: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    content = turn.get("content")
    if not isinstance(content, list):
        return turn, []
    blocks: list[Any] = []
    images: list[Any] = []
    for block in content:
        if ANTHROPIC.is_result(block):
            block, found = _split(ANTHROPIC, block)
            images += found
        blocks.append(block)
    if not images:
        return turn, []
    results = [b for b in blocks if ANTHROPIC.is_result(b)]
    others = [b for b in blocks if not ANTHROPIC.is_result(b)]
    return {**turn, "content": [*results, ANTHROPIC.text(IMAGES_FOLLOW), *images, *others]}, images
