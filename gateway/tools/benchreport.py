"""The pure half of `fleet-gateway bench`: what it sends (prompts, a tool, an image), how it reads an
endpoint's errors, what it records besides timings (table settings, contexts, GPU power limits), the
results file, `--compare` and the progress line.

Nothing here touches the network (benchmark.py does), so every part is checked on plain values.
"""

from __future__ import annotations

import base64
import json
import math
import random
import re
import shutil
import struct
import subprocess
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from gateway.routing.table import Preset
from gateway.types import Json

# --- errors ------------------------------------------------------------------------------------------

# vLLM: "maximum context length is N" / "max_model_len=N"; llama-server: "available context size (N tokens)".
CONTEXT_RE = re.compile(r"maximum context length is (\d+)|max_model_len=(\d+)|context size \((\d+) tokens\)")
# vLLM: "your prompt contains P input tokens"; llama-server: "request (P tokens) exceeds".
PROMPT_RE = re.compile(r"prompt contains (?:at least )?(\d+) input tokens|request \((\d+) tokens\)")


class BenchError(Exception):
    """A request failed; the message is what the record keeps.

    A context-length refusal also names the context and often the prompt's size in tokens: enough
    to size the long prompt again (`context`, `prompt_tokens`).
    """

    def __init__(self, message: str, context: int | None = None, prompt_tokens: int | None = None) -> None:
        super().__init__(message)
        self.context = context
        self.prompt_tokens = prompt_tokens


def http_error(status: int, raw: bytes) -> BenchError:
    """The error an endpoint answered, in one line: its own message, not the JSON around it."""
    message = raw.decode("utf-8", "replace").strip()[:500] or "(empty body)"
    limit = prompt = None
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            message = str(error.get("message") or message)
            limit = error.get("n_ctx") if isinstance(error.get("n_ctx"), int) else None
        elif isinstance(error, str):
            message = error
        elif "detail" in body:
            message = str(body["detail"])
    found = CONTEXT_RE.search(message)
    if limit is None and found:
        limit = int(next(g for g in found.groups() if g))
    found = PROMPT_RE.search(message)
    if found:
        prompt = int(next(g for g in found.groups() if g))
    if status != 400:
        return BenchError(f"HTTP {status}: {message}")
    return BenchError(f"HTTP {status}: {message}", context=limit, prompt_tokens=prompt)


# --- inputs ------------------------------------------------------------------------------------------

_WORDS = """
    time year people way day man thing woman life child world school state family student group country
    problem hand part place case week company system program question work government number night point
    home water room mother area money story fact month lot right study book eye job word business issue
    side kind head house service friend father power hour game line end member law car city community name
    president team minute idea kid body information back parent face others level office door health person
    art war history party result change morning reason research girl guy moment air teacher force education
    river stone cloud light north field garden market bridge window letter signal engine harbor valley"""
VOCABULARY = tuple(_WORDS.split())


def filler(count: int, seed: str) -> str:
    """`count` words of deterministic prose: the same text every run, so runs compare."""
    words = random.Random(seed).choices(VOCABULARY, k=count)
    sentences = [" ".join(words[i : i + 12]).capitalize() + "." for i in range(0, count, 12)]
    return " ".join(sentences)


def decode_messages() -> list[Json]:
    text = "Continue this story for as long as you can.\n\n" + filler(200, "decode")
    return [{"role": "user", "content": text}]


def long_messages(preset: str, words: int) -> list[Json]:
    # The preset's name comes first: two presets on one server must not share each other's cache.
    text = f"Reference document for {preset}.\n\n{filler(words, 'long')}\n\nSummarise the document above."
    return [{"role": "user", "content": text}]


def parallel_messages(index: int, count: int) -> list[Json]:
    text = f"Request {index + 1} of {count}. Write a long story about a {VOCABULARY[index % 50]}."
    return [{"role": "user", "content": text}]


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name"}},
            "required": ["city"],
        },
    },
}
TOOL_PROMPT = "Call the get_weather tool to get the weather in Paris. Do not answer in text: call the tool."

IMAGE_TEXT = "73914"
# A classic 5x7 bitmap font: enough for a vision model to read, small enough to keep here.
DIGITS = {
    "0": ("01110", "10001", "10011", "10101", "11001", "10001", "01110"),
    "1": ("00100", "01100", "00100", "00100", "00100", "00100", "01110"),
    "2": ("01110", "10001", "00001", "00010", "00100", "01000", "11111"),
    "3": ("11111", "00010", "00100", "00010", "00001", "10001", "01110"),
    "4": ("00010", "00110", "01010", "10010", "11111", "00010", "00010"),
    "5": ("11111", "10000", "11110", "00001", "00001", "10001", "01110"),
    "6": ("00110", "01000", "10000", "11110", "10001", "10001", "01110"),
    "7": ("11111", "00001", "00010", "00100", "01000", "01000", "01000"),
    "8": ("01110", "10001", "10001", "01110", "10001", "10001", "01110"),
    "9": ("01110", "10001", "10001", "01111", "00001", "00010", "01100"),
}


