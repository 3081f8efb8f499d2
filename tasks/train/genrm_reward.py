"""RL rewards by domain: rule verifiers for math/logic/code, the GenRM for open domains.

MiniMax-M1 rewards prompts that rules cannot check (``general``, ``instruction``) with a
generative reward model: the response is compared pairwise with the prompt's reference
answer (Answer 1 = reference, Answer 2 = response; -1/0/1 = worse/similar/better), judged
in both orders and with blind samples (``tasks.genrm.judge.GenRMJudge``), and rule
constraints from the row's ``metadata.constraints`` decide a pair outright when exactly
one answer breaks them. The verdict maps to a reward (default -1 -> 0, 0 -> 0.5, 1 -> 1);
an unreadable verdict, or a prompt with no reference to compare with, is paid as a tie but
counted as *unread* (``genrm_unread``): its correctness is unknown, so it stays out of the
length-bias monitor and its correction.

With ``judge.dimensions`` (MiniMax-01's correctness, truthfulness, helpfulness, harmlessness) each
dimension gets its own verdict, paid by ``verdict_rewards`` and mixed by the dimensions' weights
into the sample's reward; each dimension's mean reward is logged (``genrm_dim.<name>``), and the
decision's verdict (the sign of the weighted mean) is its correctness.

A prompt in ``grade_domains`` (M1's STEM case: a ground-truth answer no rule can check) is graded
against that answer on the five-grade scale (``judge.grade_rewards``), one ``grade`` call a round;
an unreadable grade, or a prompt without a ground truth, is paid as grade 3 and counted unread.
No length correction applies to a grade: the calibration is fit on pairwise rewards.

All GenRM samples of a sampling round go to the judge in one ``compare`` call. Every
scored sample also carries its *correctness* for the length-bias monitor: the verifier's
for rule-scored samples, ``verdict >= 0`` for GenRM samples the judge read (None: unread).

With ``format`` (M1's format reward) a rule-scored answer keeps its reward only in the format
its domain asks for (``tasks.verify.registry.in_format``), else ``out_of_format_scale`` of it;
its correctness stays the verifier's, and the counters say how often the format cost a right
answer.

Each rule-scored sample is verified exactly once (one sandbox run for code): its reward
and its correctness come from that one result. A row the verifier cannot score (broken
metadata, unknown task, a crashing verifier) still scores 0, but is counted per domain
(``verify_errors.<domain>``, ``verify_error_fraction``) and its first error is logged.

The length-bias loop is closed here: the correction in force (the ``judge_calibrations`` row
for the judge the stage was handed, written by ``flows.references.recalibrate_flow``) is
subtracted from every model-judged GenRM reward; when the stage's own monitor fires,
``recalibrate`` puts the fit on the event's window in force at once, so the RL steps after
the event are corrected within the stage (the train flow stores the same correction after it).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from tasks.genrm.consistency import PairDecision
from tasks.genrm.judge import (
    Constraints,
    GenRMJudge,
    GradeRequest,
    PairRequest,
    constraints_from_metadata,
)
from tasks.genrm.length_bias import (
    CALIBRATIONS_TABLE,
    LengthCorrection,
    event_correction,
    latest_length_correction,
)
from tasks.genrm.references import judgment_rows
from tasks.rollout.base import Completion, RolloutBackend
from tasks.train.config import FormatRewardConfig, GenRMRewardConfig
from tasks.verify.registry import in_format, verify, verify_with_error

log = logging.getLogger("posttrain.train.rl")

RewardFn = Callable[[dict, str, list[int]], float]


def verifier_reward(row: dict, text: str, token_ids: list[int]) -> float:
    """The rule-based reward: the domain's verifier on the source row (0 if unscorable)."""
    return float(verify(row["domain"], row["source_row"], text))


def verifier_correct(row: dict, text: str) -> float:
    """1.0 when the domain's verifier accepts the response (0.0 for unscorable rows)."""
    return 1.0 if verify(row["domain"], row["source_row"], text) >= 0.5 else 0.0


def clip_reward(value: float) -> float:
    return min(1.0, max(0.0, float(value)))


