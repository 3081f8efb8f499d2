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
    extract_final_answer,
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

    def perturbations(self, instance: TaskInstance, rng: random.Random, limit: int = 2) -> list[str]:
        """Up to ``limit`` edits of the gold answer that the dataset's own ``score_answer`` does
        not accept (scores below 1): what counts as wrong is its call, not ours. Those it scores 0
        come first; an answer it gives partial credit (a near-miss sorted list) is still wrong.
        Candidates: a number moved by 1-3, items or words reordered, a yes/no or true/false
        flipped, the last word or character dropped (``generic_edits``)."""
        scored = [(score > 0.0, candidate) for candidate in generic_edits(instance.answer, rng)
                  if (score := self._score_or_none(instance, candidate)) is not None and score < 1.0]
        return [c for _, c in sorted(scored, key=lambda sc: sc[0])][:limit]

    def _score_or_none(self, instance: TaskInstance, answer: str) -> float | None:
        """``check``'s score, or None where the scorer fails on the answer (which proves nothing)."""
        try:
            return self.check(instance, answer)
        except Exception:  # noqa: BLE001 - any scorer failure
            return None


_FLIPS = {"yes": "no", "no": "yes", "true": "false", "false": "true", "valid": "invalid", "invalid": "valid"}


def generic_edits(gold: str, rng: random.Random) -> list[str]:
    """Edits of an answer in any format, distinct from it and from each other, in an order drawn
    from ``rng``: candidates for a wrong answer, for a scorer to confirm."""
    gold = str(gold).strip()
    out: list[str] = []
    numbers = list(_NUMBER.finditer(gold))
    for match in numbers[-1:] + numbers[:1]:
        value = match.group()
        step = rng.choice([1, 2, 3])
        moved = str(int(value) + step) if "." not in value else f"{float(value) + step:g}"
        out.append(gold[: match.start()] + moved + gold[match.end():])
    if gold.lower() in _FLIPS:
        out.append(_FLIPS[gold.lower()])
    items = [t.strip() for t in gold.split(",")] if "," in gold else []
    if len(items) > 1:
        i = rng.randrange(len(items) - 1)
        swapped = items[:i] + [items[i + 1], items[i]] + items[i + 2:]
        out.append(", ".join(swapped))
    words = gold.split()
    if len(words) > 1:
        out.append(" ".join(reversed(words)))
        out.append(" ".join(words[:-1]))
    if len(gold) > 1:
        out.append(gold[::-1])
        out.append(gold[:-1])
    out.append(f"{gold}x" if gold else "x")
    rng.shuffle(out)
    seen, unique = {gold}, []
    for candidate in out:
        if candidate.strip() and candidate not in seen:
            seen.add(candidate)
            unique.append(candidate)
    return unique


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
