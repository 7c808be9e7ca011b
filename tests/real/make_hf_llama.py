"""Write a tiny random-weight ``LlamaForCausalLM`` checkpoint for vLLM.

Run with the vLLM backend's Python (it needs ``torch``, ``transformers`` and ``tokenizers``)::

    python make_hf_llama.py OUTDIR

Everything is generated here: a byte-level BPE trained on built-in text, random weights, the
same ChatML template as the GGUF model (imported from ``make_gguf.py``). Nothing is fetched.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path

from make_gguf import BOS_TOKEN, CHAT_TEMPLATE, EOS_TOKEN, SPECIAL_TOKENS

SEED = 20240611
VOCAB_SIZE = 2048
HIDDEN = 64
LAYERS = 2
HEADS = 2
# The CPU attention kernel rejects head_dim 16: the engine starts, then dies on the first
# request (docs/engines.md §11). 32 is the smallest size that works.
HEAD_DIM = 32
INTERMEDIATE = 128
MAX_POSITIONS = 4096

# Hermes-style tool markers get their own tokens, as in the Qwen/Hermes models whose tool
# parser the replica runs with.
EXTRA_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")

_TEXT = """\
The gateway sits in front of a small fleet of model servers. Each request names a model, the
gateway picks a replica, forwards the body, and relays the answer back, token by token when the
client asked for a stream. Replicas come and go: one is loading, another is busy, a third has
the conversation's prefix in its cache. The quick brown fox jumps over the lazy dog while the
system prompt stays the same and only the last user turn changes.
{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
"""


def corpus() -> list[str]:
    """Enough distinct text for the trainer to reach the full vocabulary size."""
    rng = random.Random(SEED)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    lines = _TEXT.splitlines() * 20
    for _ in range(4000):
        words = (
            "".join(rng.choice(letters[: rng.randint(6, 26)]) for _ in range(rng.randint(2, 9)))
            for _ in range(12)
        )
        lines.append(" ".join(words))
    return lines


def build_tokenizer(out: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[*SPECIAL_TOKENS, *EXTRA_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=BOS_TOKEN,
        additional_special_tokens=list(SPECIAL_TOKENS),
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
    )
    fast.save_pretrained(out)
    # Recent transformers writes the template to chat_template.jinja; keep it in
    # tokenizer_config.json, where every loader (and a human) looks first.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return {name: tok.token_to_id(name) for name in (*SPECIAL_TOKENS, *EXTRA_TOKENS)}


def build_model(out: Path, ids: dict[str, int]) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=INTERMEDIATE,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        bos_token_id=ids[BOS_TOKEN],
        eos_token_id=ids[EOS_TOKEN],
        pad_token_id=ids[BOS_TOKEN],
        tie_word_embeddings=False,
        dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(out)
    GenerationConfig(
        bos_token_id=ids[BOS_TOKEN],
        eos_token_id=[ids[EOS_TOKEN], ids["<|endoftext|>"]],
        pad_token_id=ids[BOS_TOKEN],
    ).save_pretrained(out)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} OUTDIR", file=sys.stderr)
        return 2
    out = Path(argv[1])
    # Build beside the target and rename, so an interrupted run never leaves a directory that a
    # later "skip if present" check would trust.
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    ids = build_tokenizer(partial)
    build_model(partial, ids)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size} bytes, vocab {VOCAB_SIZE}, special ids {ids})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