@dataclass(frozen=True)
class ScoredSample:
    reward: float                 # in [0, 1]
    correct: float | None         # what the length-bias monitor holds fixed (None: unread verdict)
    scorer: str                   # "verifier" | "genrm" | "genrm_grade" | "custom"
    verdict: int | None = None    # GenRM only: the judge's verdict (None = unreadable or no reference)
    status: str = ""              # GenRM only: the decision's status ("consistent", "rule", "unparseable", ...)
    in_format: bool | None = None  # verifier only, with the format reward on: the answer's format was the asked one
    dimensions: dict[str, float] | None = None   # GenRM on dimensions: each read dimension's reward


@dataclass
class RewardCounters:
    """Per-step reward bookkeeping, summed over the step's sampling rounds."""
    genrm_scored: int = 0
    genrm_unparseable: int = 0
    genrm_position_disagreement: int = 0
    genrm_rule_decided: int = 0
    genrm_no_reference: int = 0
    genrm_unread: int = 0          # unparseable or without a reference: paid as a tie, correctness unknown
    genrm_length_corrected: int = 0
    judge_calls: int = 0
    length_correction_slope: float = 0.0      # the calibration in force (0: none)
    verified: dict[str, int] = field(default_factory=dict)        # verifier calls by domain
    verify_errors: dict[str, int] = field(default_factory=dict)   # ... that could not score the row
    first_verify_error: str | None = None
    format_checked: int = 0        # rule-scored samples whose format the format reward checked
    format_missed: int = 0         # ... not in the asked format
    format_cost_correct: int = 0   # ... of them right: the reward the format took away
    genrm_graded: int = 0          # grade_domains samples graded against their ground truth
    genrm_grade_unread: int = 0    # ... whose grade could not be read (or without a ground truth)
    grade_reward_sum: float = 0.0  # ... the rewards of the read grades, summed
    dimension_reward_sum: dict[str, float] = field(default_factory=dict)   # per dimension, over read verdicts
    dimension_read: dict[str, int] = field(default_factory=dict)
    dimension_unread: dict[str, int] = field(default_factory=dict)

    def count_dimensions(self, sample: ScoredSample, names: list[str]) -> None:
        for name in names:
            value = (sample.dimensions or {}).get(name)
            if value is None:
                self.dimension_unread[name] = self.dimension_unread.get(name, 0) + 1
            else:
                self.dimension_read[name] = self.dimension_read.get(name, 0) + 1
                self.dimension_reward_sum[name] = self.dimension_reward_sum.get(name, 0.0) + value

    def count_verification(self, domain: str, error: str | None) -> bool:
        """Count one verifier call; True for the step's first error (the one worth a log line)."""
        self.verified[domain] = self.verified.get(domain, 0) + 1
        self.verify_errors.setdefault(domain, 0)
        if error is None:
            return False
        self.verify_errors[domain] += 1
        first = self.first_verify_error is None
        self.first_verify_error = self.first_verify_error or error
        return first

    def metrics(self) -> dict[str, float]:
        n = self.genrm_scored
        verified, errors = sum(self.verified.values()), sum(self.verify_errors.values())
        return {"genrm_scored": float(n),
                "genrm_unparseable_fraction": self.genrm_unparseable / n if n else 0.0,
                "genrm_position_disagreement_fraction": self.genrm_position_disagreement / n if n else 0.0,
                "genrm_rule_decided_fraction": self.genrm_rule_decided / n if n else 0.0,
                "genrm_no_reference": float(self.genrm_no_reference),
                "genrm_unread_fraction": self.genrm_unread / n if n else 0.0,
                "genrm_judge_calls": float(self.judge_calls),
                "genrm_length_corrected": float(self.genrm_length_corrected),
                "genrm_length_correction_slope": self.length_correction_slope,
                "verify_error_fraction": errors / verified if verified else 0.0,
                **({"format_miss_fraction": self.format_missed / self.format_checked,
                    "format_cost_correct_fraction": self.format_cost_correct / self.format_checked}
                   if self.format_checked else {}),
                **({"genrm_graded": float(self.genrm_graded),
                    "genrm_grade_unread_fraction": self.genrm_grade_unread / self.genrm_graded,
                    "genrm_grade_reward": (self.grade_reward_sum / (self.genrm_graded - self.genrm_grade_unread)
                                           if self.genrm_graded > self.genrm_grade_unread else 0.0)}
                   if self.genrm_graded else {}),
                **{f"genrm_dim.{d}": self.dimension_reward_sum.get(d, 0.0) / k
                   for d, k in sorted(self.dimension_read.items()) if k},
                **{f"genrm_dim_unread_fraction.{d}": self.dimension_unread.get(d, 0) / (
                    self.dimension_unread.get(d, 0) + self.dimension_read.get(d, 0))
                   for d in sorted({*self.dimension_read, *self.dimension_unread})},
                **{f"verify_errors.{d}": float(k) for d, k in sorted(self.verify_errors.items())}}


