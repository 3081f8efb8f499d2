"""The ``sweep`` flow: one training stage of a finished run trained again with other seeds, and
each seed's model scored on the held-out items against the stage it is measured from.

How much a stage adds is one number per run; whether it is the stage's doing or its seed's
shows only across seeds. A sweep takes the newest training run of a home that trained the
stage (``rl`` by default) and, for each seed, trains that stage again from the very model and
data snapshot the run's stage started from, with the run's own settings (its ``job.json``) but
for ``train.seed`` (RL's sampling, curriculum and data order). Each seed's model is registered
in ``models`` as ``<run>~seed<k>/<stage>``; it never becomes the newest model, the model a stage
name means, or the ladder ``evaluate`` scores.

Then one evaluate run scores the stage it is measured from (``against``: the last SFT stage
for RL, so the figure is RL - SFT; else the ladder rung before the stage) and every seed's model
on the same held-out items with the same sampling seeds, and gives each seed's difference a
paired 95% interval. Each seed's training run in MLflow gets that seed's held-out figures under
the names the pipeline's evaluate run uses (``eval.<stage>.<benchmark>.pass_at_1``,
``eval.delta.<stage>_vs_<against>.<benchmark>.{diff,lo,hi}``), so ``posttrain compare`` and
MLflow's compare view put the seeds side by side; the sweep's own run holds the mean and
standard deviation across seeds (``sweep.<benchmark>.diff.{mean,sd,min,max}``) and a plot.
What a sweep writes is marked as its own (``SWEEP_WRITER``): a later ``posttrain run`` neither
redoes a stage for it nor hands it over.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import polars as pl
from prefect import flow

from data_specs.stages import last_of, train_stage
from flows.common import flow_context, flow_logger, report_progress
from flows.evaluate import evaluate_flow
from flows.pipeline import SWEEP_WRITER
from flows.train import _digest, train_stage_task
from tasks import tracking
from tasks.evaluate import HELDOUT_GROUPS, EvaluateConfig, heldout_group
from tasks.heldout_stats import find_interval, intervals_of
from tasks.model_registry import pipeline_models, read_models, refuse_failed_audit, sweep_run_name
from tasks.train.config import TrainConfig
from tasks.train.harness import StageJob
from warehouse import TableRef, Warehouse, recording_writer


def default_against(stage: str, ladder: list[str]) -> str:
    """What a stage's seeds are measured from: the last SFT stage for RL (the recipe's two
    halves), else the ladder rung before the stage."""
    if train_stage(stage).recipe == "rl":
        return last_of("sft")
    before = ladder[:ladder.index(stage)] if stage in ladder else []
    if not before:
        raise ValueError(f"sweep {stage}: no ladder stage before it to measure it from (evaluate.stages "
                         f"{ladder}); name one with `against`")
    return before[-1]


def swept_run(wh: Warehouse, stage: str, against: str, accept_failed_audit: bool = False) -> tuple[dict, str]:
    """The newest training run's ``models`` row of ``stage`` and the checkpoint of ``against``
    in the same run (``base``: the model the run started from)."""
    models = pipeline_models(read_models(wh))
    rows = models.filter(pl.col("stage") == stage) if not models.is_empty() else models
    if rows.is_empty():
        raise LookupError(f"sweep {stage}: no training run of {wh.home} trained stage {stage!r}; "
                          "run the pipeline first (`posttrain run`)")
    row = rows.row(-1, named=True)
    refuse_failed_audit(row, accept_failed_audit)
    run = models.filter(pl.col("run_name") == row["run_name"])
    if against == "base":
        return row, run.row(0, named=True)["init_model"]
    found = run.filter(pl.col("stage") == against)
    if found.is_empty():
        raise LookupError(f"sweep {stage}: run {row['run_name']!r} has no {against!r} model to measure the "
                          f"seeds from (it trained {sorted(set(run['stage']))})")
    refuse_failed_audit(found.row(-1, named=True), accept_failed_audit)
    return row, found["path"][-1]


def stage_settings(row: dict, fallback: TrainConfig) -> tuple[TrainConfig, bool]:
    """The settings the run's stage trained with (its ``job.json``), else ``fallback`` (the
    profile's today); whether they are the run's own."""
    job = Path(row["path"]).parent / "job.json"
    if job.exists():
        return TrainConfig(**StageJob.load(job).config), True
    return fallback, False


def seed_list(first: int, count: int) -> list[int]:
    if count < 1:
        raise ValueError(f"sweep: seeds must be at least 1, got {count}")
    return list(range(first, first + count))


def seed_label(stage: str, seed: int) -> str:
    """The label a seed's model is evaluated under (a valid MLflow metric-name part)."""
    return f"{stage}_seed{seed}"


