"""Compare two pipeline runs, and write a report for one, from MLflow and the warehouse.

A run is addressed by its MLflow run id, or by an experiment name (its newest top-level
run). A run's *family* is the run plus every run nested under it (the stage runs), so a
pipeline parent brings its ingest, curate, ..., evaluate children along.

What is compared: parameters that differ, the final value of every metric side by side,
held-out pass@k (metrics ``eval.<benchmark>.pass_at_<k>`` logged by the evaluate stage),
and the data funnel: rows each stage removed, per reason, read from the ``decisions`` and
``quarantine`` tables (whose ``run_id`` is the MLflow run of the stage that wrote them).
Plots: reward curves, pass@k bars, funnel bars.
"""
from __future__ import annotations

import base64
import html
import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import polars as pl
from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from data_specs.stages import last_of
from flows.common import mlflow_run_url
from tasks import tracking
from tasks.evaluate import ladder_figure, ladder_order, ladder_stages, ladder_verdict
from tasks.heldout_stats import Interval, interval_table
from tasks.train.config import STAGE_ORDER
from warehouse import Warehouse

# The pipeline run's tag naming the train stages that trained 0 steps, with their reasons.
IDLE_STAGES_TAG = "posttrain.idle_stages"

EVAL_METRIC = re.compile(r"^eval\.(?P<benchmark>.+)\.pass_at_(?P<k>\d+)$")
CURVE_PATTERN = re.compile(r"reward", re.IGNORECASE)
MAX_CURVES = 6


# -- finding runs ----------------------------------------------------------------------------------

def _client(home: str | os.PathLike | None, tracking_uri: str | None) -> MlflowClient:
    tracking.configure(tracking_uri, home)
    return MlflowClient()


def resolve_run(client: MlflowClient, ref: str) -> Run:
    """A run id, or an experiment name (its newest top-level run, preferring pipeline runs)."""
    try:
        return client.get_run(ref)
    except MlflowException:
        pass
    exp = client.get_experiment_by_name(ref)
    if exp is None:
        raise LookupError(f"{ref!r} is neither an MLflow run id nor an experiment name in {tracking_uri_of()}")
    runs = [r for r in client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
            if "mlflow.parentRunId" not in r.data.tags]
    if not runs:
        raise LookupError(f"experiment {ref!r} has no top-level runs")
    pipelines = [r for r in runs if r.data.tags.get("posttrain.stage") == "pipeline"]
    return (pipelines or runs)[0]


def tracking_uri_of() -> str:
    import mlflow
    return mlflow.get_tracking_uri()


def stage_of(run: Run) -> str:
    return run.data.tags.get("posttrain.stage") or run.info.run_name or run.info.run_id[:8]


@dataclass
class RunFamily:
    root: Run
    runs: list[Run]          # the root first, then nested runs breadth-first

    @property
    def run_ids(self) -> list[str]:
        return [r.info.run_id for r in self.runs]

    @property
    def label(self) -> str:
        return f"{self.root.info.run_name or stage_of(self.root)} {self.root.info.run_id[:8]}"

    def keyed(self) -> list[tuple[str, Run]]:
        """(stage key, run), one key per run, the same in every run of the same pipeline.

        A run's key is its stage; where a stage repeats (the pipeline runs the train flow once
        per stage branch, concurrently), its run name (``train sft_short``), which says which
        branch it is whatever order the branches started in; a #n suffix only where run names
        repeat too. Comparing two runs pairs metrics and params by these keys."""
        stages = Counter(stage_of(r) for r in self.runs)
        names = Counter(r.info.run_name for r in self.runs)
        seen: Counter[str] = Counter()
        out = []
        for r in self.runs:
            key = stage_of(r)
            if stages[key] > 1 and r.info.run_name and names[r.info.run_name] == 1:
                key = r.info.run_name
            seen[key] += 1
            out.append((key if seen[key] == 1 else f"{key}#{seen[key]}", r))
        return out


