"""Steps to reach a fixed reward: CISPO against GRPO, same task, model and settings, 3 seeds.

The task is trivially learnable (reward 1 when the response starts with a token id in a
fixed quarter of the vocabulary), the model the in-house tiny hybrid, and each batch gets
several off-policy updates, which is where the two objectives differ: GRPO's PPO clip
drops the gradient of tokens whose ratio left the trust region, CISPO keeps it with a
clipped weight. Prints steps-to-target per seed and the mean ratio GRPO/CISPO (> 1 means
CISPO got there in fewer steps). Runs in a temporary POSTTRAIN_HOME.

    .venv/bin/python bench/cispo_vs_grpo.py [--seeds 0 1 2 --target 0.6 --max-steps 20]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TASKS = ["object_counting", "boolean_expressions", "web_of_lies", "operation"]
MODEL = {"tokenizer_vocab_size": 320, "hybrid": {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "softmax_attention_every": 2, "max_position_embeddings": 512,
    "lightning_chunk_size": 32, "num_experts": 0}}


def first_token_reward(row, text, token_ids):
    return 1.0 if token_ids and token_ids[0] % 4 == 0 else 0.0


def prepare(home: Path):
    """Warehouse with synthetic tasks, the cached small base model, and rl_prompts."""
    import polars as pl

    from tasks.synthesize import generate_task_instances
    from tasks.train.base_model import prepare_base_model
    from tasks.train.config import TrainConfig
    from tasks.train.data import Sources, build_rl_prompts
    from warehouse import Warehouse

    wh = Warehouse(home)
    rows = []
    for name in TASKS:
        rows += generate_task_instances(name, [0], 12, 0, 3, "configured")["rows"]
    wh.write("synthetic_tasks", pl.DataFrame(rows))
    # no difficulty stage in this bench: RL-side prompts train undecided
    cfg = TrainConfig(base_model={"kind": "hybrid", "name": "bench-base", "tokenizer_texts": 200},
                      data={"rl_requires_difficulty": False})
    base = prepare_base_model(wh, cfg.base_model, MODEL)
    frame, parents, _ = build_rl_prompts(Sources(wh, "rl_prompts"), cfg)
    ref = wh.write("rl_prompts", frame, parents=parents)
    return wh, str(base), str(ref)


def run(wh, base: str, data_ref: str, loss: str, seed: int, args) -> list[float]:
    from tasks.train.config import TrainConfig
    from tasks.train.harness import StageHarness, StageJob
    from tasks.train.rl import train_rl

    cfg = TrainConfig(
        seed=seed, optimizer={"lr": args.lr},
        engine={"zero_stage": 0, "precision": "fp32", "micro_batch_size": 2},
        rl={"steps": args.max_steps, "checkpoint_every": 10**6, "loss": loss, "prompts_per_step": 4,
            "group_size": 8, "updates_per_batch": args.updates, "eps_low": 0.2 if loss == "grpo" else 1.0,
            "windows": [{"max_tokens": 2, "eps_high": 0.2, "gradient_clipping": 1.0}],
            "curriculum": [{"start_step": 0, "domains": {"logic": 1.0}}],
            "repetition_window": None, "max_sampling_rounds": 2})
    job = StageJob(stage="rl", home=str(wh.home), run_name=f"bench-{loss}-{seed}", profile="bench",
                   init_model=base, data_ref=data_ref, config=cfg.model_dump(), fingerprint=f"{loss}-{seed}")
    harness = StageHarness(job)
    train_rl(harness, reward_fn=first_token_reward)
    return [r["reward_mean"] for r in harness.steps.records()]


def steps_to(curve: list[float], target: float, window: int = 2) -> int | None:
    """First step (1-based) at which the mean reward of the last ``window`` steps reaches target."""
    for i in range(window - 1, len(curve)):
        if sum(curve[i - window + 1: i + 1]) / window >= target:
            return i + 1
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--target", type=float, default=0.6)
    ap.add_argument("--max-steps", type=int, default=20)
    ap.add_argument("--updates", type=int, default=4, help="off-policy updates per generation batch")
    ap.add_argument("--lr", type=float, default=1e-2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-cispo-") as tmp:
        os.environ["POSTTRAIN_HOME"] = tmp
        wh, base, data_ref = prepare(Path(tmp))
        results: dict[str, list[int]] = {"cispo": [], "grpo": []}
        for seed in args.seeds:
            for loss in ("cispo", "grpo"):
                start = time.time()
                curve = run(wh, base, data_ref, loss, seed, args)
                reached = steps_to(curve, args.target)
                # not reached: counted as max_steps + 1 (a lower bound on the true cost)
                results[loss].append(reached if reached is not None else args.max_steps + 1)
                print(f"seed {seed} {loss:5s}: steps to reward {args.target}: "
                      f"{reached if reached is not None else f'> {args.max_steps}'}  "
                      f"({time.time() - start:.0f}s)  curve {[round(r, 2) for r in curve]}", flush=True)
    mean = {k: sum(v) / len(v) for k, v in results.items()}
    print(f"mean steps: cispo {mean['cispo']:.1f}, grpo {mean['grpo']:.1f}; "
          f"ratio grpo/cispo: {mean['grpo'] / mean['cispo']:.2f}x (> 1: CISPO faster)")


if __name__ == "__main__":
    main()
