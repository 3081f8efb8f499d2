"""The evaluate stage's sampling cost on the smol ladder's held-out families: before and after
stopping at the answer, on the same items, model and settings.

Three passes over the same held-out items (the smol profile's evaluate section: its trained
families, ``--per-task`` items each, n samples, T 1.0, top-p 0.95, its max_tokens), one model:
  old        the evaluate stage before 2026-12-06: one random stream for the call, no stop string
  full       one stream per sample (``seed_per_sequence``), no stop string
  new        one stream per sample and logic items stop at ``</answer>`` (today's evaluate)
``full`` and ``new`` draw the same samples: every ``new`` sample's tokens are the first tokens of
its ``full`` twin (checked and printed), so their pass@1 differ only where a model writes a second
answer after its first. Prints seconds, generated tokens and pass@1 of each, and old / new.
An evaluate stage runs this once per ladder stage; the ratio is per stage.

  python bench/evaluate_cost.py [--model smol|PATH] [--per-task 16] [--n 4] [--threads 2]
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from tasks.evaluate import EvaluateConfig, evaluate_items, heldout_synthetic_items
from tasks.profile import load_profile
from tasks.rollout.config import LocalConfig
from tasks.rollout.factory import resolve_model
from tasks.rollout.local import LocalBackend


class Recording:
    """The backend, keeping every completion it returns (to compare the passes sample by sample)."""

    def __init__(self, backend: LocalBackend, params_hook=None):
        self.backend, self.params_hook, self.completions = backend, params_hook, []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def generate(self, prompts, params):
        out = self.backend.generate(prompts, self.params_hook(params) if self.params_hook else params)
        self.completions.extend(c for per_prompt in out for c in per_prompt)
        return out


def run(name: str, items, backend, cfg, params_hook=None) -> dict:
    rec = Recording(backend, params_hook)
    t0 = time.perf_counter()
    results = evaluate_items(items, rec, cfg)
    seconds = time.perf_counter() - t0
    correct, n = sum(r.correct for r in results), sum(r.n for r in results)
    tokens = sum(len(c.token_ids) for c in rec.completions)
    print(f"{name:5s} {seconds:8.1f} s  {tokens:7d} tokens  {tokens / seconds:6.1f} tok/s  pass@1 {correct / n:.3f}",
          flush=True)
    return {"seconds": seconds, "tokens": tokens, "pass": correct / n, "completions": rec.completions,
            "results": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smol")
    ap.add_argument("--profile", default="smol")
    ap.add_argument("--per-task", type=int, default=16)
    ap.add_argument("--n", type=int, default=None, help="samples per item (default: the profile's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    cfg = load_profile(args.profile).section("evaluate", EvaluateConfig)
    if args.n is not None:
        cfg = cfg.model_copy(update={"n": args.n, "k": [1]})
    spec = cfg.synthetic.model_copy(update={"per_task": args.per_task, "untrained": []})
    items = heldout_synthetic_items(spec, set()).items
    backend = LocalBackend.from_path(resolve_model(args.model),
                                     LocalConfig(batch_size=args.batch_size, threads=args.threads))
    print(f"{len(items)} items ({', '.join(spec.tasks or [])}) x n={cfg.n}, T={cfg.temperature}, "
          f"top-p={cfg.top_p}, max_tokens={cfg.max_tokens}, model {args.model}, {args.threads} threads, "
          f"batch {args.batch_size}")
    old = run("old", items, backend, cfg, lambda p: replace(p, seed_per_sequence=False, stop=()))
    full = run("full", items, backend, cfg, lambda p: replace(p, stop=()))
    new = run("new", items, backend, cfg)
    prefixes = sum(f.token_ids[:len(c.token_ids)] == c.token_ids
                   for c, f in zip(new["completions"], full["completions"]))
    same_score = sum(a.correct == b.correct for a, b in zip(new["results"], full["results"]))
    print(f"same samples: {prefixes}/{len(new['completions'])} new samples are the first tokens of their full "
          f"twin; {same_score}/{len(items)} items score the same count correct")
    print(f"old / new: {old['seconds'] / new['seconds']:.2f}x wall, {old['tokens'] / max(1, new['tokens']):.2f}x "
          f"tokens; full / new: {full['seconds'] / new['seconds']:.2f}x wall")


if __name__ == "__main__":
    main()
