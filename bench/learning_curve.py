"""What the tiny pipeline's training does, over seeds: held-out pass@1 per stage, mean ± sd,
and CISPO against GRPO in steps to a fixed held-out pass@1 on the same task mix.

1. The whole tiny pipeline once (ingest, curate, synthesize, ...), then its training
   stages again for every further seed (``POSTTRAIN__TRAIN__SEED``: model init, data order,
   RL sampling): difficulty re-bands with each seed's DPO model, evaluate adds its ladder.
   Prints base / SFT / DPO / RL held-out pass@1 per family as mean ± sd over the seeds.
2. From each seed's DPO model and RL prompts, RL with ``loss: cispo`` and ``loss: grpo``
   (GRPO with PPO's two-sided clip, eps_low 0.2), everything else equal. The learning rate
   is held constant and one run per loss and seed saves a checkpoint at every
   ``--checkpoints`` step count, each evaluated on the held-out items. Prints the curves
   (mean ± sd over seeds), the steps each loss needs to reach ``--target`` and the ratio
   CISPO/GRPO (paper: about 0.5). ``--rl KEY=VALUE`` sets the RL regime of both, e.g.
   ``epochs_per_batch=4`` (PPO epochs: the regime where PPO's clip drops tokens' gradients
   after the first pass and CISPO's clipped weight keeps them).

    .venv/bin/python bench/learning_curve.py [--seeds 0 1 2] [--checkpoints 10 20 40 60]
    .venv/bin/python bench/learning_curve.py --home .posttrain --target 0.6 --rl epochs_per_batch=4
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

STAGES = ("base", "sft_long", "dpo_long", "rl")
TRAINING = ["sft_short", "sft_long", "dpo_short", "dpo_long", "difficulty", "rl", "evaluate"]


def run_seed(home: Path, seed: int, first: bool) -> dict:
    """The pipeline (all of it for the first seed, its training part after) with this train seed."""
    from flows.pipeline import pipeline_flow

    os.environ["POSTTRAIN__TRAIN__SEED"] = str(seed)
    try:
        return pipeline_flow(profile="tiny", home=str(home), stages=None if first else TRAINING)
    finally:
        os.environ.pop("POSTTRAIN__TRAIN__SEED", None)


def heldout_pass1(model_path: str, home: Path, profile_name: str = "tiny") -> float:
    """Mean held-out pass@1 over the profile's held-out families (evaluate's items, sampling and verifiers)."""
    from tasks.evaluate import (
        EvaluateConfig,
        evaluate_items,
        heldout_synthetic_items,
        training_instance_ids,
    )
    from tasks.profile import load_profile
    from tasks.rollout.config import RolloutConfig
    from tasks.rollout.factory import make_backend
    from warehouse import Warehouse

    profile = load_profile(profile_name)
    cfg = profile.section("evaluate", EvaluateConfig)
    rollout = profile.section("rollout", RolloutConfig)
    items = heldout_synthetic_items(cfg.synthetic, training_instance_ids(Warehouse(home))).items
    backend = make_backend(rollout.model_copy(update={"model": model_path}))
    results = evaluate_items(items, backend, cfg)
    by_family: dict[str, list[float]] = {}
    for r in results:
        by_family.setdefault(r.item.benchmark, []).append(r.correct / r.n)
    return statistics.mean(statistics.mean(v) for v in by_family.values())


def rl_overrides(pairs: list[str]) -> dict:
    """``--rl updates_per_batch=8 --rl rollout_engine.max_staleness=4`` as a nested dict."""
    import yaml

    out: dict = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--rl {pair!r}: expected KEY=VALUE")
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return out


def _merged(base: dict, extra: dict) -> dict:
    return {k: _merged(base.get(k) or {}, v) if isinstance(v, dict) else v for k, v in extra.items()} | \
        {k: v for k, v in base.items() if k not in extra}


def checkpoint_model(stage_path: Path, steps: int, like: str, out: Path) -> str:
    """The policy after ``steps`` RL steps as a Hugging Face directory: the DeepSpeed
    checkpoint's module weights loaded into the architecture (and tokenizer) of ``like``."""
    import torch

    from model.loading import load_causal_lm

    model, tokenizer = load_causal_lm(like)
    states = torch.load(stage_path / "ds" / f"step_{steps:08d}" / "mp_rank_00_model_states.pt",
                        map_location="cpu", weights_only=False)
    model.load_state_dict(states["module"])
    target = out / f"step_{steps:08d}"
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return str(target)


