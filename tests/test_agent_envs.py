"""The agent environments: deterministic by seed, solved by their experts, strict about tool
calls, and (code repair) confined by the sandbox with a reward that editing tests cannot fake.

Everything is real: the environments step through their own tools, and code repair's tests run
in the project's sandbox (``tasks.verify.sandbox``)."""
from __future__ import annotations

import socket
import time

import pytest

from tasks.agents.envs import END_REASONS, ENVIRONMENTS, Action, ToolCall, env_names, make_env
from tasks.agents.envs.code_repair import (
    ALL_TESTS,
    PROJECT_SOURCE,
    PROJECT_TESTS,
    SITES,
    SOURCE,
    TESTS,
    CodeRepair,
    plant,
    run_project_tests,
    tampering,
)
from tasks.agents.envs.feedback import LEVEL_HIGHS, Feedback
from tasks.agents.envs.tool_arithmetic import LEVELS, CalculatorError, ToolArithmetic, evaluate

ENV_LEVELS = {"tool_arithmetic": len(LEVELS), "feedback": len(LEVEL_HIGHS), "code_repair": 2}
PARSE_ERROR = Action("<tool_call>{oops</tool_call>", parse_error="could not parse the tool call: Expecting value")


def play(env, seed: int, actions: list[Action]) -> tuple[list, list]:
    """(the reset, every step result) of ``actions`` played from ``reset(seed)``."""
    reset = env.reset(seed)
    results = []
    for action in actions:
        results.append(env.step(action))
        if results[-1].done:
            break
    return reset, results


def fingerprint(name: str, seed: int):
    """What makes a task: its opening messages and the expert's solution."""
    env = make_env(name)
    actions = env.expert_actions(seed)
    return (env.reset(seed).messages, [(a.text, a.tool_calls) for a in actions])


# --- determinism --------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_the_same_seed_gives_the_same_episode(name):
    runs = []
    for _ in range(2):
        env = make_env(name)
        reset, results = play(env, 7, env.expert_actions(7))
        runs.append((reset.messages, [t.schema() for t in reset.tools],
                     [(r.observation, r.reward, r.done, r.info) for r in results]))
    assert runs[0] == runs[1]
    assert runs[0][2][-1][2] is True   # the episode was played to its end


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_different_seeds_give_different_tasks(name):
    tasks = [repr(fingerprint(name, seed)) for seed in range(6)]
    assert len(set(tasks)) >= 4, f"{name}: seeds 0..5 gave only {len(set(tasks))} distinct tasks"


# --- the experts, right and wrong answers ---------------------------------------------------

@pytest.mark.parametrize("name,level,seed",
                         [(n, lv, s) for n in sorted(ENVIRONMENTS) for lv in range(ENV_LEVELS[n])
                          for s in range(3 if n == "code_repair" else 5)])
def test_the_expert_solves_every_environment(name, level, seed):
    env = make_env(name, level=level)
    actions = env.expert_actions(seed)    # called before reset, as the agent SFT stage does
    reset, results = play(env, seed, actions)
    assert len(results) == len(actions) <= env.max_turns
    final = results[-1]
    assert final.done and final.info["success"] is True and final.info["outcome"] == 1.0
    assert final.info["ended"] == "answered" and final.info["ended"] in END_REASONS
    assert all(not r.done and r.observation and r.info["tool_error"] == 0 for r in results[:-1])
    assert "<answer>" in reset.messages[0]["content"] and "<answer>" in actions[-1].text
    assert all(a.thinking and (a.text == "" if a.tool_calls else True) for a in actions)
    assert bool(reset.tools) == ("tool" in reset.messages[0]["content"])


def test_a_wrong_arithmetic_answer_scores_zero():
    env = ToolArithmetic()
    _, value = env.problem(3)
    env.reset(3)
    result = env.step(Action(f"<answer>{value + 1}</answer>"))
    assert result.done and result.info["outcome"] == 0.0 and result.info["success"] is False
    assert result.info["ended"] == "answered"
    env.reset(3)
    assert env.step(Action(f"The result is <answer>{value:,}</answer>")).info["outcome"] == 1.0


