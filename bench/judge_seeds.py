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
PLATEAU_END = 400


def plateau_exit(losses: list[float], drop: float = 0.75) -> int | None:
    """First step whose trailing mean loss is below ``drop`` x the plateau's: the jump from
    guessing the grade to reading it. The plateau is the lowest trailing mean of steps 100-400
    (the loss settles onto it at a pace that follows the lr; its first 100 steps learn the format)."""
    if len(losses) < PLATEAU_END + PLATEAU_WINDOW:
        return None
    plateau = min(statistics.mean(losses[end - PLATEAU_WINDOW:end]) for end in range(100 + PLATEAU_WINDOW, PLATEAU_END + 1))
    for end in range(PLATEAU_END + PLATEAU_WINDOW, len(losses) + 1):
        if statistics.mean(losses[end - PLATEAU_WINDOW:end]) < drop * plateau:
            return end
    return None


def rebuild_judge_data(home: Path, overrides: dict) -> None:
    """``judge_data`` built again with the profile's settings plus ``data.*`` overrides (the
    profile's seed: the examples are the pipeline's, only the training seed varies)."""
    import polars as pl
    from transformers import AutoTokenizer

    from tasks.profile import load_profile
    from tasks.train.config import TrainConfig
    from tasks.train.data import write_training_tables
    from warehouse import Warehouse

    wh = Warehouse(home)
    base = wh.read("models").filter(pl.col("stage") == "judge").row(-1, named=True)["init_model"]
    cfg = TrainConfig(**_merged(load_profile("tiny").section("train", TrainConfig).model_dump(), overrides))
    write_training_tables(wh, cfg, AutoTokenizer.from_pretrained(base), tables=["judge_data"])
    print(f"judge_data rebuilt with {overrides['data']}: {wh.read('judge_data').height} examples")


def reshaped_base(home: Path, overrides: dict) -> str:
    """A base model of the profile's ``model.yaml`` plus ``overrides`` (``hybrid.*`` sizes), built
    with the pipeline's tokenizer and seed under the copied home: the judge stage started from
    another shape than the policy's."""
    import polars as pl
    from transformers import AutoTokenizer

    from model import ModelSection, build_tiny_model
    from tasks.profile import load_profile
    from warehouse import Warehouse

    wh = Warehouse(home)
    base = wh.read("models").filter(pl.col("stage") == "judge").row(-1, named=True)["init_model"]
    profile = load_profile("tiny")
    section = ModelSection(**_merged(profile.raw("model"), overrides))
    out = home / "models" / "bench-judge-base"
    tokenizer = AutoTokenizer.from_pretrained(base)
    build_tiny_model(tokenizer, section, seed=profile.core.seed).save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"judge base model reshaped with {overrides}")
    return str(out)


def train_judge(home: Path, seed: int, overrides: dict, init_model: str | None = None) -> tuple[str, list[float], float]:
    """(model path, per-step loss, seconds) of the judge stage trained with this seed (from the
    pipeline's base model, or ``init_model``)."""
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
    job = StageJob(stage="judge", home=str(home), run_name=tag, profile="tiny", init_model=init_model or judge_row["init_model"],
                   data_ref=str(wh.latest("judge_data")), config=cfg.model_dump(), fingerprint=tag)
    t0 = time.time()
    result = execute_stage(job)
    # the response's own loss (a prompt loss, when set, falls from the first step and would hide the plateau)
    losses = [r.get("response_loss", r["loss"]) for r in StageHarness(job).steps.records()]
    return result["path"], losses, time.time() - t0


def grade_items(home: Path, per_task: int | None):
    """The held-out grade items: the pipeline's own ``judge_benchmark`` (``per_task`` None), or
    ``per_task`` fresh held-out items per family, built as the references flow builds them (the
    pipeline's 20 per family leave a standard error near 0.06 on one seed's accuracy)."""
    import polars as pl

    from data_specs import get_spec
    from tasks.genrm.config import ReferencesConfig
    from tasks.genrm.validation import synthetic_benchmark_items
    from tasks.profile import load_profile
    from warehouse import Warehouse

    wh = Warehouse(home)
    if per_task is None:
        return wh.read("judge_benchmark").filter(pl.col("kind") == "grade")
    v = load_profile("tiny").section("references", ReferencesConfig).validation
    training_ids = set(wh.read("synthetic_tasks")["id"].cast(pl.Utf8).to_list())
    items = synthetic_benchmark_items(v.synthetic_tasks, per_task, v.synthetic_levels, v.seed, training_ids,
                                      v.synthetic_max_draws, ["grade"])
    spec = get_spec("judge_benchmark")
    return spec.conform(pl.DataFrame(items, schema=spec.schema))


