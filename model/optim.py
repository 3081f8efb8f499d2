"""The optimizer the training stages use: M1's AdamW."""
from __future__ import annotations

import torch

# M1 section 3.1 / Appendix: AdamW with beta = (0.9, 0.95) and eps = 1e-15, because the
# gradients of a large model span many orders of magnitude and late-training updates are tiny.
M1_ADAM_BETAS = (0.9, 0.95)
M1_ADAM_EPS = 1e-15


def build_adamw(params, lr: float, betas: tuple[float, float] = M1_ADAM_BETAS, eps: float = M1_ADAM_EPS,
                weight_decay: float = 0.0) -> torch.optim.AdamW:
    """The M1 optimizer: a plain torch AdamW (DeepSpeed accepts it with zero_allow_untested_optimizer)."""
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
