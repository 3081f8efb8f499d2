"""Curate reporting: per-stage counters and the funnel / similarity plots in MLflow."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import polars as pl

from tasks import tracking
from tasks.curate.pipeline import CurateResult
from warehouse import TableRef, Warehouse

SIMILARITY_PANELS = {
    "minhash_candidate_jaccard": "MinHash: estimated Jaccard of LSH candidates",
    "semantic_nearest_cosine": "Semantic: nearest-neighbour cosine",
    "decontam_ngram_coverage": "Decontam: n-gram coverage of best item",
    "decontam_embedding_cosine": "Decontam: cosine to nearest benchmark item",
}


def funnel_figure(result: CurateResult):
    stages = list(result.stages.values())   # in run order: the blocks' own, spelled once (curate_blocks)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = [s.stage.split(".", 1)[1] for s in stages]
    ax.bar(names, [s.rows_in for s in stages], color="#c8d6e5", label="rows in")
    ax.bar(names, [s.kept for s in stages], color="#2e86de", label="kept")
    for i, s in enumerate(stages):
        # the removed count and why (the two commonest reasons), over each bar
        why = "\n".join(f"{reason.split(':')[0]} {n}" for reason, n in s.removed.most_common(2))
        ax.text(i, s.rows_in, f"-{s.removed_total}" + (f"\n{why}" if why else ""), ha="center", va="bottom",
                fontsize=7)
    ax.set_ylabel("rows")
    ax.set_title(f"curate funnel ({result.counters.get('rows_new', 0):.0f} new rows)")
    ax.legend()
    return fig


def similarity_figure(result: CurateResult, thresholds: dict[str, float]):
    fig, axes = plt.subplots(1, len(SIMILARITY_PANELS), figsize=(16, 3.2))
    for ax, (key, title) in zip(axes, SIMILARITY_PANELS.items()):
        values = np.asarray(result.similarities.get(key, []), dtype=float)
        values = values[np.isfinite(values)]
        if len(values):
            ax.hist(values, bins=40, color="#576574")
        else:
            ax.text(0.5, 0.5, "no values", ha="center", va="center", transform=ax.transAxes)
        if key in thresholds:
            ax.axvline(thresholds[key], color="#ee5253", linestyle="--", label="threshold")
            ax.legend(fontsize=7)
        ax.set_title(title, fontsize=9)
    return fig


EXCERPT_CHARS = 90
MAX_REMOVED_SHOWN = 500   # per block, in the UIs (the decisions table holds every row)


def _excerpt(text: str | None) -> str | None:
    if text is None:
        return None
    text = " ".join(str(text).split())
    return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS - 1] + "…"


def removed_rows(wh: Warehouse, run_id: str, prompts: TableRef | None, benchmarks: TableRef | None
                 ) -> dict[str, pl.DataFrame]:
    """Per curate block (``curate.minhash`` ...), the rows this run removed, as a user reads them:
    the prompt's excerpt, the reason, what it matched (the kept row's or the benchmark item's
    excerpt, with its id) and the score; from the ``decisions`` this run wrote."""
    if not wh.exists("decisions"):
        return {}
    removed = (wh.scan("decisions").filter((pl.col("run_id") == run_id) & (pl.col("decision") == "removed")
                                           & pl.col("stage").str.starts_with("curate."))
               .select("stage", "row_id", "reason", "reference_id", "score").collect())
    if removed.is_empty():
        return {}
    ids = set(removed["row_id"].to_list()) | {r for r in removed["reference_id"].to_list() if r}
    texts: dict[str, str] = {}
    if prompts is not None:
        rows = wh.scan(prompts.name, prompts.snapshot).filter(pl.col("id").is_in(list(ids))).select("id", "prompt")
        texts.update(dict(rows.collect().iter_rows()))
    if benchmarks is not None:
        bench = (wh.scan(benchmarks.name, benchmarks.snapshot)
                 .select(pl.format("{}:{}", "benchmark", "item_id").alias("key"), "text")
                 .filter(pl.col("key").is_in(list(ids))).collect())
        texts.update(dict(bench.iter_rows()))
    out = {}
    for (stage,), frame in removed.group_by("stage", maintain_order=True):
        out[stage] = pl.DataFrame({   # the reason first: the UIs' tables cut the right-hand columns
            "reason": frame["reason"],
            "prompt": [_excerpt(texts.get(r)) for r in frame["row_id"]],
            "matched": [_excerpt(texts.get(r)) if r else None for r in frame["reference_id"]],
            "matched_id": frame["reference_id"],
            "score": frame["score"],
            "row_id": frame["row_id"],
        }, schema={"reason": pl.Utf8, "prompt": pl.Utf8, "matched": pl.Utf8, "matched_id": pl.Utf8,
                   "score": pl.Float64, "row_id": pl.Utf8})
    return out


def log_removed(removed: dict[str, pl.DataFrame], run_id: str | None = None) -> None:
    """Each block's removed rows as an MLflow table (``curate/removed/<block>.json``, shown in the
    run's artifacts and its evaluation view), the first ``MAX_REMOVED_SHOWN`` of them."""
    from mlflow.tracking import MlflowClient

    for stage, frame in removed.items():
        MlflowClient().log_table(tracking.current_run_id() if run_id is None else run_id,
                                 frame.head(MAX_REMOVED_SHOWN).to_pandas(),
                                 f"curate/removed/{stage.split('.', 1)[-1]}.json")


def log_curate(result: CurateResult, thresholds: dict[str, float], run_id: str | None = None) -> None:
    """Counters per stage (``curate.<stage>.*``), run totals, and the two plots."""
    for stage in result.stages.values():
        tracking.log_counters(stage.counters(), prefix=stage.stage, run_id=run_id)
    tracking.log_counters(result.counters, prefix="curate", run_id=run_id)
    tracking.log_figure(funnel_figure(result), "plots/curate_funnel.png", run_id=run_id)
    tracking.log_figure(similarity_figure(result, thresholds), "plots/curate_similarity.png", run_id=run_id)