def references_judge(model_path: str):
    """The references flow's judge (the profile's sampling and consistency), with this model."""
    from tasks.genrm.config import ReferencesConfig
    from tasks.genrm.judge import GenRMJudge
    from tasks.profile import load_profile
    from tasks.rollout.factory import make_backend

    cfg = load_profile("tiny").section("references", ReferencesConfig)
    rollout = cfg.judge.rollout.model_copy(update={"model": model_path})
    return GenRMJudge(make_backend(rollout), cfg.judge.model_copy(update={"rollout": rollout}), seed=cfg.seed)


def grade_accuracy(model_path: str, items) -> dict[str, float]:
    """The references flow's judge on held-out grade items, with this model."""
    from tasks.genrm.validation import judge_accuracy

    return judge_accuracy(references_judge(model_path), items, run_id=None).metrics


def tournament_parseable(home: Path, model_path: str) -> float:
    """Share of the judge's samples the parser reads on the pipeline's reference tournaments:
    every pair of each open prompt's candidates (the stored answer against the policy's samples),
    both orders, as the Swiss rounds ask them. Open prompts are outside the judge's training
    data, which is where a judge that learned to continue text instead of answering shows it."""
    import itertools

    import polars as pl

    from tasks.genrm.judge import PairRequest
    from warehouse import Warehouse

    wh = Warehouse(home)
    tournaments = wh.read("tournaments")
    prompts = {r["id"]: r["prompt"] for table in ("sft_pool", "prompts")
               for r in wh.read(table).filter(pl.col("id").is_in(tournaments["prompt_id"].unique().to_list()))
               .select("id", "prompt").iter_rows(named=True)}
    requests = [PairRequest(prompts[pid], a, b)
                for (pid,), group in tournaments.group_by("prompt_id", maintain_order=True)
                for a, b in itertools.combinations(group["text"].to_list(), 2)]
    samples = [s for d in references_judge(model_path).compare(requests) for s in d.samples]
    return sum(s.parsed.status == "ok" for s in samples) / max(1, len(samples))


def main() -> None:
    from tasks.genrm.validation import judge_table

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", type=Path, required=True, help="a finished tiny pipeline home (copied, not changed)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--train", action="append", default=[], metavar="KEY=VALUE",
                    help="train-section overrides, e.g. judge.steps=1200, judge.lr=0.003, judge.prefix_shared=false")
    ap.add_argument("--model", action="append", default=[], metavar="KEY=VALUE",
                    help="start the judge from a base model of another shape, e.g. hybrid.softmax_attention_every=1")
    ap.add_argument("--items", type=int, default=None, metavar="N",
                    help="score on N fresh held-out grade items per family instead of the pipeline's judge_benchmark")
    args = ap.parse_args()
    overrides = rl_overrides(args.train)
    with tempfile.TemporaryDirectory(prefix="bench-judge-") as tmp:
        home = Path(tmp)
        os.environ["POSTTRAIN_HOME"] = tmp
        shutil.copytree(args.home, home, dirs_exist_ok=True, ignore=shutil.ignore_patterns("prefect", "checkpoints"))
        shutil.copytree(args.home / "models", home / "models", dirs_exist_ok=True)
        print(f"judge stage over seeds {args.seeds}, settings {overrides or 'as the profile'}")
        if "data" in overrides:
            rebuild_judge_data(home, overrides)
        init_model = reshaped_base(home, rl_overrides(args.model)) if args.model else None
        items = grade_items(home, args.items)
        print(f"{items.height} held-out grade items")
        rows = []
        for seed in args.seeds:
            path, losses, seconds = train_judge(home, seed, overrides, init_model)
            m = grade_accuracy(path, items)
            m["tournament_parseable"] = tournament_parseable(home, path)
            rows.append(m)
            print(f"  seed {seed}: grade accuracy {m['grade_accuracy']:.3f} (p {m['grade_p_vs_chance']:.1e}, "
                  f"unreadable {m['grade_unreadable']:.2f}), tournament verdicts read "
                  f"{m['tournament_parseable']:.2f}, left the plateau at step {plateau_exit(losses)}, "
                  f"final loss {statistics.mean(losses[-PLATEAU_WINDOW:]):.4f}, {seconds:.0f}s", flush=True)
            families = [r for r in judge_table(m) if r["items"] != "all synthetic" and "grade accuracy" in r]
            print("    per family: " + ", ".join(f"{r['items']} {r['grade accuracy']:.2f}" for r in families), flush=True)
        accuracies = [m["grade_accuracy"] for m in rows]
        sd = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
        beat = sum(m["grade_p_vs_chance"] < 0.01 for m in rows)
        print(f"grade accuracy {statistics.mean(accuracies):.3f} ± {sd:.3f}; "
              f"{beat} of {len(rows)} seeds beat chance at p < 0.01")


if __name__ == "__main__":
    main()
