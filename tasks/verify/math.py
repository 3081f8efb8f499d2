"""Math verifier: pull the final answer out of a response and compare it with math-verify.

The final answer is the last ``<answer>...</answer>`` block (SynLogic/M1 style) or else the
last ``\\boxed{...}``. math-verify then decides equivalence (symbolic, numeric, sets,
intervals), so "1/2", "0.5" and "\\frac{1}{2}" all match.
"""
from __future__ import annotations

import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from tasks.synth.base import extract_answer as extract_answer_tag

_TIMEOUT_S = 5
_EXTRACTION = (LatexExtractionConfig(), ExprExtractionConfig())


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i].strip() or None
        i += 1
    return None  # unbalanced: the response was cut off inside the box


def extract_final_answer(response: str) -> str | None:
    """The last <answer> block, else the last \\boxed{}; None when the response has neither."""
    if not isinstance(response, str):
        return None
    tagged = extract_answer_tag(response)
    if tagged is not None:
        boxed = last_boxed(tagged)
        return boxed if boxed is not None else tagged
    return last_boxed(response)


def _timeout_s() -> int | None:
    # math-verify times out with signal.alarm, which only works in the main thread.
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def parse_math_answer(expression: str) -> list:
    """math-verify's parse of an answer (bare or in $...$ / \\boxed{}); empty when unparseable."""
    seconds = _timeout_s()
    wrapped = expression if "$" in expression or "\\boxed" in expression else f"${expression}$"
    parsed = parse(wrapped, extraction_config=_EXTRACTION, parsing_timeout=seconds)
    if not parsed:
        parsed = parse(expression, extraction_config=_EXTRACTION, parsing_timeout=seconds)
    return parsed


def math_equal(gold: str, predicted: str) -> bool:
    """math-verify equivalence of two answer strings, with exact match as the fallback."""
    if gold.strip() == predicted.strip():
        return True
    gold_parsed, predicted_parsed = parse_math_answer(gold), parse_math_answer(predicted)
    if not gold_parsed or not predicted_parsed:
        return False
    try:
        return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=_timeout_s()))
    except Exception:  # noqa: BLE001 - sympy can raise anything on odd input; that is a miss
        return False


def verify_math(gold: str | None, response: str) -> float:
    """1.0 when the response's final answer equals ``gold``, else 0.0."""
    if gold is None or not str(gold).strip():
        return 0.0
    predicted = extract_final_answer(response)
    if predicted is None:
        return 0.0
    return 1.0 if math_equal(str(gold), predicted) else 0.0
