"""Every training loss in one module: SFT cross-entropy, DPO, GRPO, DAPO and CISPO. The
per-token log-probs they consume come from ``model.logprobs``.

All policy losses take per-token tensors of shape [B, T] (B responses, T response
positions) with a 0/1 ``mask`` of the tokens that count, and return a scalar loss to
*minimize* plus a dict of detached statistics. Rows of a batch are laid out group by group
(``group_size`` consecutive rows answer the same prompt).

References: DPO (Rafailov et al. 2023, sigmoid loss); GRPO (Shao et al. 2024, DeepSeekMath:
PPO-clip per token, mean over each response, then over responses); DAPO (Yu et al. 2025:
clip-higher, token-mean over the batch); CISPO (MiniMax-M1, arXiv 2506.13585, Eq. 4-5 and the
Eq. 7 mask variant).
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


# --------------------------------------------------------------------------- SFT


def sft_loss(logp: torch.Tensor, mask: torch.Tensor,
             normalization: Literal["token", "sample"] = "token") -> torch.Tensor:
    """Negative log-likelihood of the masked tokens.

    ``token``: sum over every counted token / number of counted tokens (long answers weigh
    more). ``sample``: each sample's mean NLL, then the mean over samples that have tokens.
    """
    if normalization == "token":
        return masked_mean(-logp, mask)
    if normalization == "sample":
        return _sample_mean(-logp, mask)
    raise ValueError(f"unknown SFT normalization {normalization!r}; expected 'token' or 'sample'")


# --------------------------------------------------------------------------- DPO


def sequence_logprob(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of the counted tokens' log-probs of each row: log pi(response | prompt)."""
    return (logp * mask.to(logp.dtype)).sum(-1)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
             reference_rejected: torch.Tensor, beta: float = 0.1) -> tuple[torch.Tensor, dict[str, float]]:
    """Sigmoid DPO: -log sigmoid(beta * [(pi_c - ref_c) - (pi_r - ref_r)]), mean over pairs.

    Inputs are sequence log-probs [P]; the reference ones are precomputed once and stored.
    """
    chosen_reward = beta * (policy_chosen - reference_chosen)
    rejected_reward = beta * (policy_rejected - reference_rejected)
    margin = chosen_reward - rejected_reward
    loss = -F.logsigmoid(margin).mean()
    stats = {
        "reward_chosen": chosen_reward.detach().mean().item(),
        "reward_rejected": rejected_reward.detach().mean().item(),
        "reward_margin": margin.detach().mean().item(),
        "reward_accuracy": (margin.detach() > 0).float().mean().item(),
    }
    return loss, stats


