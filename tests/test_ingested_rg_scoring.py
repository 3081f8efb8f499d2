"""Ingested reasoning-gym prompts (``posttrain ingest`` with a reasoning_gym source) are scored by
their dataset's own ``score_answer``, as ``rg:`` synthesized tasks are (issue #32, item 6): a
string comparison with math-verify accepted a countdown "expression" that is only the target,
and never gave reasoning-gym's partial credit."""
import json

import pytest

from tasks.sources import reasoning_gym_records
from tasks.synth.base import TaskVerifyError
from tasks.verify.registry import verify_strict, verify_with_error


def _ingested(dataset: str, index: int = 0, size: int = 4) -> dict:
    rec = list(reasoning_gym_records([dataset], per_task=size, seed=0))[index]
    return {"id": f"rg-{dataset}-{index}", **rec.data, "metadata": json.dumps(rec.data["metadata"])}


def test_countdown_is_scored_by_its_own_rules_not_by_the_value():
    row = _ingested("countdown")
    meta = json.loads(row["metadata"])
    import reasoning_gym
    entry = reasoning_gym.create_dataset("countdown", size=4, seed=0)[0]
    target, numbers = entry["metadata"]["target"], entry["metadata"]["numbers"]
    assert row["answer"] == entry["answer"] and meta["rg_dataset"] == "countdown"
    # the gold expression, and other orders of it, reach the target with the given numbers
    assert row["answer"] == "6*(98 - 54) - 34 - 66"   # seed 0's first item
    for expression in (row["answer"], "6*(98 - 54) - 66 - 34", "(98 - 54)*6 - 66 - 34"):
        assert verify_strict("logic", row, f"<answer>{expression}</answer>") == 1.0, expression
    # the bare target has the right value but uses none of the numbers: reasoning-gym rejects it
    # (math-verify's comparison of values, the old scorer, gave it full marks)
    assert str(target) not in [str(n) for n in numbers]
    assert verify_strict("logic", row, f"<answer>{target}</answer>") < 1.0
    from tasks.verify.math import math_equal
    assert math_equal(row["answer"], str(target))   # what the old path accepted


def test_an_untagged_numeric_answer_is_read_from_the_last_number():
    row = _ingested("basic_arithmetic")
    assert verify_strict("logic", row, f"so the result is {row['answer']}") == 1.0
    assert verify_strict("logic", row, "no idea") == 0.0


def test_broken_metadata_is_an_error_that_names_the_row_not_a_silent_zero():
    row = _ingested("basic_arithmetic")
    row["metadata"] = json.dumps({"rg_dataset": "no_such_dataset", "rg_seed": 0, "rg_size": 4, "rg_index": 0})
    with pytest.raises(TaskVerifyError, match="no_such_dataset"):
        verify_strict("logic", row, "<answer>1</answer>")
    score, error = verify_with_error("logic", row, "<answer>1</answer>")
    assert score == 0.0 and "no_such_dataset" in error
