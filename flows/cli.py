"""``posttrain``: the command line. Every command prints one clear line on error and exits non-zero."""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

import flows  # noqa: F401  (applies environment defaults before Prefect loads)
from data_specs.stages import STAGE_NAMES
from tasks.train import proc as child_procs  # stdlib only: the launchers a signal stops

app = typer.Typer(help="posttrain: LLM post-training pipeline (MiniMax-01/M1 recipe) on Prefect, DuckDB and MLflow.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
table_app = typer.Typer(help="Inspect warehouse tables.", no_args_is_help=True)
profile_app = typer.Typer(help="Inspect profiles.", no_args_is_help=True)
app.add_typer(table_app, name="table")
app.add_typer(profile_app, name="profile")
console = Console()
err_console = Console(stderr=True)


def _known_profile(name: str) -> str:
    """An unknown profile is a bad argument, said before a flow (and its Prefect API) starts."""
    from tasks.profile import available_profiles, configs_dir
    if not Path(name).is_dir() and not (configs_dir() / "profiles" / name).is_dir():
        raise typer.BadParameter(f"unknown profile {name!r}; available: {available_profiles()}")
    return name


ProfileOpt = typer.Option("tiny", "--profile", "-p", help="profile name or directory", callback=_known_profile)


def _home_dir(home: str | None) -> str | None:
    """A --home that is a file is a bad argument (else: "File exists" from whatever makes a directory in it)."""
    if home is not None and Path(home).exists() and not Path(home).is_dir():
        raise typer.BadParameter(f"{home}: not a directory")
    return home


HomeOpt = typer.Option(None, "--home", help="data directory (default $POSTTRAIN_HOME or ./.posttrain)",
                       callback=_home_dir)
AcceptFailedAuditOpt = typer.Option(False, "--accept-failed-audit",
                                    help="use a model whose training-data audit failed (it is refused otherwise)")


def _wh(home: str | None):
    from warehouse import Warehouse
    return Warehouse(home)


def _print_frame(df, title: str | None = None, max_rows: int = 50) -> None:
    t = Table(title=title, show_lines=False)
    for c in df.columns:
        t.add_column(c, overflow="fold", max_width=60)
    for row in df.head(max_rows).iter_rows():
        t.add_row(*["" if v is None else str(v)[:300] for v in row])
    console.print(t)
    if df.height > max_rows:
        console.print(f"... {df.height - max_rows} more rows")


def _stage_progress():
    """A rich progress display fed by the flows' stage hooks."""
    from flows.common import set_progress_hook
    progress = Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
                        TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=console,
                        transient=False)
    state: dict = {}

    def hook(stage: str, event: str) -> None:
        # the pipeline and the stage flow both report a stage: one bar per stage
        if event == "start" and stage not in state:
            state[stage] = progress.add_task(stage, total=1)
        elif event == "done" and stage in state:
            progress.update(state[stage], completed=1)

    set_progress_hook(hook)
    return progress


@app.command()
def ingest(
    paths: list[Path] = typer.Argument(None, help="JSONL / JSON / CSV / Parquet files or directories"),
    source: str | None = typer.Option(None, "--source", "-s", help="source name stored with each row"),
    domain: str | None = typer.Option(None, "--domain", "-d", help="math | logic | code | general | ..."),
    kind: str = typer.Option("prompts", "--kind", help="prompts or benchmarks"),
    bundled: bool = typer.Option(False, "--bundled", help="also ingest the bundled offline sources"),
    field: list[str] = typer.Option([], "--field", help="map a field: prompt=question (repeatable)"),
    profile: str = ProfileOpt, home: str | None = HomeOpt,
):
    """Load files (and/or the bundled sources) into `prompts` / `benchmarks`; bad rows go to `quarantine`."""
    from flows.ingest import ingest_flow
    mapping = {}
    for f in field:
        k, sep, v = f.partition("=")
        if not sep:
            raise typer.BadParameter(f"--field {f!r}: expected NAME=COLUMN")
        mapping[k] = v
    if not paths and not bundled:
        raise typer.BadParameter("give PATH(s) or --bundled")
    with console.status("ingesting..."):
        res = ingest_flow(paths=[str(p) for p in paths or []], source=source, kind=kind, domain=domain,
                          bundled=bundled, mapping=mapping or None, profile=profile, home=home)
    console.print(f"[bold]rows in[/] {res['rows_in']}  [green]stored[/] {res['stored']}  "
                  f"already present {res['already_present']}  [red]quarantined[/] {res['quarantined']} "
                  f"{res['quarantine_reasons'] or ''}")
    console.print(f"MLflow run {res['mlflow_run_id']}")


@app.command()
def curate(profile: str = ProfileOpt, home: str | None = HomeOpt):
    """Filter, deduplicate (exact, MinHash, semantic), decontaminate and split into `sft_pool` / `rl_pool`."""
    from flows.curate import curate_flow
    with console.status("curating..."):
        res = curate_flow(profile=profile, home=home)
    shown = {k: res[k] for k in ("rows_new", "hashed", "encoded", "removed", "sft_pool", "rl_pool") if k in res}
    _print_counts(shown, title=f"curate ({res.get('runner', 'local')})")
    console.print(f"MLflow run {res['mlflow_run_id']}")


