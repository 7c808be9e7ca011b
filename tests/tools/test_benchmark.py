"""`fleet-gateway bench` against a gateway over simulated replicas, and its pure parts on plain values.

The simulators run at a small time scale so decode rates are finite and positive; nothing here asserts
on a number's size, only that each one is there, sane, and where the record says it is.
"""

from __future__ import annotations

import asyncio
import io
import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from gateway import __version__
from gateway.cli import main
from gateway.tools.benchmark import Bench, Client, Options, Target, discover, run_bench
from gateway.tools.benchreport import (
    DIGITS,
    IMAGE_TEXT,
    BenchError,
    Progress,
    check_tool,
    compare,
    digits_png,
    gpu_info,
    http_error,
    latest_by_preset,
    parse_nvidia_smi,
)
from tests.support.harness import Running, run_gateway
from tests.support.servers import ThreadServer, free_port, sim_replica

RESULT_KEYS = {
    "decode_tps",
    "cold_ttft_s",
    "cold_ttft_note",
    "repeat_ttft_s",
    "cached_tokens_on_repeat",
    "decode_tps_with_context",
    "parallel",
    "tool_call",
    "image",
}
RECORD_KEYS = {
    "time",
    "gateway_version",
    "target",
    "preset",
    "served_model",
    "replicas",
    "settings",
    "results",
    "served_by",
    "gpu",
    "error",
}


def sim(engine: str, model: str, **knobs: Any) -> ThreadServer:
    # answer_tokens above the quick decode budget: the simulator ignores ignore_eos, the budget stops it.
    return sim_replica(engine, model, time_scale=0.01, answer_tokens=64, **knobs)


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, ThreadServer]]:
    servers = {
        "v0": sim("vllm", "dense-served", context=8192),
        "l0": sim("llamacpp", "dense-served", context=8192),
        "vis": sim("vllm", "vision-served"),
        "small": sim("llamacpp", "small-served", context=1024),
        "noparser": sim("vllm", "plain-served", tool_parser=False),
        "nodetails": sim("vllm", "plain-served", prompt_tokens_details=False),
    }
    yield servers
    for server in servers.values():
        server.stop()


@pytest.fixture(autouse=True)
def fresh_caches(fleet: dict[str, ThreadServer]) -> None:
    # Each test starts as after an engine start: the cold request must find nothing cached.
    for server in fleet.values():
        httpx2.post(server.url + "/sim/reset")


@pytest.fixture(scope="module")
def routes(fleet: dict[str, ThreadServer], tmp_path_factory: pytest.TempPathFactory) -> Path:
    text = f"""
defaults: {{min_max_tokens: 0}}
presets:
  vllm:
    served_model: dense-served
    aliases: [dense]
    replicas: [{{name: v0, url: "{fleet["v0"].url}", engine: vllm}}]
  llama:
    served_model: dense-served
    min_max_tokens: 48
    params: {{temperature: 0.7}}
    replicas: [{{name: l0, url: "{fleet["l0"].url}", engine: llamacpp}}]
  vision:
    served_model: vision-served
    vision: true
    replicas: [{{name: vis, url: "{fleet["vis"].url}", engine: vllm}}]
  broken:
    served_model: gone-served
    replicas: [{{name: gone, url: "http://127.0.0.1:{free_port()}", engine: vllm}}]
routing: {{default: vllm, images: vision}}
"""
    path = tmp_path_factory.mktemp("bench") / "routes.yaml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def gw(routes: Path) -> Iterator[Running]:
    with run_gateway(routes.read_text()) as running:
        yield running