def stored_reference(row: dict, fields: list[str]) -> str | None:
    """The row's own answer text: the first non-empty of ``fields`` in the source row, then the row."""
    for source in (row.get("source_row") or {}, row):
        for name in fields:
            value = source.get(name)
            if isinstance(value, str) and value.strip():
                return value
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return str(value)
    return None


def row_constraints(row: dict) -> Constraints | None:
    """The prompt's rule constraints; a malformed block is logged and ignored, never fatal."""
    source = row.get("source_row") or {}
    try:
        return constraints_from_metadata(source.get("metadata"))
    except ValueError as e:
        log.warning("rl_prompts row %s: ignoring rule constraints: %s", row.get("prompt_id"), e)
        return None


@dataclass
class _Pending:
    group: int
    sample: int
    request: PairRequest


@dataclass
class DomainReward:
    """Scores one sampling round: verifiers (or a custom function) and one batched GenRM call.

    ``judge_backend`` is a zero-argument factory, called the first time a GenRM sample
    needs judging, so a pool without open-domain prompts never loads a judge model.
    ``custom`` replaces the verifier reward (tests, ablations); correctness then still
    comes from the verifiers, so the monitor holds the same thing fixed.
    ``home``: the warehouse whose newest ``judge_calibrations`` row for this judge corrects
    the GenRM rewards (re-read when the table gains a snapshot), unless ``pin_calibrations``
    fixed the snapshot read (the RL stage reads the one it was handed, or none when it was
    handed none, never a newer one another run wrote); ``calibration`` sets the correction
    directly (it is replaced by the table's when both are given).
    """
    cfg: GenRMRewardConfig
    references: dict[str, str] = field(default_factory=dict)
    judge_backend: Callable[[], RolloutBackend] | None = None
    seed: int = 0
    custom: RewardFn | None = None
    # raw judge outputs of the RL stage, drained into the `judgments` table (context "rl");
    # each names the rollout it judged as "<rollout_prefix>:<step>:<round>:<prompt_id>:<index>"
    run_id: str | None = None
    rollout_prefix: str = "rl"
    judgments: list[dict] = field(default_factory=list)
    home: str | None = None
    calibration: LengthCorrection | None = None
    verify_workers: int = 1
    format: FormatRewardConfig | None = None   # the format reward (None or disabled: off)
    _backend: RolloutBackend | None = field(default=None, init=False, repr=False)
    _calibration_snapshot: str | None = field(default=None, init=False, repr=False)
    _calibrations_pin: tuple[Any] | None = field(default=None, init=False, repr=False)   # (TableRef | None,)
    _warehouse: Any = field(default=None, init=False, repr=False)
    _in_stage: bool = field(default=False, init=False, repr=False)   # a correction this stage fitted is in force
    # verifier verdicts decided ahead (``verify_ahead``), by step: (prompt_id, response) -> verdict
    _ahead: dict[int, dict] = field(default_factory=dict, init=False, repr=False)
    _ahead_lock: Any = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def judge_model(self) -> str:
        return self.cfg.judge.rollout.model

    def refresh_calibration(self) -> LengthCorrection | None:
        """The correction in force: the newest calibration for the judge, once per table snapshot."""
        if self.home is None or self._in_stage:
            return self.calibration
        from warehouse import Warehouse

        wh = self._warehouse = self._warehouse or Warehouse(self.home)
        latest = self._calibrations_pin[0] if self._calibrations_pin else wh.latest(CALIBRATIONS_TABLE)
        snapshot = latest.snapshot if latest is not None else None
        if snapshot != self._calibration_snapshot:
            self._calibration_snapshot = snapshot
            found = latest_length_correction(wh, self.judge_model, snapshot) if snapshot else None
            self.calibration = found or self.calibration
            if found is not None:
                log.info("GenRM rewards of judge %s: length correction slope %.4f (judge_calibrations@%s)",
                         self.judge_model, found.slope, snapshot)
        return self.calibration

    def pin_calibrations(self, ref) -> None:
        """Read ``judge_calibrations`` at ``ref`` (a TableRef; None: no calibration) from now on,
        whatever snapshots the table gains (a recalibration of this stage itself is put in force by
        ``recalibrate``)."""
        self._calibrations_pin = (ref,)

    def recalibrate(self, event: dict) -> LengthCorrection:
        """Put in force the correction for a length-bias event of this stage (its window, with
        ``event_context()`` taken before this call): the fit on top of the correction the
        window's rewards carried. Table snapshots read later do not undo it."""
        _, correction = event_correction(event)
        self.use_correction(correction)
        return correction

    def use_correction(self, correction: LengthCorrection | None) -> None:
        """The correction in force from now on (a resumed stage restores the one it had)."""
        self.calibration = correction
        self._in_stage = correction is not None

    def in_stage_correction(self) -> dict | None:
        """The correction this stage put in force (``recalibrate``), for its checkpoints."""
        return self.calibration.as_dict() if self._in_stage and self.calibration is not None else None

    def event_context(self) -> dict:
        """What a length-bias event needs for its recalibration: whose rewards, already corrected how."""
        active = self.calibration if self.custom is None else None
        return {"judge_model": self.judge_model, "base_calibration": active.as_dict() if active else None}

    def uses_genrm(self, row: dict) -> bool:
        """Whether the GenRM scores the row (pairwise against a reference, or graded)."""
        return self.cfg.enabled and self.custom is None and (
            row["domain"] in self.cfg.domains or row["domain"] in self.cfg.grade_domains)

    def graded(self, row: dict) -> bool:
        return row["domain"] in self.cfg.grade_domains

    def score(self, rows: list[dict], groups: list[list[Completion]], counters: RewardCounters,
              step: int = 0, round_: int = 0) -> list[list[ScoredSample]]:
        out: list[list[ScoredSample | None]] = [[None] * len(g) for g in groups]
        pending: list[_Pending] = []
        grading: list[tuple[int, int, GradeRequest]] = []   # (group, sample, request) graded vs the ground truth
        rule: list[tuple[int, int]] = []    # (group, sample) scored by the verifiers
        for gi, (row, completions) in enumerate(zip(rows, groups)):
            for si, c in enumerate(completions):
                if not self.uses_genrm(row):
                    rule.append((gi, si))
                    continue
                if self.graded(row):
                    truth = stored_reference(row, self.cfg.grade_fields)
                    if truth is None:
                        counters.genrm_no_reference += 1
                        out[gi][si] = self._grade_sample(None, "no_reference")
                    else:
                        grading.append((gi, si, GradeRequest(row["prompt"], truth, c.text)))
                    continue
                request = self._request(row, c.text)
                if request is None:
                    counters.genrm_no_reference += 1
                    out[gi][si] = self._genrm_sample(None, "no_reference")
                else:
                    pending.append(_Pending(gi, si, request))
        decided = self._verdicts(step, round_, [(rows[gi], groups[gi][si].text) for gi, si in rule])
        for (gi, si), verdict in zip(rule, decided, strict=True):
            out[gi][si] = self._rule_sample(rows[gi], groups[gi][si], verdict, counters)
        if pending:
            correction = self.refresh_calibration()
            counters.length_correction_slope = correction.slope if correction is not None else 0.0
            decisions = self._judge(step, round_).compare([p.request for p in pending])
            # a round whose every pair the rule constraints decided never reached the judge model
            counters.judge_calls += any(d.status != "rule" for d in decisions)
            for p, decision in zip(pending, decisions, strict=True):
                sample = self._pair_sample(decision)
                out[p.group][p.sample] = self._corrected(sample, len(groups[p.group][p.sample].token_ids), counters)
                prompt_id = rows[p.group]["prompt_id"]
                self.judgments += judgment_rows(
                    decision.samples, run_id=self.run_id, context="rl", kind="pairwise", prompt_id=prompt_id,
                    match_id=None, first_id="reference",
                    second_id=f"{self.rollout_prefix}:{step}:{round_}:{prompt_id}:{p.sample}",
                    judge_model=getattr(self._backend, "name", "judge"))
        if grading:
            grades = self._judge(step, round_, grading=True).grade([g for _, _, g in grading])
            counters.judge_calls += 1
            for (gi, si, _), decision in zip(grading, grades, strict=True):
                out[gi][si] = self._grade_sample(decision.reward, decision.status)
                prompt_id = rows[gi]["prompt_id"]
                self.judgments += judgment_rows(
                    decision.samples, run_id=self.run_id, context="rl", kind="grade", prompt_id=prompt_id,
                    match_id=None, first_id=f"{self.rollout_prefix}:{step}:{round_}:{prompt_id}:{si}",
                    second_id=None, judge_model=getattr(self._backend, "name", "judge"))
        names = [d.name for d in self.cfg.judge.dimensions]
        for samples in out:
            for s in samples:
                if s is not None and s.scorer == "genrm_grade":
                    counters.genrm_graded += 1
                    counters.genrm_grade_unread += s.correct is None
                    counters.grade_reward_sum += s.reward if s.correct is not None else 0.0
                if s is not None and s.scorer == "genrm":
                    counters.genrm_scored += 1
                    if names and s.status != "rule" and s.status != "no_reference":
                        counters.count_dimensions(s, names)
                    counters.genrm_unparseable += s.status == "unparseable"
                    counters.genrm_position_disagreement += s.status == "position_disagreement"
                    counters.genrm_rule_decided += s.status == "rule"
                    counters.genrm_unread += s.correct is None
        return out  # type: ignore[return-value]

    def verify_ahead(self, step: int, rows: list[dict], groups: list[list[Completion]]) -> None:
        """Decide the verifier verdicts of ``step``'s first round while earlier steps train (the
        rollout engine's request thread calls it once the batch sampled ahead is in): ``score``
        then takes them instead of deciding them again. A verdict is a function of its row and
        response alone, so deciding it earlier changes no reward; the counters, the custom
        reward and the GenRM samples stay with ``score``."""
        items = [(row, c.text) for row, completions in zip(rows, groups) if not self.uses_genrm(row)
                 for c in completions]
        verdicts = {(row["prompt_id"], text): v for (row, text), v in zip(items, self._verify_all(items), strict=True)}
        with self._ahead_lock:
            self._ahead[step] = verdicts

    def _verdicts(self, step: int, round_: int, items: list[tuple[dict, str]]) -> list[tuple[float, str | None]]:
        """The verdicts of ``items``: those decided ahead for the step's first round, the rest now."""
        with self._ahead_lock:
            ahead = self._ahead.pop(step, {}) if round_ == 0 else {}
        keys = [(row["prompt_id"], text) for row, text in items]
        missing = [(item, key) for item, key in zip(items, keys) if key not in ahead]
        decided = {**ahead, **dict(zip([key for _, key in missing], self._verify_all([item for item, _ in missing]),
                                       strict=True))}
        return [decided[key] for key in keys]

    def _verify_all(self, items: list[tuple[dict, str]]) -> list[tuple[float, str | None]]:
        """(score, error) of every (row, response), in order, ``verify_workers`` at a time (math
        answers decided in worker processes, one per thread; code in its sandbox); each verdict is
        a function of its row and response alone, so the order of deciding changes nothing."""
        def one(item: tuple[dict, str]) -> tuple[float, str | None]:
            return verify_with_error(item[0]["domain"], item[0]["source_row"], item[1])

        if self.verify_workers <= 1 or len(items) <= 1:
            return [one(item) for item in items]
        with ThreadPoolExecutor(max_workers=self.verify_workers, thread_name_prefix="rl-verify") as pool:
            return list(pool.map(one, items))

    def _rule_sample(self, row: dict, c: Completion, verdict: tuple[float, str | None],
                     counters: RewardCounters) -> ScoredSample:
        # one verification per sample (one sandbox run for code): reward and correctness share it
        score, error = verdict
        if counters.count_verification(row["domain"], error):
            log.warning("rl_prompts row %s (%s): the verifier cannot score it, reward 0 and counted in "
                        "verify_errors.%s: %s", row.get("prompt_id"), row["domain"], row["domain"], error)
        correct = 1.0 if score >= 0.5 else 0.0
        if self.custom is not None:
            return ScoredSample(clip_reward(self.custom(row, c.text, list(c.token_ids))), correct, "custom")
        fmt = self.format
        shaped = in_format(row["domain"], c.text) if fmt and fmt.enabled and row["domain"] in fmt.domains else None
        if shaped is None:
            return ScoredSample(clip_reward(score), correct, "verifier")
        counters.format_checked += 1
        if not shaped:
            counters.format_missed += 1
            counters.format_cost_correct += correct > 0
            score *= fmt.out_of_format_scale
        return ScoredSample(clip_reward(score), correct, "verifier", in_format=shaped)

    def _corrected(self, sample: ScoredSample, length: int, counters: RewardCounters) -> ScoredSample:
        """The judge's reward minus the calibrated length effect (a rule decision is not the judge's)."""
        c = self.calibration
        if c is None or sample.status == "rule" or sample.correct is None or (
                c.groups is not None and sample.correct not in c.groups):
            return sample
        counters.genrm_length_corrected += 1
        return replace(sample, reward=float(c.apply([sample.reward], [length], [sample.correct])[0]))

    def _genrm_sample(self, verdict: int | None, status: str) -> ScoredSample:
        # an unreadable verdict (or a prompt without any reference) is paid as a tie, and its
        # correctness is unknown: not "correct", which would put it in the monitor's correct group
        if verdict is None:
            return ScoredSample(self.cfg.verdict_rewards[0], None, "genrm", None, status)
        return ScoredSample(self.cfg.verdict_rewards[verdict], 1.0 if verdict >= 0 else 0.0, "genrm", verdict, status)

    def _pair_sample(self, decision: PairDecision) -> ScoredSample:
        """The reward of a pairwise decision: its verdict's, or on dimensions the weighted mean of
        each read dimension's verdict reward (its correctness: the combined verdict >= 0)."""
        sample = self._genrm_sample(decision.verdict, decision.status)
        if decision.dimensions is None or decision.verdict is None:
            return sample
        weights = {d.name: d.weight for d in self.cfg.judge.dimensions}
        rewards = {name: self.cfg.verdict_rewards[v] for name, v in decision.dimensions.items() if v is not None}
        total = sum(weights.get(name, 0.0) for name in rewards)
        reward = sum(weights.get(name, 0.0) * r for name, r in rewards.items()) / total if total else sample.reward
        return replace(sample, reward=clip_reward(reward), dimensions=rewards)

    def _grade_sample(self, reward: float | None, status: str) -> ScoredSample:
        """A graded sample: its grade's reward, correct when at least 0.5; an unread grade (or no
        ground truth) is paid as grade 3 with its correctness unknown."""
        if reward is None:
            return ScoredSample(self.cfg.judge.grade_rewards[3], None, "genrm_grade", None, status)
        return ScoredSample(clip_reward(reward), 1.0 if reward >= 0.5 else 0.0, "genrm_grade", None, status)

    def _request(self, row: dict, response: str) -> PairRequest | None:
        reference = self.references.get(row["prompt_id"]) or stored_reference(row, self.cfg.reference_fields)
        if reference is None:
            return None
        return PairRequest(row["prompt"], reference, response, row_constraints(row))

    def _judge(self, step: int, round_: int, grading: bool = False) -> GenRMJudge:
        if self._backend is None:
            if self.judge_backend is None:
                raise ValueError("rl.genrm: open-domain and graded prompts need a judge backend, none was given")
            self._backend = self.judge_backend()
        # a fresh judge per round: its seeds depend on (seed, step, round) only, so a
        # resumed run judges a step exactly as the first attempt did (grading on seeds of its own)
        seed = self.seed * 1_000_003 + step * 7919 + round_ + (500_009 if grading else 0)
        return GenRMJudge(self._backend, self.cfg.judge, seed=seed)


def references_by_prompt(references, prompt_ids: set[str]) -> dict[str, str]:
    """prompt_id -> reference text from ``current_references`` output, for the pool's prompts."""
    if references.is_empty() or not {"prompt_id", "reference"} <= set(references.columns):
        return {}
    return {r["prompt_id"]: r["reference"] for r in references.iter_rows(named=True)
            if r["prompt_id"] in prompt_ids and isinstance(r["reference"], str) and r["reference"].strip()}

