"""Decontamination against benchmark items: word n-gram overlap and embedding similarity.

n-gram overlap (default 13 words, over normalized text) reports, for every (row, item)
pair that shares a gram, both signals the literature uses: whether any n-gram is shared,
and the fraction of the item's distinct n-grams the row covers. An item shorter than n
words is one gram of its whole length, so a short benchmark question is still caught
verbatim. The configured rule ("any" or "coverage") decides removal.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from tasks.curate.config import DecontamConfig
from tasks.curate.normalize import ngram_hashes, tokenize


@dataclass
class BenchmarkGrams:
    """Distinct n-gram hashes of every benchmark item."""
    keys: list[str]          # "benchmark:item_id" per item
    grams: pl.DataFrame      # columns gram (u64), item (i64)
    totals: np.ndarray       # distinct grams per item
    short_lengths: list[int]  # word counts of items shorter than n (matched as whole grams)
    n: int


def benchmark_grams(keys: list[str], normalized: list[str], n: int) -> BenchmarkGrams:
    tokens = tokenize(normalized, "word")
    grams, owner = ngram_hashes(tokens, n, short_docs="whole")
    frame = pl.DataFrame({"gram": grams, "item": owner}).unique()
    totals = np.bincount(frame["item"].to_numpy(), minlength=len(keys)) if frame.height else np.zeros(len(keys), int)
    short = sorted({int(L) for L in tokens.lengths if 0 < L < n})
    return BenchmarkGrams(keys, frame, totals, short, n)


def ngram_overlaps(normalized_rows: list[str], bench: BenchmarkGrams) -> pl.DataFrame:
    """(row, item, shared, coverage) for every row/item pair sharing at least one gram."""
    empty = pl.DataFrame(schema={"row": pl.Int64, "item": pl.Int64, "shared": pl.UInt32, "coverage": pl.Float64})
    if not normalized_rows or bench.grams.height == 0:
        return empty
    tokens = tokenize(normalized_rows, "word")
    bench_set = bench.grams["gram"].to_numpy()
    parts = []
    for size in [bench.n, *bench.short_lengths]:
        grams, owner = ngram_hashes(tokens, size, short_docs="skip")
        hit = np.isin(grams, bench_set)   # most row grams match nothing: filter before joining
        if hit.any():
            parts.append(pl.DataFrame({"gram": grams[hit], "row": owner[hit]}))
    if not parts:
        return empty
    matched = pl.concat(parts).unique().join(bench.grams, on="gram")
    counts = matched.group_by("row", "item").agg(pl.len().cast(pl.UInt32).alias("shared"))
    totals = pl.Series("total", bench.totals[counts["item"].to_numpy()], dtype=pl.Float64)
    return counts.with_columns((pl.col("shared").cast(pl.Float64) / totals).clip(upper_bound=1.0).alias("coverage")
                               ).sort("row", "item")


@dataclass
class Contamination:
    row: np.ndarray          # row index
    reference: list[str]     # "benchmark:item_id"
    score: np.ndarray        # coverage (n-gram) or cosine (embedding)
    reason: list[str]


def ngram_contamination(overlaps: pl.DataFrame, bench: BenchmarkGrams, cfg: DecontamConfig) -> Contamination:
    """The best-covered item per contaminated row under the configured rule."""
    hits = overlaps if cfg.ngram_rule == "any" else overlaps.filter(pl.col("coverage") >= cfg.min_coverage)
    best = hits.sort(["row", "coverage", "item"], descending=[False, True, False]).unique("row", keep="first",
                                                                                       maintain_order=True)
    reason = f"ngram_overlap:{cfg.ngram_rule}_{cfg.ngram}gram"
    return Contamination(best["row"].to_numpy(), [bench.keys[i] for i in best["item"].to_list()],
                         best["coverage"].to_numpy(), [reason] * best.height)


def embedding_contamination(best_item: np.ndarray, best_score: np.ndarray, keys: list[str],
                            cfg: DecontamConfig) -> Contamination:
    rows = np.flatnonzero(best_score >= cfg.embedding_threshold)
    return Contamination(rows, [keys[best_item[r]] for r in rows], best_score[rows].astype(np.float64),
                         ["embedding_similarity"] * len(rows))
