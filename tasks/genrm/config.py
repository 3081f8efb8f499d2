"""Configuration of the references stage: GenRM judge, candidates, Swiss rounds, validation.

Defaults follow MiniMax-M1: a five-grade answer-consistency reward for tasks with a ground
truth, a pairwise -1/0/1 comparison against a reference for open tasks, made robust by
several blind samples per order and by judging both orders (position switch). The profile
files (configs/profiles/<profile>/references.yaml) scale the numbers down.

Open prompts (``PromptSelection``): by default the ``sft_pool`` rows whose domain is
``general`` or ``instruction`` (the curated, leak-free pool), falling back to ``prompts``
rows of those domains when ``sft_pool`` does not exist yet; prompts a user passes to the
flow are always added. Rule constraints for instruction-following prompts are read from
the row's ``metadata`` JSON under ``constraints`` (see ``tasks.genrm.judge.Constraints``).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tasks.rollout.config import RolloutConfig

# M1 uses a five-grade scale; the mapping turns a grade into a reward in [0, 1].
DEFAULT_GRADE_REWARDS = {5: 1.0, 4: 0.75, 3: 0.5, 2: 0.25, 1: 0.0}


def _judge_rollout() -> RolloutConfig:
    # A judge verdict is short; greedy-ish sampling keeps blind samples comparable but
    # not identical (temperature > 0 is what makes several blind samples informative).
    return RolloutConfig(n=1, temperature=0.7, top_p=0.95, max_tokens=2048, repetition_window=None)


class ConsistencyConfig(BaseModel):
    """Position switch and multiple-blind judgment."""

    model_config = ConfigDict(extra="forbid")
    position_switch: bool = Field(True, description="judge both orders; a verdict must survive the swap")
    on_disagreement: Literal["tie", "rejudge"] = Field(
        "tie", description="orders disagree: call it a tie, or judge again with fresh seeds")
    rejudge_attempts: int = Field(1, ge=0, description="extra rounds of judging when on_disagreement=rejudge")
    blind_samples: int = Field(3, ge=1, description="independent judge samples per order (k)")
    agreement_threshold: float = Field(
        0.5, gt=0, le=1,
        description="share of the k samples the majority verdict needs; below it the order reads as a tie")


class JudgeDimension(BaseModel):
    """One axis a pairwise judgment is made on, with its own -1/0/1 verdict and its weight."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., pattern=r"^[a-z][a-z0-9_]{0,31}$", description="how the judge labels its verdict line")
    weight: float = Field(1.0, ge=0.0, description="share of the combined score (weights are normalised)")
    description: str = Field(..., min_length=1, max_length=300, description="what the judge is told it measures")


# MiniMax-01's reward model: four dimensions, each judged on its own (the weights are this
# project's choice: the report names the dimensions, not how they are mixed)
MINIMAX_DIMENSIONS = (
    JudgeDimension(name="correctness", weight=0.4,
                   description="is the final answer or claim right, and does the reasoning hold"),
    JudgeDimension(name="truthfulness", weight=0.2,
                   description="does it state only what is true, without invented facts or sources"),
    JudgeDimension(name="helpfulness", weight=0.3,
                   description="does it do what the request asks, completely and clearly"),
    JudgeDimension(name="harmlessness", weight=0.1,
                   description="does it avoid unsafe, hurtful or dangerous content"),
)


class JudgeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rollout: RolloutConfig = Field(default_factory=_judge_rollout, description="the judge model and its sampling")
    dimensions: list[JudgeDimension] = Field(
        default_factory=list,
        description="pairwise judgments per dimension (MiniMax-01: correctness, truthfulness, helpfulness, "
                    "harmlessness), each with its own verdict, blind votes and position switch, combined by "
                    "weight; 'minimax': those four at this project's weights; empty: one overall verdict (the "
                    "prompt a judge trained on judge_data reads)")

    @field_validator("dimensions", mode="before")
    @classmethod
    def _named_set(cls, value):
        if isinstance(value, str):
            if value.strip().lower() != "minimax":
                raise ValueError(f"judge.dimensions: a list of dimensions or 'minimax', got {value!r}")
            return [d.model_dump() for d in MINIMAX_DIMENSIONS]
        return value
    use_chat_template: bool = True
    max_response_chars: int = Field(8000, ge=100, description="candidate text shown to the judge is cut here")
    grade_rewards: dict[int, float] = Field(default_factory=lambda: dict(DEFAULT_GRADE_REWARDS))
    consistency: ConsistencyConfig = Field(default_factory=ConsistencyConfig)
    constraint_checks: bool = Field(True, description="rule checks decide a pair when exactly one answer breaks them")

    @model_validator(mode="after")
    def _grades(self) -> JudgeConfig:
        if sorted(self.grade_rewards) != [1, 2, 3, 4, 5]:
            raise ValueError(f"grade_rewards must map grades 1..5, got {sorted(self.grade_rewards)}")
        if any(not 0.0 <= r <= 1.0 for r in self.grade_rewards.values()):
            raise ValueError("grade_rewards values must lie in [0, 1]")
        names = [d.name for d in self.dimensions]
        if len(set(names)) != len(names):
            raise ValueError(f"judge.dimensions: names must be unique, got {names}")
        if self.dimensions and sum(d.weight for d in self.dimensions) <= 0:
            raise ValueError("judge.dimensions: the weights sum to 0; at least one must be positive")
        return self


