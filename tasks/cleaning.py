"""What a response must be to train on, beyond a right answer (M1 cleans its cold-start data
this way): finished, not repetitive, its answer in the domain's format, reasoning before it.
Teacher samples (``tasks.samples``) and the gold solutions SFT falls back to
(``tasks.train.data``) go through the same ``clean_reason``."""
from __future__ import annotations

import re
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from tasks.genrm.config import OPEN_DOMAINS
from tasks.synth.base import extract_final_answer


class _Scored(Protocol):   # tasks.scoring.ScoredSample
    completion: object
    reward: float
    error: str | None


class CleanConfig(BaseModel):
    """What a verified sample must also be to train on (M1 cleans its cold-start data the same way)."""
    model_config = ConfigDict(extra="forbid")
    min_reasoning_words: int = Field(
        4, ge=0, description="words before the final answer (math, logic): a bare answer teaches skipping the reasoning")
    max_repeated_line_share: float = Field(
        0.3, ge=0, le=1, description="share of non-empty lines that repeat an earlier line, above which a sample "
                                     "is repetitive")
    allow_truncated: bool = Field(False, description="keep samples cut at max_tokens or by the repetition check")


_ANSWER_TAG = re.compile(r"<answer>", re.IGNORECASE)


def reasoning_words(domain: str, text: str) -> int:
    """Words before the final answer: before the last ``<answer>`` tag or ``\\boxed{``."""
    cut = max((m.start() for m in _ANSWER_TAG.finditer(text)), default=-1)
    boxed = text.rfind("\\boxed{")
    end = cut if cut >= 0 else boxed
    return len(text[: end if end >= 0 else len(text)].split())


def repeated_line_share(text: str) -> float:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) < 2:
        return 0.0
    return (len(lines) - len(set(lines))) / len(lines)


def clean_reason(domain: str, sample: _Scored, cfg: CleanConfig, constraints_ok: bool | None = None) -> str | None:
    """Why a sample does not train (None: it does). Checked in order: verification, finish,
    repetition, the answer's format, reasoning before the answer."""
    text = sample.completion.text or ""
    if not text.strip():
        return "empty"
    if domain in OPEN_DOMAINS:
        if constraints_ok is None:
            return "unverifiable"
        if not constraints_ok:
            return "constraints_failed"
    elif sample.error:
        return "verify_error"
    elif sample.reward < 1.0:
        return "wrong"
    if sample.completion.truncated and not cfg.allow_truncated:
        return "truncated"
    if repeated_line_share(text) > cfg.max_repeated_line_share:
        return "repetitive"
    if domain == "math" and extract_final_answer(text) is None:
        return "no_answer"
    if domain == "code" and not _has_code_block(text):
        return "no_code_block"
    if domain in ("math", "logic") and reasoning_words(domain, text) < cfg.min_reasoning_words:
        return "no_reasoning"
    return None


def _has_code_block(text: str) -> bool:
    from tasks.verify.code import extract_code

    return extract_code(text)[1]
