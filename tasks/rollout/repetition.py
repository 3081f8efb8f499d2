"""MiniMax-M1 repetition early truncation.

M1 stopped an RL rollout once 3,000 consecutive tokens each had probability above 0.99:
such a run means the model is stuck in a loop, and the rest of the sample only wastes
compute and poisons the gradient. The local sampler applies the rule token by token while
it generates (``RepetitionTracker``); for backends that only report log-probs afterwards,
``truncate_on_repetition`` cuts the finished completion at the same place.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from tasks.rollout.base import Completion


def repetition_cut(logprobs: Sequence[float | None], window: int, prob: float) -> int | None:
    """Number of tokens to keep, or None when no run of ``window`` confident tokens exists.

    The kept prefix ends with the token that completed the run, which is the same token at
    which the streaming tracker stops generating. An unknown log-prob (None: a server left it
    out) is skipped: no evidence either way, it neither counts towards a run nor ends one, so
    only tokens known to be confident can cut a sample.
    """
    if window < 1:
        raise ValueError(f"repetition window must be >= 1, got {window}")
    threshold = math.log(prob)
    run = 0
    for position, logprob in enumerate(logprobs):
        if logprob is None:
            continue
        run = run + 1 if logprob > threshold else 0
        if run >= window:
            return position + 1
    return None


def truncate_on_repetition(
    completion: Completion,
    window: int | None,
    prob: float,
    decode: Callable[[list[int]], str] | None = None,
    token_texts: Sequence[str] | None = None,
) -> Completion:
    """Apply the rule after the fact; the text is rebuilt from ``decode`` or ``token_texts``."""
    if window is None or completion.logprobs is None or completion.finish_reason == "repetition":
        return completion
    keep = repetition_cut(completion.logprobs, window, prob)
    if keep is None:
        return completion
    if token_texts is not None:
        text = "".join(token_texts[:keep])
    elif decode is not None and completion.token_ids:
        text = decode(completion.token_ids[:keep])
    else:
        raise ValueError("truncate_on_repetition needs decode() or token_texts to cut the text")
    return replace(
        completion,
        text=text,
        token_ids=completion.token_ids[:keep],
        logprobs=completion.logprobs[:keep],
        finish_reason="repetition",
    )


class RepetitionTracker:
    """Per-sequence count of consecutive confident tokens for a batch being sampled."""

    def __init__(self, batch_size: int, window: int | None, prob: float, device: torch.device):
        self.window = window
        self.threshold = math.log(prob)
        self.run = torch.zeros(batch_size, dtype=torch.long, device=device)

    def update(self, sampled_logprobs: torch.Tensor) -> torch.Tensor:
        """Feed this step's log-probs; returns a bool mask of sequences that must stop now."""
        if self.window is None:
            return torch.zeros_like(self.run, dtype=torch.bool)
        confident = sampled_logprobs > self.threshold
        self.run = torch.where(confident, self.run + 1, torch.zeros_like(self.run))
        return self.run >= self.window

    def select(self, keep: torch.Tensor) -> None:
        """Drop rows of finished sequences when the batch is compacted."""
        self.run = self.run[keep]
