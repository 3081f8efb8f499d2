"""Every training loss in one module: SFT cross-entropy, DPO, GRPO, DAPO and CISPO, and the
per-token log-probs they consume, re-encoding every row (``token_logprobs``) or encoding each
distinct prompt once for the responses that share it (``prefix_shared_logprobs``).

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

import inspect
import itertools
import logging
import weakref
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from model.config import IGNORE_INDEX

log = logging.getLogger("posttrain.losses")

# --------------------------------------------------------------------------- log-probs


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 log p(label) and entropy per position from full logits (labels -100 give log-prob 0)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    valid = labels != IGNORE_INDEX
    picked = log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return torch.where(valid, picked, torch.zeros_like(picked)), entropy


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-prob, entropy, auxiliary loss) of every next token, [B, T-1] each (the entropy is
    meant for the scored positions: the fused head gives 0 where the label is ignored).

    ``logp[:, t]`` scores ``labels[:, t+1]`` (labels default to input_ids; -100 is ignored).
    Models that expose ``fused_token_logprobs`` (the in-house hybrid), and transformers models
    whose ``lm_head`` was adopted as the fused head (``model.loading`` does it on load), go
    through the fused FP32 kernel that never builds full-vocabulary logits; any other causal LM
    through its logits, upcast to FP32.
    The auxiliary loss is the MoE balance loss already scaled by its coefficient (0 if none).
    """
    labels = input_ids if labels is None else labels
    if hasattr(model, "fused_token_logprobs"):
        logp, entropy, aux = model.fused_token_logprobs(input_ids, attention_mask, labels, with_aux=True)
        return logp, entropy, aux * _aux_coefficient(model)
    targets = labels[:, 1:]
    if attention_mask is not None:
        targets = targets.masked_fill(attention_mask[:, 1:] == 0, IGNORE_INDEX)
    logp, entropy = _hf_scores(model, targets, input_ids=input_ids, attention_mask=attention_mask)
    return logp, entropy, logp.new_zeros(())


def _fused_hf_head(model):
    """(decoder, head) of a transformers causal LM whose ``lm_head`` was adopted as the fused FP32
    head (``model.loading.adopt_fused_head``), else None."""
    from model.hybrid import FusedLogprobHead

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, FusedLogprobHead) and hasattr(model, "get_decoder"):
        return model.get_decoder(), head
    return None


