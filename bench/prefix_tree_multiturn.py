"""Forward+backward of multi-turn agent samples through a prefix trie (tree attention) vs
separate forwards of every sample.

Synthetic data shaped like agent RL: ``--group`` trajectories share a prompt of
``--prompt-len`` tokens; each has K turns of a policy turn (``--policy-len`` tokens) and a tool
result (``--tool-len``); ``--branches`` more trajectories fork from the first after
``--shared-turns`` shared turns (fewer when K is smaller). Each trajectory gives one training
sample per turn: turn k's sample is the history up to and including its policy turn k (as when
earlier thinking is dropped from the context, or histories are stored per turn), so the samples
of one trajectory are prefixes of each other; a branch contributes the samples of its own turns.
The loss is the same on both sides: each sample's log-probs of its last policy turn times a
random advantage, summed (every position is scored on both sides). ``padded`` is the
separate side's padded tokens: its padding and per-forward overhead can put the ratio above
the bound.

Both sides run the same model on the same sequences, in forwards of at most ``--budget`` padded
tokens: the tree as rows of at most that many trie tokens (``model.trie.trie_logprobs``), the
separate side as right-padded batches of at most that many tokens (``separate_logprobs``), each
micro-batch with its own backward (gradient accumulation). After one warm-up of each side the
sides alternate ``--repeats`` times per K; the median is reported. tokens/s counts the
samples' tokens (the same number for both), so the ratio is the speed-up; the bound is tokens
/ trie tokens (goal: ratio >= 5x at 8 turns).

    .venv/bin/python bench/prefix_tree_multiturn.py                  # SmolLM2-135M-Instruct
    .venv/bin/python bench/prefix_tree_multiturn.py --model tiny     # a random small Llama
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def load_model(name: str):
    import torch

    if name == "tiny":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
        return LlamaForCausalLM._from_config(config, attn_implementation="sdpa").train(), "tiny random Llama"
    from model.loading import load_causal_lm
    from tasks.rollout.smol import smollm2_path

    model, _ = load_causal_lm(smollm2_path())
    return model.train(), "SmolLM2-135M-Instruct"


def make_samples(args, turns: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    """(samples, scored length of each: its last policy turn), seeded per K."""
    import torch

    gen = torch.Generator().manual_seed(args.seed + turns)

    def toks(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    def new_turns(n: int) -> list[tuple[list[int], list[int]]]:
        return [(toks(args.policy_len), toks(args.tool_len)) for _ in range(n)]

    prompt = toks(args.prompt_len)
    trajectories = [(new_turns(turns), 1) for _ in range(args.group)]
    shared = min(args.shared_turns, turns - 1)
    for _ in range(args.branches):
        trajectories.append((trajectories[0][0][:shared] + new_turns(turns - shared), shared + 1))
    samples = []
    for turn_list, first in trajectories:
        for k in range(first, turns + 1):
            history = [t for policy, tool in turn_list[:k - 1] for t in policy + tool]
            samples.append(prompt + history + turn_list[k - 1][0])
    return samples, [args.policy_len] * len(samples)


def sample_loss(logp: list, scored: list[int], advantage: list[float]):
    return sum(a * lp[-n:].sum() for lp, n, a in zip(logp, scored, advantage))


def run_tree(model, samples, scored, advantage, budget):
    from model.trie import trie_logprobs

    out = trie_logprobs(model, samples, max_tokens_per_row=budget)
    sample_loss(out.logp, scored, advantage).backward()
    return out


def run_separate(model, samples, scored, advantage, budget):
    from model.trie import padded_batches, separate_logprobs

    logp = [None] * len(samples)
    for batch in padded_batches([len(s) for s in samples], budget):
        out = separate_logprobs(model, [samples[i] for i in batch])
        sample_loss(out.logp, [scored[i] for i in batch], [advantage[i] for i in batch]).backward()
        for i, lp in zip(batch, out.logp):
            logp[i] = lp.detach()
    return logp


def timed(fn, model, *args):
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    out = fn(model, *args)
    return time.perf_counter() - start, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("smol", "tiny"), default="smol")
    ap.add_argument("--turns", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--group", type=int, default=2, help="trajectories sharing the prompt")
    ap.add_argument("--branches", type=int, default=1, help="trajectories forked from the first one")
    ap.add_argument("--shared-turns", type=int, default=4, help="turns a branch shares before it forks")
    ap.add_argument("--prompt-len", type=int, default=150)
    ap.add_argument("--policy-len", type=int, default=32)
    ap.add_argument("--tool-len", type=int, default=16)
    ap.add_argument("--budget", type=int, default=2048, help="padded tokens per forward, both sides")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch

    from model.trie import PrefixTrie, padded_batches, tree_attention_reason

    wall = time.perf_counter()

    torch.set_num_threads(args.threads)
    model, model_name = load_model(args.model)
    reason = tree_attention_reason(model)
    if reason is not None:
        sys.exit(f"{model_name} cannot run tree attention exactly: {reason}")
    vocab = model.config.vocab_size
    print(f"model {model_name} ({model.config._attn_implementation} attention), threads {args.threads}; "
          f"group {args.group} + {args.branches} branch(es) forked after {args.shared_turns} turns; prompt "
          f"{args.prompt_len}, policy turn {args.policy_len}, tool result {args.tool_len} tokens; one sample per "
          f"turn; forwards of <= {args.budget} padded tokens; {args.repeats} repeats, median")

    gen = torch.Generator().manual_seed(args.seed)
    warm, warm_scored = make_samples(args, 1, vocab)
    warm_adv = torch.randn(len(warm), generator=gen).tolist()
    timed(run_tree, model, warm, warm_scored, warm_adv, args.budget)
    timed(run_separate, model, warm, warm_scored, warm_adv, args.budget)

    print(f"{'turns':>5} {'samples':>7} {'tokens':>7} {'trie':>6} {'bound':>6} {'rows':>4} {'batches':>7} "
          f"{'padded':>7} {'separate tok/s':>14} {'tree tok/s':>10} {'ratio':>6} {'max|dlogp|':>10}")
    results = []
    for turns in args.turns:
        samples, scored = make_samples(args, turns, vocab)
        advantage = torch.randn(len(samples), generator=gen).tolist()
        trie = PrefixTrie.build(samples)
        times = {"tree": [], "separate": []}
        gap, rows = 0.0, 0
        for rep in range(args.repeats):
            t_sep, sep_logp = timed(run_separate, model, samples, scored, advantage, args.budget)
            t_tree, tree_out = timed(run_tree, model, samples, scored, advantage, args.budget)
            times["separate"].append(t_sep)
            times["tree"].append(t_tree)
            if rep == 0:
                rows = tree_out.rows
                gap = max(float((a.detach() - b).abs().max()) for a, b in zip(tree_out.logp, sep_logp) if b.numel())
        med = {side: statistics.median(t) for side, t in times.items()}
        lengths = [len(s) for s in samples]
        layout = padded_batches(lengths, args.budget)
        batches, padded = len(layout), sum(len(b) * lengths[b[0]] for b in layout)
        tokens = trie.num_tokens
        ratio = med["separate"] / med["tree"]
        results.append((turns, ratio, trie.bound))
        print(f"{turns:5d} {len(samples):7d} {tokens:7d} {trie.num_nodes:6d} {trie.bound:6.2f} {rows:4d} {batches:7d} {padded:7d} "
              f"{tokens / med['separate']:14.1f} {tokens / med['tree']:10.1f} {ratio:5.2f}x {gap:10.2e}")
    for turns, ratio, bound in results:
        if turns == 8:
            print(f"speed ratio tree/separate at 8 turns: {ratio:.2f}x (bound {bound:.2f}x; goal >= 5x): "
                  f"{'met' if ratio >= 5 else 'not met'}")
    print(f"bench wall time {time.perf_counter() - wall:.0f} s")


if __name__ == "__main__":
    main()
