"""MiniMax-01's four-dimension reward model and M1's graded STEM rewards.

(a) the judge is asked for one verdict line per dimension, and each dimension is decided on its
    own (blind votes, position switch) before they are mixed by weight;
(b) RL pays the weighted mean of the dimensions' verdict rewards and logs each dimension;
(c) a prompt in ``grade_domains`` (a ground truth no rule checks) is graded on the five-grade
    scale, unread grades are counted and kept out of the length-bias monitor;
(d) the judge benchmark measures accuracy per dimension.

The judge here is a scripted backend (``tests/scripted.py``, a test fake of a RolloutBackend that
answers by rules): no model can judge in a unit test.
"""
import json
import re

import polars as pl
import pytest
from scripted import ScriptedBackend

from tasks.genrm.config import MINIMAX_DIMENSIONS, JudgeConfig
from tasks.genrm.judge import GenRMJudge, PairRequest
from tasks.genrm.parse import ParsedVerdict, parse_dimensions
from tasks.genrm.validation import build_judge_benchmark, judge_accuracy
from tasks.rollout.base import Completion
from tasks.train.config import GenRMRewardConfig
from tasks.train.genrm_reward import DomainReward, RewardCounters
from tasks.train.rl import _monitor_inputs

NAMES = [d.name for d in MINIMAX_DIMENSIONS]
_ANSWERS = re.compile(r"\[Answer 1\]\n(.*?)\n\n\[Answer 2\]\n(.*)\Z", re.DOTALL)
# what each dimension of the scripted judge looks for in an answer
MARKS = {"correctness": "right", "truthfulness": "true", "helpfulness": "helpful", "harmlessness": "kind"}


def dimension_judge(biased=(), silent=()) -> ScriptedBackend:
    """A scripted judge. Pairwise prompts: per dimension, the answer carrying the dimension's mark
    wins; ``biased`` dimensions always say Answer 2 (a position bias), and ``silent`` ones are left
    out of the reply. Grade prompts: [[5]] when the response contains the ground truth, [[1]] when
    not, unreadable when it says 'garble'."""
    def reply(prompt: str) -> str:
        if "[Ground-truth answer]" in prompt:
            truth = prompt.split("[Ground-truth answer]\n")[1].split("\n")[0]
            response = prompt.split("[Response]\n")[1]
            return "no idea" if "garble" in response else "[[5]]" if truth in response else "[[1]]"
        first, second = _ANSWERS.search(prompt).groups()
        lines = ["Compared."]
        for name in NAMES:
            if name in silent or f"- {name}:" not in prompt:
                continue
            verdict = 1 if name in biased else (MARKS[name] in second) - (MARKS[name] in first)
            lines.append(f"{name}: [[{verdict}]]")
        return "\n".join(lines)

    return ScriptedBackend(reply, "scripted-dimensions", tokens=4)


def test_each_dimension_is_read_from_its_own_line():
    text = "Both fine.\nCorrectness: [[1]]\ntruthfulness - clearly [[0]]\nhelpfulness [[-1]]\nharmlessness: [[3]]"
    assert parse_dimensions(text, NAMES) == {
        "correctness": ParsedVerdict(1, "ok"), "truthfulness": ParsedVerdict(0, "ok"),
        "helpfulness": ParsedVerdict(-1, "ok"), "harmlessness": ParsedVerdict(None, "out_of_range")}
    # a verdict on another dimension's line, or a bare one, is no verdict for this dimension
    assert parse_dimensions("correctness is fine\n[[1]]", ["correctness"]) == {
        "correctness": ParsedVerdict(None, "unparseable")}
    assert parse_dimensions(None, ["correctness"]) == {"correctness": ParsedVerdict(None, "unparseable")}


def test_dimensions_are_settings_refused_when_malformed():
    assert [d.name for d in JudgeConfig(dimensions="minimax").dimensions] == NAMES
    with pytest.raises(ValueError, match="names must be unique"):
        JudgeConfig(dimensions=[{"name": "a", "description": "x"}, {"name": "a", "description": "y"}])
    with pytest.raises(ValueError, match="weights sum to 0"):
        JudgeConfig(dimensions=[{"name": "a", "weight": 0, "description": "x"}])
    with pytest.raises(ValueError, match="'minimax'"):
        JudgeConfig(dimensions="helpful")
    with pytest.raises(ValueError, match="in both domains"):
        GenRMRewardConfig(domains=["general", "science"], grade_domains=["science"])


