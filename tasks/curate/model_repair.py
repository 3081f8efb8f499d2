"""Model-based data repair (MiniMax-M1): where a rule could only remove a row, a model tries first.

Two jobs, each asked of a rollout backend in batches (one ``generate`` call per ``batch_rows``
rows), each output kept only past checks that do not trust the model:

- **answers** (math rows ``math_answer_parse`` removes: math-verify cannot parse the answer).
  The model sees the problem, the stored answer and the solution and is asked to copy out the
  final answer. Its answer is kept when it is a whole expression (no dangling operator), parses
  (``answer_parses``, the rule's own check) and the source states it (``stated_in``). The source
  is the stored answer when that states any math (a number, a math span); else the stored answer
  and the end of the solution (its last ``STATED_SOLUTION_CHARS``, where a solution states its
  result). Stated means: the expression occurs there (spacing
  and ``$`` aside, not inside a longer number or name, not as an operand of an
  expression), or math-verify finds
  it equal to a math span, ``\\boxed{}`` or number there; a bare comma list when each of its
  items is. The problem is not a source: an answer copied from the question, or solved from it,
  was not extracted; a correct answer the text never states is dropped too (a wrong gold answer
  costs RL more than a lost row).
- **tests** (code rows ``code_tests`` removes: no tests, but a reference solution in
  ``solution`` or ``answer``). The model writes a HumanEval ``check(candidate)``. Kept when it
  holds ``min_assertions`` asserts and does not define the solution itself, the reference passes
  it in the sandbox, and at least ``min_killed`` of up to ``max_mutants`` mutants of the
  reference (``tasks.curate.mutants``) fail it: tests a wrong solution passes as well check
  nothing. Every mutant runs, and the share killed is the decision's score.

A repaired row goes through every rule again (another rule may still remove it); kept, it has a
``rewritten`` decision (``math_answer_parse:model_extracted``, ``code_tests:model_generated_tests``)
and ``model_repair`` in its metadata (what was there before, the model). A row the model cannot
repair is removed with a reason saying why. A failing ``generate`` call removes its batch's rows
(``...:model_error``) and a failing sandbox run its row (``code_tests:sandbox_error``); neither
stops the run.
"""
from __future__ import annotations

import ast
import json
import logging
import re
from collections import Counter
from dataclasses import dataclass, field

import polars as pl

from tasks.curate.config import CodeTestsRepairConfig, FilterConfig, ModelRepairConfig
from tasks.curate.filters import FilterOutcome, Row, answer_parses, run_rules
from tasks.curate.mutants import mutants
from tasks.curate.parallel import LocalMapper, chunked
from tasks.rollout.base import RolloutBackend, SamplingParams
from tasks.synth.base import after_thinking, last_boxed
from tasks.verify.code import code_blocks, extract_code, runnable_prompt
from tasks.verify.math import extract_final_answer, math_equal
from tasks.verify.sandbox import SandboxLimits, run_python_sandboxed

log = logging.getLogger("posttrain.curate.model_repair")

# the rule reasons a job repairs
UNPARSEABLE = "math_answer_parse:unparseable_answer"
NO_TESTS = "code_tests:no_tests"
# answers
ANSWER_EXTRACTED = "math_answer_parse:model_extracted"                # kept, rewritten
ANSWER_UNSUPPORTED = "math_answer_parse:model_answer_unsupported"     # parses, but the source does not state it
ANSWER_NOT_EXTRACTED = "math_answer_parse:model_could_not_extract"    # no parseable answer in any sample
ANSWER_MODEL_ERROR = "math_answer_parse:model_error"
# tests
TESTS_GENERATED = "code_tests:model_generated_tests"                  # kept, rewritten
TESTS_REFERENCE_NOT_RUNNABLE = "code_tests:reference_not_runnable"    # the reference is not a program defining the entry point
TESTS_NO_MUTANT = "code_tests:no_mutant"                              # nothing to tell strong tests from weak ones
TESTS_NONE_WRITTEN = "code_tests:model_wrote_no_tests"
TESTS_SANDBOX_ERROR = "code_tests:sandbox_error"
TESTS_FAIL_REFERENCE = "code_tests:generated_tests_fail_reference"
TESTS_TOO_WEAK = "code_tests:generated_tests_too_weak"                # fewer than min_killed mutants fail them
TESTS_MODEL_ERROR = "code_tests:model_error"
# when every sample fails, the reason of the one that got furthest
_TESTS_PROGRESS = (TESTS_NONE_WRITTEN, TESTS_SANDBOX_ERROR, TESTS_FAIL_REFERENCE, TESTS_TOO_WEAK)

