"""Multiple-blind votes, position switching and the disagreement policy, on a ScriptedJudge."""
from scripted import ScriptedBackend

from tasks.genrm.config import ConsistencyConfig
from tasks.genrm.consistency import (
    BACKWARD,
    FORWARD,
    Vote,
    blind_grade,
    blind_vote,
    combine_orders,
    judge_pairs_consistently,
)
from tasks.genrm.judge import (
    Constraints,
    constraint_failures,
    constraints_from_metadata,
    rule_decision,
)
from tasks.genrm.parse import parse_pairwise


class ScriptedJudge:
    """Test fake: raw judge outputs scripted per (pair, order, attempt); records every query."""

    def __init__(self, script: dict[tuple[int, str, int], list[str]]):
        self.script = script
        self.queries: list[tuple[int, str, int]] = []

    def __call__(self, queries, attempt):
        out = []
        for pair, order in queries:
            self.queries.append((pair, order, attempt))
            texts = self.script[(pair, order, attempt)]
            out.append([(t, parse_pairwise(t)) for t in texts])
        return out


def test_blind_vote_majority_threshold_and_splits():
    assert blind_vote([1, 1, 0], 0.5) == Vote(1, 2 / 3, 3, "ok")
    assert blind_vote([1, 1, 0], 0.7).status == "no_consensus"
    assert blind_vote([1, 1, 0], 0.7).verdict == 0
    assert blind_vote([1, -1], 0.5) == Vote(0, 0.5, 2, "no_consensus")       # split: a tie
    assert blind_vote([None, None, -1], 0.3) == Vote(-1, 1 / 3, 1, "ok")      # unparseable samples count in k
    assert blind_vote([None, None], 0.5) == Vote(None, 0.0, 0, "unparseable")
    assert blind_vote([], 0.5).status == "unparseable"


def test_combine_orders_negates_the_swapped_order():
    ok = lambda v: Vote(v, 1.0, 3, "ok")
    assert combine_orders(ok(1), ok(-1)) == (1, "consistent")
    assert combine_orders(ok(0), ok(0)) == (0, "consistent")
    assert combine_orders(ok(1), ok(1)) == (None, "position_disagreement")   # position bias
    assert combine_orders(ok(1), Vote(None, 0, 0, "unparseable")) == (None, "position_disagreement")
    assert combine_orders(Vote(None, 0, 0, "unparseable"), Vote(None, 0, 0, "unparseable")) == (None, "unparseable")


def test_position_switch_keeps_consistent_verdicts_and_ties_disagreements():
    judge = ScriptedJudge({
        (0, FORWARD, 0): ["[[1]]", "[[1]]"], (0, BACKWARD, 0): ["[[-1]]", "[[-1]]"],   # consistent
        (1, FORWARD, 0): ["[[1]]", "[[1]]"], (1, BACKWARD, 0): ["[[1]]", "[[1]]"],     # always prefers Answer 2
        (2, FORWARD, 0): ["??", "no idea"], (2, BACKWARD, 0): ["", "[[7]]"],           # garbage
    })
    cfg = ConsistencyConfig(position_switch=True, on_disagreement="tie", blind_samples=2)
    d = judge_pairs_consistently(3, judge, cfg)
    assert [(x.verdict, x.status) for x in d] == [(1, "consistent"), (0, "position_disagreement"),
                                                  (None, "unparseable")]
    assert all(x.attempts == 1 for x in d)
    assert len(d[2].samples) == 4 and {s.parsed.status for s in d[2].samples} == {"unparseable", "out_of_range"}


def test_rejudge_retries_only_disagreeing_pairs_then_falls_back_to_a_tie():
    judge = ScriptedJudge({
        (0, FORWARD, 0): ["[[-1]]"], (0, BACKWARD, 0): ["[[1]]"],
        (1, FORWARD, 0): ["[[1]]"], (1, BACKWARD, 0): ["[[1]]"],
        (1, FORWARD, 1): ["[[1]]"], (1, BACKWARD, 1): ["[[-1]]"],    # agrees on the re-judge
        (2, FORWARD, 0): ["[[0]]"], (2, BACKWARD, 0): ["[[1]]"],
        (2, FORWARD, 1): ["[[0]]"], (2, BACKWARD, 1): ["[[1]]"],
        (2, FORWARD, 2): ["[[1]]"], (2, BACKWARD, 2): ["[[1]]"],     # never agrees
    })
    cfg = ConsistencyConfig(on_disagreement="rejudge", rejudge_attempts=2, blind_samples=1)
    d = judge_pairs_consistently(3, judge, cfg)
    assert [(x.verdict, x.status, x.attempts) for x in d] == [
        (-1, "consistent", 1), (1, "consistent", 2), (0, "position_disagreement", 3)]
    assert sorted(q for q in judge.queries if q[0] == 0) == [(0, BACKWARD, 0), (0, FORWARD, 0)]
    assert len(d[2].samples) == 6


