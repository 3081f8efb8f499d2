"""GenRM judge examples inside SFT: the policy learns the judge's two jobs on items it can check.

From SFT-side synthetic instances (``tasks.genrm.synthetic``), in the judge's own prompts:

- **grade** examples: the gold answer or a verifier-rejected perturbation graded against
  the ground truth; the response is the bare grade (``[[5]]`` consistent, ``[[1]]`` not).
  Every instance used gives both, so the two grades are exactly balanced and the verdict
  can only come from comparing the response with the ground truth.
- **pairwise** examples: gold vs a rejected perturbation as Answer 1 / Answer 2, the
  response the correct answer then the verdict (``[[-1]]``: Answer 1 better, ``[[1]]``:
  Answer 2 better). Within a task the gold's slot alternates over a seeded shuffle:
  both orders, balanced, so position alone never predicts the verdict. These teach the
  comparison format the references flow and the RL GenRM read; judging which of two
  answers is right needs solving the task, so their accuracy follows the policy's.

- **open pairwise** examples (``open_pair_rows``): an open SFT-pool prompt (general /
  instruction, no verifier) with its own reference answer against another open prompt's,
  in either order, the response the bare verdict. An answer to a different request is
  worse by construction, so the label needs no verifier; these teach the verdict format on
  the requests the reference tournaments and the RL GenRM judge, which synthetic
  instances never look like (a judge trained on those alone writes a "solved answer" to an
  open request and loses its verdict in it).

About ``pairwise_share`` of a task's ``per_task`` examples are pairwise, the rest grade (an
even number); grade and pairwise examples come from different instances.

Rows are shaped like every other ``sft_data`` source row, with ``domain = "judge"``,
``source_table = "synthetic_tasks"`` and ``source_id`` the instance the item came from;
their prompt *contains* the instance's prompt instead of equalling it.

Nothing is skipped unseen: a ``JudgeAccount`` says what became of every instance offered (used,
skipped with its reason, or left over once its task had its examples), names the tasks that
gave no example at all, and lists each instance that gave none by id with its reason (the
builder writes them as ``decisions`` rows). A reasoning-gym task's wrong answer is an edit of
its gold that the dataset's own ``score_answer`` rejects.
"""
from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tasks.genrm.config import JUDGE_DOMAIN, JudgeConfig
from tasks.genrm.prompts import pairwise_prompt
from tasks.genrm.synthetic import (
    answer_text,
    grade_text,
    judge_grades,
    judge_pair,
    judge_response,
    verdict_text,
)

log = logging.getLogger("posttrain.train.judge_data")

# candidates and question are shown whole: tiny prompts are far below the default cut
DEFAULT_MAX_CHARS = JudgeConfig().max_response_chars


@dataclass
class JudgeAccount:
    """What became of the synthetic instances offered to the judge builder: ``used`` (they gave
    examples), ``skipped`` by reason, ``unused`` (their task had its examples before they were
    reached); and the tasks that gave none. offered = used + skipped + unused.

    ``removed``: each instance that gave no example, as (instance id, reason, task), the reason
    one of ``skipped``'s or ``unused``: one entry per instance skipped or unused."""
    offered: int = 0
    used: int = 0
    unused: int = 0
    skipped: Counter = field(default_factory=Counter)
    tasks_without_examples: list[str] = field(default_factory=list)
    removed: list[tuple[str, str, str | None]] = field(default_factory=list)

    def skip(self, instance: dict, reason: str) -> None:
        """An instance (a ``_task_instances`` row) that gave no example, and why."""
        self.skipped[reason] += 1
        self.removed.append((str(instance["_id"]), reason, instance.get("task")))

    def leave(self, instances: list[dict]) -> None:
        """Instances not reached: their task had its examples first."""
        self.unused += len(instances)
        self.removed += [(str(r["_id"]), "unused", r.get("task")) for r in instances]

    def counters(self) -> dict[str, int]:
        out = {"judge_instances_offered": self.offered, "judge_instances_used": self.used,
               "judge_instances_unused": self.unused,
               "judge_tasks_without_examples": len(self.tasks_without_examples)}
        out.update({f"judge_instances_skipped_{reason}": n for reason, n in sorted(self.skipped.items())})
        return out


