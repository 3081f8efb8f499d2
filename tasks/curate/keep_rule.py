"""Keep rule for duplicate clusters: which member stays, and which kept row each other member goes for.

A cluster's new members are ranked (the first difference decides):
  1. a checkable answer (tests for code, an answer math-verify parses, a logic answer);
  2. source priority from the profile (lower first);
  3. the medoid: the smallest total word-level edit distance to the rest of the cluster
     (words as written, so a dropped "..." or a changed case is an edit too; each distance
     capped at a quarter of the text, see ``capped_distance``). Copies of a
     document each carry their own edits, so the original sits closest to all of them,
     while a copy padded with inserted words is far from every other member (ranking by
     length, as before, kept exactly that padded copy);
  4. a row the quality filters did not have to rewrite (its text is as submitted);
  5. fewer words: in a two-member cluster the distances tie, and padding is the common
     corruption;
  6. id, so the choice never depends on input order.
Rows kept by an earlier run are not ranked: they stay, and a new row linked to one goes.
``tasks.curate.dedup`` applies the rule once per cluster, after every dedup stage.

Removal follows direct links only. The best-ranked row is kept and takes the rows linked to
it; a row linked only through a chain of others is not a duplicate of that keeper, so it is
ranked again among what is left. (Keeping one row per connected component, as before, let a
chain through shared boilerplate remove a whole different document's cluster.)
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
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


def rank(candidates: Sequence[int], costs: Sequence[int], standing: Mapping[int, Standing]) -> list[int]:
    """Candidates best first, by the rule in the module docstring (``costs``: medoid costs)."""
    def key(i: int) -> tuple:
        s = standing[candidates[i]]
        return (not s.verifiable, s.priority, int(costs[i]), s.rewritten, s.words, s.row_id)
    return [candidates[i] for i in sorted(range(len(candidates)), key=key)]


def removals(ranked: Sequence[int], old: Iterable[int],
             links: Mapping[int, Mapping[int, tuple[int, float]]]) -> dict[int, tuple[int, int, float]]:
    """{removed row: (kept row it links to, link stage, link score)} for one linked cluster.

    ``ranked``: the cluster's new rows, best first; ``old``: its rows kept by earlier runs;
    ``links``: row -> {linked row: (stage, score)}, both directions, lower stage = stronger.
    """
    old = set(old)
    out: dict[int, tuple[int, int, float]] = {}
    for row in ranked:
        to_old = {o: link for o, link in links.get(row, {}).items() if o in old}
        if to_old:
            best = min(to_old, key=lambda o: (to_old[o][0], -to_old[o][1], o))
            out[row] = (best, *to_old[best])
    for row in ranked:
        if row in out:
            continue
        # row is kept; a linked row ranked above it is already removed (else it would have taken row)
        for other, (stage, score) in sorted(links.get(row, {}).items()):
            if other not in out and other not in old:
                out[other] = (row, stage, score)
    return out