def run_family(client: MlflowClient, root: Run) -> RunFamily:
    # MLflow's search accepts only "=" on tags: one query per parent, breadth-first
    runs, frontier = [root], [root]
    while frontier:
        children = []
        for parent in frontier:
            children += client.search_runs([root.info.experiment_id],
                                           filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
                                           order_by=["attributes.start_time ASC"])
        runs += children
        frontier = children
    return RunFamily(root, runs)


# -- what a family holds ---------------------------------------------------------------------------

def family_params(family: RunFamily) -> dict[str, str]:
    """Every run's params keyed ``stage.param``; a param already named by its section (curate's
    ``curate.minhash.threshold``) is not prefixed twice."""
    return {name if name.startswith(f"{key}.") else f"{key}.{name}": value
            for key, r in family.keyed() for name, value in r.data.params.items()}


MAX_LABEL_SETTINGS = 2


def difference_labels(fa: RunFamily, fb: RunFamily, pa: dict[str, str], pb: dict[str, str]) -> tuple[str, str]:
    """Legends that say what differs: the settings (section paths, ``curate.minhash.threshold``)
    both runs logged with different values, up to two, else the run names (A / B where equal)."""
    settings = [k for k in sorted(set(pa) & set(pb)) if pa[k] != pb[k] and k.count(".") >= 2]
    if settings:
        shown = settings[:MAX_LABEL_SETTINGS]
        more = f" (+{len(settings) - len(shown)})" if len(settings) > len(shown) else ""
        return tuple(", ".join(f"{k}={p[k]}" for k in shown) + more for p in (pa, pb))   # type: ignore[return-value]
    label_a, label_b = fa.label, fb.label
    return (f"A {label_a}", f"B {label_b}") if label_a == label_b else (label_a, label_b)


def family_metrics(family: RunFamily) -> dict[str, float]:
    """Final (latest) value of every metric, keyed ``stage/metric``."""
    return {f"{key}/{name}": value for key, r in family.keyed() for name, value in r.data.metrics.items()}


def eval_pass_at_k(family: RunFamily) -> pl.DataFrame:
    """benchmark, k, pass_at_k of the final model (the per-stage ladder metrics are ``eval_ladder``'s)."""
    rows = []
    for key, r in family.keyed():
        for name, value in r.data.metrics.items():
            m = EVAL_METRIC.match(name)
            if m and not STAGE_PREFIX.match(name):
                rows.append({"benchmark": m["benchmark"], "k": int(m["k"]), "pass_at_k": float(value)})
    schema = {"benchmark": pl.Utf8, "k": pl.Int64, "pass_at_k": pl.Float64}
    return pl.DataFrame(rows, schema=schema).unique(["benchmark", "k"], keep="last").sort("benchmark", "k")


LADDER_STAGES = ("base", *STAGE_ORDER)   # the models evaluate scores, in training order
_LADDER = "|".join(LADDER_STAGES)
STAGE_PREFIX = re.compile(rf"^eval\.({_LADDER})\.")  # a per-stage metric, any k
STAGE_EVAL_METRIC = re.compile(rf"^eval\.(?P<stage>{_LADDER})\.(?P<benchmark>.+)\.pass_at_1$")


def eval_ladder(family: RunFamily) -> dict[str, dict[str, float]]:
    """benchmark -> stage -> held-out pass@1, from the evaluate stage's per-stage metrics."""
    out: dict[str, dict[str, float]] = {}
    for _key, r in family.keyed():
        for name, value in r.data.metrics.items():
            m = STAGE_EVAL_METRIC.match(name)
            if m:
                out.setdefault(m["benchmark"], {})[m["stage"]] = float(value)
    return {b: dict(sorted(v.items(), key=lambda kv: LADDER_STAGES.index(kv[0]))) for b, v in sorted(out.items())}


DELTA_METRIC = re.compile(rf"^eval\.delta\.(?P<b>{_LADDER})_vs_(?P<a>{_LADDER})\.(?P<benchmark>.+)\."
                          r"(?P<what>diff|lo|hi)$")


