"""Paired intervals for what a stage changed on held-out items.

Every stage of a run is evaluated on the same items with the same sampling seed, so the
difference between two stages is measured *paired*: per item, the pass rate after stage B
minus the pass rate after stage A. Its 95% interval is a bootstrap over items (2,000
resamples, percentile interval); a pooled figure (the mean over families) resamples items
within each family, so every family keeps its weight. An interval that contains 0 means the
difference is within the noise of this many items and samples.
"""
from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from itertools import pairwise

import numpy as np

from data_specs.stages import last_of

REPS = 2000
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """B − A on ``benchmark`` (a family, or a pooled mean of families), paired over ``items``."""
    benchmark: str
    a: str
    b: str
    diff: float
    lo: float
    hi: float
    items: int

    @property
    def within_noise(self) -> bool:
        return self.lo <= 0.0 <= self.hi

    @property
    def fell(self) -> bool:
        """B below A beyond the interval."""
        return self.hi < 0.0

    def label(self) -> str:
        return f"{self.diff:+.2f} [{self.lo:+.2f}, {self.hi:+.2f}]"

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> Interval:
        return cls(str(d["benchmark"]), str(d["a"]), str(d["b"]), float(d["diff"]), float(d["lo"]), float(d["hi"]),
                   int(d["items"]))


def paired_bootstrap(diffs: list[np.ndarray], reps: int = REPS, level: float = LEVEL, seed: int = 0
                     ) -> tuple[float, float, float]:
    """(mean, lo, hi) of the mean over groups of each group's mean per-item difference; items
    resampled with replacement within each group."""
    groups = [np.asarray(d, dtype=np.float64) for d in diffs if len(d)]
    if not groups:
        raise ValueError("paired_bootstrap: no paired items")
    rng = np.random.default_rng(seed)
    point = float(np.mean([g.mean() for g in groups]))
    boots = np.zeros(reps)
    for g in groups:
        boots += g[rng.integers(0, len(g), size=(reps, len(g)))].mean(axis=1)
    boots /= len(groups)
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(boots, [tail, 1.0 - tail])
    return point, float(lo), float(hi)


def comparison_pairs(stages: list[str]) -> list[tuple[str, str]]:
    """What a user asks of a ladder: each stage against the one before it, RL against SFT (the
    recipe's two halves) and the last stage against the first."""
    pairs = list(pairwise(stages))
    sft, rl = last_of("sft"), last_of("rl")
    for pair in ((sft, rl), (stages[0], stages[-1]) if stages else None):
        if pair and pair[0] in stages and pair[1] in stages and pair[0] != pair[1] and pair not in pairs:
            pairs.append(pair)
    return pairs


ItemScores = Mapping[str, Mapping[tuple[str, str], float]]   # stage -> (benchmark, item_id) -> pass rate


def stage_intervals(scores: ItemScores, groups: Mapping[str, Iterable[str]],
                    pairs: list[tuple[str, str]] | None = None, reps: int = REPS, level: float = LEVEL,
                    seed: int = 0) -> list[Interval]:
    """A paired interval for every (group, pair) both stages of which scored the group's items.

    ``groups``: name -> the benchmarks it pools (a family is its own group of one)."""
    stages = list(scores)
    out: list[Interval] = []
    for name, members in groups.items():
        members = list(members)
        for a, b in pairs if pairs is not None else comparison_pairs(stages):
            if a not in scores or b not in scores:
                continue
            diffs = []
            for bench in members:
                keys = sorted(k for k in scores[a] if k[0] == bench and k in scores[b])
                if keys:
                    diffs.append(np.array([scores[b][k] - scores[a][k] for k in keys]))
            if not diffs:
                continue
            # a seed per (group, pair): an interval does not depend on which others were asked for
            key_seed = zlib.crc32(f"{seed}|{name}|{a}|{b}".encode())
            diff, lo, hi = paired_bootstrap(diffs, reps, level, key_seed)
            out.append(Interval(name, a, b, diff, lo, hi, sum(len(d) for d in diffs)))
    return out


def intervals_of(evaluated: dict | None) -> list[Interval]:
    """The intervals an evaluate result carries (as dicts: it crossed a flow's return value)."""
    return [Interval.from_dict(d) for d in (evaluated or {}).get("intervals") or []]


def find_interval(intervals: Iterable[Interval], benchmark: str, a: str, b: str) -> Interval | None:
    return next((iv for iv in intervals if (iv.benchmark, iv.a, iv.b) == (benchmark, a, b)), None)


def interval_metrics(intervals: Iterable[Interval]) -> dict[str, float]:
    """MLflow metric names ``delta.<b>_vs_<a>.<benchmark>.{diff,lo,hi}`` (under the ``eval`` prefix)."""
    out = {}
    for iv in intervals:
        for what in ("diff", "lo", "hi"):
            out[f"delta.{iv.b}_vs_{iv.a}.{iv.benchmark}.{what}"] = getattr(iv, what)
    return out


def key_pairs(intervals: Iterable[Interval]) -> set[tuple[str, str]]:
    """The comparisons shown per family: RL against SFT and the last stage against the first
    (each pooled group shows every comparison)."""
    intervals = list(intervals)
    stages = list(dict.fromkeys(s for iv in intervals for s in (iv.a, iv.b)))
    firsts = {iv.a for iv in intervals}
    lasts = {iv.b for iv in intervals}
    first = next((s for s in stages if s not in lasts), stages[0] if stages else None)
    last = next((s for s in reversed(stages) if s not in firsts), stages[-1] if stages else None)
    return {(last_of("sft"), last_of("rl")), (first, last)}


def verdict_word(iv: Interval) -> str:
    return "within noise" if iv.within_noise else ("gain" if iv.lo > 0 else "FALL")


VERDICT_STYLE = {"gain": "green", "FALL": "red", "within noise": "dim"}   # rich styles, by verdict_word


def interval_table(intervals: Iterable[Interval], order: list[str], pooled: Iterable[str] = ()) -> list[dict]:
    """Rows to print (benchmark, comparison, difference, interval, verdict) in ``order``: every
    comparison of a pooled benchmark (``pooled``, or one no other interval's name extends), the key
    comparisons of a single family."""
    intervals = list(intervals)
    keys, pooled = key_pairs(intervals), set(pooled)
    names = {iv.benchmark for iv in intervals}
    pooled |= {n for n in names if any(m.startswith(f"{n}/") for m in names)}
    rank = {b: i for i, b in enumerate(order)}
    shown = [iv for iv in intervals if iv.benchmark in pooled or (iv.a, iv.b) in keys]
    shown.sort(key=lambda iv: rank.get(iv.benchmark, len(rank)))
    return [{"benchmark": iv.benchmark, "comparison": f"{iv.b} - {iv.a}", "difference": f"{iv.diff:+.3f}",
             "interval": f"[{iv.lo:+.3f}, {iv.hi:+.3f}]", "verdict": verdict_word(iv), "items": iv.items}
            for iv in shown]