@app.command()
def synthesize(
    per_task: int | None = typer.Option(None, "--per-task", help="instances per task (profile default when unset)"),
    task: list[str] = typer.Option([], "--task", help="only these tasks (own names or rg:<dataset>)"),
    calibrate: bool = typer.Option(False, "--calibrate", help="first calibrate levels with base and strong solvers "
                                   "(on without it where the profile sets synthesize.calibration.enabled)"),
    strong_model: str | None = typer.Option(None, "--strong-model", help="model alias or path of the strong solver "
                                            "(default: synthesize.calibration.strong_model, else the base model)"),
    profile: str = ProfileOpt, home: str | None = HomeOpt,
):
    """Generate SynLogic-style verifiable task instances into `synthetic_tasks`."""
    from flows.synthesize import synthesize_flow
    with console.status("synthesizing..."):
        res = synthesize_flow(profile=profile, home=home, per_task=per_task, tasks=task or None,
                              calibrate=calibrate, strong_model=strong_model)
    console.print(f"[green]{res['instances']}[/] instances over {res['tasks']} tasks -> {res['tables']['synthetic_tasks']}")
    if res.get("calibration"):
        console.print(calibration_table(res["calibration"]))
    console.print(f"MLflow run {res['mlflow_run_id']}")


def calibration_table(bands: list[dict]) -> Table:
    """Each task's calibrated level band, as the run summary shows it."""
    table = Table(title="calibrated difficulty bands (M1: base pass rate in (0, 0.5) .. strong pass@k > 0)")
    for col in ("task", "levels", "of", "status"):
        table.add_column(col)
    from tasks.synthesize import band_levels
    for b in bands:
        table.add_row(b["task"], band_levels(b), str(b["n_levels"]), b["status"])
    return table


@app.command()
def difficulty(
    table: list[str] = typer.Option([], "--table", help="tables to band (default: rl_pool, synthetic_tasks)"),
    model: str | None = typer.Option(None, "--model", help="model alias or path (default: profile)"),
    profile: str = ProfileOpt, home: str | None = HomeOpt,
):
    """Roll out, verify, compute pass@k and keep each domain's difficulty band."""
    from flows.difficulty import difficulty_flow
    with console.status("sampling and verifying..."):
        res = difficulty_flow(profile=profile, home=home, tables=table or None, model=model)
    _print_counts(res["decisions"], title=f"difficulty decisions ({res['model']})")
    console.print(f"MLflow run {res['mlflow_run_id']}")


@app.command()
def samples(
    job: str = typer.Argument("teacher", help="teacher (reasoning for SFT) or on_policy (the policy's own samples for DPO)"),
    model: str | None = typer.Option(None, "--model", help="model alias, path or stage name (default: profile)"),
    profile: str = ProfileOpt, home: str | None = HomeOpt,
):
    """Sample the SFT side's prompts, verify and clean: teacher targets for SFT, on-policy pairs for DPO."""
    from flows.samples import samples_flow
    from tasks.samples import JOBS
    if job not in JOBS:
        raise typer.BadParameter(f"job must be one of {list(JOBS)}, not {job!r}")
    with console.status(f"sampling ({job})..."):
        res = samples_flow(job=job, profile=profile, home=home, model=model)
    if not res["enabled"]:
        console.print(f"samples.{job} is disabled in profile {profile!r}: nothing sampled")
    else:
        _print_counts({k: int(v) for k, v in res["counts"].items()}, title=f"samples {job} ({res['model']})")
    console.print(f"MLflow run {res['mlflow_run_id']}")


