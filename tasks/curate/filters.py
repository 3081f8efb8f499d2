"""M1 quality filters: each a named rule that removes a row with a reason code, or rewrites it.

Rules run in the configured order on one row at a time; the first rule that removes a
row decides its reason (``<rule>:<detail>``). The multiple-choice rule rewrites instead
of removing when it can: the options are cut from the prompt and the answer becomes the
chosen option's text, so the question is open-ended and no longer guessable.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from tasks.curate.config import FilterConfig
from tasks.genrm.config import OPEN_DOMAINS
from tasks.verify.math import parse_math_answer as parse_math_expression

REWRITTEN = "rewritten"


@dataclass
class Row:
    """The fields the rules read (and the multiple-choice rule may change)."""
    id: str
    domain: str
    prompt: str
    answer: str | None
    tests: str | None = None
    rewrites: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Verdict:
    removed: bool
    reason: str


RuleFn = Callable[[Row, FilterConfig], Verdict | None]


# -- incomplete ----------------------------------------------------------------------------
_DANGLING_END = re.compile(r"(\b(?:and|or|the|of|to|a|an|with|for|is|are|that|which|if|then|by|in)|[,;(\[{]|\\)\s*$",
                           re.IGNORECASE)
# "... the answer is ..." is cut off; "1 + 2 + ..." (a series) is not
_ELLIPSIS_END = re.compile(r"[A-Za-z]{2,}[ ,]*(\.\.\.|…)\s*$")


def needs_answer(domain: str) -> bool:
    """Whether a row of the domain is useless without a reference answer: not code (its
    verifier runs tests) and not the open domains (M1's tasks without answers, rewarded by
    the GenRM in RL)."""
    return domain != "code" and domain not in OPEN_DOMAINS


def incomplete(row: Row, cfg: FilterConfig) -> Verdict | None:
    prompt = (row.prompt or "").strip()
    if not prompt:
        return Verdict(True, "incomplete:empty_prompt")
    if len(prompt) < cfg.min_prompt_chars:
        return Verdict(True, "incomplete:too_short")
    if needs_answer(row.domain) and not (row.answer or "").strip():
        return Verdict(True, "incomplete:empty_answer")
    if row.domain != "code" and (_ELLIPSIS_END.search(prompt) or _DANGLING_END.search(prompt)):
        return Verdict(True, "incomplete:truncated_prompt")
    return None


# -- formatting ----------------------------------------------------------------------------
_BEGIN_END = re.compile(r"\\(begin|end)\{([^}]*)\}")
_HTML_ENTITY = re.compile(r"&(?:[a-z]{2,6}|#\d{2,5});")
_MOJIBAKE = re.compile("[\ufffd]|Ã[\u0080-\u00bf]|â€")


def _unescaped_dollars(text: str) -> int:
    return len(re.findall(r"(?<!\\)\$", text))


def _balanced_braces(text: str) -> bool:
    depth = 0
    for ch in re.sub(r"\\\\", "", text):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth < 0:
                return False
    return depth == 0


def _balanced_environments(text: str) -> bool:
    stack = []
    for kind, name in _BEGIN_END.findall(text):
        if kind == "begin":
            stack.append(name)
        elif not stack or stack.pop() != name:
            return False
    return not stack


def formatting_problem(text: str, domain: str) -> str | None:
    if _MOJIBAKE.search(text):
        return "bad_encoding"
    if _HTML_ENTITY.search(text):
        return "html_entities"
    if text.count("```") % 2:
        return "unclosed_code_fence"
    if domain == "code":
        return None  # code carries brackets inside strings and comments
    if _unescaped_dollars(text) % 2:
        return "unbalanced_dollar"
    if text.count("\\(") != text.count("\\)") or text.count("\\[") != text.count("\\]"):
        return "unbalanced_math_delimiters"
    if not _balanced_environments(text):
        return "unbalanced_environment"
    if not _balanced_braces(text):
        return "unbalanced_braces"
    # half-open intervals like [0, 1) mix bracket kinds, so round and square count together
    if text.count("(") + text.count("[") != text.count(")") + text.count("]"):
        return "unbalanced_brackets"
    return None


def formatting(row: Row, cfg: FilterConfig) -> Verdict | None:
    for part, text in (("prompt", row.prompt), ("answer", row.answer or "")):
        problem = formatting_problem(text, row.domain)
        if problem:
            return Verdict(True, f"formatting:{problem}_in_{part}")
    return None


# -- several sub-questions -----------------------------------------------------------------
_SUBPART_MARKERS = (
    re.compile(r"(?:^|\s)\(a\).*?(?:^|\s)\(b\)", re.DOTALL),
    re.compile(r"(?:^|\n)\s*a\)\s.*?\n\s*b\)\s", re.DOTALL),
    re.compile(r"(?:^|\s)\(i\).*?(?:^|\s)\(ii\)", re.DOTALL),
    re.compile(r"\bpart\s*(?:\(?[a1]\)?)\b.*?\bpart\s*(?:\(?[b2]\)?)\b", re.DOTALL | re.IGNORECASE),
    re.compile(r"(?:^|\n)\s*1[.)]\s.*\?.*?\n\s*2[.)]\s.*\?", re.DOTALL),
)


def multi_part(row: Row, cfg: FilterConfig) -> Verdict | None:
    text = row.prompt
    if any(p.search(text) for p in _SUBPART_MARKERS):
        return Verdict(True, "multi_part:enumerated_subquestions")
    if text.count("?") > cfg.max_question_marks:
        return Verdict(True, "multi_part:many_questions")
    return None


# -- proofs --------------------------------------------------------------------------------
_PROOF = re.compile(r"\b(prove|proof|disprove|show that|demonstrate that|justify your answer|verify that)\b",
                    re.IGNORECASE)


def proof(row: Row, cfg: FilterConfig) -> Verdict | None:
    if _PROOF.search(row.prompt):
        return Verdict(True, "proof:proof_question")
    return None


# -- guessable binary answers --------------------------------------------------------------
_BINARY_ANSWERS = {"yes", "no", "true", "false", "y", "n", "t", "f", "correct", "incorrect",
                   "possible", "impossible", "exists", "does not exist"}


def binary_answer(row: Row, cfg: FilterConfig) -> Verdict | None:
    answer = re.sub(r"[\s.$]|\\text\{|\\boxed\{|\}", " ", (row.answer or "")).strip().lower()
    if " ".join(answer.split()) in _BINARY_ANSWERS:
        return Verdict(True, "binary_answer:yes_no_true_false")
    return None


# -- multiple choice -> open-ended ---------------------------------------------------------
_OPTION_STYLES = (
    re.compile(r"\(([A-E])\)\s*"),                       # (A) 12  (B) 13
    re.compile(r"(?:^|\n)\s*([A-E])[.):]\s+"),           # A. 12 \n B. 13
)
_CHOICES_LABEL = re.compile(r"(answer\s+choices|choices|options|choose\s+one)\s*:?\s*$", re.IGNORECASE)
_LETTER_ANSWER = re.compile(r"^\s*(?:\\text\{|\\textbf\{|\\boxed\{)?\(?([A-E])\)?\}?\s*[.:]?\s*$")


def parse_options(prompt: str) -> tuple[str, dict[str, str]] | None:
    """(stem, {letter: option text}) when the prompt lists options A, B, C... in order."""
    for style in _OPTION_STYLES:
        marks = list(style.finditer(prompt))
        letters = [m.group(1) for m in marks]
        if len(marks) < 2 or letters != [chr(ord("A") + i) for i in range(len(marks))]:
            continue
        options = {}
        for i, m in enumerate(marks):
            end = marks[i + 1].start() if i + 1 < len(marks) else len(prompt)
            options[m.group(1)] = prompt[m.end():end].strip().rstrip(",;").strip()
        stem = _CHOICES_LABEL.sub("", prompt[:marks[0].start()].rstrip()).rstrip()
        return stem, options
    return None


def multiple_choice(row: Row, cfg: FilterConfig) -> Verdict | None:
    parsed = parse_options(row.prompt)
    if parsed is None:
        return None
    stem, options = parsed
    letter = _LETTER_ANSWER.match(row.answer or "")
    chosen = options.get(letter.group(1)) if letter else None
    if chosen is None:
        # the answer may already be an option's text
        by_text = [k for k, v in options.items() if v.strip() == (row.answer or "").strip()]
        chosen = options[by_text[0]] if len(by_text) == 1 else None
    texts = list(options.values())
    if not chosen or not stem or len(set(texts)) != len(texts) or len(stem) < cfg.min_prompt_chars:
        return Verdict(True, "multiple_choice:cannot_rewrite")
    row.prompt, row.answer = stem, chosen
    row.rewrites.append("multiple_choice_to_open")
    return Verdict(False, "multiple_choice:rewritten_open_ended")


# -- answers a rule-based checker parses ---------------------------------------------------
# Words that belong in math answers; any other word of 3+ letters makes the answer prose,
# which math-verify would still "parse" as a product of single-letter symbols.
_MATH_WORDS = {"sqrt", "sin", "cos", "tan", "cot", "sec", "csc", "log", "exp", "arcsin", "arccos",
               "arctan", "sinh", "cosh", "tanh", "min", "max", "gcd", "lcm", "mod", "det", "inf",
               "infty", "infinity", "frac", "dfrac", "tfrac", "cdot", "times", "binom", "choose",
               "div", "cup", "cap", "and", "text", "mathrm", "left", "right", "pmod", "deg",
               "circ", "degree", "degrees", "ldots", "cdots", "dots", "floor", "ceil", "lfloor",
               "rfloor", "lceil", "rceil", "sum", "prod", "lim", "pmatrix", "bmatrix"}
_WORD = re.compile(r"(?<!\\)\b[A-Za-z]{3,}\b")
# A plain decimal number always parses (checked against math-verify on integers, big
# integers, signed decimals and zero-padded ones); skipping its LaTeX parse saves ~5 ms a row.
_PLAIN_NUMBER = re.compile(r"[+-]?[0-9]+(?:\.[0-9]+)?")


def looks_like_prose(answer: str) -> bool:
    return any(w.lower() not in _MATH_WORDS for w in _WORD.findall(answer))


@lru_cache(maxsize=65536)
def answer_parses(answer: str) -> bool:
    """Whether math-verify extracts an expression from the answer (cached: answers repeat)."""
    if looks_like_prose(answer):
        return False
    if _PLAIN_NUMBER.fullmatch(answer):
        return True
    try:
        return bool(parse_math_expression(answer))
    except Exception:  # noqa: BLE001 - math-verify/sympy raise many types on odd input
        return False


def math_answer_parse(row: Row, cfg: FilterConfig) -> Verdict | None:
    if row.domain == "math" and not answer_parses((row.answer or "").strip()):
        return Verdict(True, "math_answer_parse:unparseable_answer")
    return None


def code_tests(row: Row, cfg: FilterConfig) -> Verdict | None:
    if row.domain == "code" and not (row.tests or "").strip():
        return Verdict(True, "code_tests:no_tests")
    return None


RULES: dict[str, RuleFn] = {
    "incomplete": incomplete,
    "formatting": formatting,
    "multi_part": multi_part,
    "proof": proof,
    "binary_answer": binary_answer,
    "multiple_choice": multiple_choice,
    "math_answer_parse": math_answer_parse,
    "code_tests": code_tests,
}


def check_rules(cfg: FilterConfig) -> list[RuleFn]:
    unknown = [r for r in cfg.rules if r not in RULES]
    if unknown:
        raise ValueError(f"curate.filters.rules: unknown rule(s) {unknown}; known: {list(RULES)}")
    return [RULES[r] for r in cfg.rules]


@dataclass
class FilterOutcome:
    id: str
    removed_reason: str | None      # None: kept
    rewritten_reason: str | None    # set when a rule rewrote the row
    prompt: str
    answer: str | None
    tests: str | None = None
    rewrites: list[str] = field(default_factory=list)


def run_rules(row: Row, cfg: FilterConfig, rewritten: str | None = None) -> FilterOutcome:
    """Every configured rule on one row; ``rewritten``: the reason of an earlier rewrite of it
    (model repair runs the rules again on the row it fixed, ``tasks.curate.model_repair``)."""
    removed = None
    for rule in check_rules(cfg):
        try:
            verdict = rule(row, cfg)
        except Exception as e:  # noqa: BLE001 - a rule crashing on one row removes that row
            verdict = Verdict(True, f"{rule.__name__}:rule_error:{type(e).__name__}")
        if verdict is None:
            continue
        if verdict.removed:
            removed = verdict.reason
            break
        rewritten = verdict.reason
    return FilterOutcome(row.id, removed, rewritten, row.prompt, row.answer, row.tests, list(row.rewrites))


def apply_filters(rows: list[Row], cfg: FilterConfig) -> list[FilterOutcome]:
    """Run every configured rule on every row; one bad row never stops the batch."""
    check_rules(cfg)
    return [run_rules(row, cfg) for row in rows]
