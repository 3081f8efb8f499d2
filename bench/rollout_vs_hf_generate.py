"""Local rollout backend vs plain transformers generate(), same model, prompts and settings.

Prints generated tokens/s for:
  peer  hf_generate        model.generate() per prompt (num_return_sequences=n), the usual call
  peer  hf_generate_batch  model.generate() on the whole left-padded batch at once
  ours  local              LocalBackend.generate (batched, compacting KV cache)
  ours  openai             OpenAIBackend through `posttrain serve-model` (subprocess)
and the ratios ours / hf_generate.  Usage:
  python bench/rollout_vs_hf_generate.py [--model smol|tiny-llama|PATH] [--prompts 16] [--n 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from tasks.rollout.base import SamplingParams
from tasks.rollout.config import LocalConfig, OpenAIConfig
from tasks.rollout.factory import resolve_model
from tasks.rollout.local import LocalBackend
from tasks.rollout.openai_client import OpenAIBackend
from tasks.rollout.server import ServerProcess

QUESTIONS = [
    "What is 17 times 23?", "Write a haiku about autumn.", "Explain what a prime number is.",
    "Name three planets.", "How do I reverse a list in Python?", "What is the capital of France?",
    "Give me a synonym for happy.", "Why is the sky blue?", "Solve 2x + 3 = 11.",
    "Describe a cat in one sentence.", "What does HTTP stand for?", "List the first five square numbers.",
    "Translate 'good morning' to Spanish.", "What is 2 to the power of 10?", "Define entropy briefly.",
    "What is the boiling point of water?",
]


def hf_generate(backend: LocalBackend, prompts: list[str], params: SamplingParams, batched: bool) -> int:
    model, tok = backend.model, backend.tokenizer
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    torch.manual_seed(params.seed)
    groups = [prompts] if batched else [[p] for p in prompts]
    generated = 0
    for group in groups:
        enc = tok(group, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, do_sample=params.temperature > 0, temperature=params.temperature,
                             top_p=params.top_p, max_new_tokens=params.max_tokens,
                             num_return_sequences=params.n, pad_token_id=tok.pad_token_id)
        new = out[:, enc["input_ids"].shape[1]:]
        for row in new.tolist():
            length = len(row)
            for i, t in enumerate(row):
                if t in backend.eos_ids:
                    length = i + 1
                    break
            generated += length
    return generated


def timed(fn):
    start = time.perf_counter()
    tokens = fn()
    return tokens, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smol")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    backend = LocalBackend.from_path(path, LocalConfig(batch_size=64, threads=args.threads))
    prompts = [backend.format_chat([{"role": "user", "content": q}]) for q in (QUESTIONS * 8)[: args.prompts]]
    params = SamplingParams(n=args.n, temperature=1.0, top_p=0.95, max_tokens=args.max_tokens, seed=0,
                            repetition_window=None)
    # Warm up both sides so neither pays first-call costs (allocator, kernel selection) in its timing.
    warm_up = SamplingParams(n=1, max_tokens=4)
    backend.generate(prompts[:2], warm_up)
    hf_generate(backend, prompts[:2], warm_up, batched=True)

    print(f"model={path.name} prompts={args.prompts} n={args.n} max_tokens={args.max_tokens} "
          f"threads={args.threads} cpu_count={os.cpu_count()}", flush=True)
    results, rate = {}, {}

    def record(name, fn):
        results[name] = timed(fn)
        tokens, seconds = results[name]
        rate[name] = tokens / seconds
        print(f"  {name:18s} {tokens:6d} tokens {seconds:7.2f}s {rate[name]:8.1f} tok/s", flush=True)

    record("hf_generate", lambda: hf_generate(backend, prompts, params, batched=False))
    record("hf_generate_batch", lambda: hf_generate(backend, prompts, params, batched=True))
    record("local", lambda: sum(len(c.token_ids) for per in backend.generate(prompts, params) for c in per))
    with ServerProcess(path, threads=args.threads, batch_size=64) as server:
        client = OpenAIBackend(OpenAIConfig(base_url=server.base_url, concurrency=4, prompts_per_request=4))
        client.generate(prompts[:2], SamplingParams(n=1, max_tokens=4))  # warm-up
        record("openai", lambda: sum(len(c.token_ids) for per in client.generate(prompts, params) for c in per))
        client.close()
    for ours in ("local", "openai"):
        print(f"  ratio {ours}/hf_generate = {rate[ours] / rate['hf_generate']:.2f}x   "
              f"{ours}/hf_generate_batch = {rate[ours] / rate['hf_generate_batch']:.2f}x")


if __name__ == "__main__":
    main()
