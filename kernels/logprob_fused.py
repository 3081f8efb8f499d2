"""FP32 LM head -> per-token log-prob and entropy without the full-vocabulary logits.

Forward walks the vocabulary in chunks keeping an online logsumexp (running max m,
sum of exp(l - m), and sum of exp(l - m) * l for the entropy); backward recomputes each
chunk's logits. Rows are chunked too, so peak extra memory is rows_chunk x vocab_chunk.

With lse the log-normalizer and mean = E_p[logit]:
    logp_y  = l_y - lse                       d/dl_j = [j == y] - p_j
    entropy = lse - mean                      d/dl_j = p_j * (mean - l_j)

Its matmuls run in full FP32 even where the process allowed TF32 (``torch.set_float32_matmul_
precision("high")``, common in GPU training scripts): the head exists to be FP32.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .utils import kernel_entry


def _online_stats(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, vocab_chunk: int):
    """For rows h (fp32), return lse, mean logit and the label logit, chunking the vocabulary."""
    rows = h.shape[0]
    run_max = h.new_full((rows,), float("-inf"))
    run_sum = h.new_zeros(rows)
    run_weighted = h.new_zeros(rows)
    label_logit = h.new_zeros(rows)
    for start in range(0, w.shape[0], vocab_chunk):
        logits = h @ w[start : start + vocab_chunk].float().T
        new_max = torch.maximum(run_max, logits.max(-1).values)
        rescale = torch.exp(run_max - new_max)
        probs_unnorm = torch.exp(logits - new_max[:, None])
        run_sum = run_sum * rescale + probs_unnorm.sum(-1)
        run_weighted = run_weighted * rescale + (probs_unnorm * logits).sum(-1)
        run_max = new_max
        in_chunk = (labels >= start) & (labels < start + logits.shape[1])
        local = (labels - start).clamp(0, logits.shape[1] - 1)
        label_logit = torch.where(in_chunk, logits.gather(1, local[:, None]).squeeze(1), label_logit)
    lse = run_max + torch.log(run_sum)
    return lse, run_weighted / run_sum, label_logit


@contextmanager
def full_fp32_matmuls() -> Iterator[None]:
    """FP32 matmuls inside, whatever float32_matmul_precision the caller set; restored after."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


class FusedTokenLogprob(torch.autograd.Function):
    @staticmethod
    @full_fp32_matmuls()
    def forward(ctx, hidden, weight, labels, ignore_index, vocab_chunk, row_chunk):
        h_all = hidden.reshape(-1, hidden.shape[-1])
        flat_labels = labels.reshape(-1)
        valid = flat_labels != ignore_index
        safe_labels = torch.where(valid, flat_labels, torch.zeros_like(flat_labels))
        lse_parts, mean_parts, label_parts = [], [], []
        for start in range(0, h_all.shape[0], row_chunk):
            h = h_all[start : start + row_chunk].float()
            lse, mean, label_logit = _online_stats(
                h, weight, safe_labels[start : start + row_chunk], vocab_chunk
            )
            lse_parts.append(lse)
            mean_parts.append(mean)
            label_parts.append(label_logit)
        lse = torch.cat(lse_parts)
        mean_logit = torch.cat(mean_parts)
        logp = torch.where(valid, torch.cat(label_parts) - lse, torch.zeros_like(lse))
        entropy = lse - mean_logit
        ctx.save_for_backward(hidden, weight, safe_labels, valid, lse, mean_logit)
        ctx.chunks = (vocab_chunk, row_chunk)
        return logp.view(labels.shape), entropy.view(labels.shape)

    @staticmethod
    @full_fp32_matmuls()
    def backward(ctx, d_logp, d_entropy):
        hidden, weight, labels, valid, lse, mean_logit = ctx.saved_tensors
        vocab_chunk, row_chunk = ctx.chunks
        h_all = hidden.reshape(-1, hidden.shape[-1])
        g_logp = (d_logp.reshape(-1).float() if d_logp is not None else torch.zeros_like(lse))
        g_logp = g_logp * valid
        g_ent = d_entropy.reshape(-1).float() if d_entropy is not None else torch.zeros_like(lse)
        d_hidden = torch.zeros_like(h_all, dtype=torch.float32)
        d_weight = torch.zeros_like(weight, dtype=torch.float32)
        for r0 in range(0, h_all.shape[0], row_chunk):
            rows = slice(r0, r0 + row_chunk)
            h = h_all[rows].float()
            for v0 in range(0, weight.shape[0], vocab_chunk):
                w = weight[v0 : v0 + vocab_chunk].float()
                logits = h @ w.T
                probs = torch.exp(logits - lse[rows, None])
                grad = probs * (g_ent[rows, None] * (mean_logit[rows, None] - logits) - g_logp[rows, None])
                in_chunk = (labels[rows] >= v0) & (labels[rows] < v0 + w.shape[0])
                local = (labels[rows] - v0).clamp(0, w.shape[0] - 1)
                grad.scatter_add_(1, local[:, None], (g_logp[rows] * in_chunk)[:, None])
                d_hidden[rows] += grad @ w
                d_weight[v0 : v0 + vocab_chunk] += grad.T @ h
        d_hidden = d_hidden.view(hidden.shape).to(hidden.dtype)
        return d_hidden, d_weight.to(weight.dtype), None, None, None, None


@kernel_entry("head")
def token_logprobs_fused(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    vocab_chunk: int = 4096,
    row_chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    return FusedTokenLogprob.apply(hidden, weight, labels, ignore_index, vocab_chunk, row_chunk)
