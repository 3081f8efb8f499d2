"""Duplicate clusters across the dedup stages, and one keep decision per cluster.

The exact, MinHash and semantic stages find links; which row a cluster keeps is decided once,
after all of them, so it is chosen with every member in view. (Deciding stage by stage let
a MinHash pair settle on a trimmed copy before the semantic stage had found the rest of
the cluster, and left earlier decisions naming rows a later stage removed.)

Rows whose normalized text is identical form a unit; links join units (a row is linked
wherever its unit is). A MinHash or semantic link between two math or logic rows whose
checkable answers differ is no duplicate link: the texts are alike, the problems are not
("find all three-digit automorphic numbers" and "... four-digit ..."). Such a link still
reaches the split's leakage clusters; here it joins nothing, so neither problem is removed
in favour of the other. A cluster is a connected set of units. In each, ``keep_rule``
ranks the rows of the new units and removes along direct links; rows kept by earlier runs
stay. The decision for a removed row names the kept row it is directly linked to, the
stage of that link (the strongest kind when several link them: exact, then MinHash, then
semantic) and the link's score, and the row counts as removed by that stage.

The stages still shrink their working set to save work: MinHash hashes one row per unit and
the semantic stage encodes one unit per MinHash cluster (``provisional_removals``).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import polars as pl

from tasks.curate import keep_rule as kr
from tasks.curate.accounting import StageCount
from tasks.curate.minhash import components
from tasks.verify.math import MathVerifyTimeout, math_equal

STAGES = ("curate.exact", "curate.minhash", "curate.semantic")
REASONS = ("exact_duplicate", "near_duplicate_minhash", "near_duplicate_semantic")
EXACT, MINHASH, SEMANTIC = range(3)


@dataclass(frozen=True)
class Removal:
    row: int
    kept: int
    stage: int     # index into STAGES
    score: float


class KeepRanking:
    """The keep rule over this run's nodes: each new row's standing, every node's words and answer.

    Read-only for the blocks (it only memoizes word ids, edit distances and answer verdicts).
    ``answers``: per node, (domain, answer) for a math or logic row with a checkable answer, else None.
    """

    def __init__(self, n_old: int, node_ids: list[str], prompts: list[str], new: pl.DataFrame,
                 answers: list[tuple[str, str] | None]):
        self.n_old, self.node_ids, self.prompts, self.answers = n_old, node_ids, prompts, answers
        self._verifiable = new["verifiable"].to_list() if new.height else []
        self._priority = new["_priority"].to_list() if new.height else []
        self._rewritten = [r is not None for r in new["rewritten"].to_list()] if new.height else []
        self._ingested = new["_ingested"].to_list() if new.height else []
        self._words: dict[int, np.ndarray] = {}
        self._vocab: dict[str, int] = {}
        self._distances: dict[tuple[int, int], int] = {}
        self._same_answer: dict[tuple[str, str], bool] = {}

    def words(self, node: int) -> np.ndarray:
        """Words as written (case and punctuation kept) as vocabulary ids, for the edit costs."""
        if node not in self._words:
            words = (self.prompts[node] or "").split()
            self._words[node] = np.array([self._vocab.setdefault(w, len(self._vocab)) for w in words], dtype=np.int64)
        return self._words[node]

    def standing(self, node: int) -> kr.Standing:
        i = node - self.n_old
        return kr.Standing(bool(self._verifiable[i]), int(self._priority[i]), self._rewritten[i],
                           len(self.words(node)), int(self._ingested[i]), self.node_ids[node])

    def rank_rows(self, rows: list[int], context: list[int]) -> list[int]:
        """Rows best first by the keep rule, their edit costs taken against ``context`` rows."""
        if len(rows) < 2:
            return list(rows)
        sample = kr.evenly(context)
        consensus = kr.consensus_costs([self.words(r) for r in rows], [self.words(c) for c in sample])
        costs = [(float(c), sum(self._distance(r, s) for s in sample)) for r, c in zip(rows, consensus)]
        return kr.rank(rows, costs, {r: self.standing(r) for r in rows})

    def same_problem(self, rows_a: list[int], rows_b: list[int]) -> bool:
        """False when both sides carry checkable answers and none of one side's equals one of the other's."""
        a = {x for x in (self.answers[r] for r in rows_a) if x is not None}
        b = {x for x in (self.answers[r] for r in rows_b) if x is not None}
        return not a or not b or any(self._equal(x, y) for x in a for y in b)

    def _equal(self, a: tuple[str, str], b: tuple[str, str]) -> bool:
        if a[1] == b[1]:
            return True
        if a[0] != "math" or b[0] != "math":
            return False
        key = (min(a[1], b[1]), max(a[1], b[1]))
        if key not in self._same_answer:
            try:
                self._same_answer[key] = math_equal(*key)
            except MathVerifyTimeout:   # no verdict: kept apart, a duplicate kept beats a problem lost
                self._same_answer[key] = False
        return self._same_answer[key]

    def _distance(self, a: int, b: int) -> int:
        key = (min(a, b), max(a, b))
        if key not in self._distances:
            self._distances[key] = 0 if a == b else kr.capped_distance(self.words(a), self.words(b))
        return self._distances[key]


class DuplicateClusters:
    """Units, links between them, and the keep decision. Nodes below ``n_old`` are kept pool rows.

    The curate runner adds every block's links (``add``); blocks only query.
    """

    def __init__(self, n_nodes: int, ranking: KeepRanking):
        self.n_old, self.ranking = ranking.n_old, ranking
        self.unit = np.arange(n_nodes)
        self.rows_of: dict[int, list[int]] = {}                     # unit -> its rows, when not just itself
        self.links: dict[int, dict[int, tuple[int, float]]] = {}   # unit -> {unit: (stage, score)}
        self.answer_conflicts: set[tuple[int, int]] = set()        # unit pairs linked but answering differently

    # building
    def add(self, stage: int, pairs: np.ndarray, scores: np.ndarray) -> None:
        """Exact pairs (row, unit) put the row in that unit; other pairs link the units of their rows."""
        if stage != EXACT:
            self._add_links(stage, pairs, scores)
            return
        joined: dict[int, list[int]] = {}
        for row, unit in pairs.tolist():
            joined.setdefault(unit, [unit]).append(row)
        for unit, rows in joined.items():
            self.unit[rows] = unit
            self.rows_of[unit] = sorted(set(self.rows(unit)) | set(rows))

    def with_links(self, stage: int, pairs: np.ndarray, scores: np.ndarray) -> DuplicateClusters:
        """A copy with these links added (a block previewing what its links would join)."""
        copy = DuplicateClusters(len(self.unit), self.ranking)
        copy.unit, copy.rows_of = self.unit.copy(), dict(self.rows_of)
        copy.links = {u: dict(nb) for u, nb in self.links.items()}
        copy.answer_conflicts = set(self.answer_conflicts)
        copy.add(stage, pairs, scores)
        return copy

    def rows(self, unit: int) -> list[int]:
        return self.rows_of.get(unit, [unit])

    def _add_links(self, stage: int, pairs: np.ndarray, scores: np.ndarray) -> None:
        for (a, b), score in zip(pairs.tolist(), scores.tolist()):
            a, b = int(self.unit[a]), int(self.unit[b])
            if a == b or (a < self.n_old and b < self.n_old):
                continue   # old pool rows were settled by the run that kept them
            if not self.ranking.same_problem(self.rows(a), self.rows(b)):
                self.answer_conflicts.add((min(a, b), max(a, b)))
                continue
            link = self.links.get(a, {}).get(b)
            if link is None or (stage, -score) < (link[0], -link[1]):
                self.links.setdefault(a, {})[b] = self.links.setdefault(b, {})[a] = (stage, float(score))

    def clusters(self) -> list[list[int]]:
        """Linked units, grouped (units without links are left out)."""
        units = np.array(sorted(self.links), dtype=np.int64)
        if not len(units):
            return []
        pairs = np.array([(a, b) for a, nb in self.links.items() for b in nb if a < b], dtype=np.int64)
        labels = components(len(units), np.searchsorted(units, pairs))
        grouped: dict[int, list[int]] = {}
        for unit, label in zip(units.tolist(), labels.tolist()):
            grouped.setdefault(label, []).append(unit)
        return list(grouped.values())

    def linked_by(self, members: list[int], stage: int) -> bool:
        return any(link[0] == stage for u in members for link in self.links.get(u, {}).values())

    # deciding
    def decide(self) -> tuple[dict[int, tuple[int, int, float]], dict[int, int]]:
        """({removed unit: (kept unit, stage, score)}, {new linked unit: its best row}), from the links so far.

        Rows are ranked, not units: rows of one unit differ in case and punctuation, and the
        rest of the cluster tells which of them is written like the others. A unit's best
        row is the one of the ranking it was kept in.
        """
        removed: dict[int, tuple[int, int, float]] = {}
        best: dict[int, int] = {}

        def rank_units(units: list[int]) -> list[int]:
            rows = [r for u in units for r in self.rows(u)]
            order: dict[int, None] = {}
            for row in self.ranking.rank_rows(rows, rows):
                unit = int(self.unit[row])
                if unit not in order:
                    best[unit] = row
                    order[unit] = None
            return list(order)

        for members in self.clusters():
            removed.update(kr.removals([u for u in members if u >= self.n_old], [u for u in members if u < self.n_old],
                                       self.links, rank_units))
        return removed, best

    def provisional_removals(self) -> list[int]:
        """Units a later stage need not look at (the final decision may still keep one)."""
        return sorted(self.decide()[0])

    def settle(self, rows: Iterable[int]) -> dict[int, Removal]:
        """{removed row: Removal} for these new rows, once every stage has added its links."""
        removed, best = self.decide()

        def kept_row(unit: int) -> int:   # a pool row, a cluster's choice, or an unlinked unit's own best
            return best.get(unit, unit)

        out: dict[int, Removal] = {}
        for row in rows:
            unit = int(self.unit[row])
            if unit in removed:
                kept, stage, score = removed[unit]
                out[row] = Removal(row, kept_row(kept), stage, score)
            elif row != kept_row(unit):
                out[row] = Removal(row, kept_row(unit), EXACT, 1.0)
        return out


def stage_counts(rows_in: int, removed: Iterable[Removal]) -> list[StageCount]:
    """Per dedup stage: rows in, kept, removed by reason (each stage takes what the last kept)."""
    by_stage = Counter(r.stage for r in removed)
    out = []
    for i, stage in enumerate(STAGES):
        sc = StageCount(stage, rows_in=rows_in, kept=rows_in - by_stage[i])
        if by_stage[i]:
            sc.removed[REASONS[i]] = by_stage[i]
        out.append(sc.check())
        rows_in = sc.kept
    return out
