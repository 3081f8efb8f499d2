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
        self.task_offset: dict[str, int] = {}   # windows a task's re-measured pass rate moved it by
        self.dropped: set[int] = set()   # pool indices the per-window refresh took out

    def phase_index(self, step: int) -> int:
        return max(i for i, p in enumerate(self.phases) if p.start_step <= step)

    def _window_at(self, step: int, task: str | None = None) -> int:
        """The level window ``task`` draws from at ``step`` (None: the phase's, for every task)."""
        base = self.phases[self.phase_index(step)].level_window + self.level_offset
        return max(0, min(base + self.task_offset.get(task, 0), len(self.windows) - 1))

    def _in_window(self, index: int, step: int) -> bool:
        task, level = self.tasks[index], self.levels[index]
        return task is None or level is None or int(level) in self.windows[self._window_at(step, task)].get(task, ())

    def _pools(self, step: int) -> dict[str, list[int]]:
        """domain -> the pool indices it may draw at ``step`` (rows without a task or level always)."""
        return {d: [i for i in idx if i not in self.dropped and self._in_window(i, step)]
                for d, idx in self.by_domain.items()}

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
        return {t: sorted(self.windows[self._window_at(step, t)].get(t, ())) for t in sorted(self.windows[0])}

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


def checked_samples(seen: list):
    """(row, solved) of every sample of a step whose correctness a verifier decided (a GenRM
    sample, pairwise or graded, has no checkable solve), from the step's (row, completions, scored,
    round) groups."""
    for row, _completions, scored, _round in seen:
        for s in scored:
            if not s.scorer.startswith("genrm") and s.correct is not None:
                yield row, s.correct == 1.0


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
        for row, correct in checked_samples(seen):
            counts = self.tally.setdefault(self.index[row["prompt_id"]], [0, 0])
            counts[0] += 1
            counts[1] += correct

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
        return {"tally": {str(i): list(c) for i, c in self.tally.items()}, "dropped": sorted(self.curriculum.dropped),
                "level_offset": self.curriculum.level_offset}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.tally = {int(i): list(c) for i, c in state["tally"].items()}
            self.curriculum.dropped = set(state["dropped"])
            self.curriculum.level_offset = int(state["level_offset"])


class AdaptiveLevels:
    """Calibration against the improving policy (M1 moves levels as the model learns): every
    ``every_steps`` steps, each synthetic task's pass rate over the samples the policy drew of it
    since the last measure (verifier correctness, at least ``min_samples``) moves its level window
    up one when above ``raise_above`` and down one when below ``lower_below``, within the pool's
    windows. The measure uses the RL samples themselves, so it costs no sampling. Counts and
    offsets ride in the stage's checkpoints."""

    def __init__(self, cfg, pool: list[dict], curriculum: Curriculum):
        self.cfg, self.curriculum = cfg, curriculum
        self.index = {r["prompt_id"]: i for i, r in enumerate(pool)}
        self.counts: dict[str, list[int]] = {}   # task -> [samples, correct] since the last measure

    def observe(self, seen: list) -> None:
        for row, correct in checked_samples(seen):
            task = self.curriculum.tasks[self.index[row["prompt_id"]]]
            if task is not None:
                counts = self.counts.setdefault(task, [0, 0])
                counts[0] += 1
                counts[1] += correct

    def due(self, step: int) -> bool:
        return (step + 1) % self.cfg.every_steps == 0

    def measure(self, step: int) -> dict[str, float]:
        """Move the tasks whose rate left the band; the measure's metrics."""
        cur, moves, out = self.curriculum, 0, {}
        last = len(cur.windows) - 1
        for task, (n, k) in sorted(self.counts.items()):
            if n < self.cfg.min_samples:
                continue
            rate, window = k / n, cur._window_at(step, task)
            move = 1 if rate > self.cfg.raise_above and window < last else -1 if rate < self.cfg.lower_below and window > 0 else 0
            cur.task_offset[task] = cur.task_offset.get(task, 0) + move
            moves += move != 0
            out[f"adaptive_pass_rate/{task}"] = rate
            out[f"adaptive_window/{task}"] = float(cur._window_at(step + 1, task))
        self.counts = {}
        return {"adaptive_moves": float(moves), **out}

    def state_dict(self) -> dict:
        return {"counts": {t: list(c) for t, c in self.counts.items()}, "task_offset": dict(self.curriculum.task_offset)}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.counts = {t: list(c) for t, c in state["counts"].items()}
            self.curriculum.task_offset = dict(state["task_offset"])