def rl_curve(home: Path, seed: int, loss: str, checkpoints: list[int],
             overrides: dict | None = None) -> list[tuple[int, float]]:
    """Held-out pass@1 after each number of RL steps, from this seed's DPO model: one run of
    ``max(checkpoints)`` steps whose DeepSpeed checkpoints are evaluated (the learning rate
    is constant, so a checkpoint is exactly what a shorter run would have ended with)."""
    import math

    import polars as pl

    from tasks.profile import load_profile
    from tasks.train.config import TrainConfig
    from tasks.train.harness import StageHarness, StageJob
    from tasks.train.rl import train_rl
    from warehouse import Warehouse

    wh = Warehouse(home)
    models = wh.read("models")
    run_name = models.filter(pl.col("stage") == "dpo_long")["run_name"][-1]
    init = models.filter((pl.col("stage") == "dpo_long") & (pl.col("run_name") == run_name))["path"][-1]
    rl_ref = str(wh.latest("rl_prompts"))
    base = load_profile("tiny").section("train", TrainConfig).model_dump()
    every, last = math.gcd(*checkpoints), max(checkpoints)
    cfg = TrainConfig(**{**base, "seed": seed, "rl": _merged(base["rl"], overrides or {}),
                         "optimizer": {**base["optimizer"], "schedule": "constant", "warmup_steps": 0}})
    cfg.rl.loss, cfg.rl.steps = loss, last
    cfg.rl.checkpoint_every, cfg.rl.keep_checkpoints = every, last // every + 1
    if "eps_low" not in (overrides or {}):   # each loss's own default unless --rl eps_low= sets it
        cfg.rl.eps_low = 0.2 if loss == "grpo" else 1.0
    tag = f"{loss}-{seed}-{last}-" + "-".join(f"{k}={v}" for k, v in sorted(_flat(overrides or {}).items()))
    job = StageJob(stage="rl", home=str(home), run_name=f"bench-{tag}", profile="tiny", init_model=init,
                   data_ref=rl_ref, config=cfg.model_dump(), fingerprint=tag)
    result = train_rl(StageHarness(job))
    stage_path = StageHarness(job).path
    records = StageHarness(job).steps.records()
    curve, done = [], 0
    with tempfile.TemporaryDirectory(prefix="bench-rl-ckpt-") as out:
        for steps in sorted(checkpoints):
            path = result["path"] if steps == last else checkpoint_model(stage_path, steps, result["path"], Path(out))
            curve.append((steps, heldout_pass1(path, home)))
            window = [r for r in records if done <= r["step"] < steps and "clip_fraction" in r]
            clipped = statistics.mean(r["clip_fraction"] for r in window) if window else float("nan")
            last_pass = [r["last_epoch_clip_fraction"] for r in window if "last_epoch_clip_fraction" in r]
            extra = f", last pass {statistics.mean(last_pass):.4f}" if last_pass else ""
            print(f"  seed {seed} {loss:5s} {steps:3d} steps: held-out pass@1 {curve[-1][1]:.3f} "
                  f"(tokens out of the clip band per update, steps {done}-{steps}: {clipped:.4f}{extra})", flush=True)
            done = steps
    return curve


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def steps_to(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((steps for steps, value in curve if value >= target), None)


def fmt(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def compare_losses(home: Path, seeds: list[int], checkpoints: list[int], target: float, overrides: dict,
                   retrain: frozenset[int] = frozenset()) -> None:
    """CISPO and GRPO from each seed's DPO model: the training stages of the seeds in ``retrain``
    run again first, so that the warehouse holds their DPO model and RL prompts; the other
    seeds start from the DPO model the warehouse holds."""
    print(f"\nCISPO vs GRPO: RL steps to held-out pass@1 >= {target:.3f} (checkpoints {checkpoints}, "
          f"RL settings {overrides or 'as the profile'})")
    last = max(checkpoints)
    not_reached = 2 * last   # a lower bound on the steps of a run that never reached the target
    need: dict[str, list[int]] = {"cispo": [], "grpo": []}
    curves: dict[str, list[list[tuple[int, float]]]] = {"cispo": [], "grpo": []}
    for seed in seeds:
        if seed in retrain:
            run_seed(home, seed, first=False)
        for loss in ("cispo", "grpo"):
            curve = rl_curve(home, seed, loss, checkpoints, overrides)
            curves[loss].append(curve)
            reached = steps_to(curve, target)
            need[loss].append(reached if reached is not None else not_reached)
    print(f"\n{'steps':>6s}" + "".join(f"{loss + ' (mean ± sd)':>22s}" for loss in curves))
    for i, steps in enumerate(sorted(checkpoints)):
        print(f"{steps:6d}" + "".join(f"{fmt([c[i][1] for c in curves[loss]]):>22s}" for loss in curves))
    mean = {k: statistics.mean(v) for k, v in need.items()}

    def listed(steps: list[int]) -> str:
        return "[" + ", ".join(f"not by {last} ({s})" if s == not_reached else str(s) for s in steps) + "]"

    print(f"steps to {target:.3f}: cispo {listed(need['cispo'])} (mean {mean['cispo']:.1f}), "
          f"grpo {listed(need['grpo'])} (mean {mean['grpo']:.1f}); a target not reached by the last "
          f"checkpoint counts as {not_reached} steps")
    censored = [loss for loss, v in need.items() if not_reached in v]
    note = f" ({' and '.join(censored)}: a lower bound on its steps)" if censored else ""
    print(f"ratio cispo/grpo: {mean['cispo'] / mean['grpo']:.2f}x{note}  (paper: about 0.5; goal <= 0.6)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--checkpoints", type=int, nargs="+", default=[10, 20, 40, 60],
                    help="RL step counts at which held-out pass@1 is measured (one run per loss and seed)")
    ap.add_argument("--target", type=float, default=None,
                    help="held-out pass@1 to reach (default: DPO's mean + half of RL's mean gain)")
    ap.add_argument("--rl", action="append", default=[], metavar="KEY=VALUE",
                    help="RL settings for the CISPO/GRPO runs, e.g. updates_per_batch=8, epochs_per_batch=4, "
                         "lr=0.001, rollout_engine.kind=serve-model, rollout_engine.max_staleness=4")
    ap.add_argument("--home", type=Path, default=None,
                    help="skip the ladder: compare the losses from a copy of this finished tiny pipeline home "
                         "(its DPO model and RL prompts for every seed; the seeds then vary RL alone); needs --target")
    args = ap.parse_args()
    overrides = rl_overrides(args.rl)
    if args.home is not None and args.target is None:
        raise SystemExit("--home needs --target (there is no ladder over seeds to place it)")
    with tempfile.TemporaryDirectory(prefix="bench-learning-") as tmp:
        home = Path(tmp)
        os.environ["POSTTRAIN_HOME"] = tmp
        if args.home is not None:
            import shutil

            shutil.copytree(args.home, home, dirs_exist_ok=True, ignore=shutil.ignore_patterns("prefect"))
            compare_losses(home, args.seeds, args.checkpoints, args.target, overrides)
            return
        ladders = []
        for i, seed in enumerate(args.seeds):
            t0 = time.time()
            res = run_seed(home, seed, first=i == 0)
            ladders.append(res["evaluate"]["ladder"])
            print(f"seed {seed}: pipeline {time.time() - t0:.0f}s", flush=True)
        families = sorted(b for b in ladders[0] if b.startswith("synthetic_heldout/"))
        print(f"\nheld-out pass@1 (T=1.0, top-p 0.95) over {len(args.seeds)} training seeds, mean ± sd")
        print(f"{'family':34s}" + "".join(f"{s:>18s}" for s in STAGES))
        for fam in families + ["synthetic_heldout"]:
            print(f"{fam:34s}" + "".join(f"{fmt([lad[fam][s] for lad in ladders]):>18s}" for s in STAGES))
        pooled = {s: statistics.mean(lad["synthetic_heldout"][s] for lad in ladders) for s in STAGES}
        target = args.target if args.target is not None else pooled["dpo_long"] + (pooled["rl"] - pooled["dpo_long"]) / 2
        # the last seed's DPO model and RL prompts are in the warehouse; the others' are made again
        compare_losses(home, [args.seeds[-1], *args.seeds[:-1]], args.checkpoints, target, overrides,
                       retrain=frozenset(args.seeds[:-1]))


if __name__ == "__main__":
    main()
