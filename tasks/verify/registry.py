"""One entry point for scoring: ``verify(domain, row, response) -> float`` in [0, 1].

``row`` is a table row as a dict (``prompts``/``rl_pool`` or ``synthetic_tasks``). A row
that cannot be scored (missing answer, unknown task, broken metadata, a crashing
verifier) never raises out of ``verify_with_error``: it scores 0.0 and says why, so one bad
row cannot crash a batch and the caller can still count it. ``verify`` drops the reason
(for callers that only want a number); ``verify_strict`` raises instead.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tasks.synth.base import after_thinking, extract_answer, last_boxed
from tasks.verify.code import code_blocks, verify_code
from tasks.verify.math import extract_final_answer, math_equal, verify_math
from tasks.verify.sandbox import SandboxLimits

# the fields of a row its domain's verifier reads, beside the response
VERIFIED_FIELDS = ("answer", "solution", "tests", "entry_point", "task", "level", "seed", "question", "metadata")


class VerifyError(ValueError):
    """A row lacks what its domain's verifier needs."""


def row_metadata(row: dict) -> dict[str, Any]:
    meta = row.get("metadata")
    if isinstance(meta, dict):
        return meta
    if isinstance(meta, str) and meta.strip():
        try:
            parsed = json.loads(meta)
        except ValueError as e:
            raise VerifyError(f"row {row.get('id')!r}: metadata is not valid JSON ({e})") from None
        return parsed if isinstance(parsed, dict) else {}
    return {}


def _math(row: dict, response: str, limits: SandboxLimits | None) -> float:
    if not row.get("answer"):
        raise VerifyError(f"row {row.get('id')!r}: math row has no 'answer'")
    return verify_math(row["answer"], response)


def _code(row: dict, response: str, limits: SandboxLimits | None) -> float:
    if not row.get("tests"):
        raise VerifyError(f"row {row.get('id')!r}: code row has no 'tests'")
    entry_point = row.get("entry_point") or row_metadata(row).get("entry_point")
    return verify_code(row.get("prompt") or "", response, row["tests"], entry_point, limits)


def synth_task_name(row: dict) -> str | None:
    return row.get("task") or row_metadata(row).get("task")


def synth_instance(row: dict):
    """Rebuild the synthesized TaskInstance a ``synthetic_tasks`` row was written from."""
    from tasks.synth.base import TaskInstance

    meta = row_metadata(row)
    instance_meta = meta.get("instance", meta) if isinstance(meta.get("instance"), dict) else meta
    return TaskInstance(
        task=synth_task_name(row),
        level=int(row.get("level") or 0),
        seed=int(row.get("seed") or 0),
        question=row.get("question") or "",
        prompt=row.get("prompt") or "",
        answer=str(row.get("answer") or ""),
        metadata=instance_meta,
    )


def _logic(row: dict, response: str, limits: SandboxLimits | None) -> float:
    name = synth_task_name(row)
    if name:
        from tasks.synth.registry import get_task

        # strict: a task whose checker fails on this instance raises (a counted error), not a silent 0
        return float(get_task(name).verify_strict(synth_instance(row), response))
    meta = row_metadata(row)
    if meta.get("rg_dataset"):
        from tasks.synth.reasoning_gym_adapter import score_ingested

        # an ingested reasoning-gym prompt: its dataset's score_answer decides, as for rg: tasks
        return score_ingested(meta, response)
    # A logic row with a plain gold answer (e.g. ingested puzzles): compare final answers.
    if not row.get("answer"):
        raise VerifyError(f"row {row.get('id')!r}: logic row has neither a task nor an 'answer'")
    predicted = extract_final_answer(response)
    return 1.0 if predicted is not None and math_equal(str(row["answer"]), predicted) else 0.0


VERIFIERS: dict[str, Callable[[dict, str, SandboxLimits | None], float]] = {
    "math": _math,
    "code": _code,
    "logic": _logic,
}


# does a response deliver its answer the way its domain's instruction asks (tasks.rollout.chat)?
# math: in \boxed{}; logic: inside <answer></answer> (every logic prompt asks for the tags);
# code: in exactly one closed fenced block. Read after the last </think>, as the extractors do.
FORMATS: dict[str, Callable[[str], bool]] = {
    "math": lambda r: last_boxed(after_thinking(r)) is not None,
    "logic": lambda r: extract_answer(r) is not None,
    "code": lambda r: len(code_blocks(after_thinking(r))) == 1,
}


def in_format(domain: str, response: str) -> bool | None:
    """Whether ``response`` gives its answer in the format its domain asks for; None for a domain
    that asks for none (open prompts, whose answer is the whole response). A lenient verifier may
    still find a right answer outside it (the last number of an untagged reasoning-gym answer)."""
    check = FORMATS.get(domain)
    return None if check is None else bool(check(response if isinstance(response, str) else ""))


def verify_strict(domain: str, row: dict, response: str, limits: SandboxLimits | None = None) -> float:
    if domain not in VERIFIERS:
        raise VerifyError(f"no verifier for domain {domain!r}; known: {sorted(VERIFIERS)}")
    return float(VERIFIERS[domain](row, response, limits))


def verify_with_error(domain: str, row: dict, response: str,
                      limits: SandboxLimits | None = None) -> tuple[float, str | None]:
    """(score, None), or (0.0, "ErrorType: message") when the row cannot be scored."""
    try:
        return verify_strict(domain, row, response, limits), None
    except Exception as e:  # noqa: BLE001 - one bad row scores 0, the batch goes on, the caller counts it
        return 0.0, f"{type(e).__name__}: {e}"[:500]


def verify(domain: str, row: dict, response: str, limits: SandboxLimits | None = None) -> float:
    """Score in [0, 1]; 0.0 for rows the domain's verifier cannot score (the reason is dropped)."""
    return verify_with_error(domain, row, response, limits)[0]
