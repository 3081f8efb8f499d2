"""Code repair: a small bundled Python project with a seeded planted bug, fixed with tools.

The project is ``textutils.py`` (eight small pure functions) and its unittest file. A seed picks
a mutation site (two at level 1) and plants it. The tools are ``read_file(path)``,
``edit(path, old, new)`` (exactly one occurrence replaced; the tests file is read-only) and
``run_tests()``. Tests run in the project's sandbox (``tasks.verify.sandbox``: no network, no
subprocesses, resource limits, a wall-clock timeout): a generated script writes the files into
its scratch dir, runs the tests in process and prints one machine-readable line.

The episode ends when the policy replies without a tool call. The reward (SWE-style) runs the
environment's pristine tests against the workspace's source, never the workspace's tests:
success iff every fail-to-pass test (those the planted bug breaks) passes and every
pass-to-pass test still does. Since the tests run in the same interpreter as the repaired
module, a module that reaches for the test machinery (imports beyond a few pure modules, dunder
or frame attributes, ``getattr``/``exec``...) scores 0 as well: a fix never needs them.
"""
from __future__ import annotations

import ast
import json
import math
import random
import secrets
from dataclasses import dataclass, field

from tasks.agents.envs.base import Action, Environment, Reset, StepResult, Tool, ToolCall
from tasks.synth.base import stable_int
from tasks.verify.sandbox import SandboxLimits, run_python_sandboxed

SOURCE, TESTS = "textutils.py", "test_textutils.py"

PROJECT_SOURCE = '''\
"""Small text and number helpers."""
import re


def slugify(text):
    words = re.findall(r"[a-z0-9]+", text.lower())
    return "-".join(words)


def word_count(text):
    return len(text.split())


def is_palindrome(text):
    letters = [c.lower() for c in text if c.isalnum()]
    return letters == letters[::-1]


def clamp(value, low, high):
    if value < low:
        return low
    if value > high:
        return high
    return value


def mean(values):
    if not values:
        raise ValueError("mean of no values")
    return sum(values) / len(values)


def digit_sum(n):
    total, n = 0, abs(n)
    while n > 0:
        total += n % 10
        n //= 10
    return total


def chunks(items, size):
    return [items[i:i + size] for i in range(0, len(items), size)]


def initials(name):
    return "".join(part[0].upper() for part in name.split())
'''

PROJECT_TESTS = '''\
import unittest

from textutils import chunks, clamp, digit_sum, initials, is_palindrome, mean, slugify, word_count


class TextUtilsTest(unittest.TestCase):
    def test_slugify_words(self):
        self.assertEqual(slugify("Hello World"), "hello-world")

    def test_slugify_punctuation(self):
        self.assertEqual(slugify("  Rock & Roll! "), "rock-roll")

    def test_word_count_spaces(self):
        self.assertEqual(word_count("one  two three"), 3)

    def test_word_count_empty(self):
        self.assertEqual(word_count(""), 0)

    def test_palindrome_mixed_case(self):
        self.assertTrue(is_palindrome("Never odd or even"))

    def test_palindrome_not(self):
        self.assertFalse(is_palindrome("palindrome"))

    def test_clamp_inside(self):
        self.assertEqual(clamp(5, 0, 10), 5)

    def test_clamp_outside(self):
        self.assertEqual(clamp(-3, 0, 10), 0)
        self.assertEqual(clamp(42, 0, 10), 10)

    def test_mean_values(self):
        self.assertEqual(mean([1, 2, 3, 4]), 2.5)

    def test_mean_empty(self):
        with self.assertRaises(ValueError):
            mean([])

    def test_digit_sum_positive(self):
        self.assertEqual(digit_sum(1234), 10)

    def test_digit_sum_negative(self):
        self.assertEqual(digit_sum(-507), 12)

    def test_chunks_even(self):
        self.assertEqual(chunks([1, 2, 3, 4], 2), [[1, 2], [3, 4]])

    def test_chunks_remainder(self):
        self.assertEqual(chunks([1, 2, 3, 4, 5], 2), [[1, 2], [3, 4], [5]])

    def test_initials_words(self):
        self.assertEqual(initials("ada lovelace"), "AL")

    def test_initials_extra_spaces(self):
        self.assertEqual(initials("  grace  brewster hopper "), "GBH")
'''

