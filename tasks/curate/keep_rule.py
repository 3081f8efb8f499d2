"""Keep rule for duplicate clusters: which member stays, and which kept row each other member goes for.

A cluster's new members are ranked (the first difference decides):
  1. a checkable answer (tests for code, an answer math-verify parses, a logic answer);
  2. source priority from the profile (lower first);
  3. the consensus cost: the words a member has beyond the cluster's consensus, each word
     at its median count over the members (words as written, so a changed case is an edit
     too). Copies of a document each carry their own edits, so only the original has no
     word the majority lacks; a padded copy's extra words are outvoted. Words a member
     lacks cost nothing here: two copies padded with the same boilerplate are a majority,
     and counting the prefix the original lacks kept a padded copy. (A sum of pairwise edit
     distances alone, the medoid, let two copies that shared an edit, or a header that
     happened to align with another copy's padding, pull the choice to a copy.) A truncated
     copy ties with the original here and loses on the medoid;
  4. the medoid: the smallest total word-level edit distance to the rest of the cluster
     (each distance capped at a quarter of the text, see ``capped_distance``), which sees
     word order where the consensus does not;
  5. a row the quality filters did not have to rewrite (its text is as submitted);
  6. fewer words: where both costs tie (a pair one word apart), padding is the common corruption;
  7. earliest ingested, then id, so the choice never depends on the order rows reach the rule.
Rows kept by an earlier run are not ranked: they stay, and a new row linked to one goes.
``tasks.curate.dedup`` applies the rule once per cluster, after every dedup stage.

Removal follows direct links only (``removals``). The best-ranked row is kept and takes the
rows linked to it; a row linked only through a chain of others is not a duplicate of that
keeper, so it stays for the next round, where what is left is ranked again against itself.
(Keeping one row per connected component, as before, let a chain through shared
boilerplate remove a whole different document's cluster; ranking the rest against the
whole cluster kept the copy closest to the other document.)
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

MAX_CONTEXT = 32   # members a candidate is compared with; a larger cluster is sampled evenly


@dataclass(frozen=True)
class Standing:
    """What the keep rule reads about one new row."""
    verifiable: bool
    priority: int
    rewritten: bool
    words: int
    ingested: int     # position in ingestion order (earlier first)
    row_id: str


def edit_distance(a: np.ndarray, b: np.ndarray) -> int:
    """Levenshtein distance between two token sequences (unit cost insert, delete, substitute)."""
    a, b = _strip_common_ends(a, b)
    if len(a) < len(b):
        a, b = b, a            # loop over the longer, vectorize over the shorter
    if not len(b):
        return len(a)
    offsets = np.arange(len(b) + 1)
    prev = offsets.copy()
    for i, token in enumerate(a, 1):
        cur = np.empty_like(prev)
        cur[0] = i
        cur[1:] = np.minimum(prev[1:] + 1, prev[:-1] + (b != token))   # delete, substitute
        prev = np.minimum.accumulate(cur - offsets) + offsets           # then insertions, left to right
    return int(prev[-1])


def _strip_common_ends(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Near-duplicates share long prefixes and suffixes; they cost nothing and need no table."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    head = int(differ[0]) if len(differ) else n
    a, b = a[head:], b[head:]
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[::-1][:n] != b[::-1][:n])
    tail = int(differ[0]) if len(differ) else n
    return a[:len(a) - tail], b[:len(b) - tail]


def evenly(items: Sequence[int], limit: int = MAX_CONTEXT) -> list[int]:
    """At most ``limit`` of ``items`` (sorted), evenly spaced: deterministic and spread out."""
    items = sorted(set(items))
    if len(items) <= limit:
        return items
    return [items[i] for i in np.linspace(0, len(items) - 1, limit).round().astype(int)]


def capped_distance(a: np.ndarray, b: np.ndarray) -> int:
    """Edit distance, at most a quarter of the longer text.

    A cluster can hold two similar documents; past that many edits a member is the other
    document, and its distance, the same for every candidate, should not sway the choice.
    """
    cap = max(1, -(-max(len(a), len(b)) // 4))
    return min(edit_distance(a, b), cap)


def consensus_costs(candidates: Sequence[np.ndarray], context: Sequence[np.ndarray]) -> np.ndarray:
    """Per candidate (word ids): its words beyond the context's consensus text, each word at
    its median count over the context members (words it lacks cost nothing here)."""
    vocab = np.unique(np.concatenate([np.zeros(0, np.int64), *candidates, *context]))

    def counts(words: np.ndarray) -> np.ndarray:
        return np.bincount(np.searchsorted(vocab, words), minlength=len(vocab))

    consensus = np.median(np.stack([counts(w) for w in context]), axis=0)
    return np.array([float(np.maximum(counts(w) - consensus, 0).sum()) for w in candidates])


def rank(candidates: Sequence[int], costs: Sequence[tuple[float, int]],
         standing: Mapping[int, Standing]) -> list[int]:
    """Candidates best first, by the rule in the module docstring (``costs``: consensus and medoid costs)."""
    def key(i: int) -> tuple:
        s = standing[candidates[i]]
        return (not s.verifiable, s.priority, *costs[i], s.rewritten, s.words, s.ingested, s.row_id)
    return [candidates[i] for i in sorted(range(len(candidates)), key=key)]


def removals(new: Iterable[int], old: Iterable[int], links: Mapping[int, Mapping[int, tuple[int, float]]],
             rank_left: Callable[[list[int]], list[int]]) -> dict[int, tuple[int, int, float]]:
    """{removed row: (kept row it links to, link stage, link score)} for one linked cluster.

    ``new``: the cluster's new rows; ``old``: its rows kept by earlier runs; ``links``: row ->
    {linked row: (stage, score)}, both directions, lower stage = stronger; ``rank_left(rows)``:
    those rows best first, ranked against each other.

    A new row linked to an old one goes to it (its strongest such link). The rest go in
    rounds: the best-ranked row left is kept and takes the rows left that link to it. Once
    a round has settled half the rows it started with, the rows still left are ranked again
    among themselves (the next document of a chain is judged by its own copies, and a large
    cluster is ranked a logarithmic number of times, not once per kept row).
    """
    old = set(old)
    out: dict[int, tuple[int, int, float]] = {}
    for row in sorted(new):
        to_old = {o: link for o, link in links.get(row, {}).items() if o in old}
        if to_old:
            best = min(to_old, key=lambda o: (to_old[o][0], -to_old[o][1], o))
            out[row] = (best, *to_old[best])
    left = {row for row in new if row not in out}
    while left:
        floor = len(left) // 2
        for row in rank_left(sorted(left)):
            if row not in left:
                continue
            left.discard(row)     # kept
            for other, (stage, score) in sorted(links.get(row, {}).items()):
                if other in left:
                    out[other] = (row, stage, score)
                    left.discard(other)
            if len(left) <= floor:
                break
    return out
