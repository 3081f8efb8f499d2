"""Automatic difficulty calibration (MiniMax-M1 on SynLogic) and the level curriculum.

For each task the levels are probed in order, easiest first:
- upper bound: the hardest level at which a strong solver still has pass@k > 0 (k = 10);
- lower bound: the lowest level at which the base solver's pass rate lies in (0, 0.5).
Difficulty is assumed to grow with level, so probing stops once the strong solver fails
``stop_after_unsolved`` levels in a row. Training then draws from [lower, upper], moving
toward ``upper`` in later stages (``curriculum_levels``).
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tasks.passk import pass_at_k
from tasks.rollout.base import RolloutBackend, SamplingParams
from tasks.rollout.chat import render_prompt
from tasks.synth.base import SynthTask, TaskInstance, stable_int
from tasks.synth.config import CalibrationConfig

# solve(prompts, n, seed) -> n completions per prompt
Solver = Callable[[list[str], int, int], list[list[str]]]

STATUS_BAND = "band"            # lower found inside the base band, upper found
STATUS_BASE_ZERO = "base_zero"  # base never in (0, 0.5): lower is the first level it drops below 0.5
STATUS_TOO_EASY = "too_easy"    # base >= 0.5 at every solvable level: lower = upper = hardest solvable
STATUS_TOO_HARD = "too_hard"    # strong pass@k = 0 already at level 0


@dataclass
class LevelProbe:
    level: int
    instances: int
    base_pass_rate: float
    strong_pass_at_k: float


@dataclass
class CalibrationResult:
    task: str
    n_levels: int
    lower_level: int
    upper_level: int
    status: str
    probes: list[LevelProbe] = field(default_factory=list)

    def to_row(self, cfg: CalibrationConfig, base_name: str, strong_name: str) -> dict[str, Any]:
        return {
            "task": self.task, "n_levels": self.n_levels, "lower_level": self.lower_level,
            "upper_level": self.upper_level, "status": self.status,
            "probes": json.dumps([asdict(p) for p in self.probes], separators=(",", ":")),
            "instances_per_level": cfg.instances_per_level, "base_samples": cfg.base_samples,
            "strong_samples": cfg.strong_samples, "strong_k": cfg.strong_k,
            "base_solver": base_name, "strong_solver": strong_name,
        }


def rollout_solver(backend: RolloutBackend, params: SamplingParams, chat: bool = True) -> Solver:
    """Adapt a RolloutBackend to the solver signature (chat-formatting prompts when asked)."""
    def solve(prompts: list[str], n: int, seed: int) -> list[list[str]]:
        rendered = [render_prompt(backend.format_chat, p, "logic") for p in prompts] if chat else prompts
        completions = backend.generate(rendered, replace(params, n=n, seed=seed))
        return [[c.text for c in row] for row in completions]
    return solve


def probe_instances(task: SynthTask, level: int, n_instances: int, seed: int) -> list[TaskInstance]:
    """The instances a calibration probe of ``task`` at ``level`` asks about (deterministic)."""
    return [task.generate(stable_int("calibration", task.name, level, i, seed), level)
            for i in range(n_instances)]


def _probe(task: SynthTask, level: int, solver: Solver, n_instances: int, n_samples: int,
           seed: int) -> list[tuple[TaskInstance, list[str], list[float]]]:
    """(instance, responses, scores) for each probe instance of ``task`` at ``level``."""
    instances = probe_instances(task, level, n_instances, seed)
    outputs = solver([inst.prompt for inst in instances], n_samples,
                     stable_int("calibration-solve", task.name, level, seed))
    if len(outputs) != len(instances):
        raise ValueError(f"solver returned {len(outputs)} rows for {len(instances)} prompts")
    return [(inst, list(responses), [task.verify(inst, r) for r in responses])
            for inst, responses in zip(instances, outputs)]


def _counts(probed: list[tuple[TaskInstance, list[str], list[float]]], threshold: float,
            first: int | None = None) -> list[tuple[int, int]]:
    """(samples, correct samples) per instance, of its first ``first`` samples (all: None)."""
    return [(len(scores[:first]), sum(x >= threshold for x in scores[:first])) for _, _, scores in probed]


def _records(probed: list[tuple[TaskInstance, list[str], list[float]]], level: int, role: str,
             threshold: float) -> list[dict]:
    return [{"level": level, "solver": role, "instance_id": inst.id, "sample": i, "response": r,
             "score": float(x), "correct": bool(x >= threshold)}
            for inst, responses, scores in probed for i, (r, x) in enumerate(zip(responses, scores))]


def probe_level(task: SynthTask, level: int, solver: Solver, n_instances: int, n_samples: int,
                seed: int, correct_threshold: float = 1.0) -> list[tuple[int, int]]:
    """(samples, correct samples) per probe instance of ``task`` at ``level``."""
    return _counts(_probe(task, level, solver, n_instances, n_samples, seed), correct_threshold)


def mean_pass_at_k(counts: list[tuple[int, int]], k: int) -> float:
    return sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)


def mean_pass_rate(counts: list[tuple[int, int]]) -> float:
    return sum(c / n for n, c in counts) / len(counts)


def choose_band(probes: list[LevelProbe], base_band: tuple[float, float]) -> tuple[int, int, str]:
    """(lower, upper, status) from the probes of consecutive levels starting at 0."""
    solvable = [p for p in probes if p.strong_pass_at_k > 0]
    if not solvable or probes[0].strong_pass_at_k == 0:
        return 0, 0, STATUS_TOO_HARD
    # levels are solvable up to the first unsolved one (difficulty is monotone by design)
    upper = probes[0].level
    for p in probes:
        if p.strong_pass_at_k == 0:
            break
        upper = p.level
    lo, hi = base_band
    usable = [p for p in probes if p.level <= upper]
    inside = [p for p in usable if lo < p.base_pass_rate < hi]
    if inside:
        return inside[0].level, upper, STATUS_BAND
    below = [p for p in usable if p.base_pass_rate < hi]
    if below:
        return below[0].level, upper, STATUS_BASE_ZERO
    return upper, upper, STATUS_TOO_EASY


def calibrate_task(task: SynthTask, base: Solver, strong: Solver, cfg: CalibrationConfig,
                   samples: list[dict] | None = None) -> CalibrationResult:
    """Probe ``task``'s levels, easiest first, until the strong solver fails
    ``stop_after_unsolved`` in a row, and choose its band. When ``strong`` is ``base`` (no
    stronger model: the model's own pass@k is the upper bound) each probe instance is sampled
    once, ``strong_samples`` times, and the base pass rate reads the first ``base_samples``.
    ``samples`` collects every response (``probe_level``)."""
    probes: list[LevelProbe] = []
    unsolved_run = 0
    shared = strong is base
    threshold = cfg.correct_threshold
    for level in range(task.n_levels):
        if shared:
            strong_probed = _probe(task, level, strong, cfg.instances_per_level,
                                   max(cfg.strong_samples, cfg.base_samples), cfg.seed)
            base_counts = _counts(strong_probed, threshold, cfg.base_samples)
            drawn = _records(strong_probed, level, "strong", threshold)
        else:
            base_probed = _probe(task, level, base, cfg.instances_per_level, cfg.base_samples, cfg.seed)
            strong_probed = _probe(task, level, strong, cfg.instances_per_level, cfg.strong_samples, cfg.seed + 1)
            base_counts = _counts(base_probed, threshold)
            drawn = _records(base_probed, level, "base", threshold) + _records(strong_probed, level, "strong",
                                                                                threshold)
        strong_counts = _counts(strong_probed, threshold)
        if samples is not None:
            samples += drawn
        probe = LevelProbe(level, len(base_counts), mean_pass_rate(base_counts),
                           mean_pass_at_k(strong_counts, cfg.strong_k))
        probes.append(probe)
        unsolved_run = unsolved_run + 1 if probe.strong_pass_at_k == 0 else 0
        if unsolved_run >= cfg.stop_after_unsolved:
            break
    lower, upper, status = choose_band(probes, cfg.base_band)
    return CalibrationResult(task.name, task.n_levels, lower, upper, status, probes)


def curriculum_levels(calibration_row: Mapping[str, Any], stage: int, n_stages: int) -> list[int]:
    """Levels to draw from in ``stage`` (0-based) of ``n_stages``: a window over [lower, upper]
    that slides to harder levels in later stages; the last stage always includes ``upper``."""
    if n_stages < 1 or not 0 <= stage < n_stages:
        raise ValueError(f"stage must be in [0, {n_stages}), got {stage}")
    lower, upper = int(calibration_row["lower_level"]), int(calibration_row["upper_level"])
    if upper < lower:
        raise ValueError(f"calibration row for {calibration_row.get('task')!r}: upper {upper} < lower {lower}")
    levels = list(range(lower, upper + 1))
    start = math.floor(stage * len(levels) / n_stages)
    end = max(start + 1, math.ceil((stage + 1) * len(levels) / n_stages))
    return levels[min(start, len(levels) - 1):end]
