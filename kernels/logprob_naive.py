"""Reference for the FP32 LM-head log-prob: materializes the full [N, vocab] logits.

    hidden: [..., D]   weight: [vocab, D]   labels: [...] (ignore_index -> log-prob 0)
    returns (logp, entropy), both float32 with the shape of ``labels``.
"""

from __future__ import annotations

import torch

from .utils import kernel_entry


@kernel_entry("head")
def token_logprobs_naive(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = hidden.float() @ weight.float().T
    log_probs = torch.log_softmax(logits, dim=-1)
    valid = labels != ignore_index
    picked = log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(valid, picked, torch.zeros((), device=picked.device))
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logp, entropy