def _hf_scores(model, targets: torch.Tensor, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 log-prob and entropy of ``targets`` (the next token of each input position but the
    last) for a transformers causal LM: from the decoder's final hidden states through the fused
    head when it has one (both calls are module calls, so ZeRO-3 gathers their weights), else from
    its logits upcast to FP32."""
    fused = _fused_hf_head(model)
    if fused is not None:
        decoder, head = fused
        hidden = decoder(**inputs).last_hidden_state
        return head(hidden[:, :-1], targets)
    return logprobs_from_logits(model(**inputs).logits[:, :-1], targets)


# --------------------------------------------------------------------------- prefix-shared log-probs


class SharedLogprobs(NamedTuple):
    """``token_logprobs``'s three outputs, plus the tokens the forward did not re-encode."""

    logp: torch.Tensor
    entropy: torch.Tensor
    aux: torch.Tensor
    tokens_saved: int
    scored: torch.Tensor          # [B, T-1] bool: the positions whose next token was scored


class PrefixLayout(NamedTuple):
    """A right-padded prompt+response batch cut into shared prefixes (each encoded once,
    left-padded) and each row's chunk (the rest of the row, right-padded). Rows sharing a prefix
    share the leading tokens of their prompts; a row's chunk starts no later than its prompt's
    last token, so that every scored token is scored inside the chunk's own forward."""

    prefix_ids: torch.Tensor      # [P, W]
    prefix_mask: torch.Tensor     # [P, W]
    prompt_of_row: torch.Tensor   # [B] -> row of the prefix batch
    chunk_ids: torch.Tensor       # [B, C]
    chunk_mask: torch.Tensor      # [B, C]
    chunk_labels: torch.Tensor    # [B, C]
    chunk_start: torch.Tensor     # [B] column of each chunk's first token in the batch


def response_starts(attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Prompt length of every row: its first scored label (at least 1; the whole row if none)."""
    scored = labels != IGNORE_INDEX
    first = torch.where(scored.any(1), scored.int().argmax(1), attention_mask.sum(1))
    return first.clamp(min=1)


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def shared_prefix_groups(prompts: list[tuple[int, ...]]) -> list[tuple[list[int], int]]:
    """Rows grouped to share the leading tokens of their prompts: (rows, shared length) per group,
    choosing the groups that encode the fewest tokens (a one-level prefix-tree merge).

    A row may share at most its prompt minus the last token; rows with identical prompts always
    share all of that. Distinct prompts join a group when sharing their common start saves more
    than keeping each its own: in sorted order the common prefix of a run of prompts is the
    smallest common prefix of neighbours, so the best grouping is a partition of the sorted
    distinct prompts into runs, found exactly by dynamic programming over run ends (a run of
    ``m`` rows sharing ``L`` tokens saves ``(m - 1) * L``).
    """
    members: dict[tuple[int, ...], list[int]] = {}
    for row, prompt in enumerate(prompts):
        members.setdefault(prompt, []).append(row)
    units = sorted(members)
    cap = [len(u) - 1 for u in units]
    count = [len(members[u]) for u in units]
    neighbour = [_common_prefix(a, b) for a, b in itertools.pairwise(units)]
    best, start = [0] * (len(units) + 1), [0] * (len(units) + 1)
    for end in range(1, len(units) + 1):          # runs units[begin:end]
        best[end], start[end] = best[end - 1] + (count[end - 1] - 1) * cap[end - 1], end - 1
        shared, rows = cap[end - 1], count[end - 1]
        for begin in range(end - 2, -1, -1):
            shared, rows = min(shared, neighbour[begin], cap[begin]), rows + count[begin]
            if shared <= 0:
                break
            if best[begin] + (rows - 1) * shared > best[end]:
                best[end], start[end] = best[begin] + (rows - 1) * shared, begin
    groups, end = [], len(units)
    while end > 0:
        begin = start[end]
        shared = min(cap[begin:end] + neighbour[begin:end - 1])
        groups.append((sorted(r for u in units[begin:end] for r in members[u]), shared))
        end = begin
    return sorted(groups)


def prefix_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                  pad_id: int = 0, prompt_lengths: torch.Tensor | None = None) -> PrefixLayout:
    """Rows share one prefix where their prompts begin alike (``shared_prefix_groups``), whatever
    their position in the batch: the G responses of an RL prompt, or SFT examples whose prompts
    open with the same instructions. Prompts end at ``prompt_lengths`` when given (labels that
    score prompt tokens too), else at each row's first scored label."""
    starts = (response_starts(attention_mask, labels) if prompt_lengths is None
              else torch.minimum(prompt_lengths, attention_mask.sum(1)).clamp(min=1))
    prompts = [tuple(ids[:n].tolist()) for ids, n in zip(input_ids, starts)]
    groups = shared_prefix_groups(prompts)
    prompt_of_row = [0] * len(prompts)
    shared_of_row = [0] * len(prompts)
    width = max(shared for _, shared in groups)
    prefix_ids = input_ids.new_full((len(groups), width), pad_id)
    prefix_mask = attention_mask.new_zeros((len(groups), width))
    for g, (rows, shared) in enumerate(groups):
        for r in rows:
            prompt_of_row[r], shared_of_row[r] = g, shared
        if shared:
            prefix_ids[g, width - shared:] = torch.tensor(prompts[rows[0]][:shared])
            prefix_mask[g, width - shared:] = 1
    chunk_start = torch.tensor(shared_of_row, device=input_ids.device)
    chunk_width = int((attention_mask.sum(1) - chunk_start).max().clamp(min=1))
    cols = chunk_start[:, None] + torch.arange(chunk_width, device=input_ids.device)[None]
    inside = cols < input_ids.shape[1]
    cols = cols.clamp(max=input_ids.shape[1] - 1)
    return PrefixLayout(
        prefix_ids, prefix_mask, torch.tensor(prompt_of_row, device=input_ids.device),
        torch.where(inside, input_ids.gather(1, cols), pad_id),
        attention_mask.gather(1, cols) * inside,
        torch.where(inside, labels.gather(1, cols), IGNORE_INDEX),
        chunk_start)


# models whose cache cannot carry a shared prefix exactly, with the reason (each logged once)
_NO_PREFIX_SHARING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _exact_prefix_cache(cache) -> str | None:
    """None when ``cache`` reproduces a full forward after left-padded prefixes, else why not.

    The in-house HybridCache does (padded tokens write nothing into a lightning state, and its
    masks and positions count only real tokens); a transformers cache only when every layer is
    a plain growing KV layer (a sliding window or a recurrent state would see the padding)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    from model.hybrid import HybridCache

    if isinstance(cache, HybridCache):
        return None
    if cache is None:
        return "the model returned no cache (use_cache off, or gradient checkpointing)"
    layers = getattr(cache, "layers", None)
    if isinstance(cache, DynamicCache) and layers and all(type(layer) is DynamicLayer for layer in layers):
        return None
    kinds = sorted({type(layer).__name__ for layer in layers or []})
    return f"its {type(cache).__name__} ({', '.join(kinds) or 'no layers'}) is not a plain KV cache"


def _forward_chunk(model, layout: PrefixLayout, cache, full_mask: torch.Tensor):
    """(log-prob, entropy, scaled aux) of every chunk position's next token, [B, C-1]."""
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)[:, -layout.chunk_ids.shape[1]:]
    if hasattr(model, "fused_token_logprobs"):  # the hybrid: fused FP32 head, balance loss over the prefix too
        out = model(layout.chunk_ids, attention_mask=full_mask, position_ids=positions, cache=cache,
                    labels=layout.chunk_labels)
        return out.token_logprobs, out.entropy, out.aux_loss * _aux_coefficient(model)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    targets = layout.chunk_labels[:, 1:].masked_fill(layout.chunk_mask[:, 1:] == 0, IGNORE_INDEX)
    logp, entropy = _hf_scores(model, targets, input_ids=layout.chunk_ids, attention_mask=full_mask,
                               position_ids=positions, **{cache_arg: cache})
    return logp, entropy, logp.new_zeros(())


def _to_batch_columns(values: torch.Tensor, chunk_start: torch.Tensor, width: int) -> torch.Tensor:
    """Chunk position j of row r -> column chunk_start[r] + j of a [B, width] tensor (0 elsewhere)."""
    cols = chunk_start[:, None] + torch.arange(values.shape[1], device=values.device)[None]
    full = values.new_zeros(values.shape[0], width + values.shape[1])
    return full.scatter(1, cols, values)[:, :width]  # columns are distinct within a row


def _aux_coefficient(model) -> float:
    if not getattr(model.config, "num_experts", 0):
        return 0.0
    return float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)


