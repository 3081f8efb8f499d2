"""Robust judgments from a noisy judge: multiple-blind votes and position switching.

Multiple-blind: each question goes to the judge ``k`` times independently; the majority
verdict stands only when enough of the ``k`` samples agree, otherwise the order reads as a
tie. Position switch: a pair is judged in both orders (Answer 1/Answer 2 swapped); the
swapped verdict is negated back, and a verdict survives only when both orders agree.
Disagreement becomes a tie, or a re-judge with fresh seeds when configured.

Everything here is pure logic over parsed samples; ``judge_pairs_consistently`` takes the
sampling as a function, so a model judge and a scripted test judge share one code path.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from data_specs.references import DECISION_STATUSES  # noqa: F401 - re-exported: a decision's statuses
from tasks.genrm.config import ConsistencyConfig
from tasks.genrm.parse import ParsedVerdict

FORWARD, BACKWARD = "forward", "backward"


@dataclass(frozen=True)
class Vote:
    """The outcome of k blind samples for one order."""
    verdict: int | None
    agreement: float    # share of the k samples that gave the majority verdict
    valid: int          # samples that parsed
    status: str         # ok | no_consensus | unparseable


@dataclass(frozen=True)
class JudgeSample:
    """One raw judge output, kept so every verdict (and every failure) is on record."""
    pair_index: int
    order: str
    attempt: int
    sample_index: int
    text: str
    parsed: ParsedVerdict


@dataclass
class PairDecision:
    verdict: int | None   # Answer 2 vs Answer 1 in the forward order: -1 / 0 / 1; None if unreadable
    status: str
    agreement: float
    attempts: int
    samples: list[JudgeSample] = field(default_factory=list)
    # judged on dimensions: each one's decided verdict (None: unread), and their weighted mean in
    # [-1, 1] over the read ones, whose sign is ``verdict``
    dimensions: dict[str, int | None] | None = None
    score: float | None = None


def blind_vote(values: Sequence[int | None], agreement_threshold: float) -> Vote:
    """Majority of the parsed values; a tie (0) when the majority is too weak or split."""
    k = len(values)
    valid = [v for v in values if v is not None]
    if k == 0 or not valid:
        return Vote(None, 0.0, 0, "unparseable")
    ranked = Counter(valid).most_common()
    top_value, top_count = ranked[0]
    agreement = top_count / k
    split = len(ranked) > 1 and ranked[1][1] == top_count
    if split or agreement < agreement_threshold:
        return Vote(0, agreement, len(valid), "no_consensus")
    return Vote(top_value, agreement, len(valid), "ok")


def combine_orders(forward: Vote, backward: Vote) -> tuple[int | None, str]:
    """Merge both orders; ``backward`` is in the swapped frame and is negated here.

    Returns (verdict, status); status ``position_disagreement`` or ``unparseable`` means
    the orders did not agree and the caller applies its disagreement policy.
    """
    if forward.verdict is None and backward.verdict is None:
        return None, "unparseable"
    if forward.verdict is None or backward.verdict is None:
        return None, "position_disagreement"  # one-sided evidence is not position-robust
    if forward.verdict == -backward.verdict:
        return forward.verdict, "consistent"
    return None, "position_disagreement"


def single_order(forward: Vote) -> tuple[int | None, str]:
    return forward.verdict, forward.status


# sample_orders(queries, attempt) -> for each (pair_index, order) query, k parsed samples
OrderSampler = Callable[[list[tuple[int, str]], int], list[list[tuple[str, ParsedVerdict]]]]


def judge_pairs_consistently(n_pairs: int, sample_orders: OrderSampler, cfg: ConsistencyConfig) -> list[PairDecision]:
    """Decide every pair with blind votes, position switching and the disagreement policy."""
    decisions: list[PairDecision | None] = [None] * n_pairs
    samples: list[list[JudgeSample]] = [[] for _ in range(n_pairs)]
    pending = list(range(n_pairs))
    attempt = 0
    while pending:
        orders = (FORWARD, BACKWARD) if cfg.position_switch else (FORWARD,)
        queries = [(i, order) for order in orders for i in pending]
        outputs = sample_orders(queries, attempt)
        votes: dict[tuple[int, str], Vote] = {}
        for (i, order), outs in zip(queries, outputs):
            samples[i].extend(JudgeSample(i, order, attempt, s, text, parsed) for s, (text, parsed) in enumerate(outs))
            votes[(i, order)] = blind_vote([p.value for _, p in outs], cfg.agreement_threshold)
        last_chance = cfg.on_disagreement == "tie" or attempt >= cfg.rejudge_attempts
        still_pending = []
        for i in pending:
            forward = votes[(i, FORWARD)]
            if cfg.position_switch:
                verdict, status = combine_orders(forward, votes[(i, BACKWARD)])
                agreement = min(forward.agreement, votes[(i, BACKWARD)].agreement)
            else:
                (verdict, status), agreement = single_order(forward), forward.agreement
            if status in ("position_disagreement", "unparseable") and not last_chance:
                still_pending.append(i)
                continue
            if status == "position_disagreement":
                verdict = 0  # orders disagree and no re-judge is left: a tie
            decisions[i] = PairDecision(verdict, status, agreement, attempt + 1, samples[i])
        pending = still_pending
        attempt += 1
    return [d for d in decisions if d is not None]


def weighted_score(weights: Mapping[str, float], verdicts: Mapping[str, int | None]) -> float | None:
    """The weighted mean of the read verdicts (weights renormalised over them); None when no
    dimension with a positive weight was read."""
    read = {name: v for name, v in verdicts.items() if v is not None and weights.get(name, 0.0) > 0}
    total = sum(weights[name] for name in read)
    if not read or total <= 0:
        return None
    return sum(weights[name] * v for name, v in read.items()) / total


def sign(value: float) -> int:
    return (value > 0) - (value < 0)


# a dimension's decision status, worst first: the combined decision carries the worst read one
_DIMENSION_STATUS_ORDER = ("position_disagreement", "no_consensus", "consistent", "ok")


def combine_dimensions(weights: Mapping[str, float], decided: Mapping[str, PairDecision],
                       samples: list[JudgeSample]) -> PairDecision:
    """One decision from each dimension's own consistent decision: the sign of their weighted
    mean verdict. Unread dimensions (None) drop out of the mean; none read is ``unparseable``."""
    verdicts = {name: d.verdict for name, d in decided.items()}
    score = weighted_score(weights, verdicts)
    read = [d for name, d in decided.items() if d.verdict is not None and weights.get(name, 0.0) > 0]
    attempts = max((d.attempts for d in decided.values()), default=1)
    if score is None:
        return PairDecision(None, "unparseable", 0.0, attempts, samples, verdicts, None)
    statuses = {d.status for d in read}
    status = next((s for s in _DIMENSION_STATUS_ORDER if s in statuses), read[0].status)
    return PairDecision(sign(score), status, min(d.agreement for d in read), attempts, samples, verdicts, score)


def blind_grade(rewards: Sequence[float | None], agreement_threshold: float) -> tuple[float | None, float, str]:
    """Mean reward of the parsed grades, when enough of the k samples parsed.

    Returns (reward, share of samples parsed, status ok | unparseable).
    """
    k = len(rewards)
    valid = [r for r in rewards if r is not None]
    share = len(valid) / k if k else 0.0
    if not valid or share < agreement_threshold:
        return None, share, "unparseable"
    return sum(valid) / len(valid), share, "ok"