def digits_png(text: str = IMAGE_TEXT, scale: int = 8) -> bytes:
    """Black digits on white as an 8-bit grayscale PNG, with zlib and struct only (no imaging library)."""
    margin, gap = 4 * scale, 2 * scale
    width = 2 * margin + len(text) * 5 * scale + (len(text) - 1) * gap
    height = 2 * margin + 7 * scale
    rows = [bytearray(b"\xff" * width) for _ in range(height)]
    for n, char in enumerate(text):
        left = margin + n * (5 * scale + gap)
        for y, bits in enumerate(DIGITS[char]):
            for x, bit in enumerate(bits):
                if bit == "1":
                    for row in rows[margin + y * scale : margin + (y + 1) * scale]:
                        start = left + x * scale
                        row[start : start + scale] = b"\x00" * scale
    raw = b"".join(b"\x00" + bytes(row) for row in rows)  # filter type 0 (None) on every row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit grayscale, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def image_messages() -> list[Json]:
    url = "data:image/png;base64," + base64.b64encode(digits_png()).decode()
    question = "What number is written in this image? Answer with the digits only."
    content = [{"type": "text", "text": question}, {"type": "image_url", "image_url": {"url": url}}]
    return [{"role": "user", "content": content}]


def chat_body(model: str, messages: list[Json], max_tokens: int, *, timed: bool = True) -> Json:
    body: Json = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if timed:
        body.update(stream=True, stream_options={"include_usage": True}, ignore_eos=True)
    return body


# --- what the record says about the target ------------------------------------------------------------


def model_context(models: Any, served: str | None) -> int | None:
    """vLLM's `max_model_len`, llama-server's `meta.n_ctx`, for the served model (or the only one)."""
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list):
        return None
    cards = [c for c in data if isinstance(c, dict)]
    named = [c for c in cards if served in (c.get("id"), *(c.get("aliases") or []))]
    for card in named or (cards if len(cards) == 1 else []):
        meta = card.get("meta")
        value = card.get("max_model_len") or (meta.get("n_ctx") if isinstance(meta, dict) else None)
        if isinstance(value, int):
            return value
    return None


def preset_settings(preset: Preset) -> Json:
    """A preset's resolved settings as JSON, stored in each bench record so that results can be
    compared with the configuration that produced them."""
    return {
        "served_model": preset.served_model,
        "aliases": list(preset.aliases),
        "vision": preset.vision,
        "thinking": preset.thinking,
        "max_tokens": preset.max_tokens,
        "min_max_tokens": preset.min_max_tokens,
        "policy": preset.policy,
        "timeouts": preset.timeouts.model_dump(),
        "limits": preset.limits.model_dump(),
        "retries": preset.retries.model_dump(),
        "prefix": preset.prefix.model_dump(),
        "abort_on_disconnect": preset.abort_on_disconnect,
        "params": dict(preset.params),
        "discover": None if preset.discover is None else preset.discover.model_dump(),
    }


def check_tool(answer: Json) -> tuple[bool, str]:
    """Whether the tool-call check's answer holds a parsed call of `get_weather` with a JSON object
    for arguments: `(ok, detail)`, the detail saying what was called or what went wrong."""
    choices = answer.get("choices") or [{}]
    message = choices[0].get("message") or {}
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        content = str(message.get("content") or "")[:160]
        return False, f"no tool_calls (finish_reason {choices[0].get('finish_reason')}); content {content!r}"
    function = (calls[0] or {}).get("function") or {}
    name, arguments = function.get("name"), function.get("arguments")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return False, f"{name}: the arguments are not JSON: {str(arguments)[:160]!r}"
    if not isinstance(parsed, dict):
        return False, f"{name}: the arguments are not a JSON object: {str(arguments)[:160]!r}"
    if name != "get_weather":
        return False, f"called {name!r}, not get_weather"
    return True, f"get_weather({json.dumps(parsed)})"


