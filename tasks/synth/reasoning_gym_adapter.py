"""Any reasoning-gym dataset behind the SynthTask interface.

Task names are ``rg:<dataset>``. Levels map to reasoning-gym's own curriculum: level L sets
every curriculum attribute to its L-th level (clamped to the attribute's last level) and
reads the attribute as that single level's range (``RangeAttributeMode.UPPER_BOUND``), so
each level is its own difficulty, not "everything up to L". A dataset without a curriculum
has one level: its default configuration. The verifier is the dataset's ``score_answer``.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

from tasks.synth.base import LevelParams, SynthTask, TaskError, TaskInstance, extract_answer

PREFIX = "rg:"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class RGLevel(LevelParams):
    global_level: int


def _json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


@cache
def _registry() -> tuple[dict, dict]:
    # imported lazily (~1 s). The package first: its import registers every dataset, and
    # while another thread is still running it (ingest beside synthesize) `reasoning_gym.factory`
    # is already importable with half the registry; importing the package waits for it to finish
    import reasoning_gym  # noqa: F401
    from reasoning_gym.factory import CURRICULA, DATASETS
    return DATASETS, CURRICULA


def reasoning_gym_datasets() -> list[str]:
    return sorted(_registry()[0])


class ReasoningGymTask(SynthTask):
    family = "reasoning_gym"
    answer_example = "42"
    unique_answer = False   # score_answer decides; several datasets accept many answers

    def __init__(self, dataset: str):
        datasets, curricula = _registry()
        if dataset not in datasets:
            raise TaskError(f"reasoning-gym has no dataset {dataset!r}")
        self.dataset = dataset
        self.name = PREFIX + dataset
        self._dataset_cls, self._config_cls = datasets[dataset]
        self._curriculum_cls = curricula.get(dataset)
        depth = 1
        if self._curriculum_cls is not None:
            depth = max(len(a.levels) for a in self._curriculum_cls().attributes.values())
        self.levels = tuple(RGLevel(k) for k in range(depth))

    def _config(self, level: int, rg_seed: int):
        defaults = {"seed": rg_seed, "size": 1}
        if self._curriculum_cls is None:
            return self._config_cls(**defaults)
        from reasoning_gym.coaching.base_curriculum import (
            DefaultCurriculumContext,
            RangeAttributeMode,
        )
        curriculum = self._curriculum_cls()
        curriculum.set_global_level(level)
        context = DefaultCurriculumContext(mode=RangeAttributeMode.UPPER_BOUND)
        return curriculum.generate_configuration(defaults, context=context)

    def entry(self, level: int, rg_seed: int) -> dict[str, Any]:
        return _cached_entry(self.dataset, level, rg_seed, self)

    def build(self, rng: random.Random, params: RGLevel) -> tuple[str, str, dict[str, Any]]:
        rg_seed = rng.randrange(2 ** 31)
        entry = self.entry(params.global_level, rg_seed)
        answer = entry.get("answer")
        meta = {"rg_dataset": self.dataset, "rg_seed": rg_seed,
                "rg_metadata": _json_safe(entry.get("metadata", {}))}
        return entry["question"], "" if answer is None else str(answer), meta

    def verify_strict(self, instance: TaskInstance, response: Any) -> float:
        """``score_answer`` on the tagged answer; where the response tags none and the gold is one
        number, on the response's last number (lm-eval's flexible extract: a small model answers
        "1 + 4 = 5" without the tags, and reasoning-gym's own scorer still decides). ``verify``
        (never raising) goes through here too."""
        strict = super().verify_strict(instance, response)
        if strict > 0 or not isinstance(response, str) or extract_answer(response) is not None:
            return strict
        if not _NUMBER.fullmatch(instance.answer.strip()):
            return strict
        numbers = _NUMBER.findall(response.replace(",", ""))
        return super().verify_strict(instance, f"<answer>{numbers[-1]}</answer>") if numbers else strict

    def check(self, instance: TaskInstance, answer: str) -> float:
        entry = self.entry(instance.level, instance.metadata["rg_seed"])
        dataset = self._dataset_cls(config=self._config(instance.level, instance.metadata["rg_seed"]))
        return float(dataset.score_answer(answer, entry))

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        return []   # what counts as wrong is score_answer's call, not ours


@lru_cache(maxsize=4096)
def _cached_entry(dataset: str, level: int, rg_seed: int, task: ReasoningGymTask) -> dict[str, Any]:
    # regenerating from (level, seed) is exact: reasoning-gym items are seeded by config.seed + index
    return task._dataset_cls(config=task._config(level, rg_seed))[0]
