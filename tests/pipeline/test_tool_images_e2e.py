"""Images in tool results through the gateway with the official SDKs, against simulated replicas
that drop an image inside a tool result the way a real engine's template does
(`drop_tool_images`): without the fix the image vanishes silently; with it a text-only preset
answers from the vision preset's description (asked once per image), a vision preset gets the
image where it reads images, and a table without a vision preset says an image was there."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx2
import openai
import orjson
import pytest

from tests.dialects.test_tool_results import PNG, URL
from tests.support.harness import Running, run_gateway
from tests.support.servers import ThreadServer, sim_replica

IMAGE_TOKENS = 256  # what the simulator charges for one image


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, ThreadServer]]:
    servers = {
        "text": sim_replica("llamacpp", "coder-served", context=32768, drop_tool_images=True),
        "eyes": sim_replica("vllm", "eyes-served", context=32768, drop_tool_images=True, reasoning_tokens=0),
    }
    yield servers
    for server in servers.values():
        server.stop()


def table(fleet: dict[str, ThreadServer], compat: str = "", vision: bool = True) -> str:
    images = "images: eyes" if vision else ""
    return f"""
defaults: {{max_tokens: 256, min_max_tokens: 0{compat}}}
presets:
  coder:
    served_model: coder-served
    aliases: ["claude-*", "gpt-*"]
    replicas: [{{name: t, url: "{fleet["text"].url}", engine: llamacpp}}]
  eyes:
    served_model: eyes-served
    vision: true
    replicas: [{{name: e, url: "{fleet["eyes"].url}", engine: vllm}}]
routing: {{default: coder, {images}}}
"""


@pytest.fixture(scope="module")
def gateway(fleet: dict[str, ThreadServer]) -> Iterator[Running]:
    with run_gateway(table(fleet)) as running:
        yield running


def requests(server: ThreadServer) -> int:
    return int(httpx2.get(server.url + "/sim/stats").json()["requests"])


def last_body(server: ThreadServer) -> dict[str, Any]:
    return orjson.loads(httpx2.get(server.url + "/sim/stats").json()["last_bodies"][-1])  # type: ignore[no-any-return]


def screenshot_turns(data: str = PNG) -> list[dict[str, Any]]:
    """Claude Code's `Read` of a screenshot: the tool_result holds an image block."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    return [
        {"role": "user", "content": "What does the screenshot say?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "/s.png"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [image]}]},
    ]


TOOLS = [
    {"name": "Read", "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}
]


def ask(url: str, model: str = "claude-haiku-4-5", turns: list[dict[str, Any]] | None = None) -> Any:
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as client:
        return client.messages.with_raw_response.create(
            model=model,
            max_tokens=256,
            tools=TOOLS,
            messages=turns or screenshot_turns(),  # type: ignore[arg-type]
        )


def test_without_the_fix_the_engine_drops_the_image_silently(fleet: dict[str, ThreadServer]) -> None:
    with run_gateway(table(fleet, ", compat: [billing_header]")) as running:
        message = ask(running.url).parse()
    assert message.content[0].text == "tool result: "  # the model saw nothing


def test_a_text_only_preset_answers_from_the_vision_presets_description(
    gateway: Running, fleet: dict[str, ThreadServer]
) -> None:
    before = requests(fleet["eyes"])
    raw = ask(gateway.url)
    assert (
        raw.headers["x-gateway-preset"] == "coder"
        and "described=1,cached=0" in raw.headers["x-gateway-rewrites"]
    )
    text = raw.parse().content[0].text
    assert text.startswith(
        "tool result: [Image from the tool result, described by the gateway's vision model]"
    )
    assert requests(fleet["eyes"]) == before + 1
    asked = last_body(fleet["eyes"])["messages"][0]["content"]
    assert "Transcribe" in asked[0]["text"] and asked[1]["image_url"]["url"] == URL
    again = ask(gateway.url)  # the next turn replays the same image: no second description
    assert (
        "described=0,cached=1" in again.headers["x-gateway-rewrites"]
        and requests(fleet["eyes"]) == before + 1
    )


def test_a_vision_preset_gets_the_image_in_a_user_turn(
    gateway: Running, fleet: dict[str, ThreadServer]
) -> None:
    with run_gateway(table(fleet, ", compat: [billing_header]")) as running:
        dropped = ask(running.url, model="eyes").parse()
    moved = ask(gateway.url, model="eyes")
    assert "moved=1" in moved.headers["x-gateway-rewrites"]
    content = last_body(fleet["eyes"])["messages"][2]["content"]
    assert [block["type"] for block in content] == ["tool_result", "text", "image"]
    assert prompt(moved.parse()) >= prompt(dropped) + IMAGE_TOKENS  # the model sees it


def prompt(message: Any) -> int:
    """The whole prompt: Messages' `input_tokens` leaves the cached tokens out."""
    return int(message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0))


def test_without_a_vision_preset_the_model_is_told_an_image_was_there(fleet: dict[str, ThreadServer]) -> None:
    with run_gateway(table(fleet, vision=False)) as running:
        raw = ask(running.url)
    assert "placeholder=1" in raw.headers["x-gateway-rewrites"]
    assert "cannot see images" in raw.parse().content[0].text


def test_codex_view_image_output_is_described_for_a_text_only_preset(
    gateway: Running, fleet: dict[str, ThreadServer]
) -> None:
    items = [
        {"role": "user", "content": "look at the screenshot"},
        {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": '{"path": "/s.png"}'},
        {
            "type": "function_call_output",
            "call_id": "c1",
            "output": [{"type": "input_image", "image_url": URL}],
        },
    ]
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as codex:
        response = codex.responses.create(model="gpt-5", input=items)  # type: ignore[arg-type]
    assert response.output_text.startswith("tool result: [Image from the tool result")


def test_a_large_screenshot_set_aside_by_the_reader_is_described(
    gateway: Running, fleet: dict[str, ThreadServer]
) -> None:
    big = "A" * (2 << 20)  # past the parse offload threshold: its string is set aside unparsed
    items = [
        {"role": "user", "content": "look"},
        {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": "{}"},
        {
            "type": "function_call_output",
            "call_id": "c1",
            "output": [{"type": "input_image", "image_url": "data:image/png;base64," + big}],
        },
    ]
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as codex:
        response = codex.responses.create(model="gpt-5", input=items)  # type: ignore[arg-type]
    assert response.output_text.startswith("tool result: [Image from the tool result")
    described = last_body(fleet["eyes"])["messages"][0]["content"][1]["image_url"]["url"]
    assert described == "data:image/png;base64," + big