# --------------------------------------------------------------------------- group advantages


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO/CISPO advantage of each response: (R - mean R) / std R within its group.

    ``rewards`` is [G * group_size] laid out group by group. The standard deviation is the
    population one (as in M1's Eq. 5 notation); a group whose rewards are all equal gets 0.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    mean = grouped.mean(-1, keepdim=True)
    std = grouped.std(-1, unbiased=False, keepdim=True)
    adv = (grouped - mean) / (std + eps)
    return torch.where(std > 0, adv, torch.zeros_like(adv)).view(-1)


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Bool [G]: groups whose rewards are not all equal (DAPO dynamic sampling keeps these)."""
    grouped = rewards.view(-1, group_size)
    return (grouped.max(-1).values - grouped.min(-1).values) > 0


# --------------------------------------------------------------------------- policy losses


def _broadcast_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return advantages[:, None].expand_as(like) if advantages.dim() == 1 else advantages


def truncated_is_weights(train_logp: torch.Tensor, sampler_logp: torch.Tensor, known: torch.Tensor,
                         cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly
    brings you off-policy RL training"): each token's weight min(pi_train / pi_sampler, cap), the
    correction for a sampler whose log-probs differ from the trainer's on the same weights (a bf16
    engine, another kernel). ``known``: the tokens whose sampler log-prob was reported; the others
    weigh 1. Returns (weights, {tis_weight_mean, tis_truncated_fraction} over the known tokens)."""
    ratio = torch.exp(train_logp - sampler_logp)
    weights = torch.where(known > 0, ratio.clamp(max=cap), torch.ones_like(ratio)).detach()
    return weights, {"tis_weight_mean": masked_mean(weights, known).item(),
                     "tis_truncated_fraction": masked_mean((ratio > cap).to(ratio.dtype), known).item()}


Normalization = Literal["group_token", "sample", "batch_token"]
# each loss's own normalization, where the stage sets none
DEFAULT_NORMALIZATION: dict[str, Normalization] = {"cispo": "group_token", "grpo": "sample", "dapo": "batch_token"}


def _group_token_mean(per_token: torch.Tensor, mask: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """Sum of each group's counted terms / that group's token count, averaged over groups."""
    mask = mask.to(per_token.dtype)
    rows = per_token.shape[0]
    size = rows if group_size is None else group_size
    if rows % size:
        raise ValueError(f"{rows} rows do not split into groups of {size}")
    sums = (per_token * mask).sum(-1).view(-1, size).sum(-1)
    tokens = mask.sum(-1).view(-1, size).sum(-1).clamp(min=1.0)
    return (sums / tokens).mean()


def _sample_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each response's counted terms / its token count, averaged over the responses with tokens."""
    mask = mask.to(per_token.dtype)
    tokens = mask.sum(-1)
    has_tokens = tokens > 0
    per_response = (per_token * mask).sum(-1) / tokens.clamp(min=1.0)
    return per_response[has_tokens].sum() / has_tokens.sum().clamp(min=1)


def normalized(per_token: torch.Tensor, mask: torch.Tensor, how: Normalization,
               group_size: int | None = None) -> torch.Tensor:
    """The objective's per-token terms reduced to a scalar, counting the tokens of ``mask``.

    ``group_token`` (M1 Eq. 4, CISPO's own): each group's summed terms over that group's token
    count (1 / sum_i |o_i|), groups averaged: a sample-level sum with token-level normalization
    within the group, so a long response weighs by its tokens and a group of long failures
    cannot drown its short successes. ``sample`` (GRPO's): each response's token mean, responses
    averaged: every response weighs the same, its tokens less the longer it runs. ``batch_token``
    (DAPO's): every counted token of the batch weighs the same.
    """
    if how == "group_token":
        return _group_token_mean(per_token, mask, group_size)
    if how == "sample":
        return _sample_mean(per_token, mask)
    if how == "batch_token":
        return masked_mean(per_token, mask)
    raise ValueError(f"unknown policy-loss normalization {how!r}; expected one of {sorted(DEFAULT_NORMALIZATION.values())}")


def _ratio_stats(ratio: torch.Tensor, mask: torch.Tensor, low: float, high: float,
                 logp: torch.Tensor, old_logp: torch.Tensor) -> dict[str, float]:
    m = mask.bool()
    r = ratio.detach()[m]
    if r.numel() == 0:
        return {"clip_fraction": 0.0, "ratio_mean": 1.0, "approx_kl": 0.0}
    clipped = (r > 1 + high) | (r < 1 - low)
    log_ratio = (logp.detach() - old_logp)[m]
    return {
        "clip_fraction": clipped.float().mean().item(),
        "ratio_mean": r.mean().item(),
        # k3 estimator of KL(old || new), as in Schulman's note
        "approx_kl": (torch.exp(-log_ratio) - 1 + log_ratio).mean().item(),
    }


def ppo_clip_terms(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                   eps_low: float, eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip objective min(r A, clip(r) A) (to maximize) and the ratio r."""
    ratio = torch.exp(logp - old_logp)
    adv = _broadcast_advantages(advantages, logp)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * adv
    return torch.minimum(unclipped, clipped), ratio


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              eps_low: float = 0.2, eps_high: float = 0.2, normalization: Normalization = "sample",
              group_size: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO: token-level PPO clip to [1 - eps_low, 1 + eps_high], mean over each response's
    tokens, then over responses (``normalization``: another reduction, see ``normalized``).

    A token whose ratio left the trust region on the side its advantage pushes towards
    contributes no gradient (the min picks the constant clipped term).
    """
    objective, ratio = ppo_clip_terms(logp, old_logp, advantages, eps_low, eps_high)
    loss = -normalized(objective, mask, normalization, group_size)
    return loss, _ratio_stats(ratio, mask, eps_low, eps_high, logp, old_logp)


def dapo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              eps_low: float = 0.2, eps_high: float = 0.28, normalization: Normalization = "batch_token",
              group_size: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """DAPO: PPO clip with a higher upper bound (clip-higher), mean over every token of the batch."""
    objective, ratio = ppo_clip_terms(logp, old_logp, advantages, eps_low, eps_high)
    loss = -normalized(objective, mask, normalization, group_size)
    return loss, _ratio_stats(ratio, mask, eps_low, eps_high, logp, old_logp)


def cispo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               eps_low: float = 1.0, eps_high: float = 0.2, group_size: int | None = None,
               variant: Literal["clip", "mask"] = "clip",
               normalization: Normalization = "group_token") -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1 Eq. 4-5): maximize sg(clip(r, 1-eps_low, 1+eps_high)) * A * log pi.

    The importance weight is clipped and detached, never the token's update itself: every
    token keeps a gradient (the rare "fork" tokens PPO clips away included). Each group's
    sum is normalized by the total token count of that group's responses (1 / sum_i |o_i|);
    groups are then averaged. M1 sets no lower bound in practice (eps_low = 1.0 turns the
    lower clip off for ratios >= 0).

    ``variant="mask"`` is Eq. 7: weight sg(r) (unclipped) times a token mask M that zeroes
    tokens with A > 0 and r > 1 + eps_high, or A < 0 and r < 1 - eps_low, i.e. the PPO
    trust region expressed as a mask on the CISPO objective.

    ``normalization`` replaces Eq. 4's per-group token normalization (``normalized``); masked
    tokens of the mask variant count in every normalizer as zeros.
    """
    ratio = torch.exp(logp - old_logp)
    adv = _broadcast_advantages(advantages, logp)
    if variant == "clip":
        weight = ratio.clamp(1 - eps_low, 1 + eps_high).detach()
        counted = mask
    elif variant == "mask":
        out_high = (adv > 0) & (ratio > 1 + eps_high)
        out_low = (adv < 0) & (ratio < 1 - eps_low)
        weight = ratio.detach()
        counted = mask * (~(out_high | out_low)).to(mask.dtype)
    else:
        raise ValueError(f"unknown CISPO variant {variant!r}; expected 'clip' or 'mask'")
    # the normalizer stays the full token count: the mask variant's masked tokens count as zeros
    per_token = weight * adv * logp * counted.to(logp.dtype)
    loss = -normalized(per_token, mask, normalization, group_size)
    return loss, _ratio_stats(ratio, mask, eps_low, eps_high, logp, old_logp)


def policy_loss(name: str, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, eps_low: float, eps_high: float, group_size: int | None = None,
                cispo_variant: Literal["clip", "mask"] = "clip",
                normalization: Normalization | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Dispatch by name: ``cispo`` | ``grpo`` | ``dapo``; ``normalization`` None: the loss's own."""
    how = normalization or DEFAULT_NORMALIZATION.get(name)
    if name == "cispo":
        return cispo_loss(logp, old_logp, advantages, mask, eps_low, eps_high, group_size, cispo_variant, how)
    if name == "grpo":
        return grpo_loss(logp, old_logp, advantages, mask, eps_low, eps_high, how, group_size)
    if name == "dapo":
        return dapo_loss(logp, old_logp, advantages, mask, eps_low, eps_high, how, group_size)
    raise ValueError(f"unknown policy loss {name!r}; expected 'cispo', 'grpo' or 'dapo'")
