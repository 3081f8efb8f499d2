"""M1 quality filters: every rule removes (or rewrites) with its reason code."""
from __future__ import annotations

import pytest

from tasks.curate.config import FilterConfig
from tasks.curate.filters import (
    Row,
    answer_parses,
    apply_filters,
    formatting_problem,
    parse_options,
)

CFG = FilterConfig()


def outcome(prompt, answer="42", domain="math", tests=None):
    return apply_filters([Row("r1", domain, prompt, answer, tests)], CFG)[0]


@pytest.mark.parametrize("prompt,answer,reason", [
    ("", "3", "incomplete:empty_prompt"),
    ("Find x.", "3", "incomplete:too_short"),
    ("Find the smallest prime larger than forty.", "", "incomplete:empty_answer"),
    ("Find the smallest prime that is larger than the", "41", "incomplete:truncated_prompt"),
    ("Compute the value of the following expression which is ...", "41", "incomplete:truncated_prompt"),
    ("Compute $x^2$ when $x = 3 and add one.", "10", "formatting:unbalanced_dollar_in_prompt"),
    ("Compute \\frac{1}{2 + \\frac{1}{3} as a fraction.", "3/7", "formatting:unbalanced_braces_in_prompt"),
    ("Evaluate \\begin{pmatrix} 1 & 2 \\end{bmatrix} please now.", "1", "formatting:unbalanced_environment_in_prompt"),
    ("Compute ((2 + 3) * 4 and report it.", "20", "formatting:unbalanced_brackets_in_prompt"),
    ("Compute 1 &amp; 2 together right now.", "3", "formatting:html_entities_in_prompt"),
    ("Find the value of caf\ufffd numbers here.", "3", "formatting:bad_encoding_in_prompt"),
    ("(a) Find x if x + 1 = 2. (b) Find y if y = 2x.", "1", "multi_part:enumerated_subquestions"),
    ("What is x? What is y? What is z? Give all three.", "1", "multi_part:many_questions"),
    ("Prove that there are infinitely many primes.", "1", "proof:proof_question"),
    ("Show that the sum of two odd numbers is even.", "1", "proof:proof_question"),
    ("Is 91 a prime number, given that it is odd?", "No", "binary_answer:yes_no_true_false"),
    ("The statement 2 + 2 = 4 holds. Decide.", "True", "binary_answer:yes_no_true_false"),
    ("Which number is the largest here? (A) 3 (B) 4", "E", "multiple_choice:cannot_rewrite"),
    ("How many solutions does the equation have in total?", "all odd numbers", "math_answer_parse:unparseable_answer"),
])
def test_rule_removes_with_reason(prompt, answer, reason):
    assert outcome(prompt, answer).removed_reason == reason


def test_clean_rows_pass_untouched():
    for prompt, answer in [("Find the sum of the interval [0, 1) lengths.", "1"),
                           ("Compute $\\frac{1}{2} + \\frac{1}{3}$ exactly.", "\\frac{5}{6}"),
                           ("For positive a, b, c, what is the smallest value of sqrt(ab+bc+ac)/(abc)^(1/3)?",
                            "sqrt(3)"),
                           ("Find a_0 + a_1 + ... for the series 1 + 1/2 + 1/4 + ....", "2")]:
        o = outcome(prompt, answer)
        assert o.removed_reason is None and o.rewritten_reason is None, (prompt, o)
        assert o.prompt == prompt and o.answer == answer


def test_multiple_choice_is_rewritten_open_ended():
    o = outcome("Which of the following is prime?\nA. 4\nB. 9\nC. 7\nD. 8", "C")
    assert o.removed_reason is None
    assert o.rewritten_reason == "multiple_choice:rewritten_open_ended"
    assert o.prompt == "Which of the following is prime?" and o.answer == "7"
    inline = outcome("What is 2+3? Answer choices: (A) 4 (B) 5 (C) 6", "(B)")
    assert (inline.prompt, inline.answer) == ("What is 2+3?", "5")
    by_text = outcome("What is 2+3? (A) 4 (B) 5 (C) 6", "5")
    assert (by_text.prompt, by_text.answer) == ("What is 2+3?", "5")


def test_parse_options_needs_ordered_letters():
    assert parse_options("Pick (B) then (A) in that order please.") is None
    stem, options = parse_options("Pick one: (A) red (B) blue")
    assert options == {"A": "red", "B": "blue"} and stem == "Pick one:"


def test_domain_aware_rules():
    # logic rows keep non-math answers; code rows need tests, not answers
    assert outcome("Spell this word backward (example: sun -> nus): alodiality", "ytilaidola",
                   domain="logic").removed_reason is None
    assert outcome("def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n", None, domain="code").removed_reason \
        == "code_tests:no_tests"
    assert outcome("def add(a, b):\n    \"\"\"Add two numbers (a + b.\"\"\"\n", None, domain="code",
                   tests="assert add(1, 2) == 3").removed_reason is None


def test_open_prompts_need_no_answer_while_math_and_logic_still_do():
    # M1's tasks without answers (writing, instruction following) are rewarded by the GenRM in
    # RL, so an open prompt without a reference answer survives; a math or logic row cannot be
    # verified without one and is still removed
    for domain, prompt in [("instruction", "Write three bullet points about keeping bees in a city garden."),
                           ("general", "Write a short poem about the sea and the colour of its waves.")]:
        for answer in (None, "", "   "):
            o = outcome(prompt, answer, domain=domain)
            assert o.removed_reason is None and o.rewritten_reason is None, (domain, answer, o)
            assert o.prompt == prompt
    assert outcome("Find the smallest prime larger than forty.", None).removed_reason == "incomplete:empty_answer"
    assert outcome("Spell this word backward (example: sun -> nus): harbor", "",
                   domain="logic").removed_reason == "incomplete:empty_answer"
    # the other incomplete checks still hold for open prompts
    assert outcome("Write a short poem about the", None, domain="general").removed_reason \
        == "incomplete:truncated_prompt"


def test_answer_parse_rejects_prose_and_accepts_math():
    for good in ["x^3-1", "\\frac{1}{2}", "[0,1)", "2^floor(n/2)", "\\sqrt{3}", "a=2,b=3"]:
        assert answer_parses(good), good
    for bad in ["The limit does not exist", "hello", "\\text{odd}", ""]:
        assert not answer_parses(bad), bad


def test_formatting_ignores_code_brackets():
    assert formatting_problem("print('(')", "code") is None
    assert formatting_problem("```python\nx = 1", "code") == "unclosed_code_fence"


def test_unknown_rule_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown rule"):
        apply_filters([Row("x", "math", "Find x such that x = 1.", "1")], FilterConfig(rules=["nope"]))


def test_every_row_gets_an_outcome():
    rows = [Row(str(i), "math", p, a) for i, (p, a) in enumerate(
        [("Find the value of 2 + 2 now.", "4"), ("", "1"), ("Prove that 1 < 2 holds.", "1")])]
    out = apply_filters(rows, CFG)
    assert [o.id for o in out] == ["0", "1", "2"]
    assert [o.removed_reason is None for o in out] == [True, False, False]
