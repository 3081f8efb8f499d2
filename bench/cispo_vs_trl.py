"""One CISPO update: posttrain (DeepSpeed engine, fused FP32 log-probs) vs TRL's GRPOTrainer
with ``loss_type="cispo"``, same model, same stored batch of rollouts, in one run.

Both sides get identical inputs: the hybrid model built from the same seed, a batch of
rollouts (prompt + completion token ids, rewards, behaviour log-probs) written once to
``<out>/rollouts.parquet``. Each side runs in its own subprocess so its peak memory
(max RSS on CPU, max allocated on CUDA) is its own. Prints tokens/s of each, their ratio
(target >= 1.3x) and the memory ratio (target <= 1.0).

    .venv/bin/python bench/cispo_vs_trl.py [--vocab 16384 --hidden 128 --layers 2 --groups 2 --group-size 8]
Defaults are sized for 2 CPU cores; on a GPU pass a larger vocabulary and model.
TRL is in the ``bench`` extra (``pip install trl``).
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "2")

from sides import print_peers, report, run_side


def build_model(args):
    import torch

    from model.config import HybridConfig
    from model.hybrid import HybridForCausalLM

    config = HybridConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                          num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                          softmax_attention_every=args.layers, max_position_embeddings=4096,
                          lightning_chunk_size=64, num_experts=0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return HybridForCausalLM(config)


def make_rollouts(args, path: Path) -> None:
    """A seeded batch: prompts, completions of varied length, 0/1 rewards, behaviour log-probs."""
    import polars as pl
    import torch

    from model.logprobs import token_logprobs

    g = torch.Generator().manual_seed(0)
    model = build_model(args).eval()
    rows = []
    n = args.groups * args.group_size
    for i in range(n):
        prompt = torch.randint(3, args.vocab, (args.prompt_len,), generator=g).tolist()
        length = int(torch.randint(args.completion_len // 2, args.completion_len + 1, (1,), generator=g))
        completion = torch.randint(3, args.vocab, (length,), generator=g).tolist()
        rows.append({"group": i // args.group_size, "prompt_ids": prompt, "completion_ids": completion,
                     "reward": float(torch.rand(1, generator=g) < 0.5)})
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
            logp, _, _ = token_logprobs(model, ids)
            r["old_logps"] = logp[0, len(r["prompt_ids"]) - 1:].tolist()
    pl.DataFrame(rows).write_parquet(path)


def load_batch(path: Path, group_size: int):
    """Left-padded prompts, right-padded completions (TRL's layout), advantages, old log-probs."""
    import polars as pl
    import torch

    from model.losses import group_advantages

    df = pl.read_parquet(path)
    n, p_len = df.height, max(len(x) for x in df["prompt_ids"])
    c_len = max(len(x) for x in df["completion_ids"])
    prompt_ids = torch.zeros(n, p_len, dtype=torch.long)
    prompt_mask = torch.zeros(n, p_len, dtype=torch.long)
    completion_ids = torch.zeros(n, c_len, dtype=torch.long)
    completion_mask = torch.zeros(n, c_len, dtype=torch.long)
    old = torch.zeros(n, c_len)
    for i, r in enumerate(df.iter_rows(named=True)):
        p, c = r["prompt_ids"], r["completion_ids"]
        prompt_ids[i, p_len - len(p):] = torch.tensor(p)
        prompt_mask[i, p_len - len(p):] = 1
        completion_ids[i, :len(c)] = torch.tensor(c)
        completion_mask[i, :len(c)] = 1
        old[i, :len(c)] = torch.tensor(r["old_logps"])
    advantages = group_advantages(torch.tensor(df["reward"].to_list()), group_size)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": advantages, "old_per_token_logps": old,
            "tokens": int(completion_mask.sum())}


def _peak_mb(baseline_kb: int) -> float:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline_kb) / 1024


def run_posttrain(args, batch) -> dict:
    import torch

    from model.logprobs import token_logprobs
    from model.losses import cispo_loss
    from tasks.train.config import EngineConfig, OptimizerConfig
    from tasks.train.engine import backward_and_step, create_engine

    model = build_model(args).train()
    engine, _ = create_engine(model, EngineConfig(zero_stage=0, precision="fp32", micro_batch_size=1,
                                                  gradient_clipping=1.0, threads_per_rank=None),
                              OptimizerConfig(lr=1e-6), lr=1e-6, total_steps=100)
    # our layout: prompt then completion, right padded; the completion's log-probs start at p_len - 1
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    p_len = batch["prompt_ids"].shape[1]

    def update():
        logp, _, _ = token_logprobs(engine.module, ids, mask)
        logp = logp[:, p_len - 1:]
        loss, _ = cispo_loss(logp, batch["old_per_token_logps"], batch["advantages"], batch["completion_mask"],
                             eps_low=1.0, eps_high=args.eps_high, group_size=args.group_size)
        backward_and_step(engine, loss)

    return _time(update, args.repeats)


