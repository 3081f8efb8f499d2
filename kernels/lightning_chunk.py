"""Chunked lightning attention in plain torch: the CPU path, same signature as the naive one.

Inside a chunk of C tokens the decay-masked quadratic form is used; across chunks only a
[K, V] fp32 state is carried, so cost grows linearly with T. All chunks' intra-chunk products
and state contributions are computed as batched matmuls; only the (cheap) state scan loops.
Gradients come from autograd through these ops.
"""

from __future__ import annotations

import math

import torch

from .utils import kernel_entry


def _chunk_decays(slope: torch.Tensor, seq_len: int, chunk: int):
    """Per-head decay factors for every chunk, including the shorter last chunk."""
    n_chunks = math.ceil(seq_len / chunk)
    s = slope.float().view(-1, 1)  # [H, 1]
    idx = torch.arange(chunk, device=slope.device, dtype=torch.float32)
    chunk_len = torch.full((n_chunks,), float(chunk), device=slope.device)
    chunk_len[-1] = seq_len - (n_chunks - 1) * chunk
    # query i of a chunk reads the incoming state decayed i+1 times
    query_decay = torch.exp(-s * (idx + 1))  # [H, C]
    # key j contributes to the outgoing state decayed (len-1-j) times; padded keys contribute 0
    dist_to_end = chunk_len[:, None] - 1 - idx[None, :]  # [N, C]
    key_decay = torch.where(
        dist_to_end >= 0,
        torch.exp(-s[:, :, None] * dist_to_end.clamp(min=0)[None]),
        torch.zeros((), device=slope.device),
    )  # [H, N, C]
    chunk_decay = torch.exp(-s * chunk_len[None, :])  # [H, N]
    dist = idx[:, None] - idx[None, :]
    intra_decay = torch.where(
        dist >= 0, torch.exp(-s[:, :, None] * dist.clamp(min=0)), torch.zeros((), device=slope.device)
    )  # [H, C, C]
    return query_decay, key_decay, chunk_decay, intra_decay


@kernel_entry("lightning", split_varlen=True)
def lightning_attn_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slope: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    scale: float = 1.0,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    span_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked lightning attention. The sequence is processed ``span_size`` tokens at a time
    (state carried between spans) so that intermediates stay cache-sized and time stays
    linear in T; within a span all chunks are batched. Packed sequences (``cu_seqlens``) run
    one after another."""
    batch, heads, seq_len, _ = q.shape
    v_dim = v.shape[-1]
    if seq_len == 0:
        state = initial_state.float() if initial_state is not None else None
        return v.new_zeros(batch, heads, 0, v_dim), state
    if scale != 1.0:
        q = q * scale
    span = max(chunk_size, span_size // chunk_size * chunk_size)
    state = initial_state.float() if initial_state is not None else None
    outputs = []
    for start in range(0, seq_len, span):
        stop = min(start + span, seq_len)
        out, state = _chunked_span(q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop],
                                   slope, state, chunk_size)
        outputs.append(out)
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return out.to(v.dtype), (state if output_final_state else None)


def _chunked_span(q, k, v, slope, state, chunk_size):
    """One span: returns its fp32 output and the fp32 state leaving it."""
    batch, heads, seq_len, k_dim = q.shape
    v_dim = v.shape[-1]
    chunk = min(chunk_size, seq_len)
    n_chunks = math.ceil(seq_len / chunk)
    pad = n_chunks * chunk - seq_len

    def blocks(x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.pad(x.float(), (0, 0, 0, pad)) if pad else x.float()
        return x.reshape(batch, heads, n_chunks, chunk, x.shape[-1])

    qc, kc, vc = blocks(q), blocks(k), blocks(v)
    query_decay, key_decay, chunk_decay, intra_decay = _chunk_decays(slope, seq_len, chunk)

    intra = ((qc @ kc.transpose(-1, -2)) * intra_decay[None, :, None]) @ vc
    chunk_kv = (kc * key_decay[None, :, :, :, None]).transpose(-1, -2) @ vc  # [B, H, N, K, V]

    if state is None:
        state = q.new_zeros(batch, heads, k_dim, v_dim, dtype=torch.float32)
    incoming_states = []
    for n in range(n_chunks):
        incoming_states.append(state)
        state = chunk_decay[None, :, n, None, None] * state + chunk_kv[:, :, n]
    incoming = torch.stack(incoming_states, dim=2)  # [B, H, N, K, V]
    out = intra + (qc * query_decay[None, :, None, :, None]) @ incoming
    return out.reshape(batch, heads, n_chunks * chunk, v_dim)[:, :, :seq_len], state