def test_feedback_hints_and_scores_each_guess_against_the_earlier_hints():
    env = Feedback()
    seed = next(s for s in range(100) if 4 <= env.hidden(s) <= 14)
    hidden = env.hidden(seed)
    env.reset(seed)
    first = env.step(Action(f"<answer>{hidden - 1}</answer>"))
    assert first.observation == [{"role": "user", "content": f"{hidden - 1} is too low."}]
    assert first.reward == pytest.approx(0.1) and not first.done
    second = env.step(Action("<answer>1</answer>"))      # below what "too low" already ruled out
    assert second.observation[0]["content"] == "1 is too low." and second.reward == pytest.approx(-0.1)
    third = env.step(Action("I think it is seven"))      # no readable guess
    assert "<answer>N</answer>" in third.observation[0]["content"] and third.reward == pytest.approx(-0.1)
    high = env.step(Action(f"<answer>{hidden + 1}</answer>"))
    assert high.observation[0]["content"] == f"{hidden + 1} is too high." and high.reward == pytest.approx(0.1)
    quiet = Feedback(process_reward=0.0)
    quiet.reset(seed)
    assert quiet.step(Action("<answer>1</answer>")).reward == 0.0


def test_feedback_ends_at_max_turns_without_the_number():
    env = Feedback()
    seed = next(s for s in range(100) if env.hidden(s) != 1)
    env.reset(seed)
    results = [env.step(Action("<answer>1</answer>")) for _ in range(env.max_turns)]
    assert env.max_turns == 6 and [r.done for r in results] == [False] * 5 + [True]
    assert results[-1].info == {"tool_error": 0, "outcome": 0.0, "success": False, "ended": "max_turns",
                                "guesses": 6}
    with pytest.raises(RuntimeError):
        env.step(Action("<answer>2</answer>"))


def test_an_unfixed_project_scores_zero():
    env = CodeRepair()
    env.reset(0)
    result = env.step(Action("<answer>done</answer>"))
    assert result.done and result.info["outcome"] == 0.0 and result.info["success"] is False
    assert result.info["fail_to_pass"] == f"0/{len(env.fail_to_pass)}"
    assert result.info["pass_to_pass"] == f"{len(env.pass_to_pass)}/{len(env.pass_to_pass)}"


# --- malformed and unknown tool calls, max_turns ---------------------------------------------

@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_a_malformed_call_is_an_error_the_policy_sees(name):
    env = make_env(name)
    env.reset(1)
    result = env.step(PARSE_ERROR)
    assert not result.done and result.info["tool_error"] == 1 and result.reward < 0
    assert len(result.observation) == 1 and "error" in result.observation[0]["content"]
    assert "parse" in result.observation[0]["content"] or name == "feedback"


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_an_unknown_tool_is_an_error_observation(name):
    env = make_env(name)
    env.reset(1)
    result = env.step(Action("", (ToolCall("shell", {"cmd": "ls"}),)))
    assert not result.done and result.info["tool_error"] == 1
    assert "error" in result.observation[0]["content"]


@pytest.mark.parametrize("name,call", [
    ("tool_arithmetic", ToolCall("calculator", {"expression": "2 + 2"})),
    ("code_repair", ToolCall("read_file", {"path": SOURCE})),
    ("feedback", None),
])
def test_the_environment_ends_the_episode_at_max_turns(name, call):
    env = make_env(name, max_turns=2)
    seed = next(s for s in range(100) if name != "feedback" or Feedback().hidden(s) != 1)
    env.reset(seed)
    action = Action("", (call,)) if call else Action("<answer>1</answer>")
    first, second = env.step(action), env.step(action)
    assert not first.done and second.done
    assert second.info["ended"] == "max_turns" and second.info["outcome"] == 0.0
    assert second.info["success"] is False and second.info["tool_error"] == 0


# --- the calculator -----------------------------------------------------------------------

@pytest.mark.parametrize("expression,value", [
    ("347 * 58 + 912", "21038"), ("-(3 + 4) * 2", "-14"), ("7 / 2", "3.5"), ("17 // 5", "3"),
    ("17 % 5", "2"), ("2 ** 10", "1024"), ("0.1 + 0.2", "0.3"), ("12 \u00d7 3 =", "36"),
])
def test_the_calculator_evaluates_arithmetic_exactly(expression, value):
    env = ToolArithmetic()
    env.reset(0)
    result = env.step(Action("", (ToolCall("calculator", {"expression": expression}),)))
    assert result.observation == [{"role": "tool", "name": "calculator", "content": value}]
    assert result.info["tool_error"] == 0 and result.reward == pytest.approx(0.1)


