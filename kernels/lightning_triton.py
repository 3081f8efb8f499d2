"""Lightning attention forward and backward in Triton, same signature as ``lightning_naive``.

One program owns one (batch, head, value-tile) and walks the sequence chunk by chunk:
decay-masked quadratic inside a chunk, a [K, BV] fp32 state carried across chunks. The
backward runs two such scans: forward order for dq (it needs the incoming states) and
reverse order for dk/dv (they need the gradient of the outgoing states). dq and dk sum
over value tiles, so each tile writes a partial that torch adds up afterwards.

Loads are cast to fp32 at once: the state must be fp32, and the interpreter mishandles bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .lightning_naive import _validate


@triton.jit
def _lightning_fwd_kernel(
    q, k, v, slope, h0, o, ht,
    T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    s = tl.load(slope + i_bh % H).to(tl.float32)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    mask_kv = mask_k[:, None] & mask_v[None, :]

    state = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        p_h0 = h0 + i_bh * K * V + o_k[:, None] * V + o_v[None, :]
        state = tl.load(p_h0, mask=mask_kv, other=0.0).to(tl.float32)

    query_decay = tl.exp(-s * (o_t + 1).to(tl.float32))
    dist = (o_t[:, None] - o_t[None, :]).to(tl.float32)
    intra_decay = tl.where(dist >= 0, tl.exp(-s * tl.maximum(dist, 0.0)), 0.0)

    for i_t in range(0, tl.cdiv(T, BT)):
        rows = i_t * BT + o_t
        mask_t = rows < T
        chunk_len = tl.minimum(T - i_t * BT, BT).to(tl.float32)
        p_q = q + i_bh * T * K + rows[:, None] * K + o_k[None, :]
        p_k = k + i_bh * T * K + rows[:, None] * K + o_k[None, :]
        p_v = v + i_bh * T * V + rows[:, None] * V + o_v[None, :]
        b_q = tl.load(p_q, mask=mask_t[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        b_k = tl.load(p_k, mask=mask_t[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        b_v = tl.load(p_v, mask=mask_t[:, None] & mask_v[None, :], other=0.0).to(tl.float32)

        scores = tl.dot(b_q, tl.trans(b_k)) * intra_decay
        b_o = tl.dot(scores, b_v) + tl.dot(b_q * query_decay[:, None], state)
        p_o = o + i_bh * T * V + rows[:, None] * V + o_v[None, :]
        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=mask_t[:, None] & mask_v[None, :])

        key_decay = tl.where(mask_t, tl.exp(-s * (chunk_len - 1.0 - o_t.to(tl.float32))), 0.0)
        state = state * tl.exp(-s * chunk_len) + tl.dot(tl.trans(b_k * key_decay[:, None]), b_v)

    if STORE_FINAL_STATE:
        p_ht = ht + i_bh * K * V + o_k[:, None] * V + o_v[None, :]
        tl.store(p_ht, state, mask=mask_kv)


@triton.jit
def _lightning_bwd_dq_kernel(
    k, v, do, slope, h0, dq_partial,
    T, BH, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
):
    """dq = ((do v^T) * D) k + query_decay * (do S_in^T), partial over this value tile."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    s = tl.load(slope + i_bh % H).to(tl.float32)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V

    state = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        p_h0 = h0 + i_bh * K * V + o_k[:, None] * V + o_v[None, :]
        state = tl.load(p_h0, mask=mask_k[:, None] & mask_v[None, :], other=0.0).to(tl.float32)

    query_decay = tl.exp(-s * (o_t + 1).to(tl.float32))
    dist = (o_t[:, None] - o_t[None, :]).to(tl.float32)
    intra_decay = tl.where(dist >= 0, tl.exp(-s * tl.maximum(dist, 0.0)), 0.0)

    for i_t in range(0, tl.cdiv(T, BT)):
        rows = i_t * BT + o_t
        mask_t = rows < T
        chunk_len = tl.minimum(T - i_t * BT, BT).to(tl.float32)
        b_k = tl.load(k + i_bh * T * K + rows[:, None] * K + o_k[None, :],
                      mask=mask_t[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        b_v = tl.load(v + i_bh * T * V + rows[:, None] * V + o_v[None, :],
                      mask=mask_t[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
        b_do = tl.load(do + i_bh * T * V + rows[:, None] * V + o_v[None, :],
                       mask=mask_t[:, None] & mask_v[None, :], other=0.0).to(tl.float32)

        d_scores = tl.dot(b_do, tl.trans(b_v)) * intra_decay
        b_dq = tl.dot(d_scores, b_k) + tl.dot(b_do, tl.trans(state)) * query_decay[:, None]
        p_dq = dq_partial + (i_v * BH + i_bh) * T * K + rows[:, None] * K + o_k[None, :]
        tl.store(p_dq, b_dq, mask=mask_t[:, None] & mask_k[None, :])

        key_decay = tl.where(mask_t, tl.exp(-s * (chunk_len - 1.0 - o_t.to(tl.float32))), 0.0)
        state = state * tl.exp(-s * chunk_len) + tl.dot(tl.trans(b_k * key_decay[:, None]), b_v)


@triton.jit
def _lightning_bwd_dkdv_kernel(
    q, k, v, do, slope, dht, dk_partial, dv, dh0,
    T, BH, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_FINAL_STATE_GRAD: tl.constexpr, STORE_INITIAL_STATE_GRAD: tl.constexpr,
):
    """Reverse scan carrying dS, the gradient of the state leaving the current chunk."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    s = tl.load(slope + i_bh % H).to(tl.float32)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    mask_kv = mask_k[:, None] & mask_v[None, :]

    d_state = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_FINAL_STATE_GRAD:
        p_dht = dht + i_bh * K * V + o_k[:, None] * V + o_v[None, :]
        d_state = tl.load(p_dht, mask=mask_kv, other=0.0).to(tl.float32)

    query_decay = tl.exp(-s * (o_t + 1).to(tl.float32))
    # transposed intra mask: row j (key), column i (query), nonzero when i >= j
    dist_t = (o_t[None, :] - o_t[:, None]).to(tl.float32)
    intra_decay_t = tl.where(dist_t >= 0, tl.exp(-s * tl.maximum(dist_t, 0.0)), 0.0)

    n_chunks = tl.cdiv(T, BT)
    for i_rev in range(0, n_chunks):
        i_t = n_chunks - 1 - i_rev
        rows = i_t * BT + o_t
        mask_t = rows < T
        chunk_len = tl.minimum(T - i_t * BT, BT).to(tl.float32)
        mask_tk = mask_t[:, None] & mask_k[None, :]
        mask_tv = mask_t[:, None] & mask_v[None, :]
        b_q = tl.load(q + i_bh * T * K + rows[:, None] * K + o_k[None, :], mask=mask_tk, other=0.0).to(tl.float32)
        b_k = tl.load(k + i_bh * T * K + rows[:, None] * K + o_k[None, :], mask=mask_tk, other=0.0).to(tl.float32)
        b_v = tl.load(v + i_bh * T * V + rows[:, None] * V + o_v[None, :], mask=mask_tv, other=0.0).to(tl.float32)
        b_do = tl.load(do + i_bh * T * V + rows[:, None] * V + o_v[None, :], mask=mask_tv, other=0.0).to(tl.float32)

        key_decay = tl.where(mask_t, tl.exp(-s * (chunk_len - 1.0 - o_t.to(tl.float32))), 0.0)
        scores_t = tl.dot(b_k, tl.trans(b_q)) * intra_decay_t
        b_dv = tl.dot(scores_t, b_do) + tl.dot(b_k * key_decay[:, None], d_state)
        d_scores_t = tl.dot(b_v, tl.trans(b_do)) * intra_decay_t
        b_dk = tl.dot(d_scores_t, b_q) + tl.dot(b_v, tl.trans(d_state)) * key_decay[:, None]

        tl.store(dv + i_bh * T * V + rows[:, None] * V + o_v[None, :],
                 b_dv.to(dv.dtype.element_ty), mask=mask_tv)
        tl.store(dk_partial + (i_v * BH + i_bh) * T * K + rows[:, None] * K + o_k[None, :],
                 b_dk, mask=mask_tk)

        d_state = d_state * tl.exp(-s * chunk_len) + tl.dot(tl.trans(b_q * query_decay[:, None]), b_do)

    if STORE_INITIAL_STATE_GRAD:
        tl.store(dh0 + i_bh * K * V + o_k[:, None] * V + o_v[None, :], d_state, mask=mask_kv)


def _tile_sizes(k_dim: int, v_dim: int, chunk_size: int) -> tuple[int, int, int]:
    block_k = max(16, triton.next_power_of_2(k_dim))
    block_v = max(16, min(64, triton.next_power_of_2(v_dim)))
    block_t = max(16, triton.next_power_of_2(chunk_size))
    return block_t, block_k, block_v


class LightningAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, slope, initial_state, output_final_state, chunk_size):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        slope = slope.float().contiguous()
        batch, heads, seq_len, k_dim = q.shape
        v_dim = v.shape[-1]
        block_t, block_k, block_v = _tile_sizes(k_dim, v_dim, chunk_size)
        n_v_tiles = triton.cdiv(v_dim, block_v)
        out = torch.empty_like(v)
        final_state = (
            q.new_empty(batch, heads, k_dim, v_dim, dtype=torch.float32) if output_final_state else None
        )
        h0 = initial_state.float().contiguous() if initial_state is not None else None
        _lightning_fwd_kernel[(n_v_tiles, batch * heads)](
            q, k, v, slope, h0, out, final_state,
            seq_len, heads, k_dim, v_dim, block_t, block_k, block_v,
            USE_INITIAL_STATE=h0 is not None, STORE_FINAL_STATE=output_final_state,
        )
        ctx.save_for_backward(q, k, v, slope, h0)
        ctx.tiles = (block_t, block_k, block_v, n_v_tiles)
        ctx.initial_state_dtype = initial_state.dtype if initial_state is not None else None
        return out, final_state

    @staticmethod
    def backward(ctx, d_out, d_final_state):
        q, k, v, slope, h0 = ctx.saved_tensors
        block_t, block_k, block_v, n_v_tiles = ctx.tiles
        batch, heads, seq_len, k_dim = q.shape
        v_dim = v.shape[-1]
        bh = batch * heads
        d_out = d_out.contiguous()
        grid = (n_v_tiles, bh)
        dq_partial = q.new_empty(n_v_tiles, batch, heads, seq_len, k_dim, dtype=torch.float32)
        dk_partial = torch.empty_like(dq_partial)
        dv = torch.empty_like(v)
        dh0 = torch.empty_like(h0) if h0 is not None else None
        dht = d_final_state.float().contiguous() if d_final_state is not None else None
        _lightning_bwd_dq_kernel[grid](
            k, v, d_out, slope, h0, dq_partial,
            seq_len, bh, heads, k_dim, v_dim, block_t, block_k, block_v,
            USE_INITIAL_STATE=h0 is not None,
        )
        _lightning_bwd_dkdv_kernel[grid](
            q, k, v, d_out, slope, dht, dk_partial, dv, dh0,
            seq_len, bh, heads, k_dim, v_dim, block_t, block_k, block_v,
            USE_FINAL_STATE_GRAD=dht is not None, STORE_INITIAL_STATE_GRAD=dh0 is not None,
        )
        dq = dq_partial.sum(0).to(q.dtype)
        dk = dk_partial.sum(0).to(k.dtype)
        if dh0 is not None:
            dh0 = dh0.to(ctx.initial_state_dtype)
        return dq, dk, dv, None, dh0, None, None


def lightning_attn_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slope: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    scale: float = 1.0,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _validate(q, k, v, slope)
    if scale != 1.0:
        q = q * scale  # outside the Function so autograd carries the scale into dq
    return LightningAttnFunction.apply(
        q, k, v, slope.to(q.device), initial_state, output_final_state, chunk_size
    )
