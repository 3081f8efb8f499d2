"""Curate reporting: per-stage counters and the funnel / similarity plots in MLflow."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from tasks import tracking
from tasks.curate.pipeline import STAGES, CurateResult

SIMILARITY_PANELS = {
    "minhash_candidate_jaccard": "MinHash: estimated Jaccard of LSH candidates",
    "semantic_nearest_cosine": "Semantic: nearest-neighbour cosine",
    "decontam_ngram_coverage": "Decontam: n-gram coverage of best item",
    "decontam_embedding_cosine": "Decontam: cosine to nearest benchmark item",
}


def funnel_figure(result: CurateResult):
    stages = [result.stages[s] for s in STAGES if s in result.stages]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = [s.stage.split(".", 1)[1] for s in stages]
    ax.bar(names, [s.rows_in for s in stages], color="#c8d6e5", label="rows in")
    ax.bar(names, [s.kept for s in stages], color="#2e86de", label="kept")
    for i, s in enumerate(stages):
        ax.text(i, s.rows_in, f"-{s.removed_total}", ha="center", va="bottom", fontsize=8)
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


def log_curate(result: CurateResult, thresholds: dict[str, float], run_id: str | None = None) -> None:
    """Counters per stage (``curate.<stage>.*``), run totals, and the two plots."""
    for stage in result.stages.values():
        tracking.log_counters(stage.counters(), prefix=stage.stage, run_id=run_id)
    tracking.log_counters(result.counters, prefix="curate", run_id=run_id)
    tracking.log_figure(funnel_figure(result), "plots/curate_funnel.png", run_id=run_id)
    tracking.log_figure(similarity_figure(result, thresholds), "plots/curate_similarity.png", run_id=run_id)
