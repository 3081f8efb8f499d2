"""vLLM rollout backend on a GPU machine vs the local sampler on the same GPU.

Prints generated tokens/s for the local backend (our batched sampler, CUDA) and the vLLM
backend, same model, prompts and settings, and their ratio; then checks the M1 repetition
rule fires on vLLM output at near-zero temperature. Needs CUDA and the gpu extra.
  python bench/vllm_rollout.py [--model smol|tiny-llama|PATH] [--prompts 64] [--n 4]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.rollout.base import SamplingParams
from tasks.rollout.config import LocalConfig, VLLMConfig
from tasks.rollout.factory import resolve_model
from tasks.rollout.local import LocalBackend
from tasks.rollout.vllm_backend import VLLMBackend, vllm_available

QUESTIONS = ["What is 17 times 23?", "Why is the sky blue?", "Solve 2x + 3 = 11.", "Name three planets.",
             "Write a haiku about autumn.", "How do I reverse a list in Python?", "Define entropy briefly.",
             "What is 2 to the power of 10?"]


def throughput(backend, prompts, params) -> tuple[int, float]:
    start = time.perf_counter()
    out = backend.generate(prompts, params)
    return sum(len(c.token_ids) for per in out for c in per), time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smol")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    if not vllm_available():
        sys.exit("vllm_rollout: needs CUDA and the vllm package (pip install 'posttrain[gpu]')")
    path = str(resolve_model(args.model))
    params = SamplingParams(n=args.n, temperature=1.0, top_p=0.95, max_tokens=args.max_tokens, seed=0)

    vllm_backend = VLLMBackend(path, VLLMConfig(gpu_memory_utilization=0.5, max_model_len=2048))
    prompts = [vllm_backend.format_chat([{"role": "user", "content": q}])
               for q in (QUESTIONS * 64)[: args.prompts]]
    vllm_backend.generate(prompts[:2], SamplingParams(max_tokens=4))
    v_tokens, v_seconds = throughput(vllm_backend, prompts, params)

    local = LocalBackend.from_path(path, LocalConfig(device="cuda", batch_size=256))
    local.generate(prompts[:2], SamplingParams(max_tokens=4))
    l_tokens, l_seconds = throughput(local, prompts, params)

    print(f"model={Path(path).name} prompts={args.prompts} n={args.n} max_tokens={args.max_tokens}")
    print(f"  local (cuda) {l_tokens:7d} tokens {l_seconds:7.2f}s {l_tokens / l_seconds:9.1f} tok/s")
    print(f"  vllm         {v_tokens:7d} tokens {v_seconds:7.2f}s {v_tokens / v_seconds:9.1f} tok/s")
    print(f"  ratio vllm/local = {(v_tokens / v_seconds) / (l_tokens / l_seconds):.2f}x")

    cold = vllm_backend.generate(prompts[:8], SamplingParams(n=2, max_tokens=256, temperature=0.05,
                                                             repetition_window=32, repetition_prob=0.99))
    truncated = sum(c.truncated for per in cold for c in per)
    print(f"  repetition rule on vllm output: {truncated}/16 completions truncated at window 32")


if __name__ == "__main__":
    main()