@app.command()
def references(
    prompt: list[str] = typer.Option([], "--prompt", help="extra open prompt text (repeatable)"),
    labelled: list[Path] = typer.Option([], "--labelled", help="labelled judge benchmark files", exists=True,
                                        dir_okay=False),
    profile: str = ProfileOpt, home: str | None = HomeOpt,
):
    """Judge candidate answers with the GenRM in Swiss rounds and store the best reference per prompt."""
    from flows.references import references_flow
    with console.status("judging..."):
        res = references_flow(profile=profile, home=home, prompts=prompt or None,
                              labelled_files=[str(p) for p in labelled] or None)
    shown = {k: v for k, v in res.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    _print_counts(shown, title="references")
    if res.get("validation"):
        _print_counts({k: v for k, v in res["validation"].items() if isinstance(v, (int, float))},
                      title="judge validation")
        _print_judge(res)
    console.print(f"MLflow run {res['mlflow_run_id']}")


_STAGE_HELP = " | ".join(STAGE_NAMES) + " (default: all)"


def _known_stages(chosen: list[str], known: list[str]) -> None:
    """An unknown --stage is a bad argument, said before a flow (and its Prefect API) starts."""
    unknown = [s for s in chosen if s not in known]
    if unknown:
        raise typer.BadParameter(f"unknown stage(s) {unknown}; known: {list(known)}", param_hint="'--stage'")


@app.command()
def train(
    stage: list[str] = typer.Option([], "--stage", help=_STAGE_HELP),
    resume: bool = typer.Option(True, "--resume/--no-resume", help="continue killed stages from checkpoints"),
    accept_failed_audit: bool = AcceptFailedAuditOpt,
    profile: str = ProfileOpt, home: str | None = HomeOpt,
):
    """Train SFT short/long -> DPO short/long -> CISPO RL on DeepSpeed; register each model.

    Each model is registered after the audit of what it trained on; a failed audit stops here."""
    _known_stages(stage, STAGE_NAMES)
    from flows.train import train_flow
    with _stage_progress():
        res = train_flow(profile=profile, home=home, stages=stage or None, resume=resume,
                         accept_failed_audit=accept_failed_audit)
    t = Table(title=f"training run {res['run_name']}")
    for col in ("stage", "steps", "final loss", "seconds", "model"):
        t.add_column(col)
    for name, r in res["stages"].items():
        t.add_row(name, str(r.get("steps")), f"{r.get('final_loss')}", f"{r.get('seconds', 0):.0f}"
                  + (" (reused)" if r.get("skipped") else ""), str(r.get("path")))
    console.print(t)
    console.print(f"final model: {res['final_model']}   MLflow run {res['mlflow_run_id']}")


@app.command()
def stages():
    """The pipeline's stages in run order, what each follows, and what each training stage trains on.

    For a training stage: the table it trains on, its recipe and what it writes (declared
    once, in data_specs/stages.py)."""
    from data_specs.stages import TRAINING_TABLES, train_stage
    from flows.pipeline import STAGES

    t = Table(title="pipeline stages (run order)")
    for col in ("stage", "after", "recipe", "trains on", "built from", "writes"):
        t.add_column(col, overflow="fold")
    for name, st in STAGES.items():
        ts = train_stage(name) if name in STAGE_NAMES else None
        after = "every other stage" if set(st.after) == set(STAGES) - {name} else ", ".join(st.after)
        after += f"; {', '.join(st.after_if)} if the GenRM judges its prompts" if st.after_if else ""
        t.add_row(name, after, ts.recipe if ts else "", ts.table if ts else "",
                  ", ".join(TRAINING_TABLES[ts.table].sources) if ts else "", ", ".join(ts.writes) if ts else "")
    console.print(t)


@app.command()
def evaluate(
    model: str | None = typer.Option(None, "--model", help="model alias or path (default: newest in `models`)"),
    benchmark: list[str] = typer.Option([], "--benchmark", help="only these benchmarks"),
    max_items: int | None = typer.Option(None, "--max-items", help="items per benchmark"),
    accept_failed_audit: bool = AcceptFailedAuditOpt,
    profile: str = ProfileOpt, home: str | None = HomeOpt,
):
    """Held-out pass@k at temperature 1.0, top-p 0.95 into `eval_results`."""
    from flows.evaluate import evaluate_flow
    with console.status("evaluating..."):
        res = evaluate_flow(profile=profile, home=home, model=model, benchmarks=benchmark or None,
                            max_items=max_items, accept_failed_audit=accept_failed_audit)
    _print_counts(res["pass_at_k"], title=f"pass@k of {res['model']}")
    console.print(f"MLflow run {res['mlflow_run_id']}")


@app.command()
def sweep(
    stage: str = typer.Option("rl", "--stage", help="the training stage to train again"),
    seeds: int = typer.Option(3, "--seeds", min=1, help="how many seeds"),
    first_seed: int | None = typer.Option(None, "--first-seed", help="default: the run's own seed + 1"),
    against: str | None = typer.Option(None, "--against", help="the stage to measure from (default: the "
                                       "last SFT stage for rl, else the ladder rung before)"),
    accept_failed_audit: bool = AcceptFailedAuditOpt,
    profile: str = ProfileOpt, home: str | None = HomeOpt,
):
    """Train one stage of the newest finished run again with other seeds; score each seed on the
    held-out items against the stage it is measured from (mean +- sd across seeds).

    Each seed starts from the model and data the run's stage started from, with the run's own
    settings but for the seed; every seed is an MLflow run `posttrain compare` puts side by side."""
    _known_stages([stage], STAGE_NAMES)
    from flows.sweep import sweep_flow
    with _stage_progress():
        res = sweep_flow(profile=profile, home=home, stage=stage, seeds=seeds, first_seed=first_seed,
                         against=against, accept_failed_audit=accept_failed_audit)
    _print_sweep(res)


def _print_sweep(res: dict) -> None:
    from tasks.evaluate import UNTRAINED_BENCHMARK
    from tasks.heldout_stats import VERDICT_STYLE, Interval, verdict_word

    stage, against = res["stage"], res["against"]
    t = Table(title=f"{stage} of run {res['run_name']} with {len(res['seeds'])} seed(s) ({res['settings']} settings): "
                    f"held-out pass@1, {stage} - {against} [paired 95% interval]")
    for col in ("seed", "steps", "seconds", "MLflow run"):
        t.add_column(col, justify="right" if col in ("steps", "seconds") else "left", no_wrap=True)
    for bench in res["pooled"]:
        name = "never trained" if bench == UNTRAINED_BENCHMARK else "trained families"
        t.add_column(f"{name}: {against} -> {stage}", justify="right")
    for s in res["seeds"]:
        cells = []
        for bench in res["pooled"]:
            b = s["benchmarks"].get(bench)
            if b is None:
                cells.append("")
                continue
            style = VERDICT_STYLE[verdict_word(Interval(bench, against, stage, b["diff"], b["lo"], b["hi"], b["items"]))]
            cells.append(f"{b[against]:.2f} -> {b[stage]:.2f}  [{style}]{b['diff']:+.2f} "
                         f"[{b['lo']:+.2f}, {b['hi']:+.2f}][/{style}]")
        t.add_row(str(s["seed"]), str(s["steps"]), f"{s['seconds'] or 0:.0f}" + (" (reused)" if s["skipped"] else ""),
                  s["mlflow_run_id"], *cells)
    console.print(t)
    for bench in res["pooled"]:
        st = res["summary"][bench]
        console.print(f"[bold]{bench}: {stage} - {against} over {st['seeds']:.0f} seeds: {st['mean']:+.3f} +- "
                      f"{st['sd']:.3f} (sd), range [{st['min']:+.3f}, {st['max']:+.3f}], {st['positive']:.0f} of "
                      f"{st['seeds']:.0f} above 0[/bold]", soft_wrap=True, highlight=False)
    console.print(f"sweep MLflow run {res['mlflow_run_id']}; compare two seeds with `posttrain compare "
                  f"{res['seeds'][0]['mlflow_run_id']} {res['seeds'][-1]['mlflow_run_id']}`", soft_wrap=True,
                  highlight=False)


@app.command()
def audit(profile: str = ProfileOpt, home: str | None = HomeOpt):
    """Prove from the warehouse that training saw only what curation and difficulty chose."""
    from flows.audit import audit_flow
    res = audit_flow(profile=profile, home=home, fail_on_violation=False)
    _print_audit(res)
    if not res["passed"]:
        raise typer.Exit(1)


def _print_audit(res: dict) -> None:
    t = Table(title="training-data audit")
    for c in ("check", "checked", "violations", "offending (first 20)"):
        t.add_column(c, overflow="fold")
    for c in res["checks"]:
        mark = "[green]0[/green]" if not c["violations"] else f"[red]{c['violations']}[/red]"
        t.add_row(c["name"], str(c["checked"]), mark, "\n".join(c["offending"]))
    console.print(t)
    verdict = "[green]passed[/green]" if res["passed"] else f"[red]FAILED: {res['violations']} violation(s)[/red]"
    console.print(f"audit {verdict} over {', '.join(res['snapshots'].values()) or 'no tables'}")


@app.command("serve-model")
def serve_model_cmd(
    model: str = typer.Argument(..., help="model directory, .gguf file, or alias (smol, tiny-llama)"),
    port: int = typer.Option(8000, "--port"),
    name: str | None = typer.Option(None, "--name", help="model name reported by /v1/models"),
):
    """Serve a local model over an OpenAI-compatible completions API on 127.0.0.1."""
    from tasks.rollout.server import serve_model
    console.print(f"serving {model} at http://127.0.0.1:{port}/v1 (Ctrl-C to stop)")
    serve_model(model, host="127.0.0.1", port=port, model_name=name)


@app.command()
def serve(
    port: int = typer.Option(4200, "--port", help="Prefect server port (reused when PREFECT_API_URL answers)"),
    pool: str = typer.Option("posttrain", "--pool", help="process work pool name"),
    deployment: list[str] = typer.Option([], "--deployment", help="only these deployments (flow/name)"),
    duration: float = typer.Option(0, "--duration", help="stop after N seconds (0: until Ctrl-C)"),
    home: str | None = HomeOpt,
):
    """Start (or reuse) a Prefect server, create a work pool, deploy every flow and start a worker."""
    from flows.deploy import serve as serve_deployments

    def ready(handle) -> None:
        reused = "" if handle.server is not None else \
            "   (reused: the server another command runs for this home; it stays up while serve runs)"
        console.print(f"Prefect UI: {handle.ui_url}   work pool: {handle.pool}{reused}")
        for d in handle.deployments:
            console.print(f"  deployed {d}")
        console.print("worker running; press Ctrl-C to stop" if not duration else f"stopping in {duration:.0f}s")

    console.print("starting Prefect server, deploying, starting a worker...")
    serve_deployments(home=home, port=port, pool=pool, deployments=deployment or None, duration=duration,
                      on_ready=ready)


@app.command()
def compare(a: str, b: str, out: Path | None = typer.Option(None, "--out", help="directory for plots"),
            home: str | None = HomeOpt):
    """Compare two runs (MLflow run ids or experiment names): params, metrics, pass@k, data funnel."""
    from flows.compare import compare as compare_runs
    from flows.compare import print_comparison
    result = compare_runs(a, b, out_dir=out, home=home)
    print_comparison(result, console)


@app.command()
def report(run_id: str, out: Path | None = typer.Option(None, "--out"), home: str | None = HomeOpt):
    """Write (and log to MLflow) an HTML report of a pipeline run."""
    from flows.compare import write_run_report
    path = write_run_report(run_id, home=home, out_dir=out)
    console.print(f"report: {path}")


def _print_counts(counts: dict, title: str) -> None:
    t = Table(title=title)
    t.add_column("name")
    t.add_column("value", justify="right")
    for k, v in counts.items():
        t.add_row(str(k), f"{v:.4g}" if isinstance(v, float) else str(v))
    console.print(t)


@table_app.command("list")
def table_list(home: str | None = HomeOpt):
    """Tables with their latest snapshot and row counts."""
    df = _wh(home).tables()
    if df.height == 0:
        console.print("no tables yet: run `posttrain ingest --bundled` or `posttrain run`")
        return
    _print_frame(df.select("name", "rows", "snapshot", "snapshots", "created"), title="tables")


@table_app.command("show")
def table_show(name: str, snapshot: str | None = typer.Option(None, "--snapshot"),
               limit: int = typer.Option(10, "--limit", "-n"), home: str | None = HomeOpt):
    """First rows of a table."""
    df = _wh(home).read(name, snapshot)
    _print_frame(df.head(limit), title=f"{name} ({df.height} rows)")


@table_app.command("history")
def table_history(name: str, home: str | None = HomeOpt):
    """Every snapshot of a table, newest first."""
    _print_frame(_wh(home).history(name).drop("content_hash"), title=f"{name} history")


@table_app.command("lineage")
def table_lineage(name: str, snapshot: str | None = typer.Option(None, "--snapshot"), home: str | None = HomeOpt):
    """The snapshots a table snapshot was built from, transitively."""
    edges = _wh(home).lineage(name, snapshot)
    if not edges:
        console.print(f"{name}: no parents recorded")
    for e in edges:
        console.print(f"{e['child']}  <-  {e['parent']}")


@table_app.command("export")
def table_export(name: str, out: Path, snapshot: str | None = typer.Option(None, "--snapshot"),
                 home: str | None = HomeOpt):
    """Write a table to .parquet, .csv, .jsonl or .json (by extension)."""
    df = _wh(home).read(name, snapshot)
    suffix = out.suffix.lower()
    out.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".parquet":
        df.write_parquet(out)
    elif suffix == ".csv":
        df.write_csv(out)
    elif suffix == ".jsonl":
        df.write_ndjson(out)
    elif suffix == ".json":
        df.write_json(out)
    else:
        raise typer.BadParameter(f"{out}: unsupported extension {suffix!r} (parquet, csv, jsonl, json)")
    console.print(f"wrote {df.height} rows of {name} to {out}")


@app.command()
def sql(query: str, home: str | None = HomeOpt, fmt: str = typer.Option("table", "--format", help="table | csv | json")):
    """Run SQL over the latest snapshot of every table (plus `catalog`)."""
    df = _wh(home).sql(query)
    if fmt == "csv":
        sys.stdout.write(df.write_csv())
    elif fmt == "json":
        sys.stdout.write(json.dumps(df.to_dicts(), default=str) + "\n")
    else:
        _print_frame(df)


@app.command()
def run(profile: str = ProfileOpt, stage: list[str] = typer.Option([], "--stage", help="run only these stages"),
        force: bool = typer.Option(False, "--force", help="re-run stages whose inputs and config are unchanged"),
        home: str | None = HomeOpt):
    """Run the full pipeline (or chosen stages) and print a summary."""
    from flows.pipeline import STAGES, pipeline_flow
    _known_stages(stage, list(STAGES))
    t0 = time.time()
    with _stage_progress():
        res = pipeline_flow(profile=profile, stages=stage or None, home=home, force=force)
    _print_summary(res, time.time() - t0, home)


def _print_ladder(ladder: dict, ivs: list) -> None:
    """Held-out pass@1 after each training stage: the table that shows whether training worked,
    with RL - SFT and last - first as paired 95% intervals (bootstrap over the same items)."""
    from data_specs.stages import last_of
    from tasks.evaluate import (
        HELDOUT_GROUPS,
        UNTRAINED_BENCHMARK,
        heldout_group,
        ladder_order,
        ladder_stages,
    )
    from tasks.heldout_stats import VERDICT_STYLE, find_interval, verdict_word

    stages = ladder_stages(ladder)
    t = Table(title="held-out pass@1 after each stage (T=1.0, top-p 0.95; synthetic: seeds never trained on; "
                    "\\[paired 95% interval])")
    t.add_column("benchmark", no_wrap=True)
    for s in stages:
        t.add_column(s, justify="right")
    sft, final = last_of("sft"), last_of("rl")
    pairs = [(sft, final)] + ([(stages[0], stages[-1])] if stages and (stages[0], stages[-1]) != (sft, final) else [])
    for a, b in pairs:
        t.add_column(f"{b} - {a}", justify="right")
    for bench in ladder_order(ladder):
        by_stage = ladder[bench]
        group = heldout_group(bench)
        never = " (never trained)" if UNTRAINED_BENCHMARK in (group, bench) else ""
        name = (f"synthetic, mean{never}" if bench in HELDOUT_GROUPS else
                f"synthetic: {bench.split('/', 1)[1]}{never}" if group else bench)
        cells = []
        for a, b in pairs:
            iv = find_interval(ivs, bench, a, b)
            if iv is not None:
                style = VERDICT_STYLE[verdict_word(iv)]
                cells.append(f"[{style}]{iv.diff:+.2f} [{iv.lo:+.2f}, {iv.hi:+.2f}][/{style}]")
            else:
                cells.append(f"{by_stage[b] - by_stage[a]:+.2f}" if a in by_stage and b in by_stage else "")
        t.add_row(name, *[f"{by_stage[s]:.2f}" if s in by_stage else "" for s in stages], *cells)
    console.print(t)


def _print_judge(references: dict) -> None:
    """The GenRM judge on held-out items it never trained on, against chance."""
    from tasks.genrm.validation import judge_table
    rows = judge_table(references.get("validation") or {})
    if not rows:
        return
    columns = list(dict.fromkeys(k for r in rows for k in r))
    t = Table(title="GenRM judge on held-out synthetic items (chance: 0.5)")
    for c in columns:
        t.add_column(c, justify="left" if c == "items" else "right", no_wrap=c == "items")
    for r in rows:
        t.add_row(*[r[c] if c == "items" else "" if c not in r else
                    (f"{r[c]:.1e}" if c.startswith("p ") else f"{r[c]:.2f}") for c in columns])
    console.print(t)
    if "unparseable_share" in references and references.get("games"):
        console.print(f"  reference tournaments: {references['games']:.0f} games, "
                      f"{1 - references['unparseable_share']:.0%} of judge samples parseable")


def _print_summary(res: dict, elapsed: float, home: str | None) -> None:
    from tasks.heldout_stats import intervals_of
    from warehouse import Warehouse
    wh = Warehouse(home)
    console.rule("[bold]posttrain run summary")
    _print_frame(wh.tables().select("name", "rows", "snapshot"), title="warehouse tables")
    for stage, out in res.items():
        if isinstance(out, dict) and "mlflow_run_id" in out:
            how = "skipped (unchanged), last" if out.get("skipped") else ""
            console.print(f"  {stage:<12} {how} MLflow run {out['mlflow_run_id']}")
    if isinstance(res.get("synthesize"), dict) and res["synthesize"].get("calibration"):
        console.print(calibration_table(res["synthesize"]["calibration"]))
    if isinstance(res.get("references"), dict):
        _print_judge(res["references"])
    if "evaluate" in res and res["evaluate"].get("ladder"):
        _print_ladder(res["evaluate"]["ladder"], intervals_of(res["evaluate"]))
    elif "evaluate" in res and res["evaluate"].get("pass_at_k"):
        _print_counts(res["evaluate"]["pass_at_k"], title=f"eval pass@k ({res['evaluate'].get('model')})")
    if "audit" in res and isinstance(res["audit"], dict) and "checks" in res["audit"]:
        _print_audit(res["audit"])
    from flows.pipeline import idle_lines, idle_stages
    from tasks.evaluate import ladder_verdict
    for line in idle_lines(idle_stages(res)):
        console.print(f"[yellow]did nothing[/yellow] {line}", soft_wrap=True, highlight=False)
    audit = res.get("audit") if isinstance(res.get("audit"), dict) else {}
    evaluated = res.get("evaluate") or {}
    verdict = ladder_verdict(evaluated.get("ladder") or {}, audit.get("passed"),
                             intervals_of(evaluated))
    if verdict:   # the one line a user reads first, last on the screen
        console.print(f"[bold]{verdict}[/bold]", soft_wrap=True, highlight=False)
    console.print(f"pipeline MLflow run: {res.get('mlflow_run_id')}   wall time {elapsed:.0f}s")
    # paths are printed whole (soft_wrap): a narrow or piped terminal must not cut them mid-word
    if res.get("report"):
        console.print(f"report: {res['report']}", soft_wrap=True, highlight=False)
    console.print(f"data: {wh.home}   open the UIs with `posttrain ui` (or `make ui`)", soft_wrap=True,
                  highlight=False)


def _newest_experiment(home: str | None) -> tuple[str, str] | None:
    """(id, name) of the home's experiment with the newest run, for a link that lands on its runs."""
    from mlflow.tracking import MlflowClient

    from tasks import tracking
    from warehouse import posttrain_home
    store = posttrain_home(home) / "mlflow.db"
    if not store.exists():
        return None
    uri = tracking.default_tracking_uri(home)
    tracking.ensure_store(uri)   # not read while another command is still creating it
    client = MlflowClient(tracking_uri=uri)
    experiments = {e.experiment_id: e.name for e in client.search_experiments() if e.name != "Default"}
    if not experiments:
        return None
    runs = client.search_runs(list(experiments), order_by=["attributes.start_time DESC"], max_results=1)
    chosen = runs[0].info.experiment_id if runs else next(iter(experiments))
    return chosen, experiments[chosen]


@app.command()
def ui(home: str | None = HomeOpt, prefect_port: int = typer.Option(4200, "--prefect-port"),
       mlflow_port: int = typer.Option(5000, "--mlflow-port"),
       duration: float = typer.Option(0, "--duration", help="stop after N seconds (0: until Ctrl-C)")):
    """Start the Prefect UI and the MLflow UI on 127.0.0.1 and print both URLs.

    The Prefect server `serve` or another `ui` runs for this home is reused."""
    from flows.deploy import ensure_prefect_server
    from flows.services import (
        record_server,
        release_prefect_server,
        start_mlflow_ui,
        using_prefect_server,
    )
    services: list = []  # whatever started is stopped, even if a later start fails
    prefect = None
    try:
        with using_prefect_server(home, "posttrain ui"):
            try:
                with console.status("starting Prefect and MLflow..."):
                    api_url, prefect = ensure_prefect_server(home, prefect_port)
                    mlflow_ui = start_mlflow_ui(mlflow_port, home)
                    services.append(mlflow_ui)
                    mlflow_ui.wait_healthy()
                    record_server(home, mlflow_ui, "mlflow")   # flows link their MLflow runs at this port
                reused = "" if prefect is not None else "   (already running for this home: reused)"
                console.print(f"Prefect UI: {api_url.removesuffix('/api')}{reused}")
                # the experiments in MLflow 3's "Model training" view (its default is the GenAI one)
                console.print(f"MLflow UI:  {mlflow_ui.url}/#/experiments?workflowType=machine_learning")
                newest = _newest_experiment(home)
                if newest is not None:
                    console.print(f"   newest runs ({newest[1]}): "
                                  f"{mlflow_ui.url}/#/experiments/{newest[0]}/runs?workflowType=machine_learning")
                console.print("press Ctrl-C to stop" if not duration else f"stopping in {duration:.0f}s")
                deadline = time.time() + duration if duration else None
                while deadline is None or time.time() < deadline:
                    time.sleep(0.5)
            except KeyboardInterrupt:
                pass
            finally:
                for service in services:
                    service.stop()
    finally:
        # the Prefect server stays up while `serve` (or another `ui`) depends on it
        release_prefect_server(home, prefect, lambda line: console.print(line, highlight=False))


@profile_app.command("show")
def profile_show(name: str = typer.Argument("tiny")):
    """The merged settings of a profile (files plus environment overrides)."""
    from tasks.profile import load_profile
    prof = load_profile(name)
    console.print_json(json.dumps({"profile": prof.name, "path": str(prof.path), "sections": prof.as_dict()}))


@profile_app.command("list")
def profile_list():
    """Available profiles."""
    from tasks.profile import available_profiles
    for p in available_profiles():
        console.print(p)


@app.command()
def gc(home: str | None = HomeOpt, older_than: float = typer.Option(3600, help="seconds")):
    """Remove snapshot directories left by crashed writers."""
    removed = _wh(home).gc(older_than)
    console.print(f"removed {len(removed)} orphaned snapshot director{'y' if len(removed) == 1 else 'ies'}")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so ``finally`` blocks and exit handlers stop child servers."""


# A SIGTERMed command is gone this many seconds later even if some thread will not stop (a
# stage task blocked in a worker thread keeps the interpreter from exiting). Not for the commands
# that stop servers of their own on the way out (their grace periods are longer).
TERM_DEADLINE_S = 20.0
_OWN_SHUTDOWN = {"ui", "serve", "serve-model"}
_deadline_armed = threading.Event()
_sigterm_seen = threading.Event()   # the exit code is 143 whatever the signal became on its way up


def _command_name() -> str | None:
    return next((a for a in sys.argv[1:] if not a.startswith("-")), None)


def _kill_temporary_prefect_servers() -> None:
    """SIGKILL the temporary Prefect API servers this process started: ``os._exit`` skips the
    exit handler that would stop them, and they would outlive the command."""
    server_mod = sys.modules.get("prefect.server.api.server")
    if server_mod is None:
        return
    for server in list(getattr(server_mod.SubprocessASGIServer, "_instances", {}).values()):
        proc = getattr(server, "server_process", None)
        if proc is not None and proc.poll() is None:
            try:
                proc.kill()
            except OSError:
                pass


def _exit_by_deadline(code: int, seconds: float) -> None:
    """Start (once) a daemon thread that kills what remains of the run and exits ``code``."""
    if _deadline_armed.is_set():
        return
    _deadline_armed.set()

    def expire() -> None:
        time.sleep(seconds)
        child_procs.terminate_children(signal.SIGKILL)
        _kill_temporary_prefect_servers()
        os.write(2, f"posttrain: still running {seconds:.0f} s after SIGTERM; exiting\n".encode())
        os._exit(code)

    threading.Thread(target=expire, name="posttrain-term-deadline", daemon=True).start()


def _on_signal_arrival(signum: int) -> None:
    """As SIGTERM or Ctrl-C arrives (from a thread, whatever handler Prefect has swapped in):
    launchers run in sessions of their own, so no signal to this process or its group reaches
    them; stop them now, and the stage threads waiting on them return."""
    if signum == signal.SIGTERM:
        _sigterm_seen.set()   # before the launchers stop: the stage failing then is the signal's doing
    child_procs.terminate_children(signal.SIGTERM)
    if signum == signal.SIGTERM and _command_name() not in _OWN_SHUTDOWN:
        _exit_by_deadline(143, TERM_DEADLINE_S)


def _on_sigterm(signum, frame) -> None:
    _on_signal_arrival(signum)
    raise Terminated()


# the commands that run a Prefect flow
_FLOW_COMMANDS = {"ingest", "curate", "synthesize", "difficulty", "samples", "references", "train", "evaluate", "sweep",
                  "audit", "run"}


def _drain_run_logs(timeout_s: float = 30.0) -> None:
    """Send the flow runs' last log records to the Prefect API before the command returns (they
    go in batches; on a busy machine the tail could miss the server a command talked to)."""
    if "prefect.logging.handlers" not in sys.modules:
        return
    from prefect.logging.handlers import APILogWorker
    try:
        APILogWorker.drain_all(timeout=timeout_s)
    except Exception:  # noqa: BLE001, S110 - logs are best effort; the command's result stands
        pass


class _NoRunTraceback(logging.Filter):
    """Prefect logs a failed flow or task run with its traceback; on the console the command's
    one ``error:`` line says what failed. The run's log (Prefect UI) keeps the traceback: its
    API handler sits on the run's logger and formats the record before the root's console one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.name.startswith(("prefect.flow_runs", "prefect.task_runs")):
            record.exc_info = record.exc_text = None
        return True


