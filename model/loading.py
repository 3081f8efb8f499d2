"""Loading a causal LM and its tokenizer for training and sampling, in-house or Hugging Face."""
from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from model.hybrid import FusedLogprobHead, HybridForCausalLM

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# transformers builds a model under process-wide patches (weight init turned off, a meta default
# device, torch.linspace replaced): two loads in threads of one process (the pipeline runs the
# references and the on-policy samples side by side) break each other, one with weights left
# on the meta device, the other with uninitialized (NaN) ones. Loads take turns.
MODEL_LOAD_LOCK = threading.RLock()


def load_causal_lm(path: str | Path, dtype: str = "float32", device: str = "cpu"):
    """Load (model, tokenizer) from a Hugging Face model directory or a .gguf file.

    The in-house hybrid is registered with ``AutoModelForCausalLM`` when ``model`` is imported,
    which importing this module does.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    with MODEL_LOAD_LOCK:
        if path.is_file() and path.suffix == ".gguf":
            # transformers dequantizes GGUF weights to full precision; the quantizer object it
            # leaves behind only gets in the way of later save/generate calls.
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=_DTYPES[dtype])
            model.hf_quantizer = None
        else:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype])
    reason = adopt_fused_head(model)
    if reason is not None:
        log.warning("%s scores tokens through its own logits, upcast to FP32 (not the fused FP32 head): %s",
                    type(model).__name__, reason)
    return model.to(device).eval(), tokenizer


def adopt_fused_head(model) -> str | None:
    """Route a Hugging Face causal LM's token scoring through the fused FP32 head (M1: the
    train/inference log-prob gap came from the LM head's precision): its ``lm_head`` becomes a
    ``FusedLogprobHead`` holding the same Parameter, so ``model.logprobs.token_logprobs`` scores
    from the decoder's final hidden states and that weight in FP32, never by upcasting
    low-precision logits. Only when the model's logits are exactly ``hidden @ lm_head.weight``,
    checked on a probe forward (soft-capped or scaled logits would be scored wrongly).
    None when adopted (or the model is the in-house hybrid, whose head already is), else why not.
    """
    if isinstance(model, HybridForCausalLM):
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if isinstance(head, FusedLogprobHead):
        return None
    if type(head) is not nn.Linear or head.bias is not None:
        return f"its output embedding is a {type(head).__name__}, not a bias-free nn.Linear"
    if decoder is None or decoder is model:
        return "it exposes no decoder (get_decoder) to take the final hidden states from"
    probe = (torch.arange(1, 9, device=head.weight.device) % head.out_features)[None]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe).logits.float()
        hidden = decoder(input_ids=probe).last_hidden_state
        direct = F.linear(hidden.float(), head.weight.float())
    model.train(was_training)
    tolerance = 1e-2 if head.weight.dtype in (torch.bfloat16, torch.float16) else 1e-4
    if logits.shape != direct.shape or not torch.allclose(logits, direct, rtol=tolerance,
                                                          atol=tolerance * float(direct.abs().max())):
        return "its logits are not its final hidden states times lm_head.weight (post-processed, e.g. soft-capped)"
    model.set_output_embeddings(FusedLogprobHead.adopt(head))
    return None