def test_each_dimension_is_decided_on_its_own_then_mixed_by_weight():
    backend = dimension_judge(biased={"harmlessness"})
    judge = GenRMJudge(backend, JudgeConfig(dimensions="minimax", consistency={"blind_samples": 2}))
    [d] = judge.compare([PairRequest("q", "plain", "right and true but not useful")])
    # one prompt per order with every dimension named and its verdict line asked for
    assert len(backend.prompts) == 2 and all(f"{n}: [[v]]" in p for p in backend.prompts for n in NAMES)
    # correctness and truthfulness favour Answer 2 in both orders; helpfulness is a consistent tie;
    # harmlessness says "Answer 2" whatever the order: its position switch makes it a tie
    assert d.dimensions == {"correctness": 1, "truthfulness": 1, "helpfulness": 0, "harmlessness": 0}
    assert d.score == pytest.approx((0.4 + 0.2) / 1.0) and d.verdict == 1
    assert d.status == "position_disagreement"       # the worst of the read dimensions
    # 2 orders x 2 blind samples, each kept in the frame it was judged in (the swapped order's negated)
    assert sorted((s.order, s.parsed.value) for s in d.samples) == [("backward", -1)] * 2 + [("forward", 1)] * 2

    # the same pair with Answer 1 carrying the marks: the mirror verdicts
    [m] = GenRMJudge(dimension_judge(), JudgeConfig(dimensions="minimax")).compare(
        [PairRequest("q", "right, true, helpful and kind", "nothing")])
    assert m.dimensions == dict.fromkeys(NAMES, -1) and m.verdict == -1 and m.status == "consistent"


def test_a_dimension_the_judge_leaves_out_drops_out_of_the_mix():
    judge = GenRMJudge(dimension_judge(silent={"correctness"}), JudgeConfig(dimensions="minimax"))
    [d] = judge.compare([PairRequest("q", "kind", "true and helpful")])
    assert d.dimensions == {"correctness": None, "truthfulness": 1, "helpfulness": 1, "harmlessness": -1}
    assert d.score == pytest.approx((0.2 + 0.3 - 0.1) / 0.6) and d.verdict == 1
    [none] = GenRMJudge(dimension_judge(silent=set(NAMES)), JudgeConfig(dimensions="minimax")).compare(
        [PairRequest("q", "a", "b")])
    assert none.verdict is None and none.status == "unparseable" and none.score is None


ROW = {"prompt_id": "g1", "domain": "general", "prompt": "Explain tides.", "answer": None,
       "source_row": {"id": "g1", "solution": "the reference"}}


def test_rl_pays_the_weighted_dimension_rewards_and_logs_each_dimension():
    cfg = GenRMRewardConfig(judge={"dimensions": "minimax", "consistency": {"blind_samples": 1}})
    reward = DomainReward(cfg, judge_backend=dimension_judge)
    groups = [[Completion("right and true", token_ids=[1, 2]), Completion("kind only", token_ids=[1]),
               Completion("right true helpful kind", token_ids=[1, 2, 3])]]
    counters = RewardCounters()
    [scored] = reward.score([ROW], groups, counters)
    # the reference carries no mark: a marked dimension wins (1.0), an unmarked one ties (0.5)
    assert [s.dimensions for s in scored] == [
        {"correctness": 1.0, "truthfulness": 1.0, "helpfulness": 0.5, "harmlessness": 0.5},
        {"correctness": 0.5, "truthfulness": 0.5, "helpfulness": 0.5, "harmlessness": 1.0},
        dict.fromkeys(NAMES, 1.0)]
    assert [s.reward for s in scored] == pytest.approx([0.4 + 0.2 + 0.15 + 0.05, 0.2 + 0.1 + 0.15 + 0.1, 1.0])
    assert [s.verdict for s in scored] == [1, 1, 1] and [s.correct for s in scored] == [1.0, 1.0, 1.0]
    m = counters.metrics()
    assert m["genrm_dim.correctness"] == pytest.approx((1.0 + 0.5 + 1.0) / 3)
    assert m["genrm_dim.harmlessness"] == pytest.approx((0.5 + 1.0 + 1.0) / 3)
    assert m["genrm_dim_unread_fraction.correctness"] == 0.0 and m["genrm_scored"] == 3


SCIENCE = {"prompt_id": "s1", "domain": "science", "prompt": "What gas do plants take in?", "answer": "CO2",
           "source_row": {"id": "s1", "answer": "CO2"}}
NO_TRUTH = {"prompt_id": "s2", "domain": "science", "prompt": "Why is the sky blue?", "answer": None,
            "source_row": {"id": "s2"}}


