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

from tasks.synth.base import (
    LevelParams,
    SynthTask,
    TaskError,
    TaskInstance,
    TaskVerifyError,
    extract_answer,
)

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
        if strict > 0 or extract_answer(response) is not None:
            return strict
        last = last_number_answer(response, instance.answer)
        return super().verify_strict(instance, f"<answer>{last}</answer>") if last is not None else strict

    def check(self, instance: TaskInstance, answer: str) -> float:
        entry = self.entry(instance.level, instance.metadata["rg_seed"])
        dataset = self._dataset_cls(config=self._config(instance.level, instance.metadata["rg_seed"]))
        return float(dataset.score_answer(answer, entry))

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        return []   # what counts as wrong is score_answer's call, not ours


def last_number_answer(response: Any, gold: str) -> str | None:
    """The response's last number, when the gold answer is one number (else None)."""
    if not isinstance(response, str) or not _NUMBER.fullmatch(str(gold).strip()):
        return None
    numbers = _NUMBER.findall(response.replace(",", ""))
    return numbers[-1] if numbers else None


def score_ingested(meta: dict[str, Any], response: Any) -> float:
    """An ingested reasoning-gym prompt (``tasks/sources.py`` rows: ``rg_dataset``, ``rg_seed``,
    ``rg_size``, ``rg_index`` in metadata), scored by its dataset's own ``score_answer`` on the
    response's answer (the tagged one, else a ``\\boxed{}``, else the last number when the gold is
    a number), as a synthesized ``rg:`` instance is: a valid answer other than the stored one
    (another expression reaching a countdown target) scores as reasoning-gym scores it.

    Raises ``TaskVerifyError`` when the row cannot be rebuilt (unknown dataset, index out of
    range) or the scorer fails on the dataset's own answer."""
    from tasks.verify.math import extract_final_answer

    try:
        dataset = _ingested_dataset(str(meta["rg_dataset"]), int(meta["rg_seed"]), int(meta["rg_size"]))
        entry = dataset[int(meta["rg_index"])]
    except Exception as e:  # broken metadata: the row cannot be scored, said so
        raise TaskVerifyError(f"reasoning-gym row {meta!r} cannot be rebuilt ({type(e).__name__}: {e})") from e
    answer = extract_final_answer(response) if isinstance(response, str) else None
    if answer is None:
        answer = last_number_answer(response, "" if entry.get("answer") is None else str(entry["answer"]))
    if answer is None:
        return 0.0
    try:
        return float(dataset.score_answer(answer, entry))
    except Exception as e:  # noqa: BLE001 - a scorer must survive garbage, unless it fails on its gold too
        try:
            dataset.score_answer(str(entry.get("answer")), entry)
        except Exception as gold_error:  # noqa: BLE001
            raise TaskVerifyError(f"reasoning-gym {meta['rg_dataset']!r}: score_answer failed ({e}) and fails "
                                  f"on the dataset's own answer ({gold_error})") from e
        return 0.0


@lru_cache(maxsize=64)
def _ingested_dataset(dataset: str, seed: int, size: int):
    import reasoning_gym
    return reasoning_gym.create_dataset(dataset, size=size, seed=seed)


@lru_cache(maxsize=4096)
def _cached_entry(dataset: str, level: int, rg_seed: int, task: ReasoningGymTask) -> dict[str, Any]:
    # regenerating from (level, seed) is exact: reasoning-gym items are seeded by config.seed + index
    return task._dataset_cls(config=task._config(level, rg_seed))[0]
