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
        self.level_offset = 0            # windows the per-window refresh moved every phase up by
        self.dropped: set[int] = set()   # pool indices the per-window refresh took out
        # per window: domain -> the pool indices it may draw (rows without a task or level always)
        self._eligible: list[dict[str, list[int]]] = []
        for chosen in self.windows:
            self._eligible.append({d: [i for i in idx if self._in_window(i, chosen)] for d, idx in self.by_domain.items()})

    def _in_window(self, index: int, chosen: dict[str, set[int]]) -> bool:
        task, level = self.tasks[index], self.levels[index]
        return task is None or level is None or int(level) in chosen.get(task, ())

    def phase_index(self, step: int) -> int:
        return max(i for i, p in enumerate(self.phases) if p.start_step <= step)

    def _window_at(self, step: int) -> int:
        return min(self.phases[self.phase_index(step)].level_window + self.level_offset, len(self.windows) - 1)

    def _pools(self, step: int) -> dict[str, list[int]]:
        return {d: [i for i in idx if i not in self.dropped] for d, idx in self._eligible[self._window_at(step)].items()}

    def drop(self, indices: set[int]) -> set[int]:
        """Take pool ``indices`` out of every later draw; the pool keeps at least one prompt per
        domain it has, so a phase's weights still mean what they say. Returns those dropped."""
        dropped = set()
        for idx in self.by_domain.values():
            left = [i for i in idx if i not in self.dropped]
            going = [i for i in left if i in indices]
            dropped |= set(going[:len(going) - (len(going) == len(left))])
        self.dropped |= dropped
        return dropped

    def remaining(self) -> list[int]:
        return sorted(i for idx in self.by_domain.values() for i in idx if i not in self.dropped)

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
        return {t: sorted(v) for t, v in sorted(self.windows[self._window_at(step)].items())}

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


class WindowRefresh:
    """M1's data refresh at each length window: when RL advances to a longer window, the prompts
    the previous window's policy solved at every sample (at least ``min_samples`` of them, all
    verifier-correct) leave the pool, and every curriculum phase moves ``level_window_step``
    level windows up (harder synthetic levels). Open-domain prompts have no checkable solve and
    are never dropped. The per-prompt tallies and the drops ride in the stage's checkpoints."""

    def __init__(self, cfg, pool: list[dict], curriculum: Curriculum):
        self.cfg, self.pool, self.curriculum = cfg, pool, curriculum
        self.index = {r["prompt_id"]: i for i, r in enumerate(pool)}
        self.tally: dict[int, list[int]] = {}   # pool index -> [samples, correct] in this window

    def observe(self, seen: list) -> None:
        for row, _completions, scored, _round in seen:
            i = self.index[row["prompt_id"]]
            for s in scored:
                if s.scorer == "genrm" or s.correct is None:   # no checkable solve
                    continue
                counts = self.tally.setdefault(i, [0, 0])
                counts[0] += 1
                counts[1] += s.correct == 1.0

    def advance(self) -> dict[str, float]:
        """The window advanced: drop the solved prompts, shift the levels; the refresh's metrics."""
        solved = {i for i, (n, k) in self.tally.items() if n >= self.cfg.min_samples and k == n}
        dropped = self.curriculum.drop(solved)
        self.curriculum.level_offset += self.cfg.level_window_step
        self.tally = {}
        left = [self.pool[i] for i in self.curriculum.remaining()]
        shares = Counter(r["domain"] for r in left)
        return {"refresh_solved": float(len(solved)), "refresh_dropped": float(len(dropped)),
                "refresh_pool": float(len(left)), "refresh_level_offset": float(self.curriculum.level_offset),
                **{f"refresh_domain_share/{d}": n / len(left) for d, n in sorted(shares.items())},
                **{f"refresh_{k}": v for k, v in level_mix(left).items()}}

    def state_dict(self) -> dict:
        return {"tally": {str(i): c for i, c in self.tally.items()}, "dropped": sorted(self.curriculum.dropped),
                "level_offset": self.curriculum.level_offset}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.tally = {int(i): list(c) for i, c in state["tally"].items()}
            self.curriculum.dropped = set(state["dropped"])
            self.curriculum.level_offset = int(state["level_offset"])
