"""Kernels: lightning attention and the fused FP32 LM-head log-prob, each with a plain-torch
reference beside it. Imports nothing of ours; Triton modules load lazily via ``dispatch``."""

from .dispatch import head_logprobs, lightning_attn, select_backend, select_head_backend
from .lightning_chunk import lightning_attn_chunk
from .lightning_naive import lightning_attn_naive, lightning_attn_recurrent
from .logprob_fused import token_logprobs_fused
from .logprob_naive import token_logprobs_naive

__all__ = [
    "head_logprobs",
    "lightning_attn",
    "lightning_attn_chunk",
    "lightning_attn_naive",
    "lightning_attn_recurrent",
    "select_backend",
    "select_head_backend",
    "token_logprobs_fused",
    "token_logprobs_naive",
]
