"""The prologue every kernel entry point shares, as one decorator: ``kernel_entry``.

Each lightning-attention entry (``lightning_attn_naive``, ``_recurrent``, ``_chunk``, ``_triton``)
and each LM-head log-prob entry (``token_logprobs_naive``, ``_fused``, ``_triton``) starts the same
way: check the shapes of its family's arguments, bring the per-head slopes to the queries' device,
and, for packed sequences (``cu_seqlens``), check the packing and then either run once per
sequence (the torch paths) or hand the kernel the offsets in the form it reads (Triton, which also
needs contiguous tensors). ``kernel_entry`` does all of it in one place, on the call's arguments
bound by name, so positional and keyword calls are guarded alike (the model is
flash-linear-attention's ``input_guard``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Literal

import torch

Family = Literal["lightning", "head"]
FAMILIES = ("lightning", "head")


def check_lightning(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor) -> None:
    """q, k [B, H, T, K], v [B, H, T, V], slope [H]."""
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"lightning attention expects q, k [B, H, T, K] and v [B, H, T, V]; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if slope.shape != (q.shape[1],):
        raise ValueError(f"slope must have shape [H={q.shape[1]}], got {tuple(slope.shape)}")


def check_packing(q: torch.Tensor, cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None) -> int:
    """Number of packed sequences; checks the [1, H, T_total, D] layout and the offsets."""
    if q.shape[0] != 1:
        raise ValueError(f"packed sequences (cu_seqlens) need batch size 1, got q {tuple(q.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError("cu_seqlens must be an int32 tensor [N+1] of cumulative sequence lengths, "
                         f"got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != q.shape[2] or bool((cu_seqlens.diff() < 0).any()):
        raise ValueError(
            f"cu_seqlens must rise from 0 to T_total={q.shape[2]}, got {cu_seqlens.tolist()}"
        )
    n_seqs = cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape[0] != n_seqs:
        raise ValueError(f"initial_state must hold one state per sequence ({n_seqs}), got {tuple(initial_state.shape)}")
    return n_seqs


def check_head(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    """hidden [..., D], weight [vocab, D], labels [...] (hidden's shape without D)."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be labels {tuple(labels.shape)} plus a feature dim"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be [vocab, {hidden.shape[-1]}], got {tuple(weight.shape)}"
        )


def _per_sequence(call: Callable[[dict], tuple], arguments: dict, n_seqs: int):
    """Run the entry on each packed sequence of ``cu_seqlens`` and join the results."""
    q, k, v = arguments["q"], arguments["k"], arguments["v"]
    initial_state, output_final_state = arguments["initial_state"], arguments["output_final_state"]
    bounds = arguments["cu_seqlens"].tolist()
    outputs, finals = [], []
    for n in range(n_seqs):
        span = slice(bounds[n], bounds[n + 1])
        h0 = initial_state[n : n + 1] if initial_state is not None else None
        out, final = call({**arguments, "q": q[:, :, span], "k": k[:, :, span], "v": v[:, :, span],
                           "initial_state": h0, "cu_seqlens": None})
        if final is None and output_final_state:  # an empty sequence keeps its initial state
            final = h0.float() if h0 is not None else q.new_zeros(1, q.shape[1], q.shape[3], v.shape[3],
                                                                 dtype=torch.float32)
        outputs.append(out)
        finals.append(final)
    out = torch.cat(outputs, dim=2)
    return out, (torch.cat(finals) if output_final_state else None)


def kernel_entry(family: Family, *, split_varlen: bool = False, contiguous: bool = False):
    """Decorate a kernel entry point of ``family`` with the prologue its family shares.

    The call's arguments are bound to the entry's signature by name (defaults filled in); then

    - ``"head"`` (hidden, weight, labels): ``check_head`` (hidden [..., D], weight [vocab, D],
      labels [...]), a ``ValueError`` naming the argument that does not fit;
    - ``"lightning"`` (q, k, v, slope, initial_state, output_final_state, ..., cu_seqlens):
      ``check_lightning`` (q, k [B, H, T, K], v [B, H, T, V], slope [H]), then ``slope`` moved to
      q's device. With ``cu_seqlens``, ``check_packing`` (batch of one, offsets rising from 0 to
      T_total, one initial state per sequence), then either, ``split_varlen``, the entry runs once
      per sequence with ``cu_seqlens=None`` and ``initial_state[n:n+1]``, the outputs joined on the
      time axis and the final states on the first (an empty sequence's final state is its initial
      state, or zeros), or ``cu_seqlens`` goes on as a contiguous int32 tensor on q's device;
    - ``contiguous``: every tensor argument is made contiguous before the entry runs (the Triton
      kernels address rows by the shapes, not the strides).

    Nothing else changes: the entry gets the same values, dtypes and remaining arguments.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; expected one of {FAMILIES}")
    if split_varlen and family != "lightning":
        raise ValueError("split_varlen applies to lightning attention entries only")

    def decorate(fn):
        signature = inspect.signature(fn)

        def call(arguments: dict):
            if contiguous:
                arguments = {name: value.contiguous() if isinstance(value, torch.Tensor) else value
                             for name, value in arguments.items()}
            return fn(**arguments)

        @functools.wraps(fn)
        def entry(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments
            if family == "head":
                check_head(arguments["hidden"], arguments["weight"], arguments["labels"])
                return call(arguments)
            q = arguments["q"]
            check_lightning(q, arguments["k"], arguments["v"], arguments["slope"])
            arguments["slope"] = arguments["slope"].to(q.device)
            cu_seqlens = arguments["cu_seqlens"]
            if cu_seqlens is not None:
                n_seqs = check_packing(q, cu_seqlens, arguments["initial_state"])
                if split_varlen:
                    return _per_sequence(call, arguments, n_seqs)
                arguments["cu_seqlens"] = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
            return call(arguments)

        return entry

    return decorate