class Progress:
    """One self-rewriting line on a terminal; plain step lines anywhere else (CI logs, pipes).

    A `\\r` line in a log file is unreadable, and a log is where a CI run's progress ends up.
    """

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 24) -> None:
        self.total = max(total, 1)
        self.stream = stream
        self.tty = stream is not None and stream.isatty()
        self.width = width
        self.done = 0
        self.label = ""
        self.started = time.monotonic()
        self._drawn = 0.0

    def start(self, label: str) -> None:
        self.label = label
        if self.stream is None:
            return
        if self.tty:
            self._draw("", force=True)
        else:
            print(f"[{self.done + 1}/{self.total}] {label}", file=self.stream, flush=True)

    def detail(self, text: str) -> None:
        """Live detail for the current step (tokens so far); terminal only, at most 10 redraws a second."""
        if self.tty:
            self._draw(text)

    def advance(self, steps: int = 1) -> None:
        self.done = min(self.total, self.done + steps)
        if self.tty:
            self._draw("", force=True)

    def message(self, text: str) -> None:
        """A line of its own (a warning, a finished preset), without breaking the bar."""
        if self.stream is None:
            return
        if self.tty:
            self.stream.write("\r\x1b[K")
        print(text, file=self.stream, flush=True)
        if self.tty and self.done < self.total:
            self._draw("", force=True)

    def close(self) -> None:
        if self.tty and self.stream is not None:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def _draw(self, detail: str, force: bool = False) -> None:
        now = time.monotonic()
        if self.stream is None or (not force and now - self._drawn < 0.1):
            return
        self._drawn = now
        filled = self.width * self.done // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        line = f"[{bar}] {self.done}/{self.total} {now - self.started:6.1f}s  {self.label}"
        if detail:
            line += f"  {detail}"
        columns = shutil.get_terminal_size((100, 20)).columns
        self.stream.write("\r\x1b[K" + line[: max(columns - 1, 20)])
        self.stream.flush()


# --- the results file --------------------------------------------------------------------------------