@pytest.mark.parametrize("expression", [
    "__import__('os').system('true')", "x + 1", "(1).real", "'a' * 3", "[1, 2]", "abs(-3)",
    "lambda: 1", "2 ** 10 ** 9", "9 ** 99", "1 / 0", "2 ^ 3", "", "1 +", "1" * 300,
])
def test_the_calculator_refuses_anything_but_bounded_arithmetic(expression):
    t0 = time.monotonic()
    with pytest.raises(CalculatorError):
        evaluate(expression)
    env = ToolArithmetic()
    env.reset(0)
    result = env.step(Action("", (ToolCall("calculator", {"expression": expression}),)))
    assert result.observation[0]["content"].startswith("error: ")
    assert result.info["tool_error"] == 1 and result.reward == pytest.approx(-0.1)
    assert time.monotonic() - t0 < 1.0    # a huge power is refused, not computed


def test_calculator_arguments_are_checked_and_the_process_reward_can_be_off():
    env = ToolArithmetic(process_reward=0.0)
    env.reset(0)
    result = env.step(Action("", (ToolCall("calculator", {"expr": "1 + 1"}),
                                  ToolCall("calculator", {"expression": 5}),
                                  ToolCall("calculator", {"expression": "1 + 1"}))))
    assert [m["content"][:6] for m in result.observation] == ["error:", "error:", "2"]
    assert result.info["tool_error"] == 2 and result.reward == 0.0


# --- code repair: the project, the sandbox, the reward ----------------------------------------

def test_every_site_breaks_exactly_its_fail_to_pass_tests_and_the_expert_fixes_it():
    pristine = run_project_tests({SOURCE: PROJECT_SOURCE, TESTS: PROJECT_TESTS})
    assert pristine.all_passed and pristine.ran == ALL_TESTS and len(ALL_TESTS) == 16
    env = CodeRepair()
    seeds = {}
    for seed in range(500):
        seeds.setdefault(env.planted_sites(seed), seed)
        if len(seeds) == len(SITES):
            break
    assert {s for (s,) in seeds} == set(SITES)
    for (site,), seed in seeds.items():
        buggy = plant(PROJECT_SOURCE, (site,))
        assert buggy.count(site.buggy) == 1, site
        run = run_project_tests({SOURCE: buggy, TESTS: PROJECT_TESTS})
        assert run.status == "ran" and sorted(run.failed) == sorted(site.fail_to_pass), site
        _, results = play(env, seed, env.expert_actions(seed))
        assert env.sites == (site,) and results[-1].info["success"] is True, site
        assert env.workspace[SOURCE] == PROJECT_SOURCE


def test_run_tests_reports_the_failing_tests():
    env = CodeRepair()
    reset = env.reset(2)
    result = env.step(Action("", (ToolCall("run_tests", {}),)))
    content = result.observation[0]["content"]
    assert result.observation[0]["name"] == "run_tests" and result.info["tool_error"] == 0
    assert content.startswith(f"{len(env.fail_to_pass)} of {len(ALL_TESTS)} tests failed")
    assert all(t in content and t in reset.messages[0]["content"] for t in env.fail_to_pass)
    assert not any(t in content for t in env.pass_to_pass)


def test_edits_must_match_exactly_once():
    env = CodeRepair()
    env.reset(0)
    before = dict(env.workspace)
    result = env.step(Action("", (ToolCall("edit", {"path": SOURCE, "old": "return", "new": "yield"}),
                                  ToolCall("edit", {"path": SOURCE, "old": "no such text", "new": "x"}),
                                  ToolCall("edit", {"path": "setup.py", "old": "a", "new": "b"}),
                                  ToolCall("read_file", {"path": "../etc/passwd"}))))
    assert result.info["tool_error"] == 4 and env.workspace == before
    assert all(m["content"].startswith("error: ") for m in result.observation)
    ok = env.step(Action("", (ToolCall("read_file", {"path": f"./{TESTS}"}),)))
    assert ok.observation[0]["content"] == PROJECT_TESTS and ok.info["tool_error"] == 0


