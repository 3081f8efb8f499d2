"""Verifier errors are counted, not silent, and each RL sample is verified exactly once.

A row the verifier cannot score (broken metadata, unknown synthetic task, unknown domain)
still scores 0 so a batch goes on, but ``verify_with_error`` says why, and the RL reward
counts it per domain in the step metrics that go to MLflow. A code sample runs the real
sandbox once: its reward and its correctness come from the same run.
"""
import logging

import pytest

import tasks.verify.code as code_verifier
from tasks.rollout.base import Completion
from tasks.train.config import GenRMRewardConfig
from tasks.train.genrm_reward import DomainReward, RewardCounters
from tasks.verify.registry import verify, verify_with_error


def pool_row(prompt_id, domain, source_row):
    return {"prompt_id": prompt_id, "domain": domain, "prompt": source_row.get("prompt", "?"),
            "answer": source_row.get("answer"), "source_row": source_row}


BROKEN_METADATA = pool_row("l1", "logic", {"id": "l1", "answer": "blue", "metadata": "{not json"})
UNKNOWN_TASK = pool_row("l2", "logic", {"id": "l2", "task": "no_such_task", "answer": "x"})
MATH_OK = pool_row("m1", "math", {"id": "m1", "answer": "5"})
CODE_NO_TESTS = pool_row("c0", "code", {"id": "c0", "prompt": "def f():\n"})
CODE = pool_row("c1", "code", {"id": "c1", "prompt": "def add(a, b):\n", "entry_point": "add",
                               "tests": "def check(candidate):\n    assert candidate(1, 2) == 3\n"})


def completions(*texts):
    return [Completion(t, token_ids=[1] * max(1, len(t.split()))) for t in texts]


def test_verify_with_error_names_the_reason_and_verify_stays_lenient():
    assert verify_with_error("math", MATH_OK["source_row"], "\\boxed{5}") == (1.0, None)
    assert verify_with_error("math", MATH_OK["source_row"], "\\boxed{4}") == (0.0, None)   # wrong, not an error
    for domain, row, expected in [("logic", BROKEN_METADATA["source_row"], "metadata is not valid JSON"),
                                  ("logic", UNKNOWN_TASK["source_row"], "unknown synthetic task"),
                                  ("poetry", {"id": "p"}, "no verifier for domain"),
                                  ("math", {"id": "m2"}, "has no 'answer'")]:
        score, error = verify_with_error(domain, row, "<answer>blue</answer>")
        assert score == 0.0 and expected in error, error
        assert verify(domain, row, "<answer>blue</answer>") == 0.0   # back-compat: a number, no raise


def test_rl_rewards_count_verifier_errors_per_domain_and_log_the_first(caplog):
    reward = DomainReward(GenRMRewardConfig(enabled=False))
    rows = [MATH_OK, BROKEN_METADATA, UNKNOWN_TASK, CODE_NO_TESTS]
    counters = RewardCounters()
    with caplog.at_level(logging.WARNING, logger="posttrain.train.rl"):
        scored = reward.score(rows, [completions("\\boxed{5}", "\\boxed{7}"),
                                     completions("<answer>blue</answer>"),
                                     completions("<answer>x</answer>", "<answer>y</answer>"),
                                     completions("    return 1\n")], counters)
        # a second round of the same step adds to the counts without another log line
        reward.score([BROKEN_METADATA], [completions("<answer>blue</answer>")], counters, round_=1)

    assert [s.reward for s in scored[0]] == [1.0, 0.0]
    assert [s.reward for g in scored[1:] for s in g] == [0.0] * 4
    m = counters.metrics()
    assert m["verify_errors.logic"] == 4.0 and m["verify_errors.code"] == 1.0 and m["verify_errors.math"] == 0.0
    assert m["verify_error_fraction"] == pytest.approx(5 / 7)
    assert "metadata is not valid JSON" in counters.first_verify_error
    warnings = [r.getMessage() for r in caplog.records if "verify_errors.logic" in r.getMessage()]
    assert len(warnings) == 1 and "l1" in warnings[0] and "metadata is not valid JSON" in warnings[0]


def test_a_code_sample_runs_the_real_sandbox_once(monkeypatch):
    runs = []
    real = code_verifier.run_python_sandboxed

    def counting_sandbox(source, limits=None):   # the real sandbox, with a call counter around it
        runs.append(source)
        return real(source, limits)

    monkeypatch.setattr(code_verifier, "run_python_sandboxed", counting_sandbox)
    counters = RewardCounters()
    scored = DomainReward(GenRMRewardConfig(enabled=False)).score(
        [CODE], [completions("    return a + b\n", "    return a - b\n", "    return (a +\n")], counters)

    assert len(runs) == 3                       # one sandbox run per sample (it was two)
    assert [(s.reward, s.correct) for s in scored[0]] == [(1.0, 1.0), (0.0, 0.0), (0.0, 0.0)]
    # a failing or non-compiling answer is a wrong answer, not a verifier error
    assert counters.metrics()["verify_errors.code"] == 0.0 and counters.verified == {"code": 3}


def test_a_custom_reward_still_verifies_each_sample_once_for_correctness(monkeypatch):
    runs = []
    real = code_verifier.run_python_sandboxed
    monkeypatch.setattr(code_verifier, "run_python_sandboxed",
                        lambda source, limits=None: runs.append(1) or real(source, limits))
    reward = DomainReward(GenRMRewardConfig(enabled=False), custom=lambda row, text, ids: 0.25)
    scored = reward.score([CODE], [completions("    return a + b\n")], RewardCounters())
    assert len(runs) == 1 and [(s.reward, s.correct, s.scorer) for s in scored[0]] == [(0.25, 1.0, "custom")]


def test_a_round_verified_by_several_threads_scores_exactly_as_one_thread(monkeypatch):
    """``rl.verify_workers`` threads (math decided by worker processes, one per thread) give the
    samples, their order and the error counts of verifying one sample after another."""
    import tasks.verify.math as math_verifier

    math_rows = [pool_row(f"m{i}", "math", {"id": f"m{i}", "answer": answer})
                 for i, answer in enumerate(["1/2", "3", "\\sqrt{2}", "x^2 - 1"])]
    rows = [*math_rows, BROKEN_METADATA, CODE]
    groups = [completions("\\boxed{0.5}", "<answer>1/3</answer>", "no answer at all"),
              completions("<answer>3.0</answer>", "<answer>three</answer>"),
              completions("\\boxed{2^{1/2}}", "\\boxed{1.41}"),
              completions("<answer>(x-1)(x+1)</answer>", "<answer>x^2+1</answer>"),
              completions("<answer>blue</answer>"),
              completions("    return a + b\n", "    return a - b\n")]
    monkeypatch.setattr(math_verifier, "_WORKER", math_verifier._MathWorkers())
    math_verifier._decided.cache_clear()
    one = RewardCounters()
    expected = DomainReward(GenRMRewardConfig(enabled=False)).score(rows, groups, one)
    math_verifier._decided.cache_clear()
    several = RewardCounters()
    got = DomainReward(GenRMRewardConfig(enabled=False), verify_workers=3).score(rows, groups, several)
    assert got == expected and several == one
    assert [[s.reward for s in g] for g in got] == [[1.0, 0.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0],
                                                     [1.0, 0.0]]
    # the threaded round went through worker processes (the one-thread round decided in this
    # main thread), and never more of them than threads asking at once
    assert 1 <= math_verifier._WORKER._started <= 3
