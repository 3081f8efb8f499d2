"""The per-token log-probs every training loss consumes, and the forward passes that produce
them: re-encoding every row (``token_logprobs``) or encoding each distinct prompt once for the
responses that share it (``prefix_shared_logprobs``); ``response_logprobs`` picks between the two
for a training stage. The losses themselves are in ``model.losses``.
"""
from __future__ import annotations

import inspect
import itertools
import logging
import weakref
from typing import NamedTuple

import torch

from model.config import IGNORE_INDEX

log = logging.getLogger("posttrain.logprobs")

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