def eval_intervals(family: RunFamily) -> list[Interval]:
    """The evaluate stage's paired 95% intervals of stage-vs-stage differences, from its metrics
    (``eval.delta.<b>_vs_<a>.<benchmark>.{diff,lo,hi}``)."""
    parts: dict[tuple[str, str, str], dict[str, float]] = {}
    for _key, r in family.keyed():
        for name, value in r.data.metrics.items():
            if m := DELTA_METRIC.match(name):
                parts.setdefault((m["benchmark"], m["a"], m["b"]), {})[m["what"]] = float(value)
    return [Interval(bench, a, b, v["diff"], v["lo"], v["hi"], 0) for (bench, a, b), v in parts.items()
            if {"diff", "lo", "hi"} <= set(v)]


def ladder_frame(ladder: dict[str, dict[str, float]]) -> pl.DataFrame:
    stages = ladder_stages(ladder)
    rows = [{"benchmark": b, **{s: None if ladder[b].get(s) is None else round(ladder[b][s], 3) for s in stages}}
            for b in ladder_order(ladder)]
    return pl.DataFrame(rows) if rows else pl.DataFrame()


def judge_frame(family: RunFamily) -> pl.DataFrame:
    """The judge validation of the family's references run, one row per group of items."""
    from tasks.genrm.validation import judge_table

    metrics: dict[str, float] = {}
    for _key, r in family.keyed():
        metrics.update(r.data.metrics)
    rows = [{k: v if not isinstance(v, float) else float(f"{v:.2g}") if k.startswith("p ") else round(v, 4)
             for k, v in row.items()} for row in judge_table(metrics)]
    return pl.DataFrame(rows) if rows else pl.DataFrame()


def funnel(wh: Warehouse | None, family: RunFamily) -> pl.DataFrame:
    """Rows removed per (stage, reason) by the family's runs: decisions plus quarantined input."""
    schema = {"stage": pl.Utf8, "reason": pl.Utf8, "rows": pl.Int64}
    parts = []
    if wh is not None:
        ids = family.run_ids
        if wh.exists("decisions"):
            parts.append(wh.read("decisions").filter(pl.col("run_id").is_in(ids))
                         .group_by("stage", "reason").agg(pl.len().cast(pl.Int64).alias("rows")))
        if wh.exists("quarantine"):
            parts.append(wh.read("quarantine").filter(pl.col("run_id").is_in(ids))
                         .group_by("reason").agg(pl.len().cast(pl.Int64).alias("rows"))
                         .select(pl.lit("ingest.quarantine").alias("stage"), "reason", "rows"))
    if not parts:
        return pl.DataFrame(schema=schema)
    return pl.concat([p.select(list(schema)) for p in parts]).sort("stage", "reason")


def metric_curves(client: MlflowClient, family: RunFamily, pattern: re.Pattern = CURVE_PATTERN
                  ) -> dict[str, list[tuple[int, float]]]:
    """``stage/metric`` -> [(step, value)] for metrics matching ``pattern`` with more than one point."""
    curves = {}
    for key, r in family.keyed():
        for name in r.data.metrics:
            if pattern.search(name):
                history = sorted((m.step, m.value) for m in client.get_metric_history(r.info.run_id, name))
                if len(history) > 1:
                    curves[f"{key}/{name}"] = history
    return curves


# -- comparing two ---------------------------------------------------------------------------------

@dataclass
class Comparison:
    a: str                       # labels
    b: str
    a_run_id: str
    b_run_id: str
    params: pl.DataFrame         # param, a, b (on both sides, with different values)
    metrics: pl.DataFrame        # metric, a, b, delta (all final metrics)
    eval: pl.DataFrame           # benchmark, k, a, b, delta
    funnel: pl.DataFrame         # stage, reason, a, b, delta
    ladder: pl.DataFrame = field(default_factory=pl.DataFrame)            # benchmark, stage, a, b, delta
    params_one_sided: pl.DataFrame = field(default_factory=pl.DataFrame)  # param, a, b (one side null)
    plots: dict[str, Path] = field(default_factory=dict)
    out_dir: Path | None = None  # where the full tables (CSV) and the plots are

    TABLES = ("params", "params_one_sided", "ladder", "eval", "funnel", "metrics")

    def write_tables(self, out: Path) -> None:
        """Every table in full as CSV (the printed ones are cut for the terminal)."""
        for name in self.TABLES:
            frame = getattr(self, name)
            if frame.width:
                frame.write_csv(out / f"{name}.csv")


