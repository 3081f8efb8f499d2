"""Model-based data work (MiniMax-M1, issue 47 item 4): where curate's rules could only remove a
row, a model repairs it first, and nothing it writes is trusted unchecked.

Real warehouse (DuckDB file under the test's home), real curate blocks, the real code sandbox
and math-verify. The model is ``ScriptedRepairBackend``, a test fake of a rollout backend (no
model that follows instructions can run in unit tests here): it answers each prompt with the
reply scripted for a phrase of the row in it, and records every ``generate`` call. One test
drives the real local backend with the random tiny Llama (noise, which the checks must reject).
"""
from __future__ import annotations

import json

import polars as pl
import pytest
from pydantic import ValidationError

from data_specs.curation import POOL_TABLES
from tasks.curate import model_repair as mr
from tasks.curate.config import CurateConfig, DecontamConfig, ModelRepairConfig, SemanticConfig
from tasks.curate.mutants import mutants
from tasks.curate.pipeline import run_curate, settings_key
from tasks.ingest import store_records
from tasks.records import RawRecord
from tasks.rollout.base import Completion
from tasks.rollout.config import RolloutConfig
from tasks.verify.code import verify_code


class ScriptedRepairBackend:
    """Test fake of a rollout backend: the reply for a prompt is the script's entry for the first
    of its keys found in the prompt (a list: one reply per sample), else prose that answers
    nothing. ``fail_on``: a phrase whose batch makes the whole ``generate`` call raise."""

    name = "scripted"

    def __init__(self, script: dict[str, str | list[str]], fail_on: str | None = None):
        self.script, self.fail_on = script, fail_on
        self.calls: list[list[str]] = []

    def format_chat(self, messages):
        return "<|user|>\n" + messages[-1]["content"] + "\n<|assistant|>\n"

    def generate(self, prompts, params):
        self.calls.append(list(prompts))
        if self.fail_on and any(self.fail_on in p for p in prompts):
            raise ConnectionError("scripted backend: the server went away")
        out = []
        for p in prompts:
            reply = next((r for key, r in self.script.items() if key in p), "I am not sure what you mean.")
            replies = reply if isinstance(reply, list) else [reply]
            out.append([Completion(replies[k % len(replies)]) for k in range(params.n)])
        return out

    def asked_about(self, phrase: str) -> int:
        return sum(phrase in p for call in self.calls for p in call)


ROLLOUT = RolloutConfig(backend="openai", model="scripted-model", max_tokens=512, repetition_window=None)


def repair_cfg(**repair) -> CurateConfig:
    settings = {"enabled": True, "rollout": ROLLOUT} | repair
    return CurateConfig(semantic=SemanticConfig(enabled=False), decontam=DecontamConfig(embedding=False),
                        model_repair=ModelRepairConfig(**settings), chunk_rows=3)


def ingest(wh, rows: list[dict], source: str = "unit") -> None:
    report = store_records(wh, [RawRecord(f"{source}.jsonl", i + 1, data=r) for i, r in enumerate(rows)], source)
    assert report.quarantined == 0


def pools(wh) -> pl.DataFrame:
    return pl.concat([wh.read(t) for t in POOL_TABLES.values()])


def decision_of(wh, prompt_phrase: str) -> dict:
    """The one decision row of the prompt containing the phrase (removed or rewritten)."""
    ids = wh.read("prompts").filter(pl.col("prompt").str.contains(prompt_phrase, literal=True))["id"].to_list()
    assert len(ids) == 1, prompt_phrase
    found = wh.read("decisions").filter(pl.col("row_id") == ids[0]).to_dicts()
    assert len(found) == 1, found
    return found[0]


def assert_every_row_accounted(wh, res, n_rows: int) -> None:
    """Rows in = rows kept + rows removed, over the run and in the filter stage's counts."""
    removed = wh.read("decisions").filter(pl.col("decision") == "removed")
    assert n_rows == pools(wh).height + removed.height
    assert removed["row_id"].is_unique().all()
    assert not set(removed["row_id"]) & set(pools(wh)["id"])
    stage = res.stages["curate.filter"]
    assert stage.rows_in == stage.kept + stage.removed_total
    filter_decisions = wh.read("decisions").filter(pl.col("stage") == "curate.filter")
    assert stage.removed_total == filter_decisions.filter(pl.col("decision") == "removed").height
    assert stage.rewritten == filter_decisions.filter(pl.col("decision") == "rewritten").height


