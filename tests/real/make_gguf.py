"""Write a tiny random-weight llama GGUF for llama-server.

Run with the llama backend's Python (it needs ``gguf`` and ``numpy``)::

    python make_gguf.py OUT.gguf

The model knows nothing; its output is random bytes. It exists so the tests exercise the real
server's HTTP surface, chat templating, slots and prompt cache in well under a second per
request. ``CHAT_TEMPLATE`` and ``SPECIAL_TOKENS`` are shared with ``make_hf_llama.py`` so both
engines render the same prompt shape.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

SEED = 20240611

N_EMBD = 64
N_BLOCKS = 2
N_HEAD = 4
N_HEAD_KV = 4
N_FF = 128
RMS_EPS = 1e-5
# llama-server caps each slot at the training context, and the gateway tests send prompts of
# several thousand tokens (4096 refused a 5k-token prompt).
CONTEXT_LENGTH = 65536

SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"

# A handful of GPT-2 style merges: llama.cpp refuses a BPE vocab with no merges at all
# ("cannot find tokenizer merges"); which merges they are does not matter.
MERGES = (
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("Ġ", "a"),
    ("e", "r"),
    ("o", "n"),
    ("r", "e"),
)

# ChatML with Qwen-style tool rendering. ``tool | tojson`` per tool, in request order, so the
# prompt bytes depend on tool order and on key order inside ``parameters`` exactly as with
# real Qwen templates (docs/engines.md §9). The empty think block appears only for an
# explicit false, as Qwen3 does; llama-server is started with enable_thinking=true by default
# so that a request without kwargs renders none (docs/engines.md §11).
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' }}
{%- if message.content is string %}{{- message.content }}{%- endif %}
{%- if message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- set call = tool_call.function if tool_call.function is defined else tool_call %}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (as in its ``encoder.py``)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


def vocabulary() -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types (1 normal, 3 control) and merges."""
    tokens = [bytes_to_unicode()[b] for b in range(256)]
    merges = []
    for left, right in MERGES:
        tokens.append(left + right)
        merges.append(f"{left} {right}")
    types = [1] * len(tokens)
    tokens.extend(SPECIAL_TOKENS)
    types.extend([3] * len(SPECIAL_TOKENS))
    return tokens, types, merges


def tensors(n_vocab: int) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(SEED)

    def weight(*shape: int) -> Any:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def norm() -> Any:
        return np.ones(N_EMBD, dtype=np.float32)

    n_embd_kv = (N_EMBD // N_HEAD) * N_HEAD_KV
    # numpy shapes are the ggml dimensions reversed: ggml's (n_embd, n_vocab) is (n_vocab, n_embd).
    out = {"token_embd.weight": weight(n_vocab, N_EMBD)}
    for i in range(N_BLOCKS):
        out |= {
            f"blk.{i}.attn_norm.weight": norm(),
            f"blk.{i}.attn_q.weight": weight(N_EMBD, N_EMBD),
            f"blk.{i}.attn_k.weight": weight(n_embd_kv, N_EMBD),
            f"blk.{i}.attn_v.weight": weight(n_embd_kv, N_EMBD),
            f"blk.{i}.attn_output.weight": weight(N_EMBD, N_EMBD),
            f"blk.{i}.ffn_norm.weight": norm(),
            f"blk.{i}.ffn_gate.weight": weight(N_FF, N_EMBD),
            f"blk.{i}.ffn_up.weight": weight(N_FF, N_EMBD),
            f"blk.{i}.ffn_down.weight": weight(N_EMBD, N_FF),
        }
    out |= {"output_norm.weight": norm(), "output.weight": weight(n_vocab, N_EMBD)}
    return out


def write(path: Path) -> None:
    import gguf

    tokens, types, merges = vocabulary()
    # Write beside the target and rename, so an interrupted run never leaves a file that a
    # later "skip if present" check would trust.
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    writer = gguf.GGUFWriter(partial, "llama")
    writer.add_name("fleet-tiny")
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_BLOCKS)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index(BOS_TOKEN))
    writer.add_eos_token_id(tokens.index(EOS_TOKEN))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, data in tensors(len(tokens)).items():
        writer.add_tensor(name, data)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    partial.replace(path)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} OUT.gguf", file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    write(out)
    print(f"wrote {out} ({out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