ANSWER_PROMPT = """Copy out the final answer of the reference solution below. Do not solve the problem \
yourself: take the answer exactly as the stored answer or the solution states it, written as one math \
expression (a number, an expression, a set or an interval; LaTeX is fine; no words, no units); when it is \
given in several equivalent forms, take the simplest (a plain number when there is one). If they state no \
final answer, reply <answer>NONE</answer>.
Reply with the answer between <answer> and </answer> and nothing else.

[Problem]
{problem}

[Stored answer]
{answer}

[Reference solution]
{solution}"""

TESTS_PROMPT = """Write unit tests for the programming problem below; its reference solution is correct.
Write a Python function `check(candidate)` that calls `candidate` (the solution's `{entry_point}`) on concrete \
inputs and asserts the exact results the reference solution returns: at least {min_assertions} assertions, \
ordinary inputs and edge cases (empty inputs, zero, negative numbers, boundaries). Use only the standard \
library. Do not define `{entry_point}` and do not call `check`.
Reply with the tests in one ```python code block.

[Problem]
{problem}

[Reference solution]
```python
{solution}
```"""


# -- answers: is an extracted answer stated by the source? ---------------------------------
_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
# an answer stands on its own in the text, not as an operand: "12" is stated in "12 apples", "x = 12."
# and "-2" in "x = -2"; not in "112", "3.12", "12.5", "x^12", "8*12*6", "5/12" or "C(12, 3)"
_BEFORE = r"(?<![A-Za-z0-9.^_\\/*+\-(])"
_AFTER = r"(?![A-Za-z0-9^_/*+\-(!]|\.[0-9])"
_NUMBER = re.compile(_BEFORE + r"-?\d+(?:\.\d+)?(?:/\d+)?" + _AFTER)
_SPACE = re.compile(r"\s+")
MAX_CANDIDATES = 64    # math-verify comparisons per extracted answer
STATED_SOLUTION_CHARS = 600   # the end of a solution, where it states its result
MAX_BARE_ANSWER_CHARS = 80    # a reply without answer tags is taken as the answer up to this long


def _spaced(text: str) -> str:
    return _SPACE.sub(" ", text.replace("$", " ")).strip()


def _occurs(answer: str, text: str) -> bool:
    """``answer`` in ``text``, standing on its own (``_BEFORE``, ``_AFTER``)."""
    return bool(answer) and re.search(_BEFORE + re.escape(answer) + _AFTER, text) is not None


def _all_boxed(text: str) -> list[str]:
    out, rest = [], text
    while (box := last_boxed(rest)) is not None:
        out.append(box)
        rest = rest[:max(rest.rfind("\\boxed{"), rest.rfind("\\fbox{"))]
    return out


def source_candidates(source: str) -> list[str]:
    """What the source states as math: its math spans (and what follows their last ``=``), boxed
    answers and numbers, in order, without repeats."""
    found: list[str] = []
    for m in _MATH_SPAN.finditer(source):
        span = next(g for g in m.groups() if g is not None).strip()
        found += [span, span.rsplit("=", 1)[-1].strip()] if "=" in span else [span]
    found += _all_boxed(source) + _NUMBER.findall(source)
    return list(dict.fromkeys(c for c in found if c))


