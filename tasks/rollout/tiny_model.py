"""A random-init 2-layer Llama with a locally trained byte-level BPE tokenizer.

The tokenizer is the in-house one (model.tokenizer). The model lets the whole rollout path
(tokenize, batch, cache, sample, serve) run in seconds on CPU with no download: the
``tiny`` profile and the tests use it. Its outputs are noise.
"""
from __future__ import annotations

from pathlib import Path

from tasks.model_cache import build_once, models_root

TINY_LLAMA_NAME = "tiny-llama"


def _corpus(size: int = 400) -> list[str]:
    """Deterministic varied text: arithmetic, code and prose fragments."""
    words = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "by", "this", "are", "from", "or", "at"]
    lines = []
    for i in range(size):
        a, b = (i * 7919) % 97, (i * 104729) % 89
        lines.append(f"What is {a} + {b}? The answer is \\boxed{{{a + b}}}.")
        lines.append(f"def f{i}(x):\n    return x * {a} + {b}\n")
        lines.append(" ".join(words[(i + j) % len(words)] for j in range(12)) + ".")
        lines.append(f"<answer>{a * b}</answer>")
    return lines


def build_tiny_llama(out_dir: str | Path, seed: int = 0, vocab_size: int = 512) -> Path:
    """A tiny Llama + tokenizer at ``out_dir``, built there once (atomically) and reused."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return build_once(out_dir.parent, out_dir.name, lambda tmp: _write_tiny_llama(tmp, seed, vocab_size))


TINY_LLAMA_LAYERS = 2


def _write_tiny_llama(out_dir: Path, seed: int, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from model.config import TINY_SIZES
    from model.tokenizer import train_tokenizer

    fast = train_tokenizer(_corpus(), vocab_size, out_dir)

    torch.manual_seed(seed)
    # the tiny preset's widths (model.config.TINY_SIZES), two dense layers: a fast stand-in policy
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=TINY_SIZES.hidden_size,
        intermediate_size=TINY_SIZES.intermediate_size,
        num_hidden_layers=TINY_LLAMA_LAYERS,
        num_attention_heads=TINY_SIZES.num_attention_heads,
        num_key_value_heads=TINY_SIZES.num_key_value_heads,
        max_position_embeddings=TINY_SIZES.max_position_embeddings,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=True,
    )
    from model.loading import MODEL_LOAD_LOCK

    with MODEL_LOAD_LOCK:   # its random init must not run under another thread's load patches
        model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir)


def tiny_llama_path(home: str | Path | None = None) -> Path:
    """The cached tiny Llama under ``$POSTTRAIN_HOME/models``, built on first use."""
    return build_tiny_llama(models_root(home) / TINY_LLAMA_NAME)