def append_record(path: Path, record: Json) -> None:
    """One line per preset run, written as soon as the preset is done: an interrupted run keeps its lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # ASCII-escaped: a random-weight model's answer may hold lone surrogates, which UTF-8 cannot encode.
    line = json.dumps(record, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    with path.open("a", encoding="utf-8") as out:
        out.write(line + "\n")


def load_records(path: Path) -> list[Json]:
    records = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not a JSON line ({exc})") from None
            if isinstance(record, dict) and isinstance(record.get("preset"), str):
                records.append(record)
    return records


def latest_by_preset(records: Sequence[Json]) -> dict[str, Json]:
    """The latest run of each preset: by its time, and on a tie the later line (the file is appended)."""
    latest: dict[str, Json] = {}
    for record in records:
        name = record["preset"]
        if name not in latest or str(record.get("time", "")) >= str(latest[name].get("time", "")):
            latest[name] = record
    return latest


# --- --compare ---------------------------------------------------------------------------------------

# (label, path into the record, lower is better): the direction is printed so a ratio reads at a glance.
ROWS: tuple[tuple[str, tuple[str, ...], bool | None], ...] = (
    ("time", ("time",), None),
    ("gateway version", ("gateway_version",), None),
    ("served model", ("served_model",), None),
    ("GPU power limit W", ("gpu", "power_limit_w"), None),
    ("decode tok/s", ("results", "decode_tps"), False),
    ("cold TTFT s", ("results", "cold_ttft_s"), True),
    ("  cold is valid", ("results", "cold_ttft_valid"), None),
    ("long prompt tokens", ("results", "prompt_tokens"), None),
    ("repeat TTFT s", ("results", "repeat_ttft_s"), True),
    ("cached on repeat", ("results", "cached_tokens_on_repeat"), None),
    ("decode tok/s, context", ("results", "decode_tps_with_context"), False),
    ("parallel n", ("results", "parallel", "n"), None),
    ("parallel total tok/s", ("results", "parallel", "aggregate_tps"), False),
    ("parallel each tok/s", ("results", "parallel", "per_request_tps"), False),
    ("tool call ok", ("results", "tool_call", "ok"), None),
    ("image ok", ("results", "image", "ok"), None),
    ("error", ("error",), None),
)


WIDTH = 22
COLD_VALID = ("results", "cold_ttft_valid")


def _get(record: Json | None, path: Sequence[str]) -> Any:
    value: Any = record
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def _show(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    text = str(value)
    return text if len(text) <= WIDTH else text[: WIDTH - 1] + "~"


def _ratio(a: Any, b: Any, lower_is_better: bool | None) -> str:
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (a, b))
    if lower_is_better is None or not numbers or a == 0 or not math.isfinite(b / a):
        return ""
    ratio = b / a
    better = ratio < 1 if lower_is_better else ratio > 1
    mark = "" if abs(ratio - 1) < 0.005 else (" better" if better else " worse")
    return f"{ratio:.2f}x{mark}"


def compare(a_path: Path, b_path: Path) -> str:
    """Per preset, the latest run of each file side by side, with B/A ratios on the numbers."""
    a, b = latest_by_preset(load_records(a_path)), latest_by_preset(load_records(b_path))
    lines = [f"A: {a_path}", f"B: {b_path}", "ratios are B/A; 'better' follows the metric's direction", ""]
    for name in [*a, *(n for n in b if n not in a)]:
        left, right = a.get(name), b.get(name)
        lines.append(f"preset {name}" + ("" if left and right else "  (only in " + ("A)" if left else "B)")))
        lines.append(f"  {'':24}{'A':>{WIDTH}}  {'B':>{WIDTH}}  B/A")
        for label, path, lower in ROWS:
            va, vb = _get(left, path), _get(right, path)
            if va is None and vb is None and label in ("error", "image ok", "GPU power limit W"):
                continue
            ratio = _ratio(va, vb, lower)
            if path[-1] == "cold_ttft_s":
                # A cached "cold" prompt against a real cold one is no comparison: say so instead.
                warm = [side for side, r in (("A", left), ("B", right)) if _get(r, COLD_VALID) is False]
                ratio = f"not comparable: {' and '.join(warm)} not cold" if warm and ratio else ratio
            lines.append(f"  {label:24}{_show(va):>{WIDTH}}  {_show(vb):>{WIDTH}}  {ratio}".rstrip())
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


# --- the machine -------------------------------------------------------------------------------------

NVIDIA_QUERY = ("--query-gpu=index,name,power.limit", "--format=csv,noheader")
Runner = Callable[[list[str]], str]


def _run(command: list[str]) -> str:
    # The binary is the one `shutil.which` found and the arguments are constants: no untrusted input.
    done = subprocess.run(command, capture_output=True, text=True, timeout=15, check=True)  # noqa: S603
    return done.stdout


def gpu_info(run: Runner = _run) -> Json | None:
    """The GPUs' power limits from nvidia-smi, or None when there is no nvidia-smi.

    A power-capped GPU decodes slower; two result files are only comparable with this in view.
    """
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return None
    try:
        output = run([binary, *NVIDIA_QUERY])
    except (OSError, subprocess.SubprocessError) as exc:
        return {"power_limit_w": None, "gpus": [], "error": f"nvidia-smi failed: {exc}"}
    gpus = parse_nvidia_smi(output)
    return {"power_limit_w": gpus[0]["power_limit_w"] if gpus else None, "gpus": gpus}


def parse_nvidia_smi(output: str) -> list[Json]:
    """Lines like `0, NVIDIA H200, 700.00 W`; `[N/A]` (a GPU without a settable limit) gives None."""
    gpus = []
    for line in output.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not parts[0].isdigit():
            continue
        # The name may itself contain commas; the index is first and the limit last.
        limit_text = parts[-1].removesuffix("W").strip()
        try:
            limit: float | None = float(limit_text)
        except ValueError:
            limit = None
        gpus.append({"index": int(parts[0]), "name": ", ".join(parts[1:-1]), "power_limit_w": limit})
    return gpus


# --- the summary on stdout ---------------------------------------------------------------------------


COLDNESS = {False: " (not cold)", None: " (cold? unknown)"}


def summary_line(record: Json) -> str:
    """One preset's bench record as the line printed at the end: its decode rate, cold and repeat
    TTFT, decode with context, parallel rate, the tool and image checks and the failed steps, or the
    error that stopped it."""
    name = record.get("preset")
    if record.get("error"):
        return f"{name}: FAILED: {record['error']}"
    r = record.get("results") or {}
    parallel = r.get("parallel") or {}
    tool = r.get("tool_call") or {}
    image = r.get("image")
    parts = [
        f"decode {_show(r.get('decode_tps'))} tok/s",
        f"cold TTFT {_show(r.get('cold_ttft_s'))} s" + COLDNESS.get(r.get("cold_ttft_valid"), ""),
        f"repeat TTFT {_show(r.get('repeat_ttft_s'))} s ({_show(r.get('cached_tokens_on_repeat'))} cached)",
        f"with context {_show(r.get('decode_tps_with_context'))} tok/s",
        f"x{_show(parallel.get('n'))} {_show(parallel.get('aggregate_tps'))} tok/s",
        f"tools {'ok' if tool.get('ok') else 'FAIL'}",
    ]
    if image is not None:
        parts.append(f"image {'ok' if image.get('ok') else 'FAIL'}")
    failed = r.get("errors") or {}
    if failed:
        parts.append("errors in " + ", ".join(failed))
    return f"{name}: " + ", ".join(parts)