def _top_level_items(answer: str) -> list[str]:
    """The items of a bare comma list ("3, -2"); [answer] when it is anything else."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(answer):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            items.append(answer[start:i].strip())
            start = i + 1
    items.append(answer[start:].strip())
    return items if len(items) > 1 and all(items) else [answer]


def _equal(a: str, b: str) -> bool:
    try:
        return math_equal(a, b)
    except Exception:  # noqa: BLE001 - a math-verify timeout or crash is no evidence
        return False


def stated_in(answer: str, source: str) -> bool:
    """Whether ``source`` (a row's stored answer and solution) states ``answer``: it occurs there,
    or equals one of the source's math spans or numbers (``source_candidates``), or is a bare comma
    list whose items each are stated."""
    spaced, text = _spaced(answer), _spaced(source)
    if _occurs(spaced, text) or _occurs(spaced.replace(" ", ""), text.replace(" ", "")):
        return True
    if any(_equal(c, answer) for c in source_candidates(source)[:MAX_CANDIDATES]):
        return True
    items = _top_level_items(answer)
    return len(items) > 1 and all(stated_in(item, source) for item in items)


def extracted_answer(text: str) -> str | None:
    """The answer a completion gives: its ``<answer>`` or ``\\boxed{}``, else the whole reply when
    it is one short line (small models answer bare); None for none or NONE."""
    answer = extract_final_answer(text)
    if answer is None:
        bare = after_thinking(text).strip()
        answer = bare if bare and "\n" not in bare and len(bare) <= MAX_BARE_ANSWER_CHARS else None
    answer = (answer or "").strip().strip("$").strip()
    return None if not answer or answer.upper() == "NONE" else answer


def answer_source(answer: str | None, solution: str | None) -> str:
    """What may state a row's answer: the stored answer when it states any math, else it and the
    end of the solution (the gold field first: a solution states intermediate results too)."""
    answer = answer or ""
    if source_candidates(answer):
        return answer
    return f"{answer}\n{(solution or '')[-STATED_SOLUTION_CHARS:]}"


_DANGLING = re.compile(r"[=+\-*/^,]\s*$")


def judge_extractions(texts: list[str] | None, source: str) -> tuple[str, str | None]:
    """(decision reason, the answer kept or None) over one row's completions, first kept wins."""
    if texts is None:
        return ANSWER_MODEL_ERROR, None
    reason = ANSWER_NOT_EXTRACTED
    for text in texts:
        answer = extracted_answer(text)
        if answer is None or _DANGLING.search(answer) or not answer_parses(answer):
            continue
        if stated_in(answer, source):
            return ANSWER_EXTRACTED, answer
        reason = ANSWER_UNSUPPORTED
    return reason, None


# -- tests: a reference program, suites from completions, checking them in the sandbox ---------
def _compiles(code: str) -> ast.Module | None:
    try:
        return ast.parse(code)
    except (SyntaxError, ValueError):
        return None


def _functions(tree: ast.Module) -> list[str]:
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def reference_program(prompt: str, reference: str) -> str | None:
    """The reference solution as a whole program, built as the code verifier builds a response's
    (``tasks.verify.code.build_program``): a fenced solution below the prompt's code, else a
    continuation of the prompt; a full solution beside a prose prompt stands alone."""
    code, fenced = extract_code(reference)
    tries = [f"{runnable_prompt(prompt)}\n\n{code}"] if fenced else [prompt + code, code]
    for program in tries:
        tree = _compiles(program)
        if tree is not None and _functions(tree):
            return program
    return None


def entry_point_of(given: str | None, prompt: str, program: str) -> str | None:
    """The function the tests call: the row's ``entry_point``, else the last function the
    prompt's code defines, else the last one the program defines; None unless the program has it."""
    defined = _functions(ast.parse(program))
    if given:
        return given if given in defined else None
    prompt_code = runnable_prompt(prompt)
    name = ((_functions(ast.parse(prompt_code)) if prompt_code else []) or defined or [None])[-1]
    return name if name in defined else None


def suite_from(text: str, entry_point: str, min_assertions: int) -> str | None:
    """The tests of a completion, as the code verifier runs them (``check`` then ``check(entry)``):
    its last fenced block, with a top-level ``check`` holding ``min_assertions`` asserts and no
    definition of the entry point; its own top-level calls of ``check`` are dropped. None if not."""
    blocks = code_blocks(after_thinking(text))
    tree = _compiles(blocks[-1]) if blocks else None
    if tree is None:
        return None
    checks = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if len(checks) != 1 or entry_point in _functions(tree) or entry_point == "check":
        return None
    if sum(isinstance(n, ast.Assert) for n in ast.walk(checks[0])) < min_assertions:
        return None
    tree.body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
                                              and isinstance(n.value.func, ast.Name) and n.value.func.id == "check")]
    return f"{ast.unparse(tree)}\n\n\ncheck({entry_point})\n"


