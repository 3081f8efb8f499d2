"""A random-init 2-layer Llama with a locally trained byte-level BPE tokenizer.

The tokenizer is the in-house one (model.tokenizer). The model lets the whole rollout path
(tokenize, batch, cache, sample, serve) run in seconds on CPU with no download: the
``tiny`` profile and the tests use it. Its outputs are noise.
"""
from __future__ import annotations

import os
from pathlib import Path

from filelock import FileLock

TINY_LLAMA_NAME = "tiny-llama"


def _corpus(size: int = 400) -> list[str]:
    """Deterministic varied text: arithmetic, code and prose fragments."""
    words = "the of and to in is that for it as with was on be by this are from or at".split()
    lines = []
    for i in range(size):
        a, b = (i * 7919) % 97, (i * 104729) % 89
        lines.append(f"What is {a} + {b}? The answer is \\boxed{{{a + b}}}.")
        lines.append(f"def f{i}(x):\n    return x * {a} + {b}\n")
        lines.append(" ".join(words[(i + j) % len(words)] for j in range(12)) + ".")
        lines.append(f"<answer>{a * b}</answer>")
    return lines


def build_tiny_llama(out_dir: str | Path, seed: int = 0, vocab_size: int = 512) -> Path:
    """Write a tiny Llama + tokenizer to ``out_dir`` (idempotent) and return the path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from model.tokenizer import train_tokenizer

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists() and (out_dir / "tokenizer.json").exists():
        return out_dir
    fast = train_tokenizer(_corpus(), vocab_size, out_dir)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(out_dir)
    return out_dir


def tiny_llama_path(home: str | Path | None = None) -> Path:
    """The cached tiny Llama under ``$POSTTRAIN_HOME/models``, built on first use."""
    root = Path(home or os.environ.get("POSTTRAIN_HOME", ".posttrain")) / "models"
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{TINY_LLAMA_NAME}.lock")):
        return build_tiny_llama(root / TINY_LLAMA_NAME)