def _quiet_run_tracebacks() -> None:
    """``POSTTRAIN_TRACEBACK=1`` keeps the tracebacks on the console (debugging a stage)."""
    if _command_name() not in _FLOW_COMMANDS or os.environ.get("POSTTRAIN_TRACEBACK") == "1":
        return
    import prefect.main  # noqa: F401  (sets up Prefect's logging, console handler included)
    from prefect.logging.handlers import PrefectConsoleHandler
    for logger in (logging.getLogger(), logging.getLogger("prefect")):
        for handler in logger.handlers:
            if isinstance(handler, PrefectConsoleHandler):
                handler.addFilter(_NoRunTraceback())


def _home_from_argv() -> str | None:
    """The ``--home`` a command was given (None: ``$POSTTRAIN_HOME`` or the default)."""
    args = sys.argv[1:]
    for i, arg in enumerate(args):
        if arg == "--home" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--home="):
            return arg.split("=", 1)[1]
    return None


@contextmanager
def _served_prefect() -> Iterator[None]:
    """Run the command's flows on the Prefect server ``ui`` or ``serve`` runs for its home (their
    runs then show there, with links both ways), not on a temporary API of their own; as is,
    when ``PREFECT_API_URL`` is set or nothing serves the home."""
    from flows.services import running_prefect_server

    if os.environ.get("PREFECT_API_URL") or _command_name() not in _FLOW_COMMANDS:
        yield
        return
    served = running_prefect_server(_home_from_argv())
    if served is None:
        yield
        return
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings

    err_console.print(f"using the Prefect server that serves this home: {served}", highlight=False)
    with temporary_settings({PREFECT_API_URL: f"{served}/api", PREFECT_UI_URL: served}):
        yield


