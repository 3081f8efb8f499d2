"""One RL update with prefix-shared group forwards vs re-encoding the prompt per response.

Both sides run the RL stage's own update (``tasks.train.rl._minibatch_step``: forward of the
policy, CISPO loss, backward, DeepSpeed optimizer step) on the same engine, the same batch
(``--prompts`` prompts of ``--prompt-len`` tokens, ``--group-size`` responses of
``--response-len`` tokens each) and the same behaviour log-probs; only ``rl.prefix_shared``
differs. The sides alternate after a warm-up update each, so load on the machine hits both
alike; the median of ``--repeats`` updates is reported. Before timing, the per-token
log-probs of the two paths are compared.

tokens/s counts the update's tokens as re-encoding sees them (rows x (prompt + response)),
the same number for both sides, so the ratio is the speed-up (goal >= 1.5x on CPU).

    .venv/bin/python bench/prefix_shared_update.py                      # tiny profile's model shape
    .venv/bin/python bench/prefix_shared_update.py --hidden 256 --layers 8 --heads 8   # wider
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def build_policy(args):
    """The hybrid model of ``configs/profiles/<profile>/model.yaml``, sizes overridable by flags."""
    import torch
    import yaml

    from model.config import HybridConfig, ModelSection
    from model.hybrid import HybridForCausalLM

    section = ModelSection(**yaml.safe_load((ROOT / "configs" / "profiles" / args.profile / "model.yaml").read_text()))
    sizes = section.hybrid.model_dump()
    for flag, key in (("hidden", "hidden_size"), ("layers", "num_hidden_layers"), ("heads", "num_attention_heads")):
        if getattr(args, flag):
            sizes[key] = getattr(args, flag)
    if args.hidden:
        sizes["intermediate_size"] = 4 * args.hidden
    if args.layers:
        sizes["softmax_attention_every"] = min(sizes["softmax_attention_every"], args.layers)
    sizes["max_position_embeddings"] = max(sizes["max_position_embeddings"], args.prompt_len + args.response_len)
    config = HybridConfig(vocab_size=args.vocab or section.tokenizer_vocab_size, pad_token_id=0, bos_token_id=1,
                          eos_token_id=2, **sizes)
    torch.manual_seed(0)
    return HybridForCausalLM(config).train(), sizes


def make_batch(args, vocab: int) -> tuple[dict, torch.Tensor]:
    """Seeded prompts and responses laid out group by group as the RL stage pads them, and advantages."""
    import torch

    from model.config import IGNORE_INDEX
    from model.losses import group_advantages
    from tasks.train.encoding import pad_batch

    gen = torch.Generator().manual_seed(0)
    seqs, prompt_lengths = [], []
    for _ in range(args.prompts):
        prompt = torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.group_size):
            seqs.append(prompt + torch.randint(3, vocab, (args.response_len,), generator=gen).tolist())
            prompt_lengths.append(args.prompt_len)
    tensors = pad_batch(seqs, prompt_lengths, pad_id=0)
    tensors["mask"] = (tensors["labels"][:, 1:] != IGNORE_INDEX).float()
    rewards = torch.tensor([float(i % 2) for i in range(len(seqs))])
    return tensors, group_advantages(rewards, args.group_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="tiny", help="model shape from configs/profiles/<profile>/model.yaml")
    ap.add_argument("--hidden", type=int, help="override hidden_size (intermediate = 4x)")
    ap.add_argument("--layers", type=int, help="override num_hidden_layers")
    ap.add_argument("--heads", type=int, help="override num_attention_heads")
    ap.add_argument("--vocab", type=int, help="override the vocabulary size (default: the profile's tokenizer)")
    ap.add_argument("--prompts", type=int, default=1, help="distinct prompts in the update")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--response-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    from model.logprobs import prefix_shared_logprobs, token_logprobs
    from tasks.train.config import EngineConfig, OptimizerConfig, RLStageConfig
    from tasks.train.engine import create_engine
    from tasks.train.rl import _minibatch_step

    torch.set_num_threads(args.threads)
    policy, sizes = build_policy(args)
    tensors, advantages = make_batch(args, policy.config.vocab_size)
    rows = list(range(advantages.numel()))
    engine, _ = create_engine(policy, EngineConfig(zero_stage=0, precision="fp32", micro_batch_size=len(rows),
                                                   threads_per_rank=args.threads),
                              OptimizerConfig(lr=1e-6), lr=1e-6, total_steps=10 ** 6)
    batch = (tensors["input_ids"], tensors["attention_mask"], tensors["labels"])
    with torch.no_grad():
        old_logp = token_logprobs(engine.module, *batch)[0]
        shared = prefix_shared_logprobs(engine.module, *batch)
    gap = float((shared.logp - old_logp).abs().max())

    def update(prefix_shared: bool) -> float:
        cfg = RLStageConfig(group_size=args.group_size, prefix_shared=prefix_shared)
        start = time.perf_counter()
        _minibatch_step(engine, cfg, tensors, rows, [rows], old_logp, advantages, eps_high=0.2)
        return time.perf_counter() - start

    times = {False: [], True: []}
    for side in (False, True):
        update(side)  # warm-up: allocator, first-call paths
    for _ in range(args.repeats):
        for side in (False, True):
            times[side].append(update(side))
    report(args, sizes, tensors, times, gap, shared.tokens_saved)


def report(args, sizes: dict, tensors: dict, times: dict, gap: float, tokens_saved: int) -> None:
    tokens = int(tensors["attention_mask"].sum())
    median = {side: statistics.median(t) for side, t in times.items()}
    print(f"update: {args.prompts} prompt(s) x G={args.group_size}, prompt {args.prompt_len} / response "
          f"{args.response_len} tokens ({tokens} tokens re-encoded, {tokens - tokens_saved} prefix-shared); "
          f"model hidden {sizes['hidden_size']}, {sizes['num_hidden_layers']} layers, "
          f"softmax every {sizes['softmax_attention_every']}; threads {args.threads}, {args.repeats} repeats")
    print(f"max |log-prob difference| prefix-shared vs re-encoding: {gap:.2e}")
    for side, name in ((False, "re-encoding"), (True, "prefix-shared")):
        print(f"{name:14s} {tokens / median[side]:10.1f} tokens/s   {median[side]:.3f} s/update (median; "
              f"min {min(times[side]):.3f})")
    print(f"speed ratio prefix-shared/re-encoding: {median[False] / median[True]:.2f}x (goal >= 1.5x)")


if __name__ == "__main__":
    main()