def _side_by_side(a: pl.DataFrame, b: pl.DataFrame, keys: list[str], value: str) -> pl.DataFrame:
    joined = a.rename({value: "a"}).join(b.rename({value: "b"}), on=keys, how="full", coalesce=True)
    return joined.with_columns((pl.col("b") - pl.col("a")).alias("delta")).sort(keys)


def _param_frame(keys: list[str], pa: dict[str, str], pb: dict[str, str]) -> pl.DataFrame:
    return pl.DataFrame({"param": keys, "a": [pa.get(k) for k in keys], "b": [pb.get(k) for k in keys]},
                        schema={"param": pl.Utf8, "a": pl.Utf8, "b": pl.Utf8})


def diff_params(pa: dict[str, str], pb: dict[str, str]) -> pl.DataFrame:
    """Settings both runs have, with different values: what a user changed between them."""
    return _param_frame(sorted(k for k in set(pa) & set(pb) if pa[k] != pb[k]), pa, pb)


def one_sided_params(pa: dict[str, str], pb: dict[str, str]) -> pl.DataFrame:
    """Settings only one run logged (a stage the other did not run, a section it lacks)."""
    return _param_frame(sorted(set(pa) ^ set(pb)), pa, pb)


def ladder_side_by_side(la: dict[str, dict[str, float]], lb: dict[str, dict[str, float]]) -> pl.DataFrame:
    """benchmark, stage, a, b, delta: held-out pass@1 after each training stage, both runs."""
    def frame(ladder):
        rows = [{"benchmark": bench, "stage": stage, "v": v} for bench, by in ladder.items() for stage, v in by.items()]
        return pl.DataFrame(rows, schema={"benchmark": pl.Utf8, "stage": pl.Utf8, "v": pl.Float64})
    out = _side_by_side(frame(la), frame(lb), ["benchmark", "stage"], "v")
    order = {stage: i for i, stage in enumerate(LADDER_STAGES)}
    return out.sort(pl.col("benchmark"), pl.col("stage").replace_strict(order, default=len(order)))


def _metric_frame(metrics: dict[str, float]) -> pl.DataFrame:
    return pl.DataFrame({"metric": list(metrics), "value": list(metrics.values())},
                        schema={"metric": pl.Utf8, "value": pl.Float64})


def compare(a: str, b: str, out_dir: str | os.PathLike | None = None, home: str | os.PathLike | None = None,
            tracking_uri: str | None = None) -> Comparison:
    """Compare runs ``a`` and ``b`` (run ids or experiment names); plots go to ``out_dir``."""
    client = _client(home, tracking_uri)
    wh = Warehouse(home)
    fa, fb = (run_family(client, resolve_run(client, ref)) for ref in (a, b))
    params_a, params_b = family_params(fa), family_params(fb)
    label_a, label_b = difference_labels(fa, fb, params_a, params_b)
    eval_a, eval_b = eval_pass_at_k(fa), eval_pass_at_k(fb)
    funnel_a, funnel_b = funnel(wh, fa), funnel(wh, fb)
    result = Comparison(
        a=label_a, b=label_b, a_run_id=fa.root.info.run_id, b_run_id=fb.root.info.run_id,
        params=diff_params(params_a, params_b),
        metrics=_side_by_side(_metric_frame(family_metrics(fa)), _metric_frame(family_metrics(fb)),
                              ["metric"], "value"),
        eval=_side_by_side(eval_a, eval_b, ["benchmark", "k"], "pass_at_k"),
        funnel=_side_by_side(funnel_a.with_columns(pl.col("rows").cast(pl.Float64)),
                             funnel_b.with_columns(pl.col("rows").cast(pl.Float64)), ["stage", "reason"], "rows"),
        ladder=ladder_side_by_side(eval_ladder(fa), eval_ladder(fb)),
        params_one_sided=one_sided_params(params_a, params_b),
    )
    out = Path(out_dir) if out_dir else wh.artifacts_dir / "compare" / f"{fa.root.info.run_id[:8]}_vs_{fb.root.info.run_id[:8]}"
    out.mkdir(parents=True, exist_ok=True)
    curves = {label_a: metric_curves(client, fa), label_b: metric_curves(client, fb)}
    result.plots = _save_plots(out, curves, result.eval, result.funnel, (label_a, label_b))
    result.write_tables(out)
    result.out_dir = out
    return result


