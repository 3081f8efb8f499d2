"""The ``difficulty`` flow: rollouts -> verify -> pass@k -> keep the configured band."""
from __future__ import annotations

from prefect import flow

from flows.common import flow_context, flow_logger, report_progress
from tasks.difficulty import DifficultyConfig, run_difficulty
from tasks.genrm.models import resolve_model_name
from tasks.rollout.config import RolloutConfig
from tasks.rollout.factory import make_backend
from warehouse import TableRef


@flow(name="difficulty", log_prints=True, flow_run_name="difficulty")
def difficulty_flow(
    profile: str = "tiny",
    home: str | None = None,
    tables: list[str] | None = None,
    model: str | None = None,
    sources: dict[str, TableRef] | None = None,
) -> dict:
    """Band every RL-side prompt of ``tables`` (default: rl_pool and synthetic_tasks) by pass rate,
    each at its snapshot in ``sources`` (the pipeline's earlier stages hand them over), else its newest."""
    log = flow_logger()
    report_progress("difficulty", "start")
    tables = tables or ["rl_pool", "synthetic_tasks"]
    params = {"tables": tables, "model": model}
    with flow_context("difficulty", profile, home, params, sections=("difficulty", "rollout")) as ctx:
        cfg = ctx.profile.section("difficulty", DifficultyConfig)
        rollout = ctx.profile.section("rollout", RolloutConfig)
        # "policy": band by what the model RL starts from can do now
        chosen_model = resolve_model_name(model or cfg.model or rollout.model, ctx.wh.home, sources)
        backend = make_backend(rollout.model_copy(update={"model": chosen_model}))
        log.info("difficulty: sampling %s with %s (n=%d, max_tokens=%d)", tables, chosen_model,
                 cfg.sampling.n, cfg.sampling.max_tokens)
        refs = run_difficulty(ctx.wh, cfg, backend, tables=tuple(tables), sources=sources)
        summary = ctx.wh.sql(
            "SELECT domain, decision, count(*) AS n FROM difficulty WHERE run_id = ? GROUP BY ALL ORDER BY ALL",
            [ctx.run_id]) if refs else None
        counts = {f"{r['domain']}.{r['decision']}": r["n"] for r in summary.iter_rows(named=True)} if summary is not None else {}
        log.info("difficulty decisions: %s", counts)
        report_progress("difficulty", "done")
        return {"mlflow_run_id": ctx.run_id, "tables": ctx.log_outputs(refs), "decisions": counts,
                "model": chosen_model}