def main() -> None:
    """Entry point: errors become one line on stderr and a non-zero exit.

    SIGTERM stops a command as Ctrl-C does (``ui`` and ``serve`` stop their servers, ``run``
    its temporary Prefect API), exiting 143 instead of 130. Both stop the stage launchers this
    process started at once; after SIGTERM a pipeline command exits within ``TERM_DEADLINE_S``.
    """
    signal.signal(signal.SIGTERM, _on_sigterm)
    child_procs.watch_signals(_on_signal_arrival)
    # click's UsageError as vendored by this typer (bad arguments: exit 2)
    usage_error = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
    # The ephemeral Prefect API stops at exit while its event recorder may still be flushing;
    # the resulting CancelledError tracebacks are noise for a CLI user (runs are already final).
    logging.getLogger("prefect.server.services.task_run_recorder").setLevel(logging.CRITICAL)
    try:
        _quiet_run_tracebacks()
        # standalone_mode=False *returns* the code of a typer.Exit a command raised (audit's 1)
        with _served_prefect():
            code = app(standalone_mode=False)
            _drain_run_logs()
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        # click turns a KeyboardInterrupt (our Terminated included) into Abort; the watch
        # thread may note the signal a moment after the main thread's handler ran
        child_procs.terminate_children(signal.SIGTERM)
        if _sigterm_seen.wait(0.5):
            sys.exit(143)
        err_console.print("aborted")
        sys.exit(130)
    except usage_error as e:
        err_console.print(f"error: {e.format_message()}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except Terminated:
        sys.exit(143)
    except KeyboardInterrupt:
        child_procs.terminate_children(signal.SIGTERM)
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - any error: one clear line, not a traceback
        if _sigterm_seen.is_set():   # e.g. the stage whose launcher the signal stopped
            sys.exit(143)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        err_console.print(f"error: {type(e).__name__}: {msg}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except BaseException as e:
        # Prefect's own SIGTERM handler, swapped in while a flow runs, raises TerminationSignal
        # (should the signal watch have missed it, stop the launchers and arm the deadline here)
        if getattr(e, "signal", None) == signal.SIGTERM or _sigterm_seen.wait(0.5):
            _on_signal_arrival(signal.SIGTERM)
            sys.exit(143)
        raise
    if _sigterm_seen.is_set():
        sys.exit(143)
    if isinstance(code, int) and code:
        sys.exit(code)


if __name__ == "__main__":
    main()
