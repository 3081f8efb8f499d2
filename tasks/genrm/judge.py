"""Judges: a GenRM over any rollout backend, plus rule checks for instruction prompts.

``GenRMJudge.compare`` decides pairs (Answer 2 vs Answer 1, -1/0/1) with the consistency
rules of ``tasks.genrm.consistency``; ``GenRMJudge.grade`` scores responses against a
ground truth on the five-grade scale. For prompts that carry rule constraints (length,
format, required words), a rule check decides a pair outright when exactly one answer
breaks the rules; otherwise the model's verdict stands.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.genrm.config import JudgeConfig
from tasks.genrm.consistency import (
    BACKWARD,
    JudgeSample,
    PairDecision,
    blind_grade,
    combine_dimensions,
    judge_pairs_consistently,
    sign,
    weighted_score,
)
from tasks.genrm.parse import (
    ParsedVerdict,
    grade_reward,
    parse_dimensions,
    parse_grade,
    parse_pairwise,
)
from tasks.genrm.prompts import grade_prompt, pairwise_prompt, reasoning_prompt
from tasks.rollout.base import RolloutBackend

# -- rule constraints ----------------------------------------------------------------------

class Constraints(BaseModel):
    """Checkable instructions of a prompt, from its metadata JSON key ``constraints``."""

    model_config = ConfigDict(extra="forbid")
    min_words: int | None = Field(None, ge=0)
    max_words: int | None = Field(None, ge=1)
    max_chars: int | None = Field(None, ge=1)
    required_words: list[str] = Field(default_factory=list)
    forbidden_words: list[str] = Field(default_factory=list)
    format: Literal["json", "bullets", "numbered", "lowercase", "uppercase"] | None = None
    ends_with: str | None = None


def constraints_from_metadata(metadata: str | dict | None) -> Constraints | None:
    """The prompt's constraints, None when it has none; ValueError naming the bad field."""
    if metadata is None or metadata == "":
        return None
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except ValueError as e:
            raise ValueError(f"metadata is not valid JSON: {e}") from None
    if not isinstance(metadata, dict) or metadata.get("constraints") is None:
        return None
    try:
        return Constraints(**metadata["constraints"])
    except (ValidationError, TypeError) as e:
        raise ValueError(f"metadata.constraints: {e}") from None


# a word may join parts with an apostrophe or hyphen (robot's, well-known); quotes and a bullet's
# dash around it are not part of it
_WORD = re.compile(r"\w+(?:['-]\w+)*")
# an English possessive or contraction: the word it is built on, then the clitic
_CLITIC = re.compile(r"(\w+?)(?:n't|'s|'re|'ve|'ll|'d|'m)")
_IRREGULAR_NEGATIONS = {"can't": "can", "won't": "will", "shan't": "shall"}


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower().replace("\u2019", "'"))


def _base_word(word: str) -> str:
    """robot's -> robot, they're -> they, isn't -> is; any other word is its own base."""
    if word in _IRREGULAR_NEGATIONS:
        return _IRREGULAR_NEGATIONS[word]
    m = _CLITIC.fullmatch(word)
    return m.group(1) if m else word


def _format_ok(text: str, fmt: str) -> bool:
    stripped = text.strip()
    if fmt == "json":
        try:
            json.loads(stripped)
            return True
        except ValueError:
            return False
    lines = [ln.strip() for ln in stripped.splitlines() if ln.strip()]
    if fmt == "bullets":
        return bool(lines) and all(ln[:1] in "-*•" for ln in lines)
    if fmt == "numbered":
        return bool(lines) and all(re.match(r"^\d+[.)]\s", ln) for ln in lines)
    if fmt == "lowercase":
        return stripped == stripped.lower()
    return stripped == stripped.upper()  # uppercase