def quick(url: str, out: Path, **changes: Any) -> Options:
    scale = {"decode_tokens": 32, "prompt_tokens": 1000, "parallel": 2, "check_tokens": 64}
    return Options(url=url, out=out, quick=True, **(scale | changes))


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_run_records_the_full_picture(gw: Running, routes: Path, tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    records = run_bench(quick(gw.url, out, routes=routes, presets=("vllm", "llama", "vision")))
    assert lines(out) == records
    assert [r["preset"] for r in records] == ["vllm", "llama", "vision"]
    by_name = {r["preset"]: r for r in records}
    for name, record in by_name.items():
        assert set(record) >= RECORD_KEYS, name
        assert set(record["results"]) >= RESULT_KEYS, name
        assert record["error"] is None and record["results"]["errors"] == {}, record
        assert record["gateway_version"] == __version__
        assert record["target"] == gw.url
        assert record["gpu"] is None  # no nvidia-smi on a test machine
        results = record["results"]
        assert results["decode_tps"] > 0
        assert results["decode_tps_with_context"] > 0
        assert results["cold_ttft_s"] > 0 and results["repeat_ttft_s"] > 0
        assert results["cold_ttft_note"] == "valid only on the first run after an engine start"
        assert results["cold_ttft_valid"] is True
        # ~1000 tokens as the simulator counts them: the calibration from the decode prompt worked.
        assert 800 <= results["prompt_tokens"] <= 1200
        assert 0 < results["cached_tokens_on_repeat"] <= results["prompt_tokens"]
        parallel = results["parallel"]
        assert parallel["n"] == 2 and parallel["aggregate_tps"] > 0 and parallel["per_request_tps"] > 0
        assert results["tool_call"] == {"ok": True, "detail": 'get_weather({"city": "example"})'}
        replica = record["replicas"][0]
        assert replica["models"]["data"][0]["id"] == record["served_model"]
        served = record["served_by"]
        assert {served["decode"], served["cold"], served["repeat"], *served["parallel"]} == {replica["name"]}
    assert by_name["vllm"]["settings"]["aliases"] == ["dense"]
    assert by_name["llama"]["settings"]["params"] == {"temperature": 0.7}
    assert by_name["llama"]["replicas"][0]["context"] == 8192
    assert by_name["vllm"]["results"]["image"] is None
    image = by_name["vision"]["results"]["image"]
    # The simulator cannot read; what counts is that the check ran and kept the answer.
    assert image["expected"] == IMAGE_TEXT and image["ok"] is False and image["answer"]
    assert by_name["vision"]["served_by"]["image"] == "vis"
    # min_max_tokens 48 > 32, but thinking is off (the preset's default): the floor guards nothing
    # there, so the bench's 32 tokens are decoded as asked and no note is needed.
    assert by_name["llama"]["results"]["decode_tokens"] == 32
    assert not any("raised max_tokens" in note for note in by_name["llama"]["notes"])
    assert by_name["vllm"]["notes"] == []


def test_a_second_run_says_its_cold_ttft_is_not_cold(gw: Running, tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    first, second = (run_bench(quick(gw.url, out, presets=("vllm",)))[0] for _ in range(2))
    assert first["results"]["cold_ttft_valid"] is True
    assert second["results"]["cold_ttft_valid"] is False
    assert second["results"]["cold_cached_tokens"] > 0
    assert any("not cold" in note for note in second["notes"])
    assert len(lines(out)) == 2


def test_the_cli_goes_on_past_a_dead_preset_and_exits_1(
    gw: Running, routes: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "results.jsonl"
    code = main(["bench", "--url", gw.url, "--routes", str(routes), "--quick", "--out", str(out)])
    assert code == 1
    records = {r["preset"]: r for r in lines(out)}
    assert list(records) == ["vllm", "llama", "vision", "broken"]
    broken = records.pop("broken")
    assert broken["error"].startswith("decode: HTTP 5")
    assert "error" in broken["replicas"][0] and broken["replicas"][0]["models"] is None
    assert all(r["error"] is None for r in records.values())
    assert records["vllm"]["options"] == {
        "decode_tokens": 32,
        "prompt_tokens": 1000,
        "parallel": 2,
        "quick": True,
    }
    captured = capsys.readouterr()
    assert "broken: FAILED: decode: HTTP 5" in captured.out
    assert "4 result lines appended to" in captured.out and "failed: broken" in captured.out
    # Not a terminal: plain step lines, no carriage returns.
    assert "[1/" in captured.err and "vllm: decode 32 tokens" in captured.err and "\r" not in captured.err


def test_the_cli_exits_0_when_every_preset_ran(gw: Running, tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    args = ["bench", "--url", gw.url, "--preset", "vllm", "--quick", "--parallel", "3", "--out", str(out)]
    assert main(args) == 0
    (record,) = lines(out)
    assert record["results"]["parallel"]["n"] == 3


def test_without_a_table_the_gateway_lists_the_presets(gw: Running, tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    # An SDK's base_url (ending in /v1) works too.
    (record,) = run_bench(quick(gw.url + "/v1", out, presets=("llama",)))
    assert record["error"] is None
    assert record["settings"] is None and record["served_model"] == "dense-served"
    # From the gateway's status data: names, engines, contexts; the replicas' URLs are not published there.
    assert record["replicas"] == [
        {"name": "l0", "engine": "llamacpp", "context": 8192, "state": "up", "models": None}
    ]


def test_a_plain_endpoint_benches_its_model_and_clamps_the_prompt(
    fleet: dict[str, ThreadServer], tmp_path: Path
) -> None:
    out = tmp_path / "results.jsonl"
    (record,) = run_bench(quick(fleet["small"].url, out, prompt_tokens=4000))
    assert record["preset"] == record["served_model"] == "small-served"
    assert record["gateway_version"] is None and record["settings"] is None
    assert record["replicas"][0]["engine"] == "llamacpp" and record["replicas"][0]["context"] == 1024
    # No gateway, no x-gateway-replica header: nobody to name.
    assert all(v in (None, [None, None]) for v in record["served_by"].values())
    results = record["results"]
    assert record["error"] is None and results["errors"] == {}
    assert results["prompt_tokens"] < 1024 - 32
    assert any("clamped" in note for note in record["notes"])


def test_a_vllm_replica_without_a_tool_parser_is_reported_not_fatal(
    fleet: dict[str, ThreadServer], tmp_path: Path
) -> None:
    (record,) = run_bench(quick(fleet["noparser"].url, tmp_path / "r.jsonl"))
    assert record["error"] is None
    tool = record["results"]["tool_call"]
    assert tool["ok"] is False
    assert tool["detail"].startswith("HTTP 400: ") and "--enable-auto-tool-choice" in tool["detail"]


def test_an_engine_that_hides_cached_tokens_is_named_not_misread(
    fleet: dict[str, ThreadServer], tmp_path: Path
) -> None:
    (record,) = run_bench(quick(fleet["nodetails"].url, tmp_path / "r.jsonl"))
    results = record["results"]
    assert record["error"] is None and results["repeat_ttft_s"] > 0
    # Unknown, not "0 cached" and not "cold": vLLM without --enable-prompt-tokens-details says nothing.
    assert results["cached_tokens_on_repeat"] is None and results["cold_ttft_valid"] is None
    assert any("--enable-prompt-tokens-details" in note for note in record["notes"])


def test_a_context_error_shortens_the_long_prompt_once(
    fleet: dict[str, ThreadServer], tmp_path: Path
) -> None:
    async def go() -> tuple[Any, list[str]]:
        async with httpx2.AsyncClient(timeout=30) as http:
            client = Client(http, fleet["small"].url, None)
            opts = quick(fleet["small"].url, tmp_path / "r.jsonl")
            (target,), _ = await discover(client, opts)
            blind = Target(target.name, target.served_model, False, None, [])  # the context unknown
            notes: list[str] = []
            sample, _ = await Bench(client, opts, Progress(1)).long_prompt(blind, 3000, 1.0, notes)
            return sample, notes

    sample, notes = asyncio.run(go())
    assert sample.prompt_tokens < 1024
    assert notes and "did not fit a context of 1024" in notes[0]


def test_an_unknown_preset_or_a_missing_target_exit_2(
    gw: Running, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.jsonl"
    assert main(["bench", "--url", gw.url, "--preset", "nope", "--quick", "--out", str(out)]) == 2
    assert "unknown preset(s) nope; the target has: vllm, llama, vision, broken" in capsys.readouterr().err
    assert main(["bench", "--url", f"http://127.0.0.1:{free_port()}", "--quick", "--out", str(out)]) == 2
    assert "ConnectError" in capsys.readouterr().err
    assert not out.exists()


# --- --compare ---------------------------------------------------------------------------------------


def record(preset: str, time: str, decode: float, ttft: float, **extra: Any) -> dict[str, Any]:
    results = {
        "decode_tps": decode,
        "cold_ttft_s": ttft,
        "tool_call": {"ok": True, "detail": "x"},
        "image": None,
    }
    return {"time": time, "preset": preset, "results": results, "error": None, **extra}


def write(path: Path, *records: dict[str, Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_compare_puts_the_latest_runs_side_by_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = write(
        tmp_path / "a.jsonl",
        record("dense", "2026-01-01T10:00:00Z", 50.0, 9.0),
        record("dense", "2026-01-02T10:00:00Z", 100.0, 1.0),  # the latest: this one is compared
        record("old", "2026-01-01T10:00:00Z", 10.0, 1.0),
    )
    b = write(
        tmp_path / "b.jsonl",
        record("dense", "2026-01-03T10:00:00Z", 150.0, 2.0, gpu={"power_limit_w": 350.0}),
    )
    assert main(["bench", "--compare", str(a), str(b)]) == 0
    text = capsys.readouterr().out
    dense = text.split("preset dense")[1].split("preset old")[0]
    rows = {line[2:26].strip(): line for line in dense.splitlines() if line.startswith("  ")}
    assert "100.0" in rows["decode tok/s"] and "150.0" in rows["decode tok/s"]
    assert rows["decode tok/s"].endswith("1.50x better")
    assert rows["cold TTFT s"].endswith("2.00x worse")  # a TTFT that doubles is worse
    assert "350.0" in rows["GPU power limit W"]
    assert "preset old  (only in A)" in text
    assert text == compare(a, b)


def test_compare_with_a_missing_or_broken_file_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = write(tmp_path / "a.jsonl", record("dense", "t", 1.0, 1.0))
    assert main(["bench", "--compare", str(good), str(tmp_path / "missing.jsonl")]) == 2
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"preset": "x"}\nnot json\n')
    assert main(["bench", "--compare", str(good), str(broken)]) == 2
    assert "broken.jsonl:2: not a JSON line" in capsys.readouterr().err


def test_latest_by_preset_prefers_the_later_line_on_equal_times() -> None:
    first, second = record("p", "t", 1.0, 1.0), record("p", "t", 2.0, 1.0)
    assert latest_by_preset([first, second])["p"] is second


# --- the pure parts ----------------------------------------------------------------------------------


def read_png(data: bytes) -> tuple[int, int, list[bytes]]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body), kind
        chunks[kind] = body
        pos += 12 + length
    width, height, depth, color, *_ = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, color) == (8, 0) and b"IEND" in chunks
    raw = zlib.decompress(chunks[b"IDAT"])
    rows = [raw[y * (width + 1) : (y + 1) * (width + 1)] for y in range(height)]
    assert all(row[0] == 0 for row in rows) and len(raw) == height * (width + 1)
    return width, height, [row[1:] for row in rows]


def test_the_image_is_a_valid_png_of_the_known_digits() -> None:
    scale = 8
    width, height, rows = read_png(digits_png(IMAGE_TEXT, scale))
    margin, gap = 4 * scale, 2 * scale
    assert width == 2 * margin + 5 * 5 * scale + 4 * gap and height == 2 * margin + 7 * scale
    # Sample the centre of every font cell: black exactly where the font has a 1.
    for n, char in enumerate(IMAGE_TEXT):
        for y, bits in enumerate(DIGITS[char]):
            for x, bit in enumerate(bits):
                px = rows[margin + y * scale + scale // 2][
                    margin + n * (5 * scale + gap) + x * scale + scale // 2
                ]
                assert px == (0 if bit == "1" else 255), (char, x, y)
    assert rows[0] == b"\xff" * width


def test_the_tool_check_wants_a_parsed_call_with_json_arguments() -> None:
    def answer(message: dict[str, Any]) -> dict[str, Any]:
        return {"choices": [{"message": message, "finish_reason": "stop"}]}

    call = {"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert check_tool(answer({"tool_calls": [call]})) == (True, 'get_weather({"city": "Paris"})')
    bad = {"function": {"name": "get_weather", "arguments": "{city: Paris"}}
    ok, detail = check_tool(answer({"tool_calls": [bad]}))
    assert not ok and "not JSON" in detail
    ok, detail = check_tool(answer({"content": "<tool_call>{...}"}))
    assert not ok and detail.startswith("no tool_calls (finish_reason stop)")


@pytest.mark.parametrize(
    ("status", "body", "context"),
    [
        (
            400,
            {
                "error": {
                    "code": 400,
                    "message": "request (9000 tokens) exceeds the available context size "
                    "(8192 tokens), try increasing it",
                    "type": "exceed_context_size_error",
                    "n_ctx": 8192,
                }
            },
            8192,
        ),
        (
            400,
            {"error": {"message": "This model's maximum context length is 1024 tokens. However, ..."}},
            1024,
        ),
        (400, {"error": {"message": "max_tokens=5000 cannot be greater than max_model_len=4096."}}, 4096),
        (503, {"error": {"message": "maximum context length is 1024"}}, None),
        (404, {"detail": "Not Found"}, None),
    ],
)
def test_errors_keep_the_message_and_the_context_they_name(
    status: int, body: Any, context: int | None
) -> None:
    error = http_error(status, json.dumps(body).encode())
    assert isinstance(error, BenchError) and error.context == context
    assert str(error).startswith(f"HTTP {status}: ") and "{" not in str(error)


def fake_nvidia_smi(directory: Path, output: str) -> None:
    script = directory / "nvidia-smi"
    # printf is a shell builtin: PATH holds only this directory.
    script.write_text(f"#!/bin/sh\nprintf '{output}'\n")
    script.chmod(0o755)


def test_gpu_power_limits_from_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu_info() is None
    fake_nvidia_smi(tmp_path, "0, NVIDIA H200, 700.00 W\\n1, NVIDIA H200, 450.00 W\\n")
    info = gpu_info()
    assert info == {
        "power_limit_w": 700.0,
        "gpus": [
            {"index": 0, "name": "NVIDIA H200", "power_limit_w": 700.0},
            {"index": 1, "name": "NVIDIA H200", "power_limit_w": 450.0},
        ],
    }
    assert parse_nvidia_smi("0, Some, Odd Name, [N/A]\n") == [
        {"index": 0, "name": "Some, Odd Name", "power_limit_w": None}
    ]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_redraws_one_line_on_a_terminal() -> None:
    screen = Terminal()
    progress = Progress(4, screen)
    progress.start("dense: decode")
    progress.advance()
    progress.start("dense: cold")
    progress.detail("cold: 12 tokens")
    progress.advance(3)
    progress.close()
    text = screen.getvalue()
    assert "\n" not in text and text.count("\r") >= 4
    assert "[######------------------] 1/4" in text and "dense: cold" in text
    log = io.StringIO()
    plain = Progress(2, log)
    plain.start("a")
    plain.detail("ignored off a terminal")
    plain.advance()
    plain.start("b")
    assert log.getvalue() == "[1/2] a\n[2/2] b\n"