# -- plots -----------------------------------------------------------------------------------------

def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def pick_curves(names: set[str], limit: int) -> list[str]:
    """At most ``limit`` of the ``stage/metric`` curves: each stage's mean reward first, then
    one more per stage in turn (RL first), so no stage is crowded out by another's many metrics."""
    ordered = sorted(names, key=lambda n: (not n.endswith("reward_mean"), n))
    by_stage: dict[str, list[str]] = {}
    for name in ordered:
        by_stage.setdefault(name.split("/", 1)[0], []).append(name)
    final = last_of("rl")
    stages = sorted(by_stage, key=lambda st: (st != final, st))
    out: list[str] = []
    while len(out) < limit and any(by_stage.values()):
        for stage in stages:
            if by_stage[stage] and len(out) < limit:
                out.append(by_stage[stage].pop(0))
    return out


def reward_curves_figure(curves: dict[str, dict[str, list[tuple[int, float]]]]):
    """One panel per metric, one line per run."""
    plt = _plt()
    names = pick_curves({name for per_run in curves.values() for name in per_run}, MAX_CURVES)
    if not names:
        return None
    ncols = min(3, len(names))   # a grid: a row of six panels shrinks each to a thumbnail on the page
    nrows = -(-len(names) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names):
        for label, per_run in curves.items():
            if name in per_run:
                steps, values = zip(*per_run[name])
                ax.plot(steps, values, marker=".", label=label)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def grouped_bars_figure(frame: pl.DataFrame, category: pl.Expr, columns: list[str], labels: list[str],
                        title: str, ylabel: str, horizontal: bool = False):
    plt = _plt()
    if frame.height == 0:
        return None
    cats = frame.select(category.alias("c")).get_column("c").to_list()
    width = 0.8 / len(columns)
    size = (7.5, max(2.5, 0.45 * len(cats) + 1.2)) if horizontal else (max(5.0, 1.1 * len(cats) + 2), 3.8)
    fig, ax = plt.subplots(figsize=size)
    for i, (col, label) in enumerate(zip(columns, labels)):
        # a side without the value is drawn as missing (no bar), never as 0
        values = frame.get_column(col).cast(pl.Float64).fill_null(float("nan")).to_list()
        pos = [x + i * width for x in range(len(cats))]
        (ax.barh if horizontal else ax.bar)(pos, values, width, label=label)
    ticks = [x + width * (len(columns) - 1) / 2 for x in range(len(cats))]
    if horizontal:
        ax.set_yticks(ticks, cats, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(ylabel)
    else:
        ax.set_xticks(ticks, cats, rotation=20, fontsize=8)
        ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _save(fig, path: Path) -> Path | None:
    if fig is None:
        return None
    fig.savefig(path, dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return path


def _save_plots(out: Path, curves, eval_frame: pl.DataFrame, funnel_frame: pl.DataFrame,
                labels: tuple[str, ...]) -> dict[str, Path]:
    cols = ["a", "b"][:len(labels)]
    saved = {
        "reward_curves": _save(reward_curves_figure(curves), out / "reward_curves.png"),
        "pass_at_k": _save(grouped_bars_figure(
            eval_frame, pl.format("{} pass@{}", "benchmark", "k"), cols, list(labels),
            "held-out pass@k", "pass@k", horizontal=True), out / "pass_at_k.png"),
        "funnel": _save(grouped_bars_figure(
            funnel_frame, pl.format("{}: {}", "stage", "reason"), cols, list(labels),
            "rows removed per stage and reason", "rows", horizontal=True), out / "funnel.png"),
    }
    return {k: v for k, v in saved.items() if v is not None}


# -- printing --------------------------------------------------------------------------------------

def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def comparison_tables(result: Comparison, max_rows: int = 60):
    """rich Tables: differing params, eval pass@k, funnel, final metrics (those that differ first)."""
    from rich.table import Table

    def table(title: str, frame: pl.DataFrame, columns: list[str], headers: list[str]) -> Table:
        t = Table(title=title, title_justify="left")
        for h in headers:
            t.add_column(h, overflow="fold", max_width=60)
        for row in frame.head(max_rows).iter_rows(named=True):
            t.add_row(*[_fmt(row[c]) for c in columns])
        if frame.height > max_rows:
            t.caption = f"{frame.height - max_rows} more rows"
        return t

    heads = [result.a, result.b, "b - a"]
    metrics = result.metrics.with_columns(
        (pl.col("a").is_null() | pl.col("b").is_null() | (pl.col("delta").abs() > 0)).alias("differs")
    ).sort(["differs", "metric"], descending=[True, False]).drop("differs")
    one_sided = result.params_one_sided.height if result.params_one_sided.width else 0
    params = table("parameters that differ (set in both runs)", result.params, ["param", "a", "b"],
                   ["param", result.a, result.b])
    if one_sided:
        params.caption = ((params.caption + "; ") if params.caption else "") + \
            f"{one_sided} more set in one run only (params_one_sided.csv)"
    ladder = table("held-out pass@1 after each training stage", result.ladder,
                   ["benchmark", "stage", "a", "b", "delta"], ["benchmark", "stage", *heads]) \
        if result.ladder.width and result.ladder.height else None
    return [t for t in (
        params,
        ladder,
        table("held-out pass@k", result.eval, ["benchmark", "k", "a", "b", "delta"], ["benchmark", "k", *heads]),
        table("data funnel: rows removed", result.funnel, ["stage", "reason", "a", "b", "delta"],
              ["stage", "reason", *heads]),
        table("final metrics", metrics, ["metric", "a", "b", "delta"], ["metric", *heads]),
    ) if t is not None]


def print_comparison(result: Comparison, console=None) -> None:
    from rich.console import Console
    console = console or Console()
    console.rule(f"[bold]{result.a}  vs  {result.b}")
    for t in comparison_tables(result):
        console.print(t)
    for name, path in result.plots.items():
        console.print(f"plot {name}: {path}")
    if result.out_dir is not None:
        console.print(f"full tables (CSV) and plots: {result.out_dir}", soft_wrap=True)


# -- the per-run report ----------------------------------------------------------------------------

def _img(path: Path | None, alt: str, missing: str) -> str:
    """The plot inlined, or ``missing`` (why there is no chart) when there is none."""
    if path is None:
        return f"<p><em>no chart: {html.escape(missing)}</em></p>"
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"><figcaption>{html.escape(alt)}</figcaption></figure>'


def _html_table(frame: pl.DataFrame, empty: str = "none", links: dict[str, str] | None = None) -> str:
    """A table; ``links`` maps a column to a URL template (``{}``: the cell) its cells link to."""
    if frame.height == 0:
        return f"<p><em>{html.escape(empty)}</em></p>"
    links = links or {}

    def cell(column: str, value) -> str:
        text = html.escape(_fmt(value))
        if column in links and value is not None:
            return f'<a href="{html.escape(links[column].format(value))}">{text}</a>'
        return text
    head = "".join(f"<th>{html.escape(c)}</th>" for c in frame.columns)
    body = "".join("<tr>" + "".join(f"<td>{cell(c, v)}</td>" for c, v in zip(frame.columns, row)) + "</tr>"
                   for row in frame.iter_rows())
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _collapsible(title: str, body: str) -> str:
    """A long section folded away under its heading (hundreds of rows would bury the summary)."""
    return f"<details><summary><h2 style='display:inline'>{html.escape(title)}</h2></summary>{body}</details>"


def _stage_rows(family: RunFamily) -> pl.DataFrame:
    """One row per run, each run under the run it is nested in (depth first, children by start)."""
    keyed = family.keyed()
    key_of = {r.info.run_id: key for key, r in keyed}
    children: dict[str | None, list[tuple[str, Run]]] = {}
    for key, r in keyed[1:]:
        children.setdefault(r.data.tags.get("mlflow.parentRunId"), []).append((key, r))
    ordered, stack = [], [keyed[0]]
    while stack:
        key, r = stack.pop()
        ordered.append((key, r))
        stack.extend(reversed(children.get(r.info.run_id, [])))
    rows = []
    for key, r in ordered:
        start, end = r.info.start_time, r.info.end_time
        parent = key_of.get(r.data.tags.get("mlflow.parentRunId"))
        rows.append({"stage": key, "within": parent, "status": r.info.status, "run_id": r.info.run_id,
                     "seconds": round((end - start) / 1000, 1) if start and end else None,
                     "profile": r.data.tags.get("posttrain.profile"),
                     "config_hash": r.data.tags.get("posttrain.config_hash")})
    return pl.DataFrame(rows, schema={"stage": pl.Utf8, "within": pl.Utf8, "status": pl.Utf8, "run_id": pl.Utf8,
                                      "seconds": pl.Float64,
                                      "profile": pl.Utf8, "config_hash": pl.Utf8})


def _dataset_rows(family: RunFamily) -> pl.DataFrame:
    rows = []
    for key, r in family.keyed():
        for di in (r.inputs.dataset_inputs if r.inputs else []):
            context = next((t.value for t in di.tags if t.key == "mlflow.data.context"), "")
            rows.append({"stage": key, "context": context, "table": di.dataset.name, "digest": di.dataset.digest})
    return pl.DataFrame(rows, schema={"stage": pl.Utf8, "context": pl.Utf8, "table": pl.Utf8, "digest": pl.Utf8})


REPORT_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}
table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:13px}th,td{border:1px solid #ccc;padding:3px 8px;text-align:left}
th{background:#f3f3f3}img{max-width:100%}figure{margin:1em 0}figcaption{color:#666;font-size:12px}
.verdict{font-size:16px;padding:.6em .8em;background:#f1f7f1;border-left:4px solid #2e8b57}"""


MLFLOW_UI_DEFAULT = "http://127.0.0.1:5000"   # where `posttrain ui` serves MLflow unless told otherwise


def write_run_report(run_id: str, home: str | os.PathLike | None = None, out_dir: str | os.PathLike | None = None,
                     tracking_uri: str | None = None, log_to_mlflow: bool = True,
                     mlflow_ui: str | None = None) -> Path:
    """Write ``report.html`` (self-contained: images inlined) for a run and its stage runs.

    Also logs it, with the PNGs, as artifacts under ``report/`` of the run. Each run id links
    to that run in the MLflow UI at ``mlflow_ui`` (default: the one ``posttrain ui`` serves this
    home on, else its default port). Returns the path.
    """
    from flows.services import running_mlflow_ui

    mlflow_ui = mlflow_ui or running_mlflow_ui(home) or MLFLOW_UI_DEFAULT
    client = _client(home, tracking_uri)
    wh = Warehouse(home)
    family = run_family(client, client.get_run(run_id))
    out = Path(out_dir) if out_dir else wh.artifacts_dir / "reports" / run_id
    out.mkdir(parents=True, exist_ok=True)
    label = family.label
    eval_frame = eval_pass_at_k(family)
    eval_frame = eval_frame.rename({"pass_at_k": "a"})
    funnel_frame = funnel(wh, family).with_columns(pl.col("rows").cast(pl.Float64).alias("a"))
    plots = _save_plots(out, {label: metric_curves(client, family)}, eval_frame, funnel_frame, (label,))
    ladder = eval_ladder(family)
    if ladder:
        plots["ladder"] = _save(ladder_figure(ladder, "held-out pass@1 (T=1.0, top-p 0.95) after each stage"),
                                out / "eval_ladder.png")
    params = pl.DataFrame([{"param": k, "value": v} for k, v in sorted(family_params(family).items())],
                          schema={"param": pl.Utf8, "value": pl.Utf8})
    metrics = _metric_frame(dict(sorted(family_metrics(family).items())))
    root = family.root
    started = datetime.fromtimestamp(root.info.start_time / 1000, tz=UTC).isoformat(timespec="seconds")
    violations = [v for k, v in family_metrics(family).items() if k.endswith("audit.violations")]
    intervals = eval_intervals(family)
    verdict = ladder_verdict(ladder, (violations[-1] == 0) if violations else None, intervals)
    interval_rows = interval_table(intervals, ladder_order(ladder))
    interval_frame = pl.DataFrame(interval_rows).drop("items") if interval_rows else pl.DataFrame()
    idle = json.loads(root.data.tags.get(IDLE_STAGES_TAG, "[]"))
    datasets = _dataset_rows(family)
    parts = [
        (f"<!doctype html><html><head><meta charset='utf-8'><title>posttrain run {html.escape(label)}</title>"
         f"<style>{REPORT_CSS}</style></head><body>"),
        f"<h1>posttrain run {html.escape(label)}</h1>",
        *([f"<p class='verdict'><strong>{html.escape(verdict)}</strong></p>"] if verdict else []),
        (f"<p>run id <code>{root.info.run_id}</code>, status {root.info.status}, started {started}, "
         f"experiment <code>{html.escape(client.get_experiment(root.info.experiment_id).name)}</code></p>"),
        "<h2>Stages</h2>",
        (f"<p>Run ids open the run in the MLflow UI that <code>posttrain ui</code> serves on {html.escape(mlflow_ui)}."
         "</p>"),
        _html_table(_stage_rows(family), links={
            "run_id": mlflow_run_url(mlflow_ui, root.info.experiment_id, "{}")}),
        "<h2>What each training stage did: held-out pass@1</h2>",
        _html_table(ladder_frame(ladder), "no per-stage evaluation in this run"),
        _img(plots.get("ladder"), "held-out pass@1 per family after base, SFT, DPO and RL",
             "this run evaluated no training stage"),
        "<h3>What each stage changed: paired 95% intervals (bootstrap over the same items and seeds)</h3>",
        _html_table(interval_frame, "no stage-vs-stage comparison in this run"),
        *(["<h3>Stages that did nothing</h3><ul>"
           + "".join(f"<li><code>{html.escape(d['stage'])}</code>: {html.escape(d['reason'])}</li>" for d in idle)
           + "</ul>"] if idle else []),
        "<h2>The GenRM judge on held-out items (chance: 0.5)</h2>",
        _html_table(judge_frame(family), "no judge validation on synthetic items in this run"),
        "<h2>Held-out pass@k of the final model</h2>", _html_table(eval_frame.rename({"a": "pass_at_k"}), "no evaluation in this run"),
        _img(plots.get("pass_at_k"), "held-out pass@k", "this run evaluated no model"),
        "<h2>Data funnel: rows removed per stage and reason</h2>",
        _html_table(funnel_frame.drop("a"), "no rows removed (or no decisions recorded for this run)"),
        _img(plots.get("funnel"), "rows removed per stage and reason", "no rows were removed in this run"),
        "<h2>Reward curves</h2>", _img(plots.get("reward_curves"), "reward curves",
                                       "no stage of this run logged a reward over more than one step"),
        _collapsible(f"Datasets ({datasets.height})", _html_table(datasets, "no datasets logged")),
        _collapsible(f"Final metrics ({metrics.height})", _html_table(metrics)),
        _collapsible(f"Parameters ({params.height})", _html_table(params)),
        "</body></html>",
    ]
    report = out / "report.html"
    report.write_text("\n".join(parts), encoding="utf-8")
    if log_to_mlflow:
        client.log_artifact(run_id, str(report), "report")
        for path in plots.values():
            client.log_artifact(run_id, str(path), "report")
    return report