# -- math: a model extracts the final answer the rules cannot parse --------------------------
MATH = [
    {"prompt": "A basket holds 5 red apples and 7 green apples. How many apples are in the basket?",
     "answer": "There are 12 apples in the basket", "solution": "Adding them up, 5 + 7 = 12 apples.",
     "domain": "math"},
    {"prompt": "A farmer has 13 cows and sells 4 of them at the market. How many cows remain on the farm?",
     "answer": "Nine cows are left on the farm", "solution": "Selling four of the thirteen cows leaves nine.",
     "domain": "math"},
    {"prompt": "A train leaves the station at noon and travels steadily east. When does it reach the next town?",
     "answer": "It depends on the timetable", "domain": "math"},
    {"prompt": "What is the sum of the numbers twenty and twenty-two written in base ten?", "answer": "42",
     "domain": "math"},
]
MATH_SCRIPT = {
    "red apples": "<answer>12</answer>",
    # the hallucinations: a number copied from the problem, and one made up
    "sells 4 of them": ["<answer>13</answer>", "<answer>11</answer>"],
    "next town": ["<answer>NONE</answer>", "<answer>whenever the timetable says</answer>"],
}


def test_math_answers_the_rules_cannot_parse_are_extracted_checked_and_counted(wh):
    ingest(wh, MATH)
    backend = ScriptedRepairBackend(MATH_SCRIPT)
    res = run_curate(wh, repair_cfg(answers={"samples": 2}), run_id="r1", repair_backend=backend)

    # extracted and stated by the row's own answer: kept with the extracted answer, rewrite recorded
    kept = decision_of(wh, "red apples")
    assert (kept["decision"], kept["reason"]) == ("rewritten", mr.ANSWER_EXTRACTED)
    row = pools(wh).filter(pl.col("id") == kept["row_id"]).to_dicts()[0]
    assert row["answer"] == "12" and row["verifiable"] and row["rewritten"] == mr.ANSWER_EXTRACTED
    record = json.loads(row["metadata"])["model_repair"]
    assert record == {"field": "answer", "before": "There are 12 apples in the basket", "model": "scripted-model"}
    # parses, but neither the answer nor the solution states it (13 is the problem's own number)
    hallucinated = decision_of(wh, "sells 4 of them")
    assert (hallucinated["decision"], hallucinated["reason"]) == ("removed", mr.ANSWER_UNSUPPORTED)
    # nothing parseable in any sample: dropped, with the reason saying the model could not do it either
    assert decision_of(wh, "next town")["reason"] == mr.ANSWER_NOT_EXTRACTED
    # a row the rules parse is never sent to the model
    assert backend.asked_about("twenty-two") == 0 and backend.asked_about("red apples") == 1

    stage = res.stages["curate.filter"]
    assert stage.removed[mr.ANSWER_UNSUPPORTED] == 1 and stage.removed[mr.ANSWER_NOT_EXTRACTED] == 1
    assert stage.removed["math_answer_parse:unparseable_answer"] == 0 and stage.rewritten == 1
    assert res.counters["model_repair.answers.asked"] == 3
    assert res.counters["model_repair.answers.model_extracted"] == 1
    assert_every_row_accounted(wh, res, len(MATH))


def test_without_model_repair_the_same_rows_are_removed_as_unparseable(wh):
    ingest(wh, MATH)
    res = run_curate(wh, CurateConfig(semantic=SemanticConfig(enabled=False), decontam=DecontamConfig(embedding=False)))
    assert res.stages["curate.filter"].removed["math_answer_parse:unparseable_answer"] == 3
    assert not any(k.startswith("model_repair.") for k in res.counters)