def _reencode(model, input_ids, attention_mask, labels, reason: str | None = None) -> SharedLogprobs:
    if reason is not None and model not in _NO_PREFIX_SHARING:
        _NO_PREFIX_SHARING[model] = reason
        log.warning("prefix-shared log-probs off for %s: %s; re-encoding every response's prompt",
                    type(model).__name__, reason)
    scored = (labels[:, 1:] != IGNORE_INDEX) & (attention_mask[:, 1:] != 0)
    return SharedLogprobs(*token_logprobs(model, input_ids, attention_mask, labels), 0, scored)


def response_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                      pad_id: int = 0, prefix_shared: bool = True,
                      prompt_lengths: torch.Tensor | None = None) -> SharedLogprobs:
    """The log-probs every training stage scores with: ``prefix_shared_logprobs`` when the
    stage's ``prefix_shared`` is on, else every row re-encoded (``tokens_saved`` 0)."""
    if prefix_shared:
        return prefix_shared_logprobs(model, input_ids, attention_mask, labels, pad_id, prompt_lengths)
    return _reencode(model, input_ids, attention_mask, labels)


def prefix_shared_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           labels: torch.Tensor, pad_id: int = 0,
                           prompt_lengths: torch.Tensor | None = None) -> SharedLogprobs:
    """``token_logprobs`` of right-padded prompt+response rows, each shared prompt prefix encoded
    once (an identical prompt all but its last token; prompts that open alike, their common start).

    The prefixes run in one forward that keeps its cache (lightning states and softmax
    keys/values, with their autograd graph); the cache rows are copied to every row of that
    prefix and the rows' remaining tokens run on top of it, so the gradient of each row flows
    back into the one shared prefix forward. Log-probs and the aux loss equal re-encoding's up
    to float summation order; entropies are given at scored positions only (0 elsewhere). Rows
    share wherever they sit (a group split across micro-batches shares within each part).
    Re-encodes when no row shares or the model's cache cannot carry a padded prefix exactly (the
    reason logged once per model).

    Labels may score prompt tokens too (a prompt loss) when ``prompt_lengths`` says where each
    prompt ends: the tokens of a shared prefix are then not scored (``scored`` says which were).
    """
    if model in _NO_PREFIX_SHARING:
        return _reencode(model, input_ids, attention_mask, labels)
    layout = prefix_layout(input_ids, attention_mask, labels, pad_id, prompt_lengths)
    if layout.prefix_ids.shape[0] == input_ids.shape[0] or layout.prefix_ids.shape[1] == 0:
        return _reencode(model, input_ids, attention_mask, labels)
    positions = (layout.prefix_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=layout.prefix_ids, attention_mask=layout.prefix_mask, position_ids=positions,
                use_cache=True, logits_to_keep=1)
    cache = getattr(out, "cache", None)
    cache = getattr(out, "past_key_values", None) if cache is None else cache
    reason = _exact_prefix_cache(cache)
    if reason is not None:
        return _reencode(model, input_ids, attention_mask, labels, reason)
    cache.batch_select_indices(layout.prompt_of_row)
    full_mask = torch.cat([layout.prefix_mask[layout.prompt_of_row], layout.chunk_mask], dim=1)
    logp, entropy, aux = _forward_chunk(model, layout, cache, full_mask)
    scored = (layout.chunk_labels[:, 1:] != IGNORE_INDEX) & (layout.chunk_mask[:, 1:] != 0)
    width = input_ids.shape[1] - 1
    saved = int(attention_mask.sum() - layout.prefix_mask.sum() - layout.chunk_mask.sum())
    return SharedLogprobs(_to_batch_columns(logp, layout.chunk_start, width),
                          _to_batch_columns(entropy * scored, layout.chunk_start, width), aux, saved,
                          _to_batch_columns(scored, layout.chunk_start, width))


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
    mask = mask.to(logp.dtype)
    nll = -logp * mask
    if normalization == "token":
        return nll.sum() / mask.sum().clamp(min=1.0)
    if normalization == "sample":
        per_sample_tokens = mask.sum(-1)
        has_tokens = per_sample_tokens > 0
        per_sample = nll.sum(-1) / per_sample_tokens.clamp(min=1.0)
        return per_sample[has_tokens].sum() / has_tokens.sum().clamp(min=1)
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
              eps_low: float = 0.2, eps_high: float = 0.2) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO: token-level PPO clip to [1 - eps_low, 1 + eps_high], mean over each response's
    tokens, then over responses.

    A token whose ratio left the trust region on the side its advantage pushes towards
    contributes no gradient (the min picks the constant clipped term).
    """
    objective, ratio = ppo_clip_terms(logp, old_logp, advantages, eps_low, eps_high)
    m = mask.to(objective.dtype)
    per_response = (objective * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    has_tokens = m.sum(-1) > 0
    loss = -per_response[has_tokens].sum() / has_tokens.sum().clamp(min=1)
    return loss, _ratio_stats(ratio, mask, eps_low, eps_high, logp, old_logp)


def dapo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              eps_low: float = 0.2, eps_high: float = 0.28) -> tuple[torch.Tensor, dict[str, float]]:
    """DAPO: PPO clip with a higher upper bound (clip-higher), mean over every token of the batch."""
    objective, ratio = ppo_clip_terms(logp, old_logp, advantages, eps_low, eps_high)
    loss = -masked_mean(objective, mask)
    return loss, _ratio_stats(ratio, mask, eps_low, eps_high, logp, old_logp)


def cispo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               eps_low: float = 1.0, eps_high: float = 0.2, group_size: int | None = None,
               variant: Literal["clip", "mask"] = "clip") -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1 Eq. 4-5): maximize sg(clip(r, 1-eps_low, 1+eps_high)) * A * log pi.

    The importance weight is clipped and detached, never the token's update itself: every
    token keeps a gradient (the rare "fork" tokens PPO clips away included). Each group's
    sum is normalized by the total token count of that group's responses (1 / sum_i |o_i|);
    groups are then averaged. M1 sets no lower bound in practice (eps_low = 1.0 turns the
    lower clip off for ratios >= 0).

    ``variant="mask"`` is Eq. 7: weight sg(r) (unclipped) times a token mask M that zeroes
    tokens with A > 0 and r > 1 + eps_high, or A < 0 and r < 1 - eps_low, i.e. the PPO
    trust region expressed as a mask on the CISPO objective.
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
        # the normalizer stays the group's full token count: masked tokens count as zeros
        per_token = weight * adv * logp * counted.to(logp.dtype)
        loss = -_group_token_mean(per_token, mask, group_size)
        return loss, _ratio_stats(ratio, mask, eps_low, eps_high, logp, old_logp)
    else:
        raise ValueError(f"unknown CISPO variant {variant!r}; expected 'clip' or 'mask'")
    per_token = weight * adv * logp
    loss = -_group_token_mean(per_token, counted, group_size)
    return loss, _ratio_stats(ratio, mask, eps_low, eps_high, logp, old_logp)


def policy_loss(name: str, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, eps_low: float, eps_high: float, group_size: int | None = None,
                cispo_variant: Literal["clip", "mask"] = "clip") -> tuple[torch.Tensor, dict[str, float]]:
    """Dispatch by name: ``cispo`` | ``grpo`` | ``dapo``."""
    if name == "cispo":
        return cispo_loss(logp, old_logp, advantages, mask, eps_low, eps_high, group_size, cispo_variant)
    if name == "grpo":
        return grpo_loss(logp, old_logp, advantages, mask, eps_low, eps_high)
    if name == "dapo":
        return dapo_loss(logp, old_logp, advantages, mask, eps_low, eps_high)
    raise ValueError(f"unknown policy loss {name!r}; expected 'cispo', 'grpo' or 'dapo'")
