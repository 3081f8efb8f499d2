"""The ``evaluate`` flow: held-out pass@k of a model on the benchmarks and fresh synthetic tasks."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace

import polars as pl
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.common import flow_context, flow_logger, report_progress
from tasks import tracking
from tasks.evaluate import (
    HELDOUT_GROUPS,
    EvalItem,
    EvaluateConfig,
    ItemResult,
    ModelChoice,
    benchmark_items,
    choose_model,
    evaluate_environments,
    evaluate_items,
    heldout_group,
    heldout_synthetic_items,
    item_rows,
    ladder_figure,
    ladder_intervals,
    ladder_table,
    pass_at_k_figure,
    pass_at_k_metrics,
    stage_ladder,
    summarize,
    trained_task_names,
    training_instance_ids,
)
from tasks.heldout_stats import interval_metrics
from tasks.rollout.base import RolloutBackend
from tasks.rollout.config import RolloutConfig
from tasks.rollout.factory import make_backend
from warehouse import TableRef


# The backend holds a loaded model: not an input Prefect can hash, so no caching. All
# benchmarks go through one task so that items of every benchmark share sampling batches.
@task(name="evaluate-items", cache_policy=NO_CACHE)
def evaluate_items_task(items: list[EvalItem], backend: RolloutBackend, cfg: EvaluateConfig) -> list[ItemResult]:
    log = flow_logger()

    def progress(done: int, total: int) -> None:
        log.info("evaluate: %d/%d items sampled and verified", done, total)

    return evaluate_items(items, backend, cfg, progress)


def _backend_for(rollout: RolloutConfig, model: ModelChoice) -> RolloutBackend:
    # the profile picks the engine (local / vllm / openai); the model is the one evaluated
    return make_backend(rollout.model_copy(update={"model": model.path}))


def _models_to_evaluate(wh, cfg: EvaluateConfig, model: str | None, accept_failed_audit: bool,
                        sources: dict[str, TableRef] | None,
                        models: dict[str, str] | None = None) -> list[ModelChoice]:
    """``models`` (label -> alias or path, in order), else the named model, else the newest run's
    stage ladder (base -> ... -> rl)."""
    if models:
        # a registered model goes by its id
        return [replace(choice, stage=label, model_id=choice.registered_id or choice.model_id)
                for label, path in models.items()
                for choice in [choose_model(wh, path, accept_failed_audit)]]
    if model or not cfg.stages:
        return [choose_model(wh, model, accept_failed_audit, sources)]
    return stage_ladder(wh, cfg.stages, accept_failed_audit, sources)


@flow(name="evaluate", log_prints=True, flow_run_name="evaluate")
def evaluate_flow(profile: str = "tiny", home: str | None = None, model: str | None = None,
                  benchmarks: list[str] | None = None, max_items: int | None = None,
                  accept_failed_audit: bool = False, sources: dict[str, TableRef] | None = None,
                  models: dict[str, str] | None = None, pairs: list[tuple[str, str]] | None = None) -> dict:
    """pass@k at the profile's temperature / top-p (M1: 1.0 / 0.95) into ``eval_results``.

    ``model``: an alias or checkpoint path; by default every model of the newest training
    run's stage ladder (``evaluate.stages``), so the table shows what each stage did.
    ``benchmarks`` and ``max_items`` override the profile's evaluate section. A registered
    model whose training-data audit failed is refused unless ``accept_failed_audit``.
    ``sources``: the snapshots to read (the pipeline hands over what its stages wrote: the
    ``models`` rows of this run, the benchmarks and training tables); else each table's newest.
    ``models``: label -> alias or path, scored in that order under those labels instead (a seed
    sweep: the stage it is compared to, then each seed's model); ``pairs``: the (a, b) differences
    b - a to give intervals for (default: those a ladder asks for).
    """
    log = flow_logger()
    report_progress("evaluate", "start")
    params = {"model": model, "benchmarks": benchmarks, "max_items": max_items,
              "accept_failed_audit": accept_failed_audit, **({"models": models} if models else {})}
    with flow_context("evaluate", profile, home, params, sections=("evaluate", "rollout")) as ctx:
        overrides = {k: v for k, v in {"benchmarks": benchmarks, "max_items": max_items}.items() if v is not None}
        cfg = EvaluateConfig.model_validate({**ctx.profile.section("evaluate", EvaluateConfig).model_dump(),
                                             **overrides})
        rollout = ctx.profile.section("rollout", RolloutConfig)
        wh = ctx.wh
        chosen = _models_to_evaluate(wh, cfg, model, accept_failed_audit, sources, models)
        final = chosen[-1]
        tracking.set_tags({"posttrain.model": final.model_id, "posttrain.model_path": final.path,
                           "posttrain.model_source": final.source,
                           "posttrain.stages": ",".join(c.stage or "-" for c in chosen)})
        read = {name: ref for name in ("benchmarks", "synthetic_tasks", "models")
                if (ref := wh.pinned(name, sources)) is not None}
        for ref in read.values():
            tracking.log_table(ref, context="input")

        items = benchmark_items(wh, cfg, sources)
        heldout = None
        if cfg.synthetic is not None:
            heldout = heldout_synthetic_items(cfg.synthetic, training_instance_ids(wh, sources),
                                              trained_task_names(wh, sources))
            items += heldout.items
            tracking.log_counters({"items": len(heldout.items),
                                   "skipped_seen_in_training": heldout.skipped_seen_in_training,
                                   "skipped_duplicates": heldout.skipped_duplicates}, prefix="eval.synthetic")
        if not items and not (cfg.agent and cfg.agent.environments):
            raise ValueError("evaluate: no items: configure benchmarks, synthetic tasks and/or agent environments")

        per_benchmark = Counter(it.benchmark for it in items)
        for bench, count in Counter(heldout_group(it.benchmark) for it in items).items():
            if bench is not None:
                per_benchmark[bench] = count   # the families pooled
        summaries, per_item, metrics, errors, results_by_stage = [], [], {}, 0, {}
        for choice in chosen:
            backend = _backend_for(rollout, choice)
            scored = [it for it in items if cfg.scores_at(it, choice.stage)]
            log.info("evaluating %s (%s) on %d items%s, n=%d, temperature=%s, top_p=%s", choice.model_id,
                     choice.stage or choice.source, len(scored),
                     f" of {len(items)} (the rest at other stages: benchmark_stages, untrained_stages)"
                     if len(scored) < len(items) else "",
                     cfg.n, cfg.temperature, cfg.top_p)
            started = time.perf_counter()
            results = evaluate_items_task(scored, backend, cfg) if scored else []
            timing = {"items": time.perf_counter() - started}
            if cfg.agent is not None and cfg.agent.environments and cfg.agent.plays_at(choice.stage):
                log.info("evaluating %s on %d held-out seeds of %s (n=%d)", choice.model_id, cfg.agent.seeds,
                         ", ".join(e.name for e in cfg.agent.environments), cfg.agent.n)
                episodes_started = time.perf_counter()
                results += evaluate_environments(backend, cfg)
                timing["episodes"] = time.perf_counter() - episodes_started
            timing["total"] = time.perf_counter() - started
            log.info("evaluated %s in %.0f s (%s)", choice.stage or choice.model_id, timing["total"],
                     ", ".join(f"{part} {sec:.0f} s" for part, sec in timing.items() if part != "total"))
            label = choice.stage or "model"
            metrics.update({f"seconds.{label}" + ("" if part == "total" else f".{part}"): round(sec, 1)
                            for part, sec in timing.items()})
            summary = summarize(results, cfg, choice, backend.name, ctx.run_id)
            summaries.append(summary)
            per_item.append(item_rows(results, choice, ctx.run_id))
            errors += sum(r.verify_errors for r in results)
            if choice.stage:
                results_by_stage[choice.stage] = results
            if choice.stage and len(chosen) > 1:
                metrics.update(pass_at_k_metrics(summary, choice.stage))
        summary = pl.concat(summaries, how="diagonal_relaxed")
        final_summary = summaries[-1]
        parents = [read[name] for name in ("benchmarks", "models") if name in read]
        refs = {
            "eval_results": wh.append("eval_results", summary, parents=parents),
            "eval_items": wh.append("eval_items", pl.concat(per_item, how="diagonal_relaxed"),
                                   parents=parents),
        }
        metrics.update(pass_at_k_metrics(final_summary))   # unprefixed: the final model's numbers
        tracking.log_counters(metrics, prefix="eval")
        tracking.log_counters({f"{b}.items": n for b, n in per_benchmark.items()}, prefix="eval")
        tracking.log_counters({"verify_errors": errors}, prefix="eval")
        tracking.log_figure(pass_at_k_figure(final_summary, f"held-out pass@k: {final.model_id}"),
                            "plots/eval_pass_at_k.png")
        ladder = ladder_table(summary)
        intervals = ladder_intervals(results_by_stage, cfg.seed, pairs) if len(results_by_stage) > 1 else []
        if intervals:
            tracking.log_counters(interval_metrics(intervals), prefix="eval")
            tracking.log_dict([iv.as_dict() for iv in intervals], "eval/intervals.json")
        if len(chosen) > 1 and any(b in HELDOUT_GROUPS or heldout_group(b) for b in ladder):
            tracking.log_figure(ladder_figure(ladder, "held-out pass@1 after each stage"), "plots/eval_ladder.png")
            tracking.log_dict(ladder, "eval/ladder.json")
        for r in final_summary.iter_rows(named=True):
            log.info("%-18s pass@%d = %.3f over %d items", r["benchmark"], r["k"], r["pass_at_k"], r["items"])
        for bench, by_stage in ladder.items():
            log.info("%-32s %s", bench, "  ".join(f"{st} {v:.2f}" for st, v in by_stage.items()))
        for iv in intervals:
            log.info("%-32s %s vs %s %s%s", iv.benchmark, iv.b, iv.a, iv.label(), " (within noise)" if iv.within_noise
                     else "")
        report_progress("evaluate", "done")
        return {"mlflow_run_id": ctx.run_id, "model": final.model_id, "model_source": final.source,
                "tables": ctx.log_outputs(refs), "pass_at_k": pass_at_k_metrics(final_summary), "items": len(items),
                "synthetic_items": len(heldout.items) if heldout else 0, "ladder": ladder,
                "intervals": [iv.as_dict() for iv in intervals],
                "stages": [c.stage for c in chosen if c.stage],
                "benchmarks": [b for b in per_benchmark if heldout_group(b) is None and b not in HELDOUT_GROUPS]}