@pytest.mark.parametrize("answer,source,stated", [
    ("12", "There are 12 apples in the basket", True),
    ("\\frac{1}{2}", "Half of them, that is $\\frac{1}{2}$ of the class.", True),
    ("0.5", "Half of them, that is $\\frac{1}{2}$ of the class.", True),      # math-verify equal to a span
    ("5/14", "Thus the probability is C(6, 3)/C(8, 3) = 5/14.", True),
    ("3, -2", "So x equals 3 or x equals -2.", True),                          # each item stated
    ("3, -5", "So x equals 3 or x equals -2.", False),
    ("13", "Selling four of the thirteen cows leaves nine.", False),
    ("2", "We get x^2 = 9, so x is three.", False),                            # an exponent is no answer
    ("12", "The basket holds 112 apples.", False),                             # part of a longer number
    ("7", "The count is 8*7*6 over 3!, which is 56.", False),                  # an operand, not a result
    ("56", "The count is 8*7*6 over 3!, which is 56.", True),
])
def test_an_extracted_answer_must_be_stated_by_the_source(answer, source, stated):
    assert mr.stated_in(answer, source) is stated


def test_the_stored_answer_is_the_source_when_it_states_math_and_a_bare_reply_counts():
    source = mr.answer_source("0 is the only possible value", "Pair them: 1*2*3 = 6 ways, none valid. So it is 0.")
    assert source == "0 is the only possible value"
    # an intermediate result of the solution is not the row's answer when the stored answer states one
    assert mr.judge_extractions(["<answer>6</answer>"], source) == (mr.ANSWER_UNSUPPORTED, None)
    assert mr.judge_extractions(["0"], source) == (mr.ANSWER_EXTRACTED, "0")            # a bare one-line reply
    # a stored answer stating no math: the end of the solution is the source; a dangling expression is none
    prose = mr.answer_source("It depends on how you count", "Counting in order gives 1*2*3 = 6.")
    assert mr.judge_extractions(["<answer>6</answer>"], prose) == (mr.ANSWER_EXTRACTED, "6")
    assert mr.judge_extractions(["<answer>1*2*3 =</answer>"], prose) == (mr.ANSWER_NOT_EXTRACTED, None)


# -- code: a model writes tests; kept only when the reference passes and a mutant fails -------
def _code(name: str, doc: str, body: str, entry_point: bool = True) -> dict:
    row = {"prompt": f'def {name}(n):\n    """{doc}"""\n', "solution": body, "domain": "code"}
    return row | ({"entry_point": name} if entry_point else {})


CODE = [
    _code("count_up", "Return the list 0, 1, ... n - 1; an empty list when n is not positive.",
          "    return [i for i in range(n)] if n > 0 else []\n"),
    _code("add_one", "Return n plus one.", "    return n + 1\n"),
    _code("double_it", "Return twice the number n.", "    return 2 * n\n", entry_point=False),
    {"prompt": 'def mystery(n):\n    """Return something about n."""\n', "domain": "code"},   # no reference
]
STRONG = ("```python\ndef check(candidate):\n    assert candidate(3) == [0, 1, 2]\n    assert candidate(1) == [0]\n"
          "    assert candidate(0) == []\n    assert candidate(-2) == []\n\ncheck(count_up)\n```")
WEAK = ("```python\ndef check(candidate):\n    assert isinstance(candidate(1), int)\n"
        "    assert isinstance(candidate(5), int)\n    assert candidate(2) is not None\n```")
WRONG = ("```python\ndef check(candidate):\n    assert candidate(2) == 5\n    assert candidate(0) == 0\n"
         "    assert candidate(1) == 2\n```")
CODE_SCRIPT = {"def count_up": STRONG, "def add_one": WEAK, "def double_it": WRONG}