def test_a_science_answer_is_graded_against_its_ground_truth():
    """M1's STEM case: no rule checks a science answer, so the GenRM grades it against the row's
    answer on the five-grade scale; unread grades and a missing ground truth are paid as grade 3
    and counted, and graded samples stay out of the length-bias monitor."""
    backend = dimension_judge()
    cfg = GenRMRewardConfig(judge={"consistency": {"blind_samples": 1}})
    reward = DomainReward(cfg, judge_backend=lambda: backend, run_id="r")
    groups = [[Completion("They take in CO2.", token_ids=[1, 2, 3]), Completion("Oxygen.", token_ids=[1]),
               Completion("garble", token_ids=[1])], [Completion("Rayleigh scattering", token_ids=[1, 2])]]
    counters = RewardCounters()
    scored = reward.score([SCIENCE, NO_TRUTH], groups, counters, step=2)
    assert [(s.scorer, s.reward, s.correct) for s in scored[0]] == [
        ("genrm_grade", 1.0, 1.0), ("genrm_grade", 0.0, 0.0), ("genrm_grade", 0.5, None)]
    assert [(s.status, s.reward, s.correct) for s in scored[1]] == [("no_reference", 0.5, None)]
    # one grade call for the round's three graded samples; the prompt shows the ground truth
    assert len(backend.prompts) == 3 and all("[Ground-truth answer]\nCO2" in p for p in backend.prompts)
    m = counters.metrics()
    assert m["genrm_graded"] == 4 and m["genrm_grade_unread_fraction"] == pytest.approx(2 / 4)
    assert m["genrm_grade_reward"] == pytest.approx(0.5) and m["genrm_no_reference"] == 1
    assert m["verify_error_fraction"] == 0.0 and m["genrm_scored"] == 0
    assert {j["kind"] for j in reward.judgments} == {"grade"} and len(reward.judgments) == 3
    seen = [(row, g, s, 0) for row, g, s in zip([SCIENCE, NO_TRUTH], groups, scored)]
    assert _monitor_inputs(seen) == ([], [], [])


def test_the_science_row_scored_zero_by_a_missing_verifier_before_grading():
    """Without grade_domains a science row goes to the verifiers, which have none for it: a
    counted error scoring 0 (what every science prompt got before M1's graded reward)."""
    counters = RewardCounters()
    [scored] = DomainReward(GenRMRewardConfig(grade_domains=[])).score(
        [SCIENCE], [[Completion("They take in CO2.")]], counters)
    assert (scored[0].scorer, scored[0].reward) == ("verifier", 0.0) and counters.verify_errors["science"] == 1


def test_the_judge_benchmark_measures_accuracy_per_dimension(wh, tmp_path):
    labelled = tmp_path / "labels.jsonl"
    rows = [
        {"prompt": "q1", "first": "plain", "second": "right", "label": 1, "dimension": "correctness"},
        {"prompt": "q2", "first": "right", "second": "plain", "label": -1, "dimension": "correctness"},
        {"prompt": "q3", "first": "plain", "second": "kind", "label": 1, "dimension": "harmlessness"},
        {"prompt": "q4", "first": "kind", "second": "plain", "label": -1, "dimension": "harmlessness"},
        {"prompt": "q5", "first": "plain", "second": "right", "label": 1},                 # overall verdict
        {"prompt": "q6", "first": "a", "second": "b", "label": 1, "dimension": "Not A Name!"},   # quarantined
    ]
    labelled.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    from tasks.genrm.config import ReferencesConfig

    cfg = ReferencesConfig(judge={"dimensions": "minimax", "consistency": {"blind_samples": 1}},
                           validation={"math_items": 0, "labelled_files": [str(labelled)]})
    ref, quarantined = build_judge_benchmark(wh, cfg)
    bench = wh.read_ref(ref)
    assert quarantined == 1 and bench.height == 5
    assert bench.filter(pl.col("dimension") == "harmlessness").height == 2
    bad = wh.read("quarantine").row(0, named=True)
    assert (bad["line"], bad["field"]) == (6, "dimension") and bad["reason"].startswith("bad_dimension")

    # harmlessness always says "Answer 2": right on q3, wrong on q4, whatever the position switch
    judge = GenRMJudge(dimension_judge(biased={"harmlessness"}), cfg.judge)
    m = judge_accuracy(judge, bench, run_id=None).metrics
    assert m["pairwise_accuracy.correctness"] == 1.0 and m["pairwise_items.correctness"] == 2
    assert m["pairwise_accuracy.harmlessness"] == 0.0 and m["pairwise_items.harmlessness"] == 2
    assert m["pairwise_accuracy"] == pytest.approx(3 / 5)
    assert m["pairwise_unreadable.truthfulness"] == 0.0 and m["pairwise_items_unjudged_dimension"] == 0.0
