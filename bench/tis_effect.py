"""What truncated importance sampling (``rl.tis_cap``, issue #33 item 5) does to learning when the
rollout engine's log-probs differ from the trainer's: the tiny profile's RL stage (or
``--profile``) from a finished home's DPO model, with a ``serve-model`` engine sampling in bf16
beside an fp32 trainer (on CPU as a bf16 inference engine beside fp32 training on a GPU), run
with TIS off and on, and with an fp32 engine as the no-mismatch reference, over ``--seeds``.

Prints, per run: the mean train/inference log-prob gap per step, TIS's mean weight and truncated
fraction, and held-out pass@1; then the mean over seeds and ``TIS on - off``.

    .venv/bin/python bench/tis_effect.py --home <a finished tiny home> [--steps 120] [--cap 2] [--seeds 0 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from async_rl import copy_home, rl_run


def mean_of(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if key in r]
    return statistics.mean(values) if values else float("nan")


def main() -> None:
    from learning_curve import heldout_pass1

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", type=Path, required=True, help="a finished pipeline home (copied, not changed)")
    ap.add_argument("--profile", default="tiny")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--cap", type=float, default=2.0, help="rl.tis_cap of the TIS run")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = ap.parse_args()
    runs = {"fp32 engine": ({"dtype": "float32"}, {}), "bf16 engine": ({"dtype": "bfloat16"}, {}),
            "bf16 engine + TIS": ({"dtype": "bfloat16"}, {"tis_cap": args.cap})}
    results: dict[str, list[float]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory(prefix="bench-tis-") as tmp:
        home = Path(tmp)
        copy_home(args.home, home)
        os.environ["POSTTRAIN_HOME"] = tmp
        for seed in args.seeds:
            for name, (engine, rl) in runs.items():
                slug = name.replace(" ", "-").replace("+", "").replace("--", "-")
                r = rl_run(home, args.profile, f"{slug}-{seed}", args.steps, 1, {"max_staleness": 0, **engine}, rl,
                           seed=seed)
                pass1 = heldout_pass1(r["path"], home, args.profile)
                results[name].append(pass1)
                rec = r["records"]
                print(f"seed {seed} {name:18s}: log-prob gap {mean_of(rec, 'train_infer_logprob_gap'):.4f}, "
                      f"TIS weight {mean_of(rec, 'tis_weight_mean'):.4f}, truncated "
                      f"{mean_of(rec, 'tis_truncated_fraction'):.4f}, reward {mean_of(rec, 'reward_mean'):.3f}, "
                      f"held-out pass@1 {pass1:.3f} ({r['seconds']:.0f} s)", flush=True)
    print(f"\nheld-out pass@1 over seeds {args.seeds} ({args.steps} RL steps each):")
    for name, values in results.items():
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        print(f"  {name:18s} {statistics.mean(values):.3f} ± {sd:.3f}")
    diff = statistics.mean(results["bf16 engine + TIS"]) - statistics.mean(results["bf16 engine"])
    print(f"TIS on - off (bf16 engine): {diff:+.3f}")


if __name__ == "__main__":
    main()