def test_generated_tests_are_kept_only_when_the_reference_passes_and_a_mutant_fails(wh):
    ingest(wh, CODE)
    backend = ScriptedRepairBackend(CODE_SCRIPT)
    res = run_curate(wh, repair_cfg(tests={"samples": 1, "timeout_s": 5}), run_id="r1", repair_backend=backend)

    kept = decision_of(wh, "def count_up")
    assert (kept["decision"], kept["reason"]) == ("rewritten", mr.TESTS_GENERATED)
    assert 0 < kept["score"] <= 1                                   # the share of mutants the tests kill
    row = pools(wh).filter(pl.col("id") == kept["row_id"]).to_dicts()[0]
    assert row["verifiable"] and row["rewritten"] == mr.TESTS_GENERATED
    assert json.loads(row["metadata"])["model_repair"]["field"] == "tests"
    # the kept tests are in the format the code verifier runs: the reference passes, a wrong solution fails
    meta = json.loads(row["metadata"])
    assert verify_code(row["prompt"], row["solution"], row["tests"], meta["entry_point"]) == 1.0
    assert verify_code(row["prompt"], "    return list(range(n + 1))\n", row["tests"], meta["entry_point"]) == 0.0
    # weak tests: every mutant of the reference passes them too
    assert decision_of(wh, "def add_one")["reason"] == mr.TESTS_TOO_WEAK
    # wrong tests: the reference itself fails them (its entry point found in the prompt's code)
    assert decision_of(wh, "def double_it")["reason"] == mr.TESTS_FAIL_REFERENCE
    # no reference solution to check tests against: not asked, removed as before
    assert decision_of(wh, "def mystery")["reason"] == "code_tests:no_tests"
    assert backend.asked_about("def mystery") == 0

    assert res.counters["model_repair.tests.asked"] == 3
    assert res.counters["model_repair.tests.no_reference"] == 1
    assert res.counters["model_repair.tests.sandbox_runs"] >= 3
    assert_every_row_accounted(wh, res, len(CODE))


def test_a_suite_that_defines_the_solution_itself_or_holds_too_few_asserts_is_no_suite():
    own = "```python\ndef add_one(n):\n    return n + 1\n\ndef check(candidate):\n" + "    assert candidate(1) == 2\n" * 3 + "```"
    few = "```python\ndef check(candidate):\n    assert candidate(1) == 2\n```"
    assert mr.suite_from(own, "add_one", 3) is None and mr.suite_from(few, "add_one", 3) is None
    suite = mr.suite_from(STRONG, "count_up", 3)
    assert suite is not None and suite.count("check(count_up)") == 1     # its own call dropped, one appended


def test_mutants_are_deterministic_and_each_changes_the_program_once():
    source = ('LIMIT = 10\n\ndef clip(values, low):\n    """Keep the values between low and LIMIT."""\n'
              '    out = []\n    for v in values:\n        if v >= low and v < LIMIT:\n            out.append(v + 0)\n'
              '    return out if out else None\n')
    first = mutants(source, 6, seed=0, key="row-1")
    assert first == mutants(source, 6, seed=0, key="row-1") and len(first) == 6
    assert mutants(source, 6, seed=1, key="row-1") != first              # the seed picks the sites
    import ast
    original = ast.unparse(ast.parse(source))
    for m in first:
        compile(m, "mutant", "exec")
        assert m != original and "LIMIT = 10" in m and "Keep the values between low and LIMIT." in m
        changed = [a != b for a, b in zip(original.splitlines(), m.splitlines())]
        assert sum(changed) == 1                                           # one site changed
    assert mutants("def f(:\n", 4, 0, "k") == [] and mutants("def f():\n    return\n", 4, 0, "k") == []


# -- batching, failures, incremental runs -----------------------------------------------------
def _many_math(n: int, tag: str) -> list[dict]:
    return [{"prompt": f"Shelf {tag}{i} holds {i + 3} books and gains {i + 4} more books. How many books are there?",
             "answer": f"The shelf holds {2 * i + 7} books in all", "domain": "math"} for i in range(n)]


def test_one_generate_call_per_batch_and_a_failed_call_removes_only_its_rows(wh):
    rows = _many_math(5, "q")
    ingest(wh, rows)
    script = {f"Shelf q{i} ": f"<answer>{2 * i + 7}</answer>" for i in range(5)}
    backend = ScriptedRepairBackend(script, fail_on="Shelf q4 ")
    res = run_curate(wh, repair_cfg(batch_rows=2), run_id="r1", repair_backend=backend)
    # five rows to repair, two per call: three calls, each with at most two prompts
    assert [len(c) for c in backend.calls] == [2, 2, 1]
    assert res.counters["model_repair.answers.generate_calls"] == 3
    assert res.counters["model_repair.answers.failed_calls"] == 1
    assert decision_of(wh, "Shelf q4 ")["reason"] == mr.ANSWER_MODEL_ERROR
    for i in range(4):
        assert decision_of(wh, f"Shelf q{i} ")["reason"] == mr.ANSWER_EXTRACTED
    assert sorted(pools(wh)["answer"].to_list()) == sorted(str(2 * i + 7) for i in range(4))
    assert_every_row_accounted(wh, res, len(rows))


