"""Synchronous vs asynchronous RL (issue #33): a profile's RL stage (``--profile``, tiny by
default; smol for SmolLM2) from a finished home's DPO model and RL prompts, run twice with the same steps, prompts and seed, each with a
``serve-model`` rollout engine in its own process and ``--ranks`` DeepSpeed trainer ranks:

- sync: ``rollout_engine.max_staleness: 0``: the engine samples, then the ranks train;
- async: ``max_staleness`` = ``--ahead`` batches x updates_per_batch x epochs_per_batch: the
  engine samples the next batches while the ranks train (``--partial-tokens`` adds partial
  rollouts).

Prints each run's wall seconds, held-out pass@1 (the evaluate stage's held-out items, as
``learning_curve.py`` scores them), the staleness distribution and partial-rollout counts of
the async run, and ``speed ratio async / sync = X.XXx``. Goal: >= 1.5x at held-out pass@1 no
lower than sync - 0.02.

    .venv/bin/python bench/async_rl.py --home <a finished tiny home> [--steps 60] [--ranks 2]
    .venv/bin/python bench/async_rl.py --home <a finished smol home> --profile smol --steps 16
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def rl_run(home: Path, profile: str, name: str, steps: int, ranks: int, engine: dict, rl_settings: dict | None = None,
           seed: int | None = None) -> dict:
    """One RL stage from the home's DPO model with a ``serve-model`` engine (``engine``: its
    settings beside that) and ``rl_settings``; its wall seconds, final model, step records and
    rollouts."""
    import polars as pl

    from tasks.profile import load_profile
    from tasks.train import checkpoint
    from tasks.train.config import TrainConfig
    from tasks.train.harness import StageJob
    from tasks.train.runner import execute_stage
    from warehouse import Warehouse

    wh = Warehouse(home)
    models = wh.read("models").filter(pl.col("stage") == "dpo_long")
    cfg = load_profile(profile).section("train", TrainConfig).model_dump()
    cfg["rl"].update(steps=steps, checkpoint_every=steps, **(rl_settings or {}))
    if seed is not None:
        cfg["seed"] = seed
    cfg["rl"]["rollout_engine"].update(kind="serve-model", threads=1, **engine)
    cfg["engine"].update(num_ranks=ranks, threads_per_rank=1, launcher="torchrun" if ranks > 1 else "process")
    cfg = TrainConfig(**cfg)   # validated as a profile would be
    job = StageJob(stage="rl", home=str(home), run_name=f"bench-rl-{name}", profile=profile,
                   init_model=models["path"][-1], data_ref=str(wh.latest("rl_prompts")), config=cfg.model_dump(),
                   fingerprint=f"bench-rl-{name}-{steps}-{ranks}-{sorted(engine.items())}-{rl_settings}-{seed}")
    shutil.rmtree(job.stage_path, ignore_errors=True)
    started = time.monotonic()
    result = execute_stage(job, timeout_s=3600)
    seconds = time.monotonic() - started
    rollouts = wh.read("rl_rollouts").filter(pl.col("train_run") == job.run_name)
    return {"seconds": seconds, "path": result["path"], "records": checkpoint.StepLog(job.stage_path, False).records(),
            "rollouts": rollouts}


def rl_updates(profile: str) -> int:
    """Optimizer steps one RL step of the profile takes (updates_per_batch x epochs_per_batch)."""
    from tasks.profile import load_profile
    from tasks.train.config import TrainConfig

    rl = load_profile(profile).section("train", TrainConfig).rl
    return rl.updates_per_batch * rl.epochs_per_batch


def copy_home(source: Path, target: Path) -> None:
    """The tables and models of a finished home; its stages' checkpoints stay where they are (the
    DPO model is read from there), so a smol home's gigabytes of optimizer states are not copied."""
    shutil.copytree(source, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("prefect", "checkpoints"))


def breakdown(records: list[dict]) -> str:
    """Where a step's time went on rank 0, mean over steps: waiting for rollouts, scoring them,
    the update, pushing weights, all of it."""
    def mean(key: str) -> float:
        values = [r.get(key, 0.0) for r in records]
        return sum(values) / max(1, len(values))
    push = records[-1].get("engine_sync_seconds", 0.0) / max(1, len(records))
    return (f"rollouts {mean('sampling_seconds'):.3f} s, scoring {mean('scoring_seconds'):.3f} s, "
            f"update {mean('update_seconds'):.3f} s, push {push:.3f} s, step {mean('step_seconds'):.3f} s")


def main() -> None:
    from learning_curve import heldout_pass1

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", type=Path, required=True, help="a finished pipeline home (copied, not changed)")
    ap.add_argument("--profile", default="tiny", help="the profile the home was made with (its RL and evaluate settings)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--ahead", type=int, default=1, help="batches the async engine samples ahead")
    ap.add_argument("--partial-tokens", type=int, default=None,
                    help="async partial rollouts: tokens sampled with the weights a batch began under")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-async-rl-") as tmp:
        home = Path(tmp)
        copy_home(args.home, home)
        os.environ["POSTTRAIN_HOME"] = tmp
        runs, per_batch = {}, rl_updates(args.profile)
        engines = {"sync": {"max_staleness": 0},
                   "async": {"max_staleness": args.ahead * per_batch, "partial_rollout_tokens": args.partial_tokens}}
        for mode in ("sync", "async"):
            runs[mode] = rl_run(home, args.profile, mode, args.steps, args.ranks, engines[mode])
            runs[mode]["pass1"] = heldout_pass1(runs[mode]["path"], home, args.profile)
            r = runs[mode]
            print(f"{mode:5s}: {r['seconds']:7.1f} s for {args.steps} steps ({args.ranks} ranks + 1 engine process), "
                  f"held-out pass@1 {r['pass1']:.3f}; per step (rank 0, mean): {breakdown(r['records'])}", flush=True)
    rollouts = runs["async"]["rollouts"]
    staleness = rollouts["staleness"].value_counts().sort("staleness")
    print("async staleness (optimizer steps behind the trained weights): "
          + ", ".join(f"{s}: {n} samples" for s, n in staleness.iter_rows()))
    partial = rollouts["version_boundary"].is_not_null().sum()
    print(f"async partial rollouts: {partial} of {rollouts.height} samples went on under the next weights")
    sync, fast = runs["sync"], runs["async"]
    print(f"held-out pass@1: sync {sync['pass1']:.3f}, async {fast['pass1']:.3f} "
          f"(async - sync = {fast['pass1'] - sync['pass1']:+.3f}; goal >= -0.02)")
    print(f"speed ratio async / sync = {sync['seconds'] / fast['seconds']:.2f}x (goal >= 1.5x)")


if __name__ == "__main__":
    main()
