"""GPU: Triton lightning attention forward+backward vs flash-linear-attention's chunk_simple_gla
(same per-head decay, scale 1.0; column skipped if fla is not installed) and vs SDPA softmax
attention (flash backend), 4K -> 32K tokens, bf16 inputs. Prints times and ratios.

    python bench/gpu_lightning.py [--heads 16] [--dim 128] [--batch 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

LENGTHS = (4096, 8192, 16384, 32768)


def _time_ms(fn, warmup: int = 3, iters: int = 10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _fwd_bwd(forward, inputs):
    def run():
        for x in inputs:
            x.grad = None
        out = forward()
        out.backward(torch.ones_like(out))
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_lightning.py needs a CUDA GPU; none found, nothing measured.")
        sys.exit(0)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kernels.lightning_triton import lightning_attn_triton

    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError:
        chunk_simple_gla = None
        print("flash-linear-attention not installed: fla column skipped")

    heads, dim, batch = args.heads, args.dim, args.batch
    slope = torch.tensor([2 ** (-8 * h / heads) for h in range(1, heads + 1)], device="cuda")
    print(f"fwd+bwd ms, B={batch} H={heads} D={dim} bf16 on {torch.cuda.get_device_name()}")
    header = f"{'T':>6} | {'triton':>8} | {'fla':>8} | {'sdpa':>8} | fla/triton | sdpa/triton"
    print(header)
    for seq_len in LENGTHS:
        q, k, v = (torch.randn(batch, heads, seq_len, dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        triton_ms = _time_ms(_fwd_bwd(lambda: lightning_attn_triton(q, k, v, slope)[0], (q, k, v)))
        fla_ms = float("nan")
        if chunk_simple_gla is not None:
            # fla: [B, T, H, D] layout, g = per-token log decay; constant -slope reproduces ours
            qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
            g = (-slope).view(1, 1, heads).expand(batch, seq_len, heads).float().contiguous()
            fla_ms = _time_ms(_fwd_bwd(lambda: chunk_simple_gla(qt, kt, vt, g=g, scale=1.0)[0], (qt, kt, vt)))
        sdpa_ms = _time_ms(_fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v)))
        print(f"{seq_len:>6} | {triton_ms:>8.2f} | {fla_ms:>8.2f} | {sdpa_ms:>8.2f} | "
              f"{fla_ms / triton_ms:>10.2f} | {sdpa_ms / triton_ms:>11.2f}", flush=True)
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
