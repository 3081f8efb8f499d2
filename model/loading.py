"""Loading a causal LM and its tokenizer for training and sampling, in-house or Hugging Face."""
from __future__ import annotations

from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_causal_lm(path: str | Path, dtype: str = "float32", device: str = "cpu"):
    """Load (model, tokenizer) from a Hugging Face model directory or a .gguf file.

    The in-house hybrid is registered with ``AutoModelForCausalLM`` when ``model`` is imported,
    which importing this module does.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    if path.is_file() and path.suffix == ".gguf":
        # transformers dequantizes GGUF weights to full precision; the quantizer object it
        # leaves behind only gets in the way of later save/generate calls.
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=_DTYPES[dtype])
        model.hf_quantizer = None
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype])
    return model.to(device).eval(), tokenizer