class BackboneOutputs(torch_nn_module := __import__("torch").nn.Module):
    """The hybrid backbone returns a tuple; TRL's fused LM head reads ``.last_hidden_state``.
    Same weights and compute, only the return type is adapted."""

    def __init__(self, backbone):
        super().__init__()
        self.inner = backbone
        self.embed_tokens = backbone.embed_tokens  # shared module, for get_input_embeddings

    def forward(self, input_ids=None, attention_mask=None, use_cache=None, **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPast

        hidden, _, _ = self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return BaseModelOutputWithPast(last_hidden_state=hidden)


def run_trl(args, batch) -> dict:
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    model = build_model(args).train()
    model.model = BackboneOutputs(model.model)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<bos>": 1, "<eos>": 2, "x": 3},
                                                                              unk_token="x")),
                                  pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(output_dir=out, loss_type="cispo", epsilon_high=1 + args.eps_high, beta=0.0,
                            per_device_train_batch_size=args.groups * args.group_size,
                            num_generations=args.group_size, use_cpu=True, report_to=[], bf16=False,
                            learning_rate=1e-6, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-15,
                            max_grad_norm=1.0, logging_steps=10**6, save_strategy="no")
        trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                              args=config, train_dataset=Dataset.from_dict({"prompt": ["x"] * 8}),
                              processing_class=tok)
        trainer.create_optimizer()
        # set by Trainer's training loop, which this single update bypasses
        trainer.current_gradient_accumulation_steps = 1
        inputs = {k: v for k, v in batch.items() if k != "tokens"}
        # TRL normalizes CISPO by the token count of the whole generation batch
        inputs["num_items_in_batch"] = batch["completion_mask"].sum().float()

        def update():
            loss = trainer.compute_loss(trainer.model, inputs)
            loss.backward()
            import torch
            torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), 1.0)
            trainer.optimizer.step()
            trainer.optimizer.zero_grad()

        return _time(update, args.repeats)


def _time(update, repeats: int) -> dict:
    update()  # warm-up: allocator, first-call paths
    start = time.perf_counter()
    for _ in range(repeats):
        update()
    return {"seconds_per_update": (time.perf_counter() - start) / repeats}


def side_main(args) -> None:
    # libraries are imported before the baseline, so peak memory counts the update only
    if args.side == "trl":
        import datasets  # noqa: F401
        import trl  # noqa: F401
    else:
        import deepspeed  # noqa: F401
    batch = load_batch(Path(args.rollouts), args.group_size)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = (run_posttrain if args.side == "posttrain" else run_trl)(args, batch)
    result.update(tokens=batch["tokens"], tokens_per_s=batch["tokens"] / result["seconds_per_update"],
                  peak_mb=_peak_mb(baseline))
    report(result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--completion-len", type=int, default=128)
    ap.add_argument("--eps-high", type=float, default=0.2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--side", choices=("posttrain", "trl"), help=argparse.SUPPRESS)
    ap.add_argument("--rollouts", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.side:   # the parent: which peer versions these figures come from
        print_peers("trl", "transformers", "torch")
    if args.side:
        side_main(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        rollouts = Path(tmp) / "rollouts.parquet"
        make_rollouts(args, rollouts)
        results = {side: run_side(__file__, side, ["--rollouts", str(rollouts)]) for side in ("posttrain", "trl")}
    ours, trl = results["posttrain"], results["trl"]
    print(f"batch: {args.groups} groups x {args.group_size}, {ours['tokens']} completion tokens, "
          f"vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers")
    for name, r in results.items():
        print(f"{name:10s} {r['tokens_per_s']:10.1f} tokens/s   {r['seconds_per_update']:.3f} s/update   "
              f"peak {r['peak_mb']:.0f} MB")
    print(f"speed ratio posttrain/trl: {ours['tokens_per_s'] / trl['tokens_per_s']:.2f}x (target >= 1.3x)")
    print(f"memory ratio posttrain/trl: {ours['peak_mb'] / max(trl['peak_mb'], 1e-9):.2f} (target <= 1.0)")


if __name__ == "__main__":
    main()
