"""`fleet-gateway bench --quick` against real llama-servers, through the gateway and directly.

The tiny random-weight model writes random bytes: the numbers mean nothing, but the wire does. Real
streams, a real `usage` chunk, a real prefix cache (`cached_tokens` on the repeat) and a real
refusal or non-answer to the tool request are what the simulator cannot vouch for.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main
from tests.support.harness import run_gateway

from .backends import LlamaServer


def routes(llama: tuple[LlamaServer, LlamaServer]) -> str:
    # prefix_affinity: the repeat must reach the replica that cached the cold prompt (round robin
    # would alternate). min_max_tokens 0: the quick budget is meant as given.
    return f"""
defaults: {{max_tokens: 256, min_max_tokens: 0}}
presets:
  gguf:
    served_model: tiny-gguf
    policy: prefix_affinity
    replicas:
      - {{name: llama-a, url: "{llama[0].url}", engine: llamacpp}}
      - {{name: llama-b, url: "{llama[1].url}", engine: llamacpp}}
routing: {{default: gguf}}
"""


def check(record: dict[str, object]) -> dict[str, object]:
    assert record["error"] is None, record
    results = record["results"]
    assert isinstance(results, dict)
    assert results["errors"] == {}, results
    assert results["decode_tps"] > 0 and results["decode_tps_with_context"] > 0
    assert results["cold_ttft_s"] > 0 and results["repeat_ttft_s"] > 0
    assert results["cached_tokens_on_repeat"] > 0
    assert results["parallel"]["aggregate_tps"] > 0
    # The random model cannot call a tool; the check must say so, not crash.
    tool = results["tool_call"]
    assert tool["ok"] is False and tool["detail"], tool
    return results


def test_quick_bench_through_the_gateway(
    llama_pair: tuple[LlamaServer, LlamaServer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = tmp_path / "routes.yaml"
    table.write_text(routes(llama_pair))
    out = tmp_path / "results.jsonl"
    with run_gateway(table.read_text()) as gateway:
        code = main(["bench", "--url", gateway.url, "--routes", str(table), "--quick", "--out", str(out)])
    assert code == 0, capsys.readouterr()
    (line,) = out.read_text().splitlines()
    record = json.loads(line)
    results = check(record)
    assert results["cold_ttft_valid"] is True  # a prompt these servers never saw
    served = record["served_by"]
    assert served["cold"] == served["repeat"] in ("llama-a", "llama-b")
    # What each llama-server's /v1/models says: 2 slots of 8192 tokens (conftest's llama_pair).
    assert [r["context"] for r in record["replicas"]] == [8192, 8192]
    assert all(r["models"]["data"][0]["owned_by"] == "llamacpp" for r in record["replicas"])
    assert record["settings"]["policy"] == "prefix_affinity"


def test_quick_bench_straight_at_a_llama_server(
    llama_pair: tuple[LlamaServer, LlamaServer], tmp_path: Path
) -> None:
    out = tmp_path / "results.jsonl"
    assert main(["bench", "--url", llama_pair[0].url, "--quick", "--out", str(out)]) == 0
    (line,) = out.read_text().splitlines()
    record = json.loads(line)
    check(record)
    assert record["gateway_version"] is None and record["replicas"][0]["engine"] == "llamacpp"