def spread(values: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one value), min and max."""
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def summarize_seeds(seeds: list[dict], benchmarks: list[str]) -> dict[str, dict[str, float]]:
    """Per benchmark: the spread of the seeds' differences and how many are above 0."""
    out = {}
    for bench in benchmarks:
        diffs = [s["benchmarks"][bench]["diff"] for s in seeds if bench in s["benchmarks"]]
        if diffs:
            out[bench] = {**spread(diffs), "seeds": len(diffs), "positive": sum(d > 0 for d in diffs)}
    return out


def seeds_figure(seeds: list[dict], benchmarks: list[str], stage: str, against: str):
    """Each seed's difference with its paired 95% interval, per pooled benchmark, and the mean."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(benchmarks), figsize=(4.5 * len(benchmarks), 3.6), squeeze=False)
    for ax, bench in zip(axes[0], benchmarks, strict=True):
        points = [(s["seed"], s["benchmarks"][bench]) for s in seeds if bench in s["benchmarks"]]
        xs = list(range(len(points)))
        diffs = [p["diff"] for _, p in points]
        ax.errorbar(xs, diffs, yerr=[[p["diff"] - p["lo"] for _, p in points], [p["hi"] - p["diff"] for _, p in points]],
                    fmt="o", capsize=4, color="tab:blue", label="seed (paired 95% interval)")
        if diffs:
            ax.axhline(statistics.fmean(diffs), color="tab:green", linestyle="--", label="mean over seeds")
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set_xticks(xs, [f"seed {seed}" for seed, _ in points])
        ax.set_title(bench)
        ax.set_ylabel(f"{stage} - {against}, held-out pass@1")
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(f"{stage} trained with {len(seeds)} seed(s): what each adds over {against}")
    fig.tight_layout()
    return fig


def _sweep_run_name() -> str:
    from prefect.runtime import flow_run

    params = flow_run.parameters
    return f"sweep {params.get('stage', 'rl')} x{params.get('seeds', 3)}"


@flow(name="sweep", log_prints=True, flow_run_name=_sweep_run_name)
def sweep_flow(profile: str = "tiny", home: str | None = None, stage: str = "rl", seeds: int = 3,
               first_seed: int | None = None, against: str | None = None, resume: bool = True,
               accept_failed_audit: bool = False) -> dict:
    """Train ``stage`` of the newest finished run again with ``seeds`` seeds (``first_seed``,
    ``first_seed + 1``, ...; default: the run's own seed + 1 onwards) and score each seed's model
    against ``against`` (default: the last SFT stage for RL) on the held-out items."""
    log = flow_logger()
    report_progress("sweep", "start")
    params = {"stage": stage, "seeds": seeds, "first_seed": first_seed, "against": against}
    # what it writes is marked as the sweep's: no pipeline stage takes it for new data
    with recording_writer(SWEEP_WRITER), flow_context("sweep", profile, home, params,
                                                      sections=("train", "model", "evaluate"),
                                                      run_name=f"sweep {stage}") as ctx:
        wh, home_str = ctx.wh, str(ctx.wh.home)
        spec = train_stage(stage)
        if spec.role != "policy" or spec.recipe == "agent":
            raise ValueError(f"sweep: stage {stage!r} is not scored on held-out items (a judge or agent stage); "
                             "sweep a policy stage such as rl")
        ladder = ctx.profile.section("evaluate", EvaluateConfig).stages
        against = against or default_against(stage, ladder)
        row, against_path = swept_run(wh, stage, against, accept_failed_audit)
        conf, own = stage_settings(row, ctx.profile.section("train", TrainConfig))
        if not own:
            log.warning("sweep %s: %s keeps no job.json beside its model; the seeds train with the profile's "
                        "settings of today", stage, row["model_id"])
        parents = [TableRef.parse(p) for p in json.loads(row["data_snapshots"] or "[]")]
        named = next((p for p in parents if p.name == spec.table), None)
        if named is None:
            raise LookupError(f"sweep {stage}: {row['model_id']} records no {spec.table} snapshot it trained on")
        ref = wh.ref(named.name, named.snapshot)   # with its rows and content hash
        chosen = seed_list(conf.seed + 1 if first_seed is None else first_seed, seeds)
        tracking.set_tags({"posttrain.sweep_of": row["run_name"], "posttrain.sweep_stage": stage,
                           "posttrain.sweep_against": against})
        log.info("sweep %s of run %s: seeds %s, from %s on %s, measured against %s", stage, row["run_name"],
                 chosen, row["init_model"], ref, against)

        trained = []
        for seed in chosen:
            seeded = conf.model_copy(update={"seed": seed})
            config_hash = _digest(row["config_hash"], "seed", seed)
            report_progress(f"sweep.seed{seed}", "start")
            res = train_stage_task(stage, home_str, ctx.profile.name, sweep_run_name(row["run_name"], seed),
                                   row["init_model"], ref, seeded.model_dump(), config_hash, ctx.run_id,
                                   resume, None, accept_failed_audit)
            tracking.set_tags({"posttrain.sweep_seed": seed, "posttrain.sweep_of": row["run_name"]},
                              run_id=res["mlflow_run_id"])
            log.info("sweep %s seed %d: %s steps in %.0fs%s", stage, seed, res.get("steps"), res.get("seconds", 0),
                     " (already trained)" if res.get("skipped") else "")
            trained.append((seed, res))
            report_progress(f"sweep.seed{seed}", "done")

        labels = {seed: seed_label(stage, seed) for seed in chosen}
        evaluated = evaluate_flow(profile=profile, home=home_str, accept_failed_audit=accept_failed_audit,
                                  models={against: against_path, **{labels[s]: r["path"] for s, r in trained}},
                                  pairs=[(against, labels[s]) for s in chosen])
        intervals = intervals_of(evaluated)
        scored = evaluated["ladder"]
        out_seeds = []
        for seed, res in trained:
            label = labels[seed]
            benchmarks = {}
            metrics = {}
            for bench, by_stage in scored.items():
                if label not in by_stage or against not in by_stage:
                    continue
                metrics[f"{against}.{bench}.pass_at_1"] = by_stage[against]
                metrics[f"{stage}.{bench}.pass_at_1"] = by_stage[label]
                iv = find_interval(intervals, bench, against, label)
                if iv is not None:
                    benchmarks[bench] = {"diff": iv.diff, "lo": iv.lo, "hi": iv.hi, "items": iv.items,
                                         against: by_stage[against], stage: by_stage[label]}
                    metrics.update({f"delta.{stage}_vs_{against}.{bench}.{w}": getattr(iv, w)
                                    for w in ("diff", "lo", "hi")})
            tracking.log_counters(metrics, prefix="eval", run_id=res["mlflow_run_id"])
            out_seeds.append({"seed": seed, "mlflow_run_id": res["mlflow_run_id"], "model": res["models"],
                              "path": res["path"], "steps": res.get("steps"), "seconds": res.get("seconds"),
                              "skipped": res.get("skipped", False), "benchmarks": benchmarks})

        pooled = [b for b in HELDOUT_GROUPS if any(b in s["benchmarks"] for s in out_seeds)]
        families = sorted({b for s in out_seeds for b in s["benchmarks"] if heldout_group(b)})
        summary = summarize_seeds(out_seeds, pooled + families)
        for bench, stats in summary.items():
            tracking.log_counters({f"{bench}.diff.{k}": v for k, v in stats.items()}, prefix="sweep")
        tracking.log_dict({"stage": stage, "against": against, "run": row["run_name"], "seeds": out_seeds,
                           "summary": summary}, "sweep/seeds.json")
        shown = pooled or families[:4]
        if shown:
            tracking.log_figure(seeds_figure(out_seeds, shown, stage, against), "plots/sweep_seeds.png")
        for bench in pooled:
            s = summary[bench]
            log.info("sweep %s - %s on %s over %d seeds: %+.3f +- %.3f (sd), %d of %d above 0", stage, against, bench,
                     s["seeds"], s["mean"], s["sd"], s["positive"], s["seeds"])
        report_progress("sweep", "done")
        return {"mlflow_run_id": ctx.run_id, "stage": stage, "against": against, "run_name": row["run_name"],
                "settings": "the run's own" if own else "the profile's", "seeds": out_seeds, "summary": summary,
                "pooled": pooled, "evaluate": {"mlflow_run_id": evaluated["mlflow_run_id"], "ladder": scored,
                                               "intervals": evaluated["intervals"]}}