def test_the_same_seed_gives_the_same_decisions_whatever_the_batch_size(tmp_path, monkeypatch):
    from warehouse import Warehouse

    frames = []
    for batch_rows in (1, 4):
        home = tmp_path / f"b{batch_rows}"
        home.mkdir()
        monkeypatch.setenv("POSTTRAIN_HOME", str(home))
        wh = Warehouse(home)
        ingest(wh, MATH + CODE)
        run_curate(wh, repair_cfg(batch_rows=batch_rows, answers={"samples": 2}, tests={"samples": 1}),
                   run_id="r", repair_backend=ScriptedRepairBackend(MATH_SCRIPT | CODE_SCRIPT))
        frames.append(wh.read("decisions").drop("run_id").sort("row_id"))
    assert frames[0].height == len(MATH + CODE) - 1 and frames[0].equals(frames[1])


def test_an_incremental_run_asks_the_model_only_about_new_rows(wh):
    ingest(wh, _many_math(2, "a"), source="first")
    cfg = repair_cfg()
    script = {f"Shelf {t}{i} ": f"<answer>{2 * i + 7}</answer>" for t in "ab" for i in range(2)}
    first = run_curate(wh, cfg, run_id="r1", repair_backend=ScriptedRepairBackend(script))
    assert first.counters["model_repair.answers.asked"] == 2
    ingest(wh, _many_math(2, "b"), source="second")
    backend = ScriptedRepairBackend(script)
    second = run_curate(wh, cfg, run_id="r2", repair_backend=backend)
    assert second.counters["from_scratch"] == 0.0 and second.counters["rows_new"] == 2
    assert backend.asked_about("Shelf a") == 0 and backend.asked_about("Shelf b") == 2
    assert pools(wh).height == 4 and set(pools(wh)["rewritten"]) == {mr.ANSWER_EXTRACTED}
    d = wh.read("decisions")
    assert d.height == 4 and d["row_id"].is_unique().all()


# -- settings ---------------------------------------------------------------------------------
def test_enabled_without_a_backend_is_an_error_at_load_time(wh, monkeypatch):
    with pytest.raises(ValidationError, match="model_repair.enabled needs curate.model_repair.rollout"):
        CurateConfig(model_repair={"enabled": True})
    from tasks.profile import ProfileError, load_profile

    monkeypatch.setenv("POSTTRAIN__CURATE__MODEL_REPAIR__ENABLED", "true")
    with pytest.raises(ProfileError, match="model_repair.rollout"):
        load_profile("tiny").section("curate", CurateConfig)
    # a config built in code and handed to run_curate without the backend: refused before any work
    ingest(wh, MATH)
    with pytest.raises(ValueError, match="no backend was given"):
        run_curate(wh, repair_cfg())
    assert not wh.exists("sft_pool")


def test_profiles_turn_it_on_for_m1_only_and_off_keeps_the_pools_settings():
    from tasks.profile import load_profile

    m1 = load_profile("m1", environ={}).section("curate", CurateConfig).model_repair
    assert m1.enabled and m1.rollout.model == "MiniMax-M1" and m1.rollout.backend == "openai"
    for name in ("tiny", "smol"):
        assert not load_profile(name, environ={}).section("curate", CurateConfig).model_repair.enabled
    # switched off, its settings do not change what the pools were made with; on, they do
    off = CurateConfig(model_repair={"enabled": False, "batch_rows": 3})
    assert settings_key(off) == settings_key(CurateConfig()) != settings_key(repair_cfg().model_copy(
        update={"semantic": SemanticConfig(), "decontam": DecontamConfig(), "chunk_rows": 2048}))


