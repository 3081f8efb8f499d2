"""Plain-torch references for lightning attention (linear attention with per-head decay).

Shapes follow the head-first layout used across ``kernels/``:
    q, k: [B, H, T, K]    v: [B, H, T, V]    slope: [H] (decay per step is exp(-slope))
    initial_state / final_state: [B, H, K, V], always float32.

The recurrence every path implements (MiniMax-01, no q·k scaling unless ``scale`` says so):
    S_t = exp(-s_h) * S_{t-1} + k_t^T v_t          (S_{-1} = initial_state or 0)
    o_t = scale * q_t S_t

``lightning_attn_naive`` is the parallel (quadratic) form; ``lightning_attn_recurrent`` is the
token-by-token form, which is also what decoding with a cache runs.

Variable-length packed sequences: with ``cu_seqlens`` (int32 [N+1], cumulative lengths) the
batch dimension is 1 and the N sequences lie one after another on the time axis,
q [1, H, T_total, K]; each starts from its own ``initial_state[n]`` (or zeros) and the final
state is [N, H, K, V]. The references run that as one call per sequence.
"""

from __future__ import annotations

import torch


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"lightning attention expects q, k [B, H, T, K] and v [B, H, T, V]; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if slope.shape != (q.shape[1],):
        raise ValueError(f"slope must have shape [H={q.shape[1]}], got {tuple(slope.shape)}")


def _validate_varlen(q: torch.Tensor, cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None) -> int:
    """Number of packed sequences; checks the [1, H, T_total, D] layout and the offsets."""
    if q.shape[0] != 1:
        raise ValueError(f"packed sequences (cu_seqlens) need batch size 1, got q {tuple(q.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError("cu_seqlens must be an int32 tensor [N+1] of cumulative sequence lengths")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != q.shape[2] or bool((cu_seqlens.diff() < 0).any()):
        raise ValueError(
            f"cu_seqlens must rise from 0 to T_total={q.shape[2]}, got {cu_seqlens.tolist()}"
        )
    n_seqs = cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape[0] != n_seqs:
        raise ValueError(f"initial_state must hold one state per sequence ({n_seqs}), got {tuple(initial_state.shape)}")
    return n_seqs


def per_sequence(attn, q, k, v, slope, initial_state, output_final_state, scale, cu_seqlens, **kw):
    """Run ``attn`` on each packed sequence of ``cu_seqlens`` and join the results."""
    n_seqs = _validate_varlen(q, cu_seqlens, initial_state)
    bounds = cu_seqlens.tolist()
    outputs, finals = [], []
    for n in range(n_seqs):
        span = slice(bounds[n], bounds[n + 1])
        h0 = initial_state[n : n + 1] if initial_state is not None else None
        out, final = attn(q[:, :, span], k[:, :, span], v[:, :, span], slope, h0, output_final_state, scale, **kw)
        if final is None and output_final_state:  # an empty sequence keeps its initial state
            final = h0.float() if h0 is not None else q.new_zeros(1, q.shape[1], q.shape[3], v.shape[3],
                                                                 dtype=torch.float32)
        outputs.append(out)
        finals.append(final)
    out = torch.cat(outputs, dim=2)
    return out, (torch.cat(finals) if output_final_state else None)


def lightning_attn_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slope: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    scale: float = 1.0,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quadratic form: o = ((q k^T) * D) v + decayed read of the initial state, all in fp32."""
    _validate(q, k, v, slope)
    if cu_seqlens is not None:
        return per_sequence(lightning_attn_naive, q, k, v, slope, initial_state, output_final_state, scale,
                            cu_seqlens)
    out_dtype = v.dtype
    q, k, v = q.float() * scale, k.float(), v.float()
    seq_len = q.shape[2]
    s = slope.float().to(q.device).view(1, -1, 1, 1)
    pos = torch.arange(seq_len, device=q.device, dtype=torch.float32)
    dist = pos[:, None] - pos[None, :]
    # where() rather than multiply: exp of a negative distance overflows and inf*0 is nan.
    decay = torch.where(dist >= 0, torch.exp(-s * dist.clamp(min=0)), torch.zeros((), device=q.device))
    out = ((q @ k.transpose(-1, -2)) * decay) @ v
    if initial_state is not None:
        out = out + (q * torch.exp(-s * (pos + 1)[:, None])) @ initial_state.float()
    final_state = None
    if output_final_state:
        key_decay = torch.exp(-s * (seq_len - 1 - pos)[:, None])
        final_state = (k * key_decay).transpose(-1, -2) @ v
        if initial_state is not None:
            final_state = final_state + torch.exp(-s * seq_len) * initial_state.float()
    return out.to(out_dtype), final_state


def lightning_attn_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slope: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    scale: float = 1.0,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token recurrence with an fp32 state; the decoding path (T is usually 1)."""
    _validate(q, k, v, slope)
    if cu_seqlens is not None:
        return per_sequence(lightning_attn_recurrent, q, k, v, slope, initial_state, output_final_state,
                            scale, cu_seqlens)
    batch, heads, seq_len, k_dim = q.shape
    v_dim = v.shape[-1]
    step_decay = torch.exp(-slope.float().to(q.device)).view(1, heads, 1, 1)
    state = (
        initial_state.float()
        if initial_state is not None
        else q.new_zeros(batch, heads, k_dim, v_dim, dtype=torch.float32)
    )
    outputs = []
    for t in range(seq_len):
        k_t, v_t = k[:, :, t].float(), v[:, :, t].float()
        state = step_decay * state + k_t.unsqueeze(-1) * v_t.unsqueeze(-2)
        outputs.append((q[:, :, t].float() * scale).unsqueeze(-2) @ state)
    out = torch.cat(outputs, dim=-2) if outputs else v.new_zeros(batch, heads, 0, v_dim).float()
    return out.to(v.dtype), (state if output_final_state else None)
