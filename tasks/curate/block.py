"""What a curate block reads and what it returns.

A block does one job (filter, exact, MinHash, semantic, keep, decontaminate, split). It
reads a ``CurationView`` (the run's rows, never written by a block) and returns a
``BlockResult``: the decisions it made (a removed row with its reason, the kept row or
benchmark item it matched and the score), the duplicate links it found, its stage counts
(rows in = kept + removed by reason) and its own counters. The runner in
``tasks.curate.pipeline`` applies results one by one and checks that every row is accounted for.

Nodes number the rows a block can see: pool rows kept by earlier runs first (0..n_old-1),
then this run's rows that passed the filter, in keep-rule order (``_ingested`` keeps their
place in ingestion order, the keep rule's last tie-break before the id).
"""
from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import polars as pl

from tasks.curate.accounting import StageCount
from tasks.curate.dedup import DuplicateClusters, KeepRanking
from tasks.curate.filters import answer_parses
from tasks.curate.split import LinkGraph
from tasks.text import normalize_series, text_hash

DEFAULT_SOURCE_PRIORITY = 100


@dataclass(frozen=True)
class Decision:
    """One row of the ``decisions`` table: a removed row, or a kept row a rule rewrote."""
    row_id: str
    stage: str
    reason: str
    reference_id: str | None = None
    score: float | None = None
    rewritten: bool = False


@dataclass(frozen=True)
class Links:
    """Duplicate links: ``pairs`` (k x 2 nodes), one score each; ``kind`` is a dedup stage (dedup.EXACT...)."""
    kind: int
    pairs: np.ndarray
    scores: np.ndarray

    @staticmethod
    def between(kind: int, a: np.ndarray, b: np.ndarray, scores: np.ndarray) -> Links:
        pairs = np.stack([np.asarray(a, np.int64), np.asarray(b, np.int64)], axis=1).reshape(-1, 2)
        return Links(kind, pairs, np.asarray(scores, np.float64))


@dataclass
class BlockResult:
    counts: list[StageCount] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    links: list[Links] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    similarities: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class CurationView:
    """The run's rows as a block sees them. ``clusters`` and ``links`` are read through their
    query methods only; the runner is their one writer."""
    incoming: pl.DataFrame       # this run's unseen prompts, as ingested (the filter's input)
    old: pl.DataFrame            # pool rows kept by earlier runs
    new: pl.DataFrame            # rows past the filter, rewritten, with _norm, text_hash, verifiable, _priority
    node_ids: list[str]
    prompts: list[str]           # prompt per node
    removed: np.ndarray          # bool per node (read-only)
    clusters: DuplicateClusters  # exact units and dedup links so far, and the keep rule
    links: LinkGraph             # every duplicate link so far (the split's leakage clusters)

    @property
    def n_old(self) -> int:
        return self.old.height

    def live_new(self) -> np.ndarray:
        """This run's nodes not removed yet."""
        return np.flatnonzero(~self.removed[self.n_old:]) + self.n_old

    def unit_heads(self) -> np.ndarray:
        """Live new nodes that stand for their exact-duplicate unit (the others share its text)."""
        nodes = self.live_new()
        return nodes[self.clusters.unit[nodes] == nodes]


class Block(Protocol):
    name: str     # the step name: "filter", "exact", ...

    def run(self, rows: CurationView) -> BlockResult: ...


def verifiable(domain: str, answer: str | None, tests: str | None) -> bool:
    """A rule can check the answer: tests for code, a parseable math answer, a logic answer."""
    if domain == "code":
        return bool((tests or "").strip())
    if domain == "math":
        return answer_parses((answer or "").strip())
    return domain == "logic" and bool((answer or "").strip())


def checkable_answers(rows: pl.DataFrame) -> list[tuple[str, str] | None]:
    """Per row: (domain, answer without spaces) for a math or logic row with a checkable answer, else None.

    Two such rows that answer differently are different problems, however alike their text.
    """
    return [(d, "".join(unicodedata.normalize("NFKC", a).split()).strip("$"))
            if ok and d in ("math", "logic") else None
            for d, a, ok in zip(rows["domain"].to_list(), rows["answer"].to_list(), rows["verifiable"].to_list())]


def candidate_rows(kept: pl.DataFrame, source_priority: dict[str, int]) -> pl.DataFrame:
    """Rows past the filter (in ingestion order) with what the dedup blocks and the keep rule
    read, in a deterministic order."""
    rows = kept.with_columns(normalize_series(kept["prompt"]).alias("_norm"),
                             pl.int_range(pl.len(), dtype=pl.Int64).alias("_ingested"))
    rows = rows.with_columns(
        pl.Series("text_hash", [text_hash(t) for t in rows["_norm"].to_list()], dtype=pl.Utf8),
        pl.Series("verifiable", [verifiable(d, a, t) for d, a, t in
                                 zip(rows["domain"], rows["answer"], rows["tests"])], dtype=pl.Boolean))
    priority = rows["source"].replace_strict(source_priority, default=DEFAULT_SOURCE_PRIORITY,
                                             return_dtype=pl.Int64) if rows.height else pl.Series([], dtype=pl.Int64)
    return (rows.with_columns(priority.alias("_priority"))
            .sort(["verifiable", "_priority", "id"], descending=[True, False, False]))


def node_space(old: pl.DataFrame, new: pl.DataFrame) -> tuple[list[str], list[str], DuplicateClusters, LinkGraph]:
    """(node ids, prompts, empty duplicate clusters, empty link graph) over old pool rows then new rows."""
    node_ids = old["id"].to_list() + new["id"].to_list()
    prompts = old["prompt"].to_list() + new["prompt"].to_list()
    ranking = KeepRanking(old.height, node_ids, prompts, new, checkable_answers(old) + checkable_answers(new))
    return node_ids, prompts, DuplicateClusters(len(node_ids), ranking), LinkGraph(len(node_ids))
