"""CPU scaling: chunked lightning attention vs softmax attention (SDPA), 1K -> 16K tokens.

Each (method, length) runs in a fresh subprocess with one thread and is timed in process
CPU time (the machine is shared, wall time is not reliable), so its peak RSS above the
post-import baseline is its own. Prints time and peak memory per length and the ratio
time(16K) / time(1K) for both: linear attention should stay near 16 (target <= 20), softmax
attention grows ~quadratically.

    python bench/lightning_scaling.py [--heads 4] [--dim 64] [--backward]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

LENGTHS = (1024, 2048, 4096, 8192, 16384)


def _measure(method: str, seq_len: int, heads: int, dim: int, backward: bool, repeats: int) -> dict:
    import psutil
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kernels.lightning_chunk import lightning_attn_chunk

    torch.manual_seed(0)
    slope = torch.tensor([2 ** (-8 * h / heads) for h in range(1, heads + 1)])
    q, k, v = (torch.randn(1, heads, seq_len, dim, requires_grad=backward) for _ in range(3))
    baseline = psutil.Process().memory_info().rss

    def step():
        if method == "lightning":
            out, _ = lightning_attn_chunk(q, k, v, slope, chunk_size=64)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if backward:
            out.sum().backward()

    grad_ctx = torch.enable_grad() if backward else torch.no_grad()
    with grad_ctx:
        step()  # warm-up
        # at least `repeats` runs and about half a second of runs: short sizes are noisy
        times, budget_end = [], time.perf_counter() + 0.5
        while len(times) < repeats or time.perf_counter() < budget_end:
            # CPU time of this single-threaded process: robust to other jobs sharing the cores
            start = time.process_time()
            step()
            times.append(time.process_time() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"seconds": min(times), "peak_mb": max(0, peak - baseline) / 2**20}


def _run_isolated(method: str, seq_len: int, args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--one", method, str(seq_len), "--heads", str(args.heads),
           "--dim", str(args.dim), "--repeats", str(args.repeats)] + (["--backward"] if args.backward else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        import torch

        torch.set_num_threads(1)
        method, seq_len = args.one[0], int(args.one[1])
        print(json.dumps(_measure(method, seq_len, args.heads, args.dim, args.backward, args.repeats)))
        return

    mode = "forward+backward" if args.backward else "forward"
    print(f"lightning (chunked torch) vs SDPA softmax attention, CPU 1 thread, {mode}, "
          f"B=1 H={args.heads} D={args.dim}")
    print(f"{'T':>6} | {'lightning s':>11} {'peak MB':>8} | {'sdpa s':>9} {'peak MB':>8} | sdpa/lightning")
    results = {"lightning": {}, "sdpa": {}}
    for seq_len in LENGTHS:
        for method, by_length in results.items():
            by_length[seq_len] = _run_isolated(method, seq_len, args)
        lt, st = results["lightning"][seq_len], results["sdpa"][seq_len]
        print(f"{seq_len:>6} | {lt['seconds']:>11.4f} {lt['peak_mb']:>8.1f} | {st['seconds']:>9.4f} "
              f"{st['peak_mb']:>8.1f} | {st['seconds'] / lt['seconds']:>6.2f}x", flush=True)
    first, last = LENGTHS[0], LENGTHS[-1]
    for method, rows in results.items():
        ratio = rows[last]["seconds"] / rows[first]["seconds"]
        print(f"{method}: time({last // 1024}K)/time({first // 1024}K) = {ratio:.1f}"
              + ("  (target <= 20)" if method == "lightning" else ""))


if __name__ == "__main__":
    main()
