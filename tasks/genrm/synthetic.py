"""Judge items from synthetic task instances, in the exact prompts the GenRM judge sees at
inference, with labels the task's own verifier vouches for:

- **pairwise** (``judge_pair``): the gold answer against a verifier-rejected perturbation,
  in either order. Label convention (``tasks.genrm.parse.parse_pairwise``): Answer 2 vs
  Answer 1, so ``-1`` when Answer 1 (the gold) is better, ``1`` when Answer 2 is.
- **grade** (``judge_grade``): one response, either the gold or a rejected perturbation,
  against the ground truth on the five-grade consistency scale (M1's GenRM for answers a
  rule cannot parse). Label 1 (consistent, grade 5) or 0 (inconsistent, grade 1).

One builder serves both sides of the judge's life:
- training (``tasks.train.judge_data``): SFT-side instances become SFT examples whose
  response is the verdict text the parser reads back;
- validation (``tasks.genrm.validation``): held-out instances (negative seeds, never a
  training instance) become labelled ``judge_benchmark`` items.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from tasks.genrm.prompts import grade_prompt, pairwise_prompt


def answer_text(answer: str) -> str:
    """A candidate as the policy writes it: the final answer in the tags verifiers read."""
    return f"<answer>{answer}</answer>"


def verdict_text(label: int) -> str:
    """The shortest judge output ``parse_pairwise`` reads as ``label`` (``[[-1]]``, ``[[1]]``)."""
    if label not in (-1, 0, 1):
        raise ValueError(f"pairwise label must be -1, 0 or 1, got {label!r}")
    return f"[[{label}]]"


def judge_response(gold: str, label: int) -> str:
    """A judge output to learn from: the brief explanation is the correct answer itself, in the
    candidates' own format, then the verdict (``parse_pairwise`` reads the last ``[[v]]``).

    Solving first turns the verdict into a match between the judge's own answer and the
    Answer 1 text, which a small model learns; a bare ``[[v]]`` leaves it at chance.
    """
    return f"{answer_text(gold)} {verdict_text(label)}"


CONSISTENT_GRADE, INCONSISTENT_GRADE = 5, 1


def grade_text(consistent: bool) -> str:
    """The judge output ``parse_grade`` reads as the top or bottom grade (``[[5]]``, ``[[1]]``).

    No explanation before it: the consistency check is a comparison of two short answers
    the prompt puts a few tokens apart, which a small judge learns from the verdict alone
    (measured on the tiny shape: 0.82 held-out accuracy with a bare verdict, 0.59 when it
    first restates the response's answer).
    """
    return f"[[{CONSISTENT_GRADE if consistent else INCONSISTENT_GRADE}]]"


_INTEGER = re.compile(r"-?\d+")


def _mirrored(gold: str, wrong: str, rng: random.Random) -> list[str]:
    """The perturbation, and for integer answers its mirror image around the gold, in a seeded
    order: the default perturbation only ever adds 1-3, so without the mirror "the smaller
    number is right" would judge every counting pair without reading the question."""
    if not (_INTEGER.fullmatch(gold.strip()) and _INTEGER.fullmatch(wrong.strip())):
        return [wrong]
    g, w = int(gold), int(wrong)
    mirror = 2 * g - w
    if mirror < 0 <= g:  # no negative counts (an obviously impossible answer teaches nothing): step down less
        mirror = rng.randrange(g) if g > 0 else None
    if mirror is None:
        return [wrong]
    return [wrong, str(mirror)] if rng.random() < 0.5 else [str(mirror), wrong]


def wrong_answer(task, instance, rng: random.Random) -> str | None:
    """A perturbation of the gold the task's own verifier rejects, or None."""
    try:
        for perturbed in task.perturbations(instance, rng):
            for wrong in _mirrored(instance.answer, perturbed, rng):
                if task.verify(instance, answer_text(wrong)) < 1.0:
                    return wrong
    except Exception:  # noqa: BLE001 - a task that cannot perturb just yields no pair
        return None
    return None


@dataclass(frozen=True)
class JudgePair:
    question: str   # the instance's full prompt (what the policy was asked)
    first: str      # Answer 1
    second: str     # Answer 2
    label: int      # -1: Answer 1 (gold) is better; 1: Answer 2 (gold) is better
    gold: str
    wrong: str

    def prompt(self, max_chars: int) -> str:
        """The judge's user turn, rendered by the very function ``GenRMJudge`` uses."""
        return pairwise_prompt(self.question, self.first, self.second, max_chars)


def judge_pair(task, instance, gold_second: bool, rng: random.Random) -> JudgePair | None:
    """Gold vs a rejected perturbation; ``gold_second`` puts the gold in Answer 2 (label 1)."""
    if task.verify(instance, answer_text(instance.answer)) < 1.0:
        return None  # a gold the verifier does not accept would teach the wrong verdict
    wrong = wrong_answer(task, instance, rng)
    if wrong is None:
        return None
    right, bad = answer_text(instance.answer), answer_text(wrong)
    first, second = (bad, right) if gold_second else (right, bad)
    return JudgePair(instance.prompt, first, second, 1 if gold_second else -1, instance.answer, wrong)


@dataclass(frozen=True)
class JudgeGrade:
    question: str       # the instance's full prompt
    ground_truth: str   # the gold answer, as the task states it
    response: str       # the candidate, in the policy's answer format
    label: int          # 1: consistent with the ground truth (the gold); 0: a rejected perturbation

    def prompt(self, max_chars: int) -> str:
        """The judge's user turn, rendered by the very function ``GenRMJudge.grade`` uses."""
        return grade_prompt(self.question, self.ground_truth, self.response, max_chars)


def judge_grades(task, instance, rng: random.Random,
                 consistent: tuple[bool, ...] = (True, False)) -> list[JudgeGrade] | None:
    """One grade item per entry of ``consistent``: the gold (True) or a rejected perturbation
    (False), each to be graded against the gold; None when any cannot be made. The gold is
    verified once for all of them."""
    if task.verify(instance, answer_text(instance.answer)) < 1.0:
        return None  # a gold the verifier does not accept would teach the wrong grade
    items = []
    for same in consistent:
        shown = instance.answer if same else wrong_answer(task, instance, rng)
        if shown is None:
            return None
        items.append(JudgeGrade(instance.prompt, instance.answer, answer_text(shown), 1 if same else 0))
    return items


def judge_grade(task, instance, consistent: bool, rng: random.Random) -> JudgeGrade | None:
    """The gold (``consistent``) or a rejected perturbation, to be graded against the gold."""
    items = judge_grades(task, instance, rng, (consistent,))
    return items[0] if items else None