@dataclass(frozen=True)
class SuiteJob:
    """One code row's candidate suites and what they are checked against."""
    row_id: str
    program: str                 # the reference solution as a whole program
    mutants: list[str]
    suites: list[str | None]     # per completion; None: it held no usable suite


@dataclass(frozen=True)
class SuiteVerdict:
    row_id: str
    reason: str
    tests: str | None = None     # the suite kept
    killed: float | None = None  # share of the mutants the kept suite fails
    sandbox_runs: int = 0


def _passes(program: str, tests: str, limits: SandboxLimits) -> bool:
    return run_python_sandboxed(f"{program}\n\n{tests}", limits).passed


def check_suites(jobs: list[SuiteJob], cfg: CodeTestsRepairConfig) -> list[SuiteVerdict]:
    """Per row, the first suite the reference passes and ``min_killed`` mutants fail (map step:
    module level, so Dask can ship it)."""
    limits = SandboxLimits(timeout_s=cfg.timeout_s, cpu_s=max(1, int(cfg.timeout_s)), memory_mb=cfg.memory_mb)
    out = []
    for job in jobs:
        reason, runs = TESTS_NONE_WRITTEN, 0
        verdict = None
        for suite in job.suites:
            if suite is None:
                continue
            try:
                runs += 1
                if not _passes(job.program, suite, limits):
                    outcome = TESTS_FAIL_REFERENCE
                else:
                    killed = sum(not _passes(m, suite, limits) for m in job.mutants)
                    runs += len(job.mutants)
                    if killed >= cfg.min_killed:
                        verdict = SuiteVerdict(job.row_id, TESTS_GENERATED, suite, killed / len(job.mutants), runs)
                        break
                    outcome = TESTS_TOO_WEAK
            except Exception as e:  # noqa: BLE001 - a sandbox that cannot start fails this row, not the run
                log.warning("curate model repair: sandbox run for %s failed: %s", job.row_id, e)
                outcome = TESTS_SANDBOX_ERROR
            reason = max(reason, outcome, key=_TESTS_PROGRESS.index)
        out.append(verdict or SuiteVerdict(job.row_id, reason, sandbox_runs=runs))
    return out


# -- the repair step ------------------------------------------------------------------------
@dataclass
class RepairResult:
    outcomes: list[FilterOutcome]                             # as given, repaired rows replaced
    metadata: dict[str, str] = field(default_factory=dict)    # row id -> its new metadata (JSON)
    scores: dict[str, float] = field(default_factory=dict)    # row id -> decision score (tests: share killed)
    counters: Counter = field(default_factory=Counter)


def _metadata(raw: str | None) -> dict:
    try:
        parsed = json.loads(raw) if raw else {}
    except ValueError:
        parsed = {"metadata": raw}
    return parsed if isinstance(parsed, dict) else {"metadata": parsed}


def _tail(text: str | None, chars: int) -> str:
    text = (text or "").strip()
    return text if len(text) <= chars else "..." + text[-chars:]


