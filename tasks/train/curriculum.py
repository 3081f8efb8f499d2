"""RL prompt curriculum (M1): rule-verified reasoning tasks first, general tasks mixed in later.

Each phase gives domain weights from its start step on. Prompts of a step are drawn by a
generator seeded with (seed, step, round), so a resumed run draws the same prompts.
Domains a phase names but the pool lacks are skipped (their weight is renormalized away).
"""
from __future__ import annotations

import random
from collections import defaultdict

from tasks.train.config import CurriculumPhase


class Curriculum:
    def __init__(self, phases: list[CurriculumPhase], domains: list[str], seed: int = 0):
        self.phases = sorted(phases, key=lambda p: p.start_step)
        self.seed = seed
        self.by_domain: dict[str, list[int]] = defaultdict(list)
        for index, domain in enumerate(domains):
            self.by_domain[domain].append(index)
        if not self.by_domain:
            raise ValueError("the RL pool is empty")

    def phase_index(self, step: int) -> int:
        return max(i for i, p in enumerate(self.phases) if p.start_step <= step)

    def weights(self, step: int) -> dict[str, float]:
        """Domain weights of the phase active at ``step``, over the domains the pool has."""
        phase = self.phases[self.phase_index(step)]
        present = {d: w for d, w in phase.domains.items() if w > 0 and self.by_domain.get(d)}
        if not present:
            raise ValueError(f"curriculum phase at step {phase.start_step} wants {sorted(phase.domains)} "
                             f"but the RL pool only has {sorted(self.by_domain)}")
        total = sum(present.values())
        return {d: w / total for d, w in present.items()}

    def sample(self, step: int, n: int, round_: int = 0) -> list[int]:
        """``n`` pool indices for ``step``: a domain by weight, then a prompt of that domain."""
        rng = random.Random(self.seed * 1_000_003 + step * 101 + round_)
        weights = self.weights(step)
        domains = sorted(weights)
        picked = rng.choices(domains, weights=[weights[d] for d in domains], k=n)
        return [rng.choice(self.by_domain[d]) for d in picked]