def test_an_endless_loop_is_reported_as_a_timeout_not_a_hang():
    env = CodeRepair(timeout_s=1.0)
    env.reset(0)
    env.step(Action("", (ToolCall("edit", {"path": SOURCE, "old": "def initials(name):\n",
                                           "new": "def initials(name):\n    while True:\n        pass\n"}),)))
    t0 = time.monotonic()
    result = env.step(Action("", (ToolCall("run_tests", {}),)))
    assert "timed out after 1s" in result.observation[0]["content"]
    final = env.step(Action("<answer>done</answer>"))
    assert final.info["tests"] == "timeout" and final.info["outcome"] == 0.0
    assert time.monotonic() - t0 < 8.0


def test_the_code_under_test_cannot_reach_the_network():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.3)
    port = listener.getsockname()[1]
    env = CodeRepair(timeout_s=5.0)
    env.reset(0)
    attacks = {
        "def word_count(text):\n": f"    import socket\n    socket.create_connection(('127.0.0.1', {port}), 1)\n",
        "def initials(name):\n": (f"    import _socket\n    s = _socket.socket()\n    s.settimeout(1)\n"
                                  f"    s.connect(('127.0.0.1', {port}))\n"),
        "def digit_sum(n):\n": ("    import _socket\n    s = _socket.socket()\n    s.settimeout(1)\n"
                                "    s.connect(('93.184.216.34', 80))\n"),
    }
    for head, body in attacks.items():
        edit = env.step(Action("", (ToolCall("edit", {"path": SOURCE, "old": head, "new": head + body}),)))
        assert edit.info["tool_error"] == 0
    shown = env.step(Action("", (ToolCall("run_tests", {}),))).observation[0]["content"]
    assert "tests failed" in shown and "Error" in shown
    run = run_project_tests(env.workspace, env.limits)    # the whole report, not the summary's first lines
    assert run.status == "ran"
    assert run.failed["test_word_count_spaces"].startswith("PermissionError")    # the socket module is off
    for test in ("test_initials_words", "test_digit_sum_positive"):              # raw sockets: no route
        assert run.failed[test].startswith("OSError") and "unreachable" in run.failed[test], run.failed[test]
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()


def test_the_tests_file_is_read_only_and_the_reward_uses_the_pristine_tests():
    env = CodeRepair()
    env.reset(4)
    fake = "import unittest\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n"
    refused = env.step(Action("", (ToolCall("edit", {"path": TESTS, "old": PROJECT_TESTS, "new": fake}),)))
    assert refused.info["tool_error"] == 1 and "read-only" in refused.observation[0]["content"]
    assert env.workspace[TESTS] == PROJECT_TESTS
    env.workspace[TESTS] = fake          # as if the workspace's tests had been changed anyway
    shown = env.step(Action("", (ToolCall("run_tests", {}),))).observation[0]["content"]
    assert shown == "1 test ran, all passed."     # the faked tests fool run_tests...
    final = env.step(Action("<answer>done</answer>"))
    assert final.info["outcome"] == 0.0 and final.info["success"] is False   # ...not the reward


def test_a_fix_that_patches_the_test_machinery_scores_zero():
    env = CodeRepair()
    env.reset(4)
    patch = "import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n"
    env.workspace[SOURCE] = patch + env.workspace[SOURCE]
    final = env.step(Action("<answer>done</answer>"))
    assert final.info["outcome"] == 0.0 and final.info["tampering"] == "imports unittest"
    assert tampering(PROJECT_SOURCE) is None
    assert tampering("def f(x):\n    return x.__class__\n") == "uses the attribute __class__"
    assert tampering("def f():\n    return getattr(f, 'x')\n") == "uses getattr"


# --- the registry -------------------------------------------------------------------------

def test_the_registry_builds_every_environment_and_names_what_is_wrong():
    assert env_names() == ["code_repair", "feedback", "tool_arithmetic"]
    for name in env_names():
        env = make_env(name, max_turns=3)
        assert env.name == name and env.max_turns == 3 and isinstance(env, ENVIRONMENTS[name])
    assert make_env("tool_arithmetic", level=2).level == 2
    with pytest.raises(ValueError, match="unknown environment 'chess'.*code_repair, feedback, tool_arithmetic"):
        make_env("chess")
    with pytest.raises(ValueError, match="environment 'feedback' has no setting 'timeout_s'.*level"):
        make_env("feedback", timeout_s=3)
    with pytest.raises(ValueError, match="level"):
        make_env("code_repair", level=5)
