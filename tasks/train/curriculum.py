"""RL prompt curriculum (M1): rule-verified reasoning tasks first, general tasks mixed in later,
and synthetic tasks at harder levels later.

Each phase gives domain weights from its start step on, and the window of each synthetic
task's levels it draws from: a task's levels in the pool, easiest first, are cut into
``level_windows`` sliding windows (``curriculum_levels``, the last always holding the hardest)
and a phase draws from its ``level_window``. Prompts without a task or level (math, code,
general) are drawn in every phase. Prompts of a step are drawn by a generator seeded with
(seed, step, round), so a resumed run draws the same prompts. Domains a phase names but the
pool lacks are skipped (their weight is renormalized away); ``unused`` says which they are,
and which phases start too late to run, so the stage can warn of settings that do nothing.
"""
from __future__ import annotations

import random
from collections import Counter, defaultdict

from tasks.synth.calibration import curriculum_levels
from tasks.train.config import CurriculumPhase


def level_windows_of(tasks: list[str | None], levels: list[int | None], n_windows: int) -> list[dict[str, set[int]]]:
    """For each window 0..n_windows-1: task -> the levels it draws (from the task's distinct
    levels in the pool, easiest first, so a window is never empty)."""
    present: dict[str, set[int]] = defaultdict(set)
    for task, level in zip(tasks, levels):
        if task is not None and level is not None:
            present[task].add(int(level))
    out = []
    for window in range(n_windows):
        chosen = {}
        for task, have in present.items():
            ordered = sorted(have)
            picks = curriculum_levels({"task": task, "lower_level": 0, "upper_level": len(ordered) - 1},
                                      window, n_windows)
            chosen[task] = {ordered[i] for i in picks}
        out.append(chosen)
    return out


class Curriculum:
    def __init__(self, phases: list[CurriculumPhase], domains: list[str], seed: int = 0,
                 tasks: list[str | None] | None = None, levels: list[int | None] | None = None,
                 level_windows: int = 1):
        self.phases = sorted(phases, key=lambda p: p.start_step)
        self.seed = seed
        self.tasks = list(tasks) if tasks is not None else [None] * len(domains)
        self.levels = list(levels) if levels is not None else [None] * len(domains)
        self.by_domain: dict[str, list[int]] = defaultdict(list)
        for index, domain in enumerate(domains):
            self.by_domain[domain].append(index)
        if not self.by_domain:
            raise ValueError("the RL pool is empty")
        self.windows = level_windows_of(self.tasks, self.levels, level_windows)
        # per window: domain -> the pool indices it may draw (rows without a task or level always)
        self._eligible: list[dict[str, list[int]]] = []
        for chosen in self.windows:
            self._eligible.append({d: [i for i in idx if self._in_window(i, chosen)] for d, idx in self.by_domain.items()})

    def _in_window(self, index: int, chosen: dict[str, set[int]]) -> bool:
        task, level = self.tasks[index], self.levels[index]
        return task is None or level is None or int(level) in chosen.get(task, ())

    def phase_index(self, step: int) -> int:
        return max(i for i, p in enumerate(self.phases) if p.start_step <= step)

    def _pools(self, step: int) -> dict[str, list[int]]:
        return self._eligible[self.phases[self.phase_index(step)].level_window]

    def weights(self, step: int) -> dict[str, float]:
        """Domain weights of the phase active at ``step``, over the domains the pool has."""
        phase, pools = self.phases[self.phase_index(step)], self._pools(step)
        present = {d: w for d, w in phase.domains.items() if w > 0 and pools.get(d)}
        if not present:
            raise ValueError(f"curriculum phase at step {phase.start_step} wants {sorted(phase.domains)} "
                             f"but the RL pool only has {sorted(self.by_domain)}")
        total = sum(present.values())
        return {d: w / total for d, w in present.items()}

    def unused(self, steps: int) -> list[str]:
        """The phase settings that change nothing in a stage of ``steps`` steps on this pool: a
        phase that starts at or after the last step, and a weighted domain the pool lacks."""
        out = []
        for p in self.phases:
            if p.start_step >= steps:
                out.append(f"curriculum phase at step {p.start_step} never starts (the stage trains {steps} steps)")
                continue
            absent = sorted(d for d, w in p.domains.items() if w > 0 and d not in self.by_domain)
            if absent:
                out.append(f"curriculum phase at step {p.start_step} weights {', '.join(absent)}, which the RL "
                           f"pool has none of (it has {', '.join(sorted(self.by_domain))}): renormalized away")
        return out

    def levels_at(self, step: int) -> dict[str, list[int]]:
        """Task -> the levels the phase active at ``step`` draws."""
        return {t: sorted(v) for t, v in sorted(self.windows[self.phases[self.phase_index(step)].level_window].items())}

    def sample(self, step: int, n: int, round_: int = 0) -> list[int]:
        """``n`` pool indices for ``step``: a domain by weight, then a prompt of that domain (a
        synthetic one at a level of the phase's window)."""
        rng = random.Random(self.seed * 1_000_003 + step * 101 + round_)
        weights, pools = self.weights(step), self._pools(step)
        domains = sorted(weights)
        picked = rng.choices(domains, weights=[weights[d] for d in domains], k=n)
        return [rng.choice(pools[d]) for d in picked]


def level_mix(rows: list[dict]) -> dict[str, float]:
    """The level mix of the synthetic prompts among ``rows``: ``level_mean`` and each level's
    share (``level_share/<k>``); empty when none has a level."""
    levels = [int(r["level"]) for r in rows if r.get("task") and r.get("level") is not None]
    if not levels:
        return {}
    counts = Counter(levels)
    return {"level_mean": sum(levels) / len(levels),
            **{f"level_share/{k}": counts[k] / len(levels) for k in sorted(counts)}}