class ModelRepair:
    """Asks ``backend`` to repair the rows two rules removed; see the module docstring."""

    def __init__(self, cfg: ModelRepairConfig, backend: RolloutBackend, mapper=None, chunk_rows: int = 64):
        if cfg.rollout is None:
            raise ValueError("curate.model_repair needs a rollout section (backend and model)")
        self.cfg, self.backend = cfg, backend
        self.mapper, self.chunk_rows = mapper or LocalMapper(), chunk_rows

    def _params(self, samples: int, temperature: float, max_tokens: int) -> SamplingParams:
        r = self.cfg.rollout
        window = r.repetition_window if r.repetition_window is not None and r.repetition_window <= max_tokens else None
        # one random stream per sequence: a row's samples do not depend on the rows batched with it
        return r.sampling_params(n=samples, temperature=temperature, max_tokens=max_tokens,
                                 repetition_window=window, logprobs=False, seed_per_sequence=True)

    def _generate(self, prompts: list[str], params: SamplingParams, counters: Counter,
                  job: str) -> list[list[str] | None]:
        """Completions per prompt, one ``generate`` call per batch; None for each prompt of a batch
        whose call failed."""
        out: list[list[str] | None] = []
        for batch in chunked(prompts, self.cfg.batch_rows):
            counters[f"model_repair.{job}.generate_calls"] += 1
            try:
                got = self.backend.generate(batch, params)
                if len(got) != len(batch):
                    raise ValueError(f"{len(got)} completion lists for {len(batch)} prompts")
                out += [[c.text for c in completions] for completions in got]
            except Exception as e:  # noqa: BLE001 - a failed call removes its rows with a reason
                log.warning("curate model repair: a %s generate call (%d rows) failed: %s", job, len(batch), e)
                counters[f"model_repair.{job}.failed_calls"] += 1
                out += [None] * len(batch)
        return out

    def _chat(self, text: str) -> str:
        return self.backend.format_chat([{"role": "user", "content": text}])

    def run(self, outcomes: list[FilterOutcome], incoming: pl.DataFrame, filters: FilterConfig) -> RepairResult:
        result = RepairResult(list(outcomes))
        cfg = self.cfg
        want = {UNPARSEABLE} if cfg.answers.enabled else set()
        want |= {NO_TESTS} if cfg.tests.enabled else set()
        asked = [i for i, o in enumerate(outcomes) if o.removed_reason in want]
        if not asked:
            return result
        ids = [outcomes[i].id for i in asked]
        rows = {r["id"]: r for r in incoming.filter(pl.col("id").is_in(ids)).select(
            "id", "domain", "answer", "solution", "metadata").to_dicts()}
        answers = [i for i in asked if outcomes[i].removed_reason == UNPARSEABLE]
        tests = [i for i in asked if outcomes[i].removed_reason == NO_TESTS]
        fixed: dict[int, tuple[str, str, dict]] = {}   # outcome index -> (reason, new value, record)
        failed: dict[int, str] = {}
        self._answers(answers, rows, result, fixed, failed)
        self._tests(tests, rows, result, fixed, failed)
        for i, reason in failed.items():
            o = outcomes[i]
            result.outcomes[i] = FilterOutcome(o.id, reason, o.rewritten_reason, o.prompt, o.answer, o.tests,
                                               o.rewrites)
        for i, (reason, value, record) in fixed.items():
            o, row = outcomes[i], rows[outcomes[i].id]
            field_name = "answer" if reason == ANSWER_EXTRACTED else "tests"
            repaired = Row(o.id, row["domain"], o.prompt, value if field_name == "answer" else o.answer,
                           value if field_name == "tests" else o.tests,
                           rewrites=o.rewrites + [f"model_{field_name}"])
            result.outcomes[i] = run_rules(repaired, filters, rewritten=reason)
            meta = _metadata(row["metadata"])
            meta["model_repair"] = {"field": field_name, "before": getattr(o, field_name), "model": cfg.rollout.model,
                                    **record}
            result.metadata[o.id] = json.dumps(meta, default=str, sort_keys=True)
        return result

    def _answers(self, indices: list[int], rows: dict, result: RepairResult, fixed: dict, failed: dict) -> None:
        if not indices:
            return
        job, c = self.cfg.answers, result.counters
        sources, prompts = [], []
        for i in indices:
            o, row = result.outcomes[i], rows[result.outcomes[i].id]
            # the problem is shown for context, never a source: only the answer and solution state answers
            sources.append(answer_source(o.answer, row["solution"]))
            prompts.append(self._chat(ANSWER_PROMPT.format(
                problem=_tail(o.prompt, job.max_source_chars), answer=_tail(o.answer, job.max_source_chars) or "(none)",
                solution=_tail(row["solution"], job.max_source_chars) or "(none)")))
        c["model_repair.answers.asked"] += len(indices)
        params = self._params(job.samples, job.temperature, job.max_tokens)
        for i, source, texts in zip(indices, sources, self._generate(prompts, params, c, "answers")):
            reason, answer = judge_extractions(texts, source)
            c[f"model_repair.answers.{reason.split(':', 1)[1]}"] += 1
            if answer is None:
                failed[i] = reason
            else:
                fixed[i] = (reason, answer, {})

    def _tests(self, indices: list[int], rows: dict, result: RepairResult, fixed: dict, failed: dict) -> None:
        if not indices:
            return
        job, c = self.cfg.tests, result.counters
        ready: list[tuple[int, str, str, list[str]]] = []   # (index, program, entry point, mutants)
        for i in indices:
            o, row = result.outcomes[i], rows[result.outcomes[i].id]
            # HumanEval-style rows carry the canonical solution as their answer
            reference = row["solution"] if (row["solution"] or "").strip() else (row["answer"] or "")
            if not reference.strip():
                c["model_repair.tests.no_reference"] += 1   # nothing to check tests against: stays no_tests
                continue
            program = reference_program(o.prompt, reference)
            entry = entry_point_of(_metadata(row["metadata"]).get("entry_point"), o.prompt, program) if program else None
            if entry is None:
                failed[i] = TESTS_REFERENCE_NOT_RUNNABLE
                continue
            found = mutants(program, job.max_mutants, self.cfg.rollout.seed, o.id)
            if len(found) < job.min_killed:
                failed[i] = TESTS_NO_MUTANT
                continue
            ready.append((i, program, entry, found))
        for i in indices:
            if i in failed:
                c[f"model_repair.tests.{failed[i].split(':', 1)[1]}"] += 1
        if not ready:
            return
        c["model_repair.tests.asked"] += len(ready)
        prompts = [self._chat(TESTS_PROMPT.format(entry_point=entry, min_assertions=job.min_assertions,
                                                  problem=result.outcomes[i].prompt.strip(), solution=program.strip()))
                   for i, program, entry, _ in ready]
        completions = self._generate(prompts, self._params(job.samples, job.temperature, job.max_tokens), c, "tests")
        jobs, by_id = [], {}
        for (i, program, entry, found), texts in zip(ready, completions):
            row_id = result.outcomes[i].id
            by_id[row_id] = i
            if texts is None:
                failed[i] = TESTS_MODEL_ERROR
                c["model_repair.tests.model_error"] += 1
                continue
            jobs.append(SuiteJob(row_id, program, found, [suite_from(t, entry, job.min_assertions) for t in texts]))
        verdicts = [v for part in self.mapper.map(check_suites, chunked(jobs, self.chunk_rows), cfg=job) for v in part]
        for v in verdicts:
            i = by_id[v.row_id]
            c[f"model_repair.tests.{v.reason.split(':', 1)[1]}"] += 1
            c["model_repair.tests.sandbox_runs"] += v.sandbox_runs
            if v.tests is None:
                failed[i] = v.reason
            else:
                fixed[i] = (v.reason, v.tests, {"mutants_killed": v.killed})
                result.scores[v.row_id] = float(v.killed)
