"""Reference for the FP32 LM-head log-prob: materializes the full [N, vocab] logits.

    hidden: [..., D]   weight: [vocab, D]   labels: [...] (ignore_index -> log-prob 0)
    returns (logp, entropy), both float32 with the shape of ``labels``.
"""

from __future__ import annotations

import torch


def _validate(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be labels {tuple(labels.shape)} plus a feature dim"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be [vocab, {hidden.shape[-1]}], got {tuple(weight.shape)}"
        )


def token_logprobs_naive(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    _validate(hidden, weight, labels)
    logits = hidden.float() @ weight.float().T
    log_probs = torch.log_softmax(logits, dim=-1)
    valid = labels != ignore_index
    picked = log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(valid, picked, torch.zeros((), device=picked.device))
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logp, entropy