class _NoItem(Exception):
    """An instance that yields no judge item, and why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _why_no_item(task, instance) -> str:
    """Why ``judge_grades`` / ``judge_pair`` made nothing of an instance: its verifier failed on
    it (``verify_error``), it rejects the gold (``gold_not_verified``), the task offers no
    perturbation to be the wrong answer (``no_perturbation``), or none it offers
    was a wrong answer the verifier rejects (``no_wrong_answer``). Drawn with a generator of its
    own: the builder's draws stay as they are."""
    from tasks.synth.base import TaskVerifyError

    try:
        if task.verify_strict(instance, answer_text(instance.answer)) < 1.0:
            return "gold_not_verified"
    except TaskVerifyError:
        return "verify_error"
    try:
        offered = task.perturbations(instance, random.Random(0))
    except Exception:  # noqa: BLE001 - a task that cannot perturb this instance offers none
        offered = []
    return "no_wrong_answer" if offered else "no_perturbation"


def _task_instances(rows: dict[str, dict]) -> dict[str, list[dict]]:
    by_task: dict[str, list[dict]] = {}
    for pid, r in rows.items():
        if r.get("_table") == "synthetic_tasks" and r.get("task"):
            by_task.setdefault(str(r["task"]), []).append({**r, "_id": pid})
    return by_task


def _take(candidates: Iterator[dict], wanted: int, max_chars: int,
          make: Callable[[object, int], list[dict]], account: JudgeAccount) -> list[dict]:
    """Examples from instances in turn until ``wanted``; ``make(instance, made_so_far)`` gives an
    instance's examples (raising ``_NoItem`` when it yields no valid item). An instance pulled is
    an instance used, or skipped with its reason in ``account``.

    An instance whose question is longer than ``max_chars`` is skipped (``too_long``): the
    judge's prompt would cut it, teaching a verdict on a problem it cannot see whole (and the
    audit would rightly find a training prompt that no longer contains its instance).
    """
    from tasks.verify.registry import synth_instance

    out: list[dict] = []
    for r in candidates if wanted > 0 else ():
        if len(str(r.get("prompt") or "")) > max_chars:
            account.skip(r, "too_long")
            continue
        try:
            made = make(synth_instance(r), len(out))
        except _NoItem as why:
            account.skip(r, why.reason)
            continue
        except Exception:  # noqa: BLE001 - a row that cannot be rebuilt is skipped, counted
            account.skip(r, "not_rebuilt")
            continue
        account.used += 1
        out += [{"source_id": r["_id"], **ex} for ex in made]
        if len(out) >= wanted:
            break
    return out


def _grade_examples(task, candidates: Iterator[dict], wanted: int, rng: random.Random,
                    max_chars: int, account: JudgeAccount) -> list[dict]:
    """``wanted`` grade examples, two per instance (consistent, then inconsistent)."""
    def make(instance, _made: int) -> list[dict]:
        items = judge_grades(task, instance, rng)
        if items is None:  # both grades or neither: the balance is what makes the verdict a comparison
            raise _NoItem(_why_no_item(task, instance))
        return [{"prompt": item.prompt(max_chars), "response": grade_text(bool(item.label))} for item in items]
    return _take(candidates, wanted, max_chars, make, account)


def _pairwise_examples(task, candidates: Iterator[dict], wanted: int, rng: random.Random,
                       max_chars: int, account: JudgeAccount) -> list[dict]:
    """``wanted`` pairwise examples, the gold's slot alternating."""
    def make(instance, made: int) -> list[dict]:
        pair = judge_pair(task, instance, gold_second=made % 2 == 1, rng=rng)
        if pair is None:
            raise _NoItem(_why_no_item(task, instance))
        return [{"prompt": pair.prompt(max_chars), "response": judge_response(pair.gold, pair.label)}]
    return _take(candidates, wanted, max_chars, make, account)