def constraint_failures(text: str, constraints: Constraints) -> list[str]:
    """Each broken rule, by name (empty when the text follows every rule)."""
    words = _words(text)
    # "The robot's arm" contains the word robot (and breaks a rule forbidding it)
    vocabulary = set(words) | {_base_word(w) for w in words}
    failures = []
    if constraints.min_words is not None and len(words) < constraints.min_words:
        failures.append(f"min_words<{constraints.min_words}")
    if constraints.max_words is not None and len(words) > constraints.max_words:
        failures.append(f"max_words>{constraints.max_words}")
    if constraints.max_chars is not None and len(text) > constraints.max_chars:
        failures.append(f"max_chars>{constraints.max_chars}")
    failures += [f"missing:{w}" for w in constraints.required_words if not _contains(text, vocabulary, w)]
    failures += [f"forbidden:{w}" for w in constraints.forbidden_words if _contains(text, vocabulary, w)]
    if constraints.format is not None and not _format_ok(text, constraints.format):
        failures.append(f"format:{constraints.format}")
    if constraints.ends_with is not None and not text.rstrip().endswith(constraints.ends_with):
        failures.append("ends_with")
    return failures


def _contains(text: str, vocabulary: set[str], phrase: str) -> bool:
    phrase = phrase.lower().strip().replace("\u2019", "'")
    return phrase in vocabulary if " " not in phrase else phrase in text.lower().replace("\u2019", "'")


def rule_decision(first: str, second: str, constraints: Constraints) -> PairDecision | None:
    """A verdict from the rules alone when exactly one answer breaks them, else None."""
    first_ok = not constraint_failures(first, constraints)
    second_ok = not constraint_failures(second, constraints)
    if first_ok == second_ok:
        return None
    return PairDecision(1 if second_ok else -1, "rule", 1.0, 0, [])


# -- requests and results ------------------------------------------------------------------

@dataclass(frozen=True)
class PairRequest:
    question: str
    first: str
    second: str
    constraints: Constraints | None = None


@dataclass(frozen=True)
class GradeRequest:
    question: str
    ground_truth: str
    response: str


@dataclass
class GradeDecision:
    reward: float | None
    parsed_share: float
    status: str
    samples: list[JudgeSample] = field(default_factory=list)


# -- the model judge -----------------------------------------------------------------------

