"""Verdict parsers. They never raise: anything they cannot read is ``unparseable``.

The verdict is the last bracketed value (``[[4]]``) in the judge's output; a trailing
``Grade: 4`` / ``Verdict: -1`` line is accepted when no bracket is present. A bracketed
value outside the allowed set is ``out_of_range``, kept apart from plain garbage so the
judge's failure modes can be counted.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

PARSE_STATUSES = ("ok", "unparseable", "out_of_range")
_BRACKETED = re.compile(r"\[\[\s*([+-]?\d{1,3})\s*\]\]")
_LABELLED = {
    "grade": re.compile(r"\bgrade\s*[:=]\s*\**\s*([+-]?\d{1,3})\b", re.IGNORECASE),
    "verdict": re.compile(r"\bverdict\s*[:=]\s*\**\s*([+-]?\d{1,3})\b", re.IGNORECASE),
}
PAIRWISE_VALUES = (-1, 0, 1)
GRADE_VALUES = (1, 2, 3, 4, 5)


@dataclass(frozen=True)
class ParsedVerdict:
    value: int | None   # the verdict (-1/0/1) or grade (1..5); None unless status == "ok"
    status: str         # one of PARSE_STATUSES


def _last_number(text: str, label: str) -> int | None:
    found = _BRACKETED.findall(text)
    if not found:
        found = _LABELLED[label].findall(text)
    return int(found[-1]) if found else None


def _parse(text: Any, label: str, allowed: tuple[int, ...]) -> ParsedVerdict:
    if not isinstance(text, str) or not text.strip():
        return ParsedVerdict(None, "unparseable")
    try:
        value = _last_number(text, label)
    except (ValueError, TypeError):  # defensive: regex groups are digits, so this is unexpected
        return ParsedVerdict(None, "unparseable")
    if value is None:
        return ParsedVerdict(None, "unparseable")
    if value not in allowed:
        return ParsedVerdict(None, "out_of_range")
    return ParsedVerdict(value, "ok")


def parse_pairwise(text: Any) -> ParsedVerdict:
    """-1 / 0 / 1: Answer 2 worse than, similar to, better than Answer 1."""
    return _parse(text, "verdict", PAIRWISE_VALUES)


def parse_dimensions(text: Any, names) -> dict[str, ParsedVerdict]:
    """Each dimension's -1 / 0 / 1 verdict, from the last ``<name>: [[v]]`` line naming it (the
    name and its bracketed verdict on one line, any words between); a dimension the text gives
    no such line for is ``unparseable``, one outside -1..1 ``out_of_range``."""
    if not isinstance(text, str) or not text.strip():
        return {name: ParsedVerdict(None, "unparseable") for name in names}
    out = {}
    for name in names:
        found = re.findall(rf"\b{re.escape(name)}\b[^\n\[]*\[\[\s*([+-]?\d{{1,3}})\s*\]\]", text, re.IGNORECASE)
        if not found:
            out[name] = ParsedVerdict(None, "unparseable")
        else:
            value = int(found[-1])
            out[name] = ParsedVerdict(value, "ok") if value in PAIRWISE_VALUES else ParsedVerdict(None, "out_of_range")
    return out


def parse_grade(text: Any) -> ParsedVerdict:
    """A grade 1..5 on the answer-consistency scale."""
    return _parse(text, "grade", GRADE_VALUES)


def grade_reward(parsed: ParsedVerdict, grade_rewards: dict[int, float]) -> float | None:
    """The configured reward of a parsed grade; None when the grade could not be read."""
    if parsed.status != "ok" or parsed.value is None:
        return None
    return float(grade_rewards[parsed.value])
