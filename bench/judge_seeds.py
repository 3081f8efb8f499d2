"""How reliably the tiny pipeline's judge stage learns to grade: the judge stage over training
seeds, each scored on the pipeline's held-out judge benchmark, against chance.

The tiny judge (4 layers, 64 wide, from the base model) learns the grade comparison in a jump
after a plateau at chance; whether and when one seed jumps is what this measures, so that a
setting is judged over seeds rather than by the one trajectory the default run follows.
From a copy of a finished tiny pipeline home (its base model, ``judge_data`` and
``judge_benchmark``), for each seed: train the judge stage with the profile's settings plus
``--train KEY=VALUE`` overrides, then grade the benchmark's held-out grade items with the
references profile's judge sampling. Prints per seed the held-out grade accuracy, its
one-sided p-value against guessing, the share of verdicts read, the step where the training
loss first left the chance plateau, and the stage's seconds; then mean ± sd and how many
seeds beat chance at p < 0.01.

    .venv/bin/python bench/judge_seeds.py --home .posttrain --seeds 0 1 2 [--train judge.steps=1200]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
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

from learning_curve import _merged, rl_overrides

PLATEAU_WINDOW = 50


def plateau_exit(losses: list[float], drop: float = 0.75) -> int | None:
    """First step whose trailing mean loss is below ``drop`` x the plateau's (steps 100-200):
    the jump from guessing the grade to reading it."""
    if len(losses) < 200 + PLATEAU_WINDOW:
        return None
    plateau = statistics.mean(losses[100:200])
    for end in range(200 + PLATEAU_WINDOW, len(losses) + 1):
        if statistics.mean(losses[end - PLATEAU_WINDOW:end]) < drop * plateau:
            return end
    return None


def train_judge(home: Path, seed: int, overrides: dict) -> tuple[str, list[float], float]:
    """(model path, per-step loss, seconds) of the judge stage trained with this seed."""
    import polars as pl

    from tasks.profile import load_profile
    from tasks.train.config import TrainConfig
    from tasks.train.harness import StageHarness, StageJob
    from tasks.train.runner import execute_stage
    from warehouse import Warehouse

    wh = Warehouse(home)
    judge_row = wh.read("models").filter(pl.col("stage") == "judge").row(-1, named=True)
    base = load_profile("tiny").section("train", TrainConfig).model_dump()
    cfg = TrainConfig(**_merged({**base, "seed": seed}, overrides))
    tag = f"bench-judge-{seed}-" + "-".join(f"{k}={v}" for k, v in sorted(overrides.get("judge", {}).items()))
    job = StageJob(stage="judge", home=str(home), run_name=tag, profile="tiny", init_model=judge_row["init_model"],
                   data_ref=str(wh.latest("judge_data")), config=cfg.model_dump(), fingerprint=tag)
    t0 = time.time()
    result = execute_stage(job)
    losses = [r["loss"] for r in StageHarness(job).steps.records()]
    return result["path"], losses, time.time() - t0


def grade_accuracy(home: Path, model_path: str) -> dict[str, float]:
    """The references flow's judge on the benchmark's grade items, with this model."""
    import polars as pl

    from tasks.genrm.config import ReferencesConfig
    from tasks.genrm.judge import GenRMJudge
    from tasks.genrm.validation import judge_accuracy
    from tasks.profile import load_profile
    from tasks.rollout.factory import make_backend
    from warehouse import Warehouse

    cfg = load_profile("tiny").section("references", ReferencesConfig)
    rollout = cfg.judge.rollout.model_copy(update={"model": model_path})
    judge = GenRMJudge(make_backend(rollout), cfg.judge.model_copy(update={"rollout": rollout}), seed=cfg.seed)
    bench = Warehouse(home).read("judge_benchmark").filter(pl.col("kind") == "grade")
    return judge_accuracy(judge, bench, run_id=None).metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", type=Path, required=True, help="a finished tiny pipeline home (copied, not changed)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--train", action="append", default=[], metavar="KEY=VALUE",
                    help="train-section overrides, e.g. judge.steps=1200, judge.lr=0.003, judge.prefix_shared=false")
    args = ap.parse_args()
    overrides = rl_overrides(args.train)
    with tempfile.TemporaryDirectory(prefix="bench-judge-") as tmp:
        home = Path(tmp)
        os.environ["POSTTRAIN_HOME"] = tmp
        shutil.copytree(args.home, home, dirs_exist_ok=True, ignore=shutil.ignore_patterns("prefect", "checkpoints"))
        shutil.copytree(args.home / "models", home / "models", dirs_exist_ok=True)
        print(f"judge stage over seeds {args.seeds}, settings {overrides or 'as the profile'}")
        rows = []
        for seed in args.seeds:
            path, losses, seconds = train_judge(home, seed, overrides)
            m = grade_accuracy(home, path)
            rows.append(m)
            print(f"  seed {seed}: grade accuracy {m['grade_accuracy']:.3f} (p {m['grade_p_vs_chance']:.1e}, "
                  f"unreadable {m['grade_unreadable']:.2f}), left the plateau at step {plateau_exit(losses)}, "
                  f"final loss {statistics.mean(losses[-PLATEAU_WINDOW:]):.4f}, {seconds:.0f}s", flush=True)
        accuracies = [m["grade_accuracy"] for m in rows]
        sd = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
        beat = sum(m["grade_p_vs_chance"] < 0.01 for m in rows)
        print(f"grade accuracy {statistics.mean(accuracies):.3f} ± {sd:.3f}; "
              f"{beat} of {len(rows)} seeds beat chance at p < 0.01")


if __name__ == "__main__":
    main()