class GenRMJudge:
    """A generative reward model over any ``RolloutBackend``."""

    def __init__(self, backend: RolloutBackend, cfg: JudgeConfig, seed: int = 0):
        self.backend = backend
        self.cfg = cfg
        self.seed = seed
        self._calls = 0  # every generate call gets its own seed: deterministic, never repeated

    @property
    def model_name(self) -> str:
        return str(getattr(self.backend, "model_name", None) or self.cfg.rollout.model)

    def _render(self, text: str) -> str:
        if not self.cfg.use_chat_template:
            return text
        return self.backend.format_chat([{"role": "user", "content": text}])

    def _sample(self, prompts: list[str], k: int) -> list[list[str]]:
        if not prompts:
            return []
        params = self.cfg.rollout.sampling_params(n=k, seed=self.seed + 1_000_003 * self._calls)
        self._calls += 1
        return [[c.text for c in per_prompt] for per_prompt in self.backend.generate(prompts, params)]

    def compare(self, requests: list[PairRequest]) -> list[PairDecision]:
        """Answer 2 (``second``) vs Answer 1 (``first``) for every request, in order."""
        decisions: list[PairDecision | None] = [None] * len(requests)
        to_model = []
        for i, req in enumerate(requests):
            if self.cfg.constraint_checks and req.constraints is not None:
                decisions[i] = rule_decision(req.first, req.second, req.constraints)
            if decisions[i] is None:
                to_model.append(i)
        if self.cfg.dimensions:
            model_decisions = self._compare_dimensions(requests, to_model)
        else:
            model_decisions = judge_pairs_consistently(
                len(to_model), lambda queries, attempt: self._sample_orders(requests, to_model, queries),
                self.cfg.consistency)
        for i, decision in zip(to_model, model_decisions):
            # the consistency loop numbers only the pairs it saw; renumber to the request's index
            decision.samples = [replace(s, pair_index=i) for s in decision.samples]
            decisions[i] = decision
        return decisions  # type: ignore[return-value]

    def _order_prompts(self, requests, to_model, queries) -> list[str]:
        prompts = []
        for local_index, order in queries:
            req = requests[to_model[local_index]]
            first, second = (req.second, req.first) if order == BACKWARD else (req.first, req.second)
            prompts.append(self._render(pairwise_prompt(req.question, first, second, self.cfg.max_response_chars,
                                                        self.cfg.dimensions)))
        return prompts

    def _sample_orders(self, requests, to_model, queries) -> list[list[tuple[str, ParsedVerdict]]]:
        texts = self._sample(self._order_prompts(requests, to_model, queries), self.cfg.consistency.blind_samples)
        return [[(t, parse_pairwise(t)) for t in outs] for outs in texts]

    def _compare_dimensions(self, requests, to_model) -> list[PairDecision]:
        """Each dimension decided on its own (blind votes, position switch, re-judging) from the
        same judge samples, then combined by weight (``combine_dimensions``). A re-judge one
        dimension asks for samples the pair once more; the others read that sample too when they
        re-judge the same pair at the same attempt."""
        names = [d.name for d in self.cfg.dimensions]
        weights = {d.name: d.weight for d in self.cfg.dimensions}
        texts: dict[tuple[int, str, int], list[str]] = {}   # (pair, order, attempt) -> k judge outputs

        def sampled(queries: list[tuple[int, str]], attempt: int) -> list[list[str]]:
            missing = [q for q in queries if (*q, attempt) not in texts]
            if missing:
                outs = self._sample(self._order_prompts(requests, to_model, missing),
                                    self.cfg.consistency.blind_samples)
                texts.update({(*q, attempt): o for q, o in zip(missing, outs)})
            return [texts[(*q, attempt)] for q in queries]

        per_dimension = {
            name: judge_pairs_consistently(
                len(to_model),
                lambda queries, attempt, name=name: [[(t, parse_dimensions(t, [name])[name]) for t in outs]
                                                     for outs in sampled(queries, attempt)],
                self.cfg.consistency)
            for name in names}
        out = []
        for local in range(len(to_model)):
            samples = [JudgeSample(local, order, attempt, s, t, self._sample_verdict(t, names, weights))
                       for (i, order, attempt), outs in texts.items() if i == local for s, t in enumerate(outs)]
            out.append(combine_dimensions(weights, {name: per_dimension[name][local] for name in names}, samples))
        return out

    @staticmethod
    def _sample_verdict(text: str, names: list[str], weights: dict[str, float]) -> ParsedVerdict:
        """One raw sample's verdict as the judgments table keeps it: the sign of its dimensions'
        weighted mean (unparseable when it gives none)."""
        parsed = parse_dimensions(text, names)
        score = weighted_score(weights, {n: p.value for n, p in parsed.items()})
        if score is None:
            bad = any(p.status == "out_of_range" for p in parsed.values())
            return ParsedVerdict(None, "out_of_range" if bad else "unparseable")
        return ParsedVerdict(sign(score), "ok")

    def grade(self, requests: list[GradeRequest]) -> list[GradeDecision]:
        """Five-grade answer-consistency reward for every request, from k blind samples."""
        return self._graded([grade_prompt(r.question, r.ground_truth, r.response, self.cfg.max_response_chars)
                             for r in requests])

    def check_reasoning(self, requests: list[GradeRequest]) -> list[GradeDecision]:
        """Five-grade soundness of a worked solution (``response``) that reaches the right answer
        (``ground_truth``), as a reward in [0, 1] from k blind samples (``grade_rewards``)."""
        return self._graded([reasoning_prompt(r.question, r.ground_truth, r.response, self.cfg.max_response_chars)
                             for r in requests])

    def _graded(self, user_turns: list[str]) -> list[GradeDecision]:
        prompts = [self._render(t) for t in user_turns]
        texts = self._sample(prompts, self.cfg.consistency.blind_samples)
        out = []
        for i, outs in enumerate(texts):
            parsed = [parse_grade(t) for t in outs]
            reward, share, status = blind_grade([grade_reward(p, self.cfg.grade_rewards) for p in parsed],
                                                self.cfg.consistency.agreement_threshold)
            samples = [JudgeSample(i, "grade", 0, s, t, p) for s, (t, p) in enumerate(zip(outs, parsed))]
            out.append(GradeDecision(reward, share, status, samples))
        return out
