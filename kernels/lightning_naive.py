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

from .utils import kernel_entry


@kernel_entry("lightning", split_varlen=True)
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
    out_dtype = v.dtype
    q, k, v = q.float() * scale, k.float(), v.float()
    seq_len = q.shape[2]
    s = slope.float().view(1, -1, 1, 1)
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


@kernel_entry("lightning", split_varlen=True)
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
    batch, heads, seq_len, k_dim = q.shape
    v_dim = v.shape[-1]
    step_decay = torch.exp(-slope.float()).view(1, heads, 1, 1)
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