def test_without_position_switch_one_order_decides():
    judge = ScriptedJudge({(0, FORWARD, 0): ["[[1]]", "[[1]]", "[[-1]]"], (1, FORWARD, 0): ["x", "y", "[[0]]"]})
    cfg = ConsistencyConfig(position_switch=False, blind_samples=3, agreement_threshold=0.6)
    d = judge_pairs_consistently(2, judge, cfg)
    assert [(x.verdict, x.status) for x in d] == [(1, "ok"), (0, "no_consensus")]
    assert all(order == FORWARD for _, order, _ in judge.queries)


def test_blind_grade_needs_enough_parsed_samples():
    assert blind_grade([1.0, 0.5, None], 0.5) == (0.75, 2 / 3, "ok")
    assert blind_grade([1.0, None, None], 0.5) == (None, 1 / 3, "unparseable")


def test_rule_checks_decide_when_exactly_one_answer_breaks_them():
    rules = Constraints(max_words=5, required_words=["paris"], format="lowercase")
    assert constraint_failures("the capital is paris", rules) == []
    assert constraint_failures("The capital of France is Lyon, I think", rules) == [
        "max_words>5", "missing:paris", "format:lowercase"]
    assert rule_decision("The capital is Lyon", "the capital is paris", rules).verdict == 1
    assert rule_decision("paris it is", "Paris? No, LYON", rules).verdict == -1
    assert rule_decision("paris", "it is paris", rules) is None        # both pass: the model decides
    bullets = Constraints(format="bullets", forbidden_words=["maybe"])
    assert constraint_failures("- one\n- two", bullets) == []
    assert constraint_failures("- one\nmaybe two", bullets) == ["forbidden:maybe", "format:bullets"]
    assert constraint_failures('{"a": 1}', Constraints(format="json")) == []



def test_possessives_and_contractions_contain_their_base_word():
    robot = Constraints(required_words=["robot"], max_words=4)
    assert constraint_failures("The robot's arm moved.", robot) == []
    assert constraint_failures("The robot\u2019s arm moved.", robot) == []          # a typographic apostrophe
    assert constraint_failures("The robots' arm moved.", Constraints(required_words=["robots"])) == []
    assert constraint_failures("A 'robot' painted.", robot) == []                  # quotes are not part of it
    assert constraint_failures("The robotic arm moved.", robot) == ["missing:robot"]
    assert constraint_failures("The robot's arm moved slowly.", robot) == ["max_words>4"]   # robot's: one word
    assert constraint_failures("- red\n- blue", Constraints(max_words=2)) == []   # a bullet's dash is no word
    contractions = Constraints(required_words=["they", "is", "can", "will"])
    assert constraint_failures("They're sure it isn't what we can't or won't do.", contractions) == []
    # a forbidden word is caught in its possessive too, and a rule verdict follows the fixed reading
    assert constraint_failures("The robot's arm.", Constraints(forbidden_words=["robot"])) == ["forbidden:robot"]
    assert rule_decision("A machine's arm.", "The robot's arm.", robot).verdict == 1


def test_bundled_open_prompts_pass_their_own_constraints_with_their_reference():
    from tasks.sources import open_prompt_records

    checked = []
    for rec in open_prompt_records():
        rules = constraints_from_metadata(rec.data.get("metadata"))
        if rules is not None:
            checked.append(rec.data["item_id"])
            assert constraint_failures(rec.data["answer"], rules) == [], rec.data["item_id"]
    assert "open-019" in checked and len(checked) >= 10


def good_judge(p: str) -> str:
    """A scripted judge: grades a response [[5]] when it contains the ground truth, and prefers
    whichever answer says GOOD."""
    if "[Ground-truth answer]" in p:
        truth = p.split("[Ground-truth answer]\n")[1].split("\n")[0]
        response = p.split("[Response]\n")[1].split("\n\n")[0]
        return "[[5]]" if truth in response else "[[1]]"
    first = p.split("[Answer 1]\n")[1].split("[Answer 2]")[0]
    second = p.split("[Answer 2]\n")[1].split("\n\n")[0]
    return "[[1]]" if "GOOD" in second else "[[-1]]" if "GOOD" in first else "[[0]]"


def test_genrm_judge_switches_positions_and_lets_rules_decide_first():
    from tasks.genrm.config import JudgeConfig
    from tasks.genrm.judge import GenRMJudge, GradeRequest, PairRequest

    backend = ScriptedBackend(good_judge)
    judge = GenRMJudge(backend, JudgeConfig(consistency={"blind_samples": 2}))
    rules = Constraints(required_words=["apple"])
    decisions = judge.compare([
        PairRequest("q", "meh", "GOOD answer"),
        PairRequest("q", "GOOD answer", "meh"),
        PairRequest("q", "same", "same too"),
        PairRequest("q", "GOOD but no fruit", "an apple", constraints=rules),   # rules overrule the model
    ])
    assert [(d.verdict, d.status) for d in decisions] == [
        (1, "consistent"), (-1, "consistent"), (0, "consistent"), (1, "rule")]
    assert len(backend.prompts) == 6                     # 3 model-judged pairs x 2 orders, none for the rule pair
    assert [s.pair_index for s in decisions[2].samples] == [2, 2, 2, 2]
    grades = judge.grade([GradeRequest("2+2?", "4", "it is 4"), GradeRequest("2+2?", "4", "five")])
    assert [(g.reward, g.status) for g in grades] == [(1.0, "ok"), (0.0, "ok")]