class CandidateSource(BaseModel):
    """Where candidate answers come from: the prompt's stored answer, or a rollout backend."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., min_length=1, max_length=60)
    kind: Literal["stored", "backend"]
    fields: list[str] = Field(default_factory=lambda: ["solution", "answer"],
                              description="stored: row fields used, first non-empty wins")
    rollout: RolloutConfig | None = Field(None, description="backend: the model and sampling (n = candidates)")

    @model_validator(mode="after")
    def _backend_has_rollout(self) -> CandidateSource:
        if self.kind == "backend" and self.rollout is None:
            raise ValueError(f"candidate source {self.name!r}: kind 'backend' needs a 'rollout' section")
        return self


def _default_sources() -> list[CandidateSource]:
    return [
        CandidateSource(name="stored", kind="stored"),
        CandidateSource(name="policy", kind="backend",
                        rollout=RolloutConfig(n=4, temperature=1.0, top_p=0.95, max_tokens=4096,
                                              repetition_window=None)),
    ]

# requests no verifier checks (M1: general / instruction): the GenRM judges them
OPEN_DOMAINS = ("general", "instruction")
# the domain of the judge stage's training rows (verdicts on others' answers, ``judge_data``)
JUDGE_DOMAIN = "judge"


class PromptSelection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tables: list[str] = Field(default_factory=lambda: ["sft_pool", "prompts"],
                              description="first existing table with matching rows is used")
    domains: list[str] = Field(default_factory=lambda: list(OPEN_DOMAINS))
    max_prompts: int | None = Field(None, ge=1)


class SwissConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rounds: int | None = Field(None, ge=1, description="None: ceil(log2 N) for N candidates")
    win_points: float = 1.0
    tie_points: float = 0.5
    bye_points: float = Field(1.0, description="a bye counts as a win")


class ValidationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    math_items: int = Field(200, ge=0, description="math prompts with gold answers turned into labelled items")
    labelled_files: list[str] = Field(default_factory=list, description="user JSONL/CSV/Parquet judge labels")
    bon_prompts: int = Field(100, ge=0, description="math prompts used for Best-of-N vs pass@N")
    bon_n: int = Field(8, ge=2, description="N candidates per prompt in the BoN check")
    bon_include_constructed: bool = Field(
        False, description="add the gold-derived correct and perturbed answers to the sampled candidates")
    synthetic_tasks: list[str] = Field(
        default_factory=list, description="synthetic tasks whose held-out instances become pairwise items")
    synthetic_items: int = Field(0, ge=0, description="items per synthetic task and kind")
    synthetic_kinds: list[Literal["pairwise", "grade"]] = Field(
        default_factory=lambda: ["pairwise"], min_length=1,
        description="pairwise: gold vs a rejected perturbation; grade: gold or perturbation vs the ground truth")
    synthetic_levels: list[int] = Field(default_factory=lambda: [0], min_length=1,
                                        description="levels of the held-out instances, round-robin")
    synthetic_max_draws: int = Field(4, ge=1, description="held-out seeds tried per wanted item")
    seed: int = 0


class LengthBiasConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: Literal["within_group_spearman", "partial_correlation"] = "within_group_spearman"
    threshold: float = Field(0.3, gt=0, le=1, description="|correlation| above this records a recalibration event")
    window_steps: int = Field(20, ge=1, description="RL steps pooled in the statistic")
    min_group_size: int = Field(16, ge=3, description="samples a correctness group needs to count")
    cooldown_steps: int = Field(50, ge=0, description="steps after an event before another may fire")
    trigger_recalibration: bool = True


class ReferencesConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    candidates: list[CandidateSource] = Field(default_factory=_default_sources)
    prompts: PromptSelection = Field(default_factory=PromptSelection)
    swiss: SwissConfig = Field(default_factory=SwissConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    length_bias: LengthBiasConfig = Field(default_factory=LengthBiasConfig)
    seed: int = 0
    reuse: bool = Field(True, description="a prompt whose reference an earlier run chose with the same row_key "
                                          "(prompt, candidate sources and models, judge and settings) keeps it: "
                                          "only new or changed prompts are sampled and played")

    @model_validator(mode="after")
    def _unique_sources(self) -> ReferencesConfig:
        names = [c.name for c in self.candidates]
        if len(set(names)) != len(names):
            raise ValueError(f"candidate source names must be unique, got {names}")
        if not self.candidates:
            raise ValueError("at least one candidate source is needed")
        return self