# the pristine tests' names, in the order unittest runs them (sorted)
ALL_TESTS: tuple[str, ...] = tuple(sorted(
    node.name for node in ast.walk(ast.parse(PROJECT_TESTS))
    if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")))


@dataclass(frozen=True)
class MutationSite:
    """A planted bug: ``original`` replaced by ``buggy`` in ``function`` of the source;
    ``fail_to_pass``: the tests it breaks (tests/test_agent_envs.py checks the list on the sandbox)."""
    function: str
    original: str
    buggy: str
    fail_to_pass: tuple[str, ...]


SITES: tuple[MutationSite, ...] = (
    MutationSite("slugify", '"-".join(words)', '"_".join(words)',
                 ("test_slugify_punctuation", "test_slugify_words")),
    MutationSite("slugify", 'r"[a-z0-9]+"', 'r"[a-z0-9]"', ("test_slugify_punctuation", "test_slugify_words")),
    MutationSite("word_count", "text.split()", 'text.split(" ")',
                 ("test_word_count_empty", "test_word_count_spaces")),
    MutationSite("is_palindrome", "[c.lower() for c in text", "[c for c in text", ("test_palindrome_mixed_case",)),
    MutationSite("clamp", "if value < low:", "if value > low:", ("test_clamp_inside", "test_clamp_outside")),
    MutationSite("mean", "sum(values) / len(values)", "sum(values) // len(values)", ("test_mean_values",)),
    MutationSite("mean", "if not values:", "if values is None:", ("test_mean_empty",)),
    MutationSite("digit_sum", "while n > 0:", "while n > 9:", ("test_digit_sum_negative", "test_digit_sum_positive")),
    MutationSite("chunks", "items[i:i + size]", "items[i:i + size - 1]", ("test_chunks_even", "test_chunks_remainder")),
    MutationSite("initials", "name.split()", 'name.split(" ")', ("test_initials_extra_spaces",)),
)
LEVELS = (1, 2)     # how many bugs a level plants (in distinct functions)

TOOLS = [
    Tool("read_file", "Show a file of the project.",
         {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}),
    Tool("edit", "Replace the one occurrence of `old` with `new` in a file.",
         {"type": "object",
          "properties": {"path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
          "required": ["path", "old", "new"]}),
    Tool("run_tests", "Run the project's tests and list the failing ones.",
         {"type": "object", "properties": {}}),
]
_TOOL_ARGUMENTS = {"read_file": {"path"}, "edit": {"path", "old", "new"}, "run_tests": set()}
ERROR_CHARS = 160
REASON_CHARS = 90


def plant(source: str, sites: tuple[MutationSite, ...]) -> str:
    """``source`` with each site's bug planted (each original must occur exactly once)."""
    for site in sites:
        if source.count(site.original) != 1:
            raise ValueError(f"mutation site {site.original!r} occurs {source.count(site.original)} times")
        source = source.replace(site.original, site.buggy)
    return source


# --- running the tests in the sandbox ------------------------------------------------------

# Prefixed with FILES, TESTS_MODULE and MARKER. Runs in the sandbox's scratch dir: the files are
# written there, the tests run in process (the sandbox forbids subprocesses) and one line holding
# a per-run marker reports them, so nothing the code under test prints can pass for it.
_HARNESS = '''
import importlib, json, sys, unittest

for _path, _text in FILES.items():
    with open(_path, "w", encoding="utf-8") as _f:
        _f.write(_text)
sys.path.insert(0, ".")
sys.dont_write_bytecode = True


class _Result(unittest.TestResult):
    def __init__(self):
        super().__init__()
        self.ran, self.failed = [], {}

    def startTest(self, test):
        super().startTest(test)
        self.ran.append(test.id().rsplit(".", 1)[-1])

    def _note(self, test, err):
        lines = str(err[1]).splitlines()
        reason = err[0].__name__ + (": " + lines[0] if lines else "")
        self.failed[test.id().rsplit(".", 1)[-1]] = reason[:REASON_CHARS]

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._note(test, err)

    def addError(self, test, err):
        super().addError(test, err)
        self._note(test, err)


try:
    _module = importlib.import_module(TESTS_MODULE)
except Exception as _e:
    _report = {"import_error": (type(_e).__name__ + ": " + str(_e))[:REASON_CHARS]}
else:
    _result = _Result()
    unittest.defaultTestLoader.loadTestsFromModule(_module).run(_result)
    _report = {"ran": _result.ran, "failed": _result.failed}
print(MARKER + json.dumps(_report))
'''


@dataclass(frozen=True)
class TestRun:
    """What one run of the tests gave: ``status`` is "ran", "import_error" (the tests could not
    import the code), "timeout" or "crashed" (no report: killed for memory, exited early...)."""
    __test__ = False   # not a pytest test class

    status: str
    ran: tuple[str, ...] = ()
    failed: dict[str, str] = field(default_factory=dict)   # test -> short reason
    detail: str = ""

    @property
    def all_passed(self) -> bool:
        return self.status == "ran" and bool(self.ran) and not self.failed

    def summary(self, timeout_s: float) -> str:
        """The short text ``run_tests`` answers."""
        if self.status == "timeout":
            return f"error: the tests timed out after {timeout_s:g}s (an endless loop?)"
        if self.status == "import_error":
            return f"error: the tests could not import the code: {self.detail}"
        if self.status == "crashed":
            return f"error: the tests crashed: {self.detail}"
        if not self.failed:
            return f"{len(self.ran)} test{'s' * (len(self.ran) != 1)} ran, all passed."
        lines = [f"{name}: {reason}" for name, reason in self.failed.items()]
        shown = lines[:4] + ([f"... and {len(lines) - 4} more"] if len(lines) > 4 else [])
        return f"{len(self.failed)} of {len(self.ran)} tests failed:\n" + "\n".join(shown)


def run_project_tests(files: dict[str, str], limits: SandboxLimits | None = None) -> TestRun:
    """Run the unittest module ``TESTS`` over ``files`` (path -> text) in the sandbox."""
    marker = f"@@posttrain-tests-{secrets.token_hex(8)}@@ "
    program = (f"FILES = {dict(files)!r}\nTESTS_MODULE = {TESTS.removesuffix('.py')!r}\n"
               f"MARKER = {marker!r}\nREASON_CHARS = {REASON_CHARS}\n" + _HARNESS)
    result = run_python_sandboxed(program, limits)
    if result.status == "timeout":
        return TestRun("timeout")
    reports = [line[len(marker):] for line in result.stdout.splitlines() if line.startswith(marker)]
    if result.status != "passed" or not reports:
        last = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        return TestRun("crashed", detail=last[:REASON_CHARS])
    report = json.loads(reports[-1])
    if "import_error" in report:
        return TestRun("import_error", detail=report["import_error"])
    return TestRun("ran", tuple(report["ran"]), dict(report["failed"]))


# --- what a repaired module may not do -----------------------------------------------------

ALLOWED_IMPORTS = frozenset({"re", "math", "string", "itertools", "collections"})
FORBIDDEN_CALLS = frozenset({"exec", "eval", "compile", "open", "globals", "locals", "vars", "getattr",
                             "setattr", "delattr", "__import__", "breakpoint", "input"})
FRAME_ATTRIBUTE_PREFIXES = ("f_", "gi_", "cr_", "ag_", "tb_", "co_")


def tampering(source: str) -> str | None:
    """Why ``source`` could be reaching for the tests' machinery (None: it does not). The tests run
    in the module's interpreter: without this a "fix" could patch ``unittest`` to pass everything."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None   # it fails the tests on its own
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or "."]
            for name in names:
                if name.split(".")[0] not in ALLOWED_IMPORTS:
                    return f"imports {name}"
        elif isinstance(node, ast.Attribute) and (node.attr.startswith("_")
                                                  or node.attr.startswith(FRAME_ATTRIBUTE_PREFIXES)):
            return f"uses the attribute {node.attr}"
        elif isinstance(node, ast.Name) and (node.id in FORBIDDEN_CALLS or node.id.startswith("__")):
            return f"uses {node.id}"
    return None


# --- the environment -----------------------------------------------------------------------

class CodeRepair(Environment):
    """Fix the planted bug(s) of the bundled project. Settings: ``level`` (0: one bug, 1: two),
    ``max_turns``, the sandbox's ``timeout_s`` and ``memory_mb``, and ``process_reward`` (taken
    off per failed or malformed tool call; 0 turns it off). ``workspace`` holds the files the
    policy sees and edits (path -> text)."""

    name = "code_repair"

    def __init__(self, level: int = 0, max_turns: int = 8, timeout_s: float = 10.0, memory_mb: int = 512,
                 process_reward: float = 0.1):
        if not 0 <= level < len(LEVELS):
            raise ValueError(f"{self.name}: level {level!r} outside 0..{len(LEVELS) - 1}")
        if max_turns < 1:
            raise ValueError(f"{self.name}: max_turns must be at least 1, got {max_turns!r}")
        self.level, self.max_turns, self.process_reward = level, max_turns, float(process_reward)
        self.timeout_s = float(timeout_s)
        self.limits = SandboxLimits(timeout_s=self.timeout_s, cpu_s=max(1, math.ceil(self.timeout_s)),
                                    memory_mb=memory_mb)
        self.sites: tuple[MutationSite, ...] = ()
        self.workspace: dict[str, str] = {}
        self._turns, self._done = 0, True

    def planted_sites(self, seed: int) -> tuple[MutationSite, ...]:
        """The mutation sites episode ``seed`` plants, each in a different function."""
        rng = random.Random(stable_int(self.name, int(seed), self.level))
        chosen: list[MutationSite] = []
        while len(chosen) < LEVELS[self.level]:
            left = [s for s in SITES if s.function not in {c.function for c in chosen}]
            chosen.append(left[rng.randrange(len(left))])
        return tuple(chosen)

    @property
    def fail_to_pass(self) -> tuple[str, ...]:
        return tuple(t for t in ALL_TESTS if any(t in s.fail_to_pass for s in self.sites))

    @property
    def pass_to_pass(self) -> tuple[str, ...]:
        return tuple(t for t in ALL_TESTS if t not in self.fail_to_pass)

    def reset(self, seed: int) -> Reset:
        self.sites = self.planted_sites(seed)
        self.workspace = {SOURCE: plant(PROJECT_SOURCE, self.sites), TESTS: PROJECT_TESTS}
        self._turns, self._done = 0, False
        prompt = (f"A bug in {SOURCE} makes these tests in {TESTS} fail: {', '.join(self.fail_to_pass)}. "
                  f"Use the tools to read the files, fix {SOURCE} and run the tests (the tests are right). "
                  "When they pass, reply without a tool call: <answer>done</answer>.")
        return Reset(messages=[{"role": "user", "content": prompt}], tools=list(TOOLS))

    def step(self, action: Action) -> StepResult:
        if self._done:
            raise RuntimeError(f"{self.name}: no live episode (call reset(seed) first)")
        self._turns += 1
        if action.parse_error is None and not action.tool_calls:
            self._done = True
            return StepResult([], 0.0, True, self._final())
        observation, failed = [], 0
        if action.parse_error is not None:
            error = action.parse_error
            text = error if error.startswith("could not parse") else f"could not parse the tool call: {error}"
            observation.append(_tool_message("tool_call", f"error: {text}"[:ERROR_CHARS]))
            failed += 1
        for call in action.tool_calls:
            content, ok = self._call(call)
            observation.append(_tool_message(call.name, content))
            failed += not ok
        reward = -self.process_reward * failed
        if self._turns >= self.max_turns:
            self._done = True
            return StepResult(observation, reward, True, {
                "tool_error": failed, "outcome": 0.0, "success": False, "ended": "max_turns"})
        return StepResult(observation, reward, False, {"tool_error": failed})

    def _call(self, call: ToolCall) -> tuple[str, bool]:
        """(the tool's answer, whether the call itself worked). Failing tests are a working call."""
        if call.name not in _TOOL_ARGUMENTS:
            return f"error: unknown tool {call.name[:40]!r}; the tools are read_file, edit, run_tests", False
        if set(call.arguments) != _TOOL_ARGUMENTS[call.name] or not all(
                isinstance(v, str) for v in call.arguments.values()):
            wanted = ", ".join(sorted(_TOOL_ARGUMENTS[call.name])) or "no arguments"
            return f"error: {call.name} takes {wanted} (strings)", False
        if call.name == "run_tests":
            return run_project_tests(self.workspace, self.limits).summary(self.timeout_s), True
        path = call.arguments["path"].strip().removeprefix("./")
        if path not in self.workspace:
            return f"error: no file {path[:40]!r}; the files are {SOURCE} and {TESTS}", False
        if call.name == "read_file":
            return self.workspace[path], True
        if path == TESTS:
            return f"error: {TESTS} is read-only (the tests are right); fix {SOURCE}", False
        old, new = call.arguments["old"], call.arguments["new"]
        count = self.workspace[path].count(old) if old else 0
        if count != 1:
            return f"error: old must occur exactly once in {path}; it occurs {count} times", False
        self.workspace[path] = self.workspace[path].replace(old, new)
        return f"edited {path}", True

    def _final(self) -> dict:
        """The pristine tests against the workspace's source (the workspace's tests play no part)."""
        source = self.workspace.get(SOURCE, "")
        f2p, p2p = self.fail_to_pass, self.pass_to_pass
        cheat = tampering(source)
        if cheat:   # not run at all: its result could not be trusted
            status, passing = "refused", set()
        else:
            run = run_project_tests({SOURCE: source, TESTS: PROJECT_TESTS}, self.limits)
            status, passing = run.status, set(run.ran) - set(run.failed) if run.status == "ran" else set()
        f2p_passed, p2p_passed = sum(t in passing for t in f2p), sum(t in passing for t in p2p)
        success = f2p_passed == len(f2p) and p2p_passed == len(p2p)
        return {"tool_error": 0, "outcome": 1.0 if success else 0.0, "success": success, "ended": "answered",
                "tests": status, "fail_to_pass": f"{f2p_passed}/{len(f2p)}",
                "pass_to_pass": f"{p2p_passed}/{len(p2p)}", **({"tampering": cheat} if cheat else {})}

    def expert_actions(self, seed: int) -> list[Action]:
        """See the failures, read the code, undo each bug, check, answer."""
        sites = self.planted_sites(seed)
        functions = " and ".join(s.function for s in sites)
        actions = [Action("", (ToolCall("run_tests", {}),), thinking="First see which tests fail."),
                   Action("", (ToolCall("read_file", {"path": SOURCE}),),
                          thinking=f"The failing tests are about {functions}: read the code.")]
        actions += [Action("", (ToolCall("edit", {"path": SOURCE, "old": s.buggy, "new": s.original}),),
                           thinking=f"In {s.function}, {s.buggy} should be {s.original}.") for s in sites]
        actions += [Action("", (ToolCall("run_tests", {}),), thinking="Check that the fix works."),
                    Action("<answer>done</answer>", thinking="All tests pass.")]
        return actions


def _tool_message(name: str, content: str) -> dict[str, str]:
    return {"role": "tool", "name": name, "content": content}