# -- through the flow, and with a real backend -------------------------------------------------
def test_the_curate_flow_builds_the_backend_from_the_profile(home, wh, monkeypatch):
    from mlflow.tracking import MlflowClient

    from flows.curate import curate_flow
    from tasks import tracking
    from tasks.rollout.factory import BACKENDS, BackendKind

    built = []

    def scripted(cfg):
        built.append(cfg.model)
        return ScriptedRepairBackend(MATH_SCRIPT | CODE_SCRIPT)

    monkeypatch.setitem(BACKENDS, "scripted", BackendKind("scripted", scripted, "openai", loads_model=False))
    for key, value in {"MODEL_REPAIR__ENABLED": "true", "MODEL_REPAIR__ROLLOUT__BACKEND": "scripted",
                       "MODEL_REPAIR__ROLLOUT__MODEL": "scripted-model", "SEMANTIC__ENABLED": "false",
                       "DECONTAM__EMBEDDING": "false"}.items():
        monkeypatch.setenv(f"POSTTRAIN__CURATE__{key}", value)
    ingest(wh, MATH + CODE)
    out = curate_flow(profile="tiny", home=str(home))
    assert built == ["scripted-model"]
    assert decision_of(wh, "red apples")["reason"] == mr.ANSWER_EXTRACTED
    assert decision_of(wh, "def count_up")["reason"] == mr.TESTS_GENERATED
    assert out["stages"]["curate.filter"]["rewritten"] == 2
    tracking.configure(home=home)
    metrics = MlflowClient().get_run(out["mlflow_run_id"]).data.metrics
    assert metrics["curate.model_repair.answers.asked"] == 3 and metrics["curate.model_repair.tests.asked"] == 3


def test_a_real_local_model_runs_the_repair_and_its_noise_is_not_kept(tmp_path, monkeypatch):
    """The random tiny Llama through the flow's own backend builder: a real prompt rendering and
    sampling path; what it writes is noise, and a repaired row is kept only if the checks hold."""
    from flows.curate import model_repair_backend
    from tasks.rollout.tiny_model import tiny_llama_path
    from warehouse import Warehouse

    model = str(tiny_llama_path(tmp_path / "models-home"))   # built once, shared by both runs
    decisions = []
    for attempt in ("a", "b"):
        home = tmp_path / attempt
        home.mkdir()
        monkeypatch.setenv("POSTTRAIN_HOME", str(home))
        wh = Warehouse(home)
        ingest(wh, MATH + CODE[:2])
        cfg = repair_cfg(rollout=RolloutConfig(backend="local", model=model, seed=3, repetition_window=None),
                         answers={"samples": 2, "temperature": 1.0, "max_tokens": 24},
                         tests={"samples": 1, "temperature": 1.0, "max_tokens": 24})
        res = run_curate(wh, cfg, run_id="r", repair_backend=model_repair_backend(cfg, str(home)))
        assert res.counters["model_repair.answers.asked"] == 3 and res.counters["model_repair.tests.asked"] == 2
        assert_every_row_accounted(wh, res, len(MATH) + 2)
        for row in pools(wh).filter(pl.col("rewritten") == mr.ANSWER_EXTRACTED).to_dicts():
            before = json.loads(row["metadata"])["model_repair"]["before"]
            assert mr.stated_in(row["answer"], f"{before}\n{row['solution'] or ''}")
        decisions.append(wh.read("decisions").drop("run_id").sort("row_id"))
    assert decisions[0].equals(decisions[1])                  # the seed decides what the model wrote


def test_the_sandbox_checks_run_as_map_tasks_on_dask_with_the_same_decisions(tmp_path, monkeypatch):
    from tasks.curate.parallel import DaskMapper, LocalMapper
    from warehouse import Warehouse

    frames = {}
    for kind in ("local", "dask"):
        home = tmp_path / kind
        home.mkdir()
        monkeypatch.setenv("POSTTRAIN_HOME", str(home))
        wh = Warehouse(home)
        ingest(wh, CODE)
        # thread workers: the same map code path, a cluster that starts in about a second
        mapper = LocalMapper() if kind == "local" else DaskMapper(n_workers=2, processes=False)
        try:
            res = run_curate(wh, repair_cfg(tests={"samples": 1}), run_id="r", mapper=mapper,
                             repair_backend=ScriptedRepairBackend(CODE_SCRIPT))
        finally:
            mapper.close()
        assert res.counters["model_repair.tests.asked"] == 3
        frames[kind] = wh.read("decisions").drop("run_id").sort("row_id")
    assert frames["local"].height == len(CODE) and frames["local"].equals(frames["dask"])