def judge_sft_rows(rows: dict[str, dict], per_task: int, seed: int, pairwise_share: float = 0.0,
                   max_chars: int = DEFAULT_MAX_CHARS, account: JudgeAccount | None = None,
                   tasks: list[str] | None = None) -> list[dict]:
    """Up to ``per_task`` judge examples per synthetic task from side rows (``side_rows``), of
    ``tasks`` only when given (instances of the others are counted as ``task_not_chosen``);
    ``account`` (when given) gets what became of every instance, and the tasks that gave none."""
    if per_task <= 0:
        return []
    from tasks.synth.registry import get_task

    account = account if account is not None else JudgeAccount()
    out: list[dict] = []
    for name, instances in sorted(_task_instances(rows).items()):
        account.offered += len(instances)
        if tasks is not None and name not in tasks:
            for r in instances:
                account.skip(r, "task_not_chosen")
            continue
        try:
            task = get_task(name)
        except Exception:  # noqa: BLE001 - an unknown task yields no judge examples, counted
            for r in instances:
                account.skip(r, "unknown_task")
            account.tasks_without_examples.append(name)
            continue
        candidates = sorted(instances, key=lambda r: r["_id"])
        rng = random.Random(f"judge:{seed}:{name}")
        rng.shuffle(candidates)
        pending = iter(candidates)  # shared: grade and pairwise examples use different instances
        n_grade = 2 * (round(per_task * (1.0 - pairwise_share)) // 2)  # whole consistent/inconsistent pairs
        examples = _grade_examples(task, pending, n_grade, rng, max_chars, account)
        examples += _pairwise_examples(task, pending, per_task - n_grade, rng, max_chars, account)
        account.leave(list(pending))   # every instance not pulled: its task had its examples first
        if not examples:
            account.tasks_without_examples.append(name)
        out += [{"source_table": "synthetic_tasks", "domain": JUDGE_DOMAIN, "response_source": "judge", **ex}
                for ex in examples]
    if account.tasks_without_examples:
        log.warning("judge examples: %d task(s) gave none: %s (instances skipped by reason: %s)",
                    len(account.tasks_without_examples), ", ".join(account.tasks_without_examples),
                    dict(account.skipped))
    return out


def open_pair_rows(open_rows: list[dict], wanted: int, seed: int, max_chars: int = DEFAULT_MAX_CHARS) -> list[dict]:
    """``wanted`` pairwise examples from open prompts (``{"id", "prompt", "gold"}`` rows): each
    prompt's gold against another prompt's gold, the gold's slot alternating, prompts in a seeded
    round-robin so every prompt is used about equally. None with fewer than two prompts."""
    rows = sorted((r for r in open_rows if r.get("gold") and r.get("prompt")), key=lambda r: r["id"])
    if wanted <= 0 or len(rows) < 2:
        return []
    rng = random.Random(f"judge-open:{seed}")
    out: list[dict] = []
    while len(out) < wanted:
        order = rows[:]
        rng.shuffle(order)
        for r in order[:wanted - len(out)]:
            other = rng.choice([o for o in rows if o["id"] != r["id"] and o["gold"] != r["gold"]] or [None])
            if other is None:
                continue
            gold_second = len(out) % 2 == 1
            first, second = (other["gold"], r["gold"]) if gold_second else (r["gold"], other["gold"])
            out.append({"source_table": r["_table"], "source_id": r["id"], "domain": JUDGE_DOMAIN,
                        "response_source": "judge",
                        "prompt": pairwise_prompt(r["prompt"], first, second, max_chars),
                        "response": verdict_text(1 if gold_second else -1)})
        if not out:
            break
    return out
