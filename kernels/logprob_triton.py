"""Triton FP32 LM-head log-prob and entropy, same signature as ``logprob_naive``.

Forward: one program per block of rows walks the vocabulary in tiles, computing each logit
tile over the feature dim and folding it into an online logsumexp; logits are never stored.
Backward, one chunk of rows at a time (so the extra memory is row_chunk x vocab fp32, at most
``GRAD_CHUNK_BYTES``):
  1. one program per (row block, vocabulary tile) recomputes its logit tile and writes
     dL/dlogits = p * (g_ent * (mean - l) - g_logp) + g_logp * [col == label];
  2. d_hidden[rows] = G @ W and d_weight += G^T @ hidden[rows], a tiled matmul whose programs
     each own one output tile in registers and loop over the contracted dim.
Four logit-sized matmuls in all, each output written once (no read-modify-write sweeps).

Every tl.dot runs on fp32 tiles with an explicit input_precision, "tf32x3" by default: a
TF32 high part and residual per operand, three tensor-core passes, within ~1e-6 of fp32, where
the GPU's default (TF32, ~1e-3 relative) moved log-probs by 1.7e-2 at a 151,936 vocabulary.
Offsets are int64 wherever rows x dim or vocab x dim can pass 2**31. See ``logprob_fused``
for the math.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch_config import HeadLaunch, head_launch
from .utils import kernel_entry


@triton.jit
def _logit_tile(h, w, n_rows, n_cols, D, BN: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """fp32 [BN, BV] = h[:BN] @ w[:BV]^T for row-major h, w starting at these pointers; rows
    past n_rows and vocabulary entries past n_cols come out 0."""
    o_r, o_c = tl.arange(0, BN), tl.arange(0, BV)
    mask_r, mask_c = o_r < n_rows, o_c < n_cols
    acc = tl.zeros([BN, BV], dtype=tl.float32)
    for d0 in range(0, D, BD):
        o_d = d0 + tl.arange(0, BD)
        mask_d = o_d < D
        b_h = tl.load(h + o_r[:, None] * D + o_d[None, :], mask=mask_r[:, None] & mask_d[None, :], other=0.0)
        b_w = tl.load(w + o_c[:, None] * D + o_d[None, :], mask=mask_c[:, None] & mask_d[None, :], other=0.0)
        acc += tl.dot(b_h.to(tl.float32), tl.trans(b_w.to(tl.float32)), input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _logprob_fwd_kernel(
    h, w, labels, logp, entropy, lse_out, mean_out,
    N, VOCAB, D, IGNORE_INDEX,
    BN: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    row0 = tl.cast(tl.program_id(0), tl.int64) * BN
    rows = row0 + tl.arange(0, BN)
    mask_r = rows < N
    b_labels = tl.load(labels + rows, mask=mask_r, other=0)
    valid = b_labels != IGNORE_INDEX
    run_max = tl.full([BN], float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros([BN], dtype=tl.float32)
    run_weighted = tl.zeros([BN], dtype=tl.float32)
    label_logit = tl.zeros([BN], dtype=tl.float32)
    for v0 in range(0, VOCAB, BV):
        col0 = tl.cast(v0, tl.int64)
        cols = col0 + tl.arange(0, BV)
        mask_c = cols < VOCAB
        logits = _logit_tile(h + row0 * D, w + col0 * D, N - row0, VOCAB - col0, D, BN, BV, BD, DOT_PRECISION)
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
def _grad_logits_kernel(
    h, w, labels, lse, mean, g_logp, g_ent, grad,
    N, VOCAB, D, IGNORE_INDEX,
    BN: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """grad[N, VOCAB] = d loss / d logits for the N rows of this chunk, one tile per program."""
    row0 = tl.cast(tl.program_id(0), tl.int64) * BN
    col0 = tl.cast(tl.program_id(1), tl.int64) * BV
    rows, cols = row0 + tl.arange(0, BN), col0 + tl.arange(0, BV)
    mask_r, mask_c = rows < N, cols < VOCAB
    logits = _logit_tile(h + row0 * D, w + col0 * D, N - row0, VOCAB - col0, D, BN, BV, BD, DOT_PRECISION)
    b_labels = tl.load(labels + rows, mask=mask_r, other=0)
    b_lse = tl.load(lse + rows, mask=mask_r, other=0.0)
    b_mean = tl.load(mean + rows, mask=mask_r, other=0.0)
    b_gl = tl.where(b_labels != IGNORE_INDEX, tl.load(g_logp + rows, mask=mask_r, other=0.0), 0.0)
    b_ge = tl.load(g_ent + rows, mask=mask_r, other=0.0)
    probs = tl.exp(logits - b_lse[:, None])
    b_grad = probs * (b_ge[:, None] * (b_mean[:, None] - logits) - b_gl[:, None])
    b_grad += tl.where(cols[None, :] == b_labels[:, None], b_gl[:, None], 0.0)
    o_r, o_c = tl.arange(0, BN), tl.arange(0, BV)
    tl.store(grad + row0 * VOCAB + col0 + o_r[:, None] * VOCAB + o_c[None, :], b_grad,
             mask=mask_r[:, None] & mask_c[None, :])


@triton.jit
def _matmul_kernel(
    a, b, c, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
    ACCUMULATE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """c[M, N] (+)= a[M, K] @ b[K, N], fp32 accumulation, any strides for a and b, c row-major."""
    m0 = tl.cast(tl.program_id(0), tl.int64) * BM
    n0 = tl.cast(tl.program_id(1), tl.int64) * BN
    o_m, o_n, o_k = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
    mask_m, mask_n = o_m < M - m0, o_n < N - n0
    a_rows = a + m0 * stride_am + o_m[:, None] * stride_am
    b_cols = b + n0 * stride_bn + o_n[None, :] * stride_bn
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_start = tl.cast(k0, tl.int64)
        mask_k = o_k < K - k_start
        b_a = tl.load(a_rows + k_start * stride_ak + o_k[None, :] * stride_ak,
                      mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b_b = tl.load(b_cols + k_start * stride_bk + o_k[:, None] * stride_bk,
                      mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc += tl.dot(b_a.to(tl.float32), b_b.to(tl.float32), input_precision=DOT_PRECISION)
    p_c = c + m0 * N + n0 + o_m[:, None] * N + o_n[None, :]
    mask_c = mask_m[:, None] & mask_n[None, :]
    if ACCUMULATE:
        acc += tl.load(p_c, mask=mask_c, other=0.0).to(tl.float32)
    tl.store(p_c, acc.to(c.dtype.element_ty), mask=mask_c)


def _matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool, launch: HeadLaunch) -> None:
    """out (+)= a @ b through ``_matmul_kernel``; a and b may be transposed views."""
    (m, k), n = a.shape, b.shape[1]
    grid = (triton.cdiv(m, launch.block_mn), triton.cdiv(n, launch.block_mn))
    _matmul_kernel[grid](
        a, b, out, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        ACCUMULATE=accumulate, BM=launch.block_mn, BN=launch.block_mn, BK=launch.block_mk,
        DOT_PRECISION=launch.dot_precision, num_warps=launch.num_warps, num_stages=launch.num_stages,
    )


def _logit_kwargs(launch: HeadLaunch) -> dict:
    return {"BN": launch.block_rows, "BV": launch.block_vocab, "BD": launch.block_dim,
            "DOT_PRECISION": launch.dot_precision, "num_warps": launch.num_warps,
            "num_stages": launch.num_stages}


class TritonTokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, launch):
        h = hidden.reshape(-1, hidden.shape[-1])
        w = weight
        flat_labels = labels.reshape(-1)
        n_rows, dim = h.shape
        vocab = w.shape[0]
        launch = launch or head_launch(n_rows, vocab, dim)
        logp, entropy, lse, mean = (h.new_empty(n_rows, dtype=torch.float32) for _ in range(4))
        _logprob_fwd_kernel[(triton.cdiv(n_rows, launch.block_rows),)](
            h, w, flat_labels, logp, entropy, lse, mean, n_rows, vocab, dim, ignore_index,
            **_logit_kwargs(launch),
        )
        ctx.save_for_backward(h, w, flat_labels, lse, mean)
        ctx.meta = (ignore_index, launch, hidden.shape)
        return logp.view(labels.shape), entropy.view(labels.shape)

    @staticmethod
    def backward(ctx, d_logp, d_entropy):
        h, w, flat_labels, lse, mean = ctx.saved_tensors
        ignore_index, launch, hidden_shape = ctx.meta
        n_rows, dim = h.shape
        vocab = w.shape[0]
        g_logp = (d_logp if d_logp is not None else torch.zeros_like(lse)).reshape(-1).float().contiguous()
        g_ent = (d_entropy if d_entropy is not None else torch.zeros_like(lse)).reshape(-1).float().contiguous()
        dh = torch.empty_like(h)
        dw = torch.empty(vocab, dim, dtype=torch.float32, device=h.device)
        grad = torch.empty(min(launch.row_chunk, n_rows), vocab, dtype=torch.float32, device=h.device)
        for r0 in range(0, n_rows, launch.row_chunk):
            rows = slice(r0, min(r0 + launch.row_chunk, n_rows))
            n_chunk = rows.stop - r0
            _grad_logits_kernel[(triton.cdiv(n_chunk, launch.block_rows), triton.cdiv(vocab, launch.block_vocab))](
                h[rows], w, flat_labels[rows], lse[rows], mean[rows], g_logp[rows], g_ent[rows], grad,
                n_chunk, vocab, dim, ignore_index, **_logit_kwargs(launch),
            )
            chunk_grad = grad[:n_chunk]
            _matmul(chunk_grad, w, dh[rows], accumulate=False, launch=launch)
            _matmul(chunk_grad.T, h[rows], dw, accumulate=r0 > 0, launch=launch)
        return dh.view(hidden_shape), dw.to(w.dtype), None, None, None


@kernel_entry("head", contiguous=True)
def token_logprobs_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    launch: HeadLaunch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``launch`` overrides the tiles and precision ``head_launch`` picks from the shapes. Inputs
    arrive contiguous (``kernel_entry``), so the flattened rows are views."""
    return TritonTokenLogprob.apply(hidden, weight, labels, ignore_index, launch)
