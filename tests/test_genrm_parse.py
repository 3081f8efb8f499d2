"""Verdict parsers: exact cases, and fuzzing that they never raise and stay in range."""
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.genrm.config import DEFAULT_GRADE_REWARDS
from tasks.genrm.parse import (
    GRADE_VALUES,
    PAIRWISE_VALUES,
    ParsedVerdict,
    grade_reward,
    parse_grade,
    parse_pairwise,
)


def test_pairwise_reads_the_last_bracketed_verdict():
    assert parse_pairwise("Answer 2 is clearer. [[1]]") == ParsedVerdict(1, "ok")
    assert parse_pairwise("At first [[1]] but on reflection [[ -1 ]]") == ParsedVerdict(-1, "ok")
    assert parse_pairwise("They are alike.\nVerdict: 0") == ParsedVerdict(0, "ok")
    assert parse_pairwise("verdict = **+1**") == ParsedVerdict(1, "ok")


def test_pairwise_failures_are_recorded_not_raised():
    assert parse_pairwise("I cannot decide") == ParsedVerdict(None, "unparseable")
    assert parse_pairwise("") == ParsedVerdict(None, "unparseable")
    assert parse_pairwise(None) == ParsedVerdict(None, "unparseable")
    assert parse_pairwise(b"[[1]]") == ParsedVerdict(None, "unparseable")
    assert parse_pairwise("[[2]]") == ParsedVerdict(None, "out_of_range")
    assert parse_pairwise("[[one]]") == ParsedVerdict(None, "unparseable")


def test_grade_scale_and_reward_mapping():
    assert parse_grade("Consistent. [[5]]") == ParsedVerdict(5, "ok")
    assert parse_grade("Grade: 2") == ParsedVerdict(2, "ok")
    assert parse_grade("[[0]]").status == "out_of_range"
    assert parse_grade("[[6]]").status == "out_of_range"
    assert grade_reward(parse_grade("[[4]]"), DEFAULT_GRADE_REWARDS) == 0.75
    assert grade_reward(parse_grade("[[1]]"), DEFAULT_GRADE_REWARDS) == 0.0
    assert grade_reward(parse_grade("nonsense"), DEFAULT_GRADE_REWARDS) is None


judge_like_text = st.one_of(
    st.text(max_size=300),
    st.lists(st.one_of(st.text(max_size=20), st.sampled_from(
        ["[[", "]]", "[[1]]", "[[-1]]", "[[0]]", "[[5]]", "[[99]]", "Verdict:", "Grade:", "-", "+", "**", "\n"])),
        max_size=30).map("".join),
)


@settings(max_examples=300, deadline=None)
@given(judge_like_text)
def test_parsers_never_raise_and_stay_in_range(text):
    for parse, allowed in ((parse_pairwise, PAIRWISE_VALUES), (parse_grade, GRADE_VALUES)):
        parsed = parse(text)
        assert parsed.status in ("ok", "unparseable", "out_of_range")
        assert (parsed.value is not None) == (parsed.status == "ok")
        if parsed.value is not None:
            assert parsed.value in allowed


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=200), st.sampled_from(PAIRWISE_VALUES), st.text(alphabet=" \n.", max_size=5))
def test_a_trailing_bracketed_verdict_always_wins(prefix, verdict, suffix):
    assert parse_pairwise(f"{prefix} [[{verdict}]]{suffix}") == ParsedVerdict(verdict, "ok")
