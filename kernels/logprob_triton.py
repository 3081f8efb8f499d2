"""Triton FP32 LM-head log-prob and entropy, same signature as ``logprob_naive``.

Forward: one program per block of rows walks vocabulary tiles with an online logsumexp.
Backward: two kernels that recompute logit tiles instead of storing them: one owns row
blocks and accumulates d_hidden, the other owns vocabulary tiles and accumulates d_weight,
so neither needs atomics and the result is deterministic. See ``logprob_fused`` for the math.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .logprob_naive import _validate


@triton.jit
def _logit_tile(h, w, rows, cols, mask_r, mask_c, D, BD: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr):
    acc = tl.zeros([BN, BV], dtype=tl.float32)
    for d0 in range(0, tl.cdiv(D, BD)):
        o_d = d0 * BD + tl.arange(0, BD)
        mask_d = o_d < D
        b_h = tl.load(h + rows[:, None] * D + o_d[None, :], mask=mask_r[:, None] & mask_d[None, :], other=0.0)
        b_w = tl.load(w + cols[:, None] * D + o_d[None, :], mask=mask_c[:, None] & mask_d[None, :], other=0.0)
        acc += tl.dot(b_h.to(tl.float32), tl.trans(b_w.to(tl.float32)))
    return acc


@triton.jit
def _logprob_fwd_kernel(
    h, w, labels, logp, entropy, lse_out, mean_out,
    N, VOCAB, D, IGNORE_INDEX,
    BN: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr,
):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    mask_r = rows < N
    b_labels = tl.load(labels + rows, mask=mask_r, other=0)
    valid = b_labels != IGNORE_INDEX
    run_max = tl.full([BN], float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros([BN], dtype=tl.float32)
    run_weighted = tl.zeros([BN], dtype=tl.float32)
    label_logit = tl.zeros([BN], dtype=tl.float32)
    for v0 in range(0, tl.cdiv(VOCAB, BV)):
        cols = v0 * BV + tl.arange(0, BV)
        mask_c = cols < VOCAB
        logits = _logit_tile(h, w, rows, cols, mask_r, mask_c, D, BD, BN, BV)
        logits = tl.where(mask_c[None, :], logits, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(logits, 1))
        rescale = tl.exp(run_max - new_max)
        unnorm = tl.exp(logits - new_max[:, None])
        run_sum = run_sum * rescale + tl.sum(unnorm, 1)
        # masked columns hold -inf logits and 0 weight: zero the logit first so 0 * -inf never appears
        run_weighted = run_weighted * rescale + tl.sum(unnorm * tl.where(mask_c[None, :], logits, 0.0), 1)
        run_max = new_max
        label_logit += tl.sum(tl.where(cols[None, :] == b_labels[:, None], logits, 0.0), 1)
    lse = run_max + tl.log(run_sum)
    mean = run_weighted / run_sum
    tl.store(logp + rows, tl.where(valid, label_logit - lse, 0.0), mask=mask_r)
    tl.store(entropy + rows, lse - mean, mask=mask_r)
    tl.store(lse_out + rows, lse, mask=mask_r)
    tl.store(mean_out + rows, mean, mask=mask_r)


@triton.jit
def _grad_logit_tile(
    h, w, labels, lse, mean, g_logp, g_ent, rows, cols, mask_r, mask_c,
    D, IGNORE_INDEX, BD: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr,
):
    """d loss / d logits for one tile: p * (g_ent * (mean - l) - g_logp) + g_logp * [col == label]."""
    logits = _logit_tile(h, w, rows, cols, mask_r, mask_c, D, BD, BN, BV)
    b_labels = tl.load(labels + rows, mask=mask_r, other=0)
    b_lse = tl.load(lse + rows, mask=mask_r, other=0.0)
    b_mean = tl.load(mean + rows, mask=mask_r, other=0.0)
    b_gl = tl.load(g_logp + rows, mask=mask_r, other=0.0)
    b_gl = tl.where(b_labels != IGNORE_INDEX, b_gl, 0.0)
    b_ge = tl.load(g_ent + rows, mask=mask_r, other=0.0)
    probs = tl.exp(logits - b_lse[:, None])
    grad = probs * (b_ge[:, None] * (b_mean[:, None] - logits) - b_gl[:, None])
    grad += tl.where(cols[None, :] == b_labels[:, None], b_gl[:, None], 0.0)
    return tl.where(mask_r[:, None] & mask_c[None, :], grad, 0.0)


@triton.jit
def _logprob_bwd_dh_kernel(
    h, w, labels, lse, mean, g_logp, g_ent, dh,
    N, VOCAB, D, IGNORE_INDEX,
    BN: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr,
):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    mask_r = rows < N
    for v0 in range(0, tl.cdiv(VOCAB, BV)):
        cols = v0 * BV + tl.arange(0, BV)
        mask_c = cols < VOCAB
        grad = _grad_logit_tile(h, w, labels, lse, mean, g_logp, g_ent, rows, cols, mask_r, mask_c,
                                D, IGNORE_INDEX, BD, BN, BV)
        for d0 in range(0, tl.cdiv(D, BD)):
            o_d = d0 * BD + tl.arange(0, BD)
            mask_d = o_d < D
            b_w = tl.load(w + cols[:, None] * D + o_d[None, :], mask=mask_c[:, None] & mask_d[None, :], other=0.0)
            p_dh = dh + rows[:, None] * D + o_d[None, :]
            mask_rd = mask_r[:, None] & mask_d[None, :]
            # this program owns these rows, so read-modify-write needs no atomics
            tl.store(p_dh, tl.load(p_dh, mask=mask_rd, other=0.0) + tl.dot(grad, b_w.to(tl.float32)), mask=mask_rd)


@triton.jit
def _logprob_bwd_dw_kernel(
    h, w, labels, lse, mean, g_logp, g_ent, dw,
    N, VOCAB, D, IGNORE_INDEX,
    BN: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr,
):
    cols = tl.program_id(0) * BV + tl.arange(0, BV)
    mask_c = cols < VOCAB
    for r0 in range(0, tl.cdiv(N, BN)):
        rows = r0 * BN + tl.arange(0, BN)
        mask_r = rows < N
        grad = _grad_logit_tile(h, w, labels, lse, mean, g_logp, g_ent, rows, cols, mask_r, mask_c,
                                D, IGNORE_INDEX, BD, BN, BV)
        for d0 in range(0, tl.cdiv(D, BD)):
            o_d = d0 * BD + tl.arange(0, BD)
            mask_d = o_d < D
            b_h = tl.load(h + rows[:, None] * D + o_d[None, :], mask=mask_r[:, None] & mask_d[None, :], other=0.0)
            p_dw = dw + cols[:, None] * D + o_d[None, :]
            mask_cd = mask_c[:, None] & mask_d[None, :]
            tl.store(p_dw, tl.load(p_dw, mask=mask_cd, other=0.0) + tl.dot(tl.trans(grad), b_h.to(tl.float32)),
                     mask=mask_cd)


def _blocks(n_rows: int, vocab: int, dim: int) -> tuple[int, int, int]:
    block_n = max(16, min(64, triton.next_power_of_2(n_rows)))
    block_v = max(16, min(128, triton.next_power_of_2(vocab)))
    block_d = max(16, min(64, triton.next_power_of_2(dim)))
    return block_n, block_v, block_d


class TritonTokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, blocks):
        h = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        w = weight.contiguous()
        flat_labels = labels.reshape(-1).contiguous()
        n_rows, dim = h.shape
        vocab = w.shape[0]
        block_n, block_v, block_d = blocks or _blocks(n_rows, vocab, dim)
        logp, entropy, lse, mean = (h.new_empty(n_rows, dtype=torch.float32) for _ in range(4))
        _logprob_fwd_kernel[(triton.cdiv(n_rows, block_n),)](
            h, w, flat_labels, logp, entropy, lse, mean,
            n_rows, vocab, dim, ignore_index, block_n, block_v, block_d,
        )
        ctx.save_for_backward(h, w, flat_labels, lse, mean)
        ctx.meta = (ignore_index, block_n, block_v, block_d, hidden.shape, hidden.dtype)
        return logp.view(labels.shape), entropy.view(labels.shape)

    @staticmethod
    def backward(ctx, d_logp, d_entropy):
        h, w, flat_labels, lse, mean = ctx.saved_tensors
        ignore_index, block_n, block_v, block_d, hidden_shape, hidden_dtype = ctx.meta
        n_rows, dim = h.shape
        vocab = w.shape[0]
        g_logp = (d_logp if d_logp is not None else torch.zeros_like(lse)).reshape(-1).float().contiguous()
        g_ent = (d_entropy if d_entropy is not None else torch.zeros_like(lse)).reshape(-1).float().contiguous()
        dh = torch.zeros(n_rows, dim, dtype=torch.float32, device=h.device)
        dw = torch.zeros(vocab, dim, dtype=torch.float32, device=h.device)
        args = (h, w, flat_labels, lse, mean, g_logp, g_ent)
        sizes = (n_rows, vocab, dim, ignore_index, block_n, block_v, block_d)
        _logprob_bwd_dh_kernel[(triton.cdiv(n_rows, block_n),)](*args, dh, *sizes)
        _logprob_bwd_dw_kernel[(triton.cdiv(vocab, block_v),)](*args, dw, *sizes)
        return dh.view(hidden_shape).to(hidden_dtype), dw.to(w.dtype), None, None, None


def token_logprobs_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    blocks: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``blocks`` = (rows, vocab, feature) tile sizes; chosen from the shapes when None."""
    _validate(hidden, weight, labels)
    return TritonTokenLogprob.apply(hidden, weight, labels, ignore_index, blocks)
