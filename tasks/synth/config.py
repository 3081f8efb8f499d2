"""The ``synthesize`` profile section. Defaults follow MiniMax-M1 / SynLogic."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class CalibrationConfig(BaseModel):
    """How levels are probed to find each task's M1 difficulty band."""
    model_config = ConfigDict(extra="forbid")
    # run it in the synthesize stage (real-model profiles): a task is probed again only when the
    # task, either model or these settings changed
    enabled: bool = False
    # the models probed, by name (as the rollout section names one); base None: the rollout's
    # model; strong None: the base model itself, its pass@strong_k the upper bound (no stronger
    # model runs here: each probe instance is then sampled once)
    base_model: str | None = None
    strong_model: str | None = None
    max_tokens: int | None = Field(None, ge=1, description="tokens a probe sample may take (None: the rollout's)")
    instances_per_level: int = Field(16, ge=1)
    base_samples: int = Field(8, ge=1)          # samples per instance for the base pass rate
    strong_samples: int = Field(10, ge=1)       # samples per instance for the strong pass@k
    strong_k: int = Field(10, ge=1)             # M1: a strong reasoning model's pass@10 > 0
    base_band: tuple[float, float] = (0.0, 0.5)  # M1: base pass rate strictly inside (0, 0.5)
    correct_threshold: float = Field(1.0, gt=0.0, le=1.0)   # score counted as a correct sample
    stop_after_unsolved: int = Field(1, ge=1)   # stop probing after this many levels at pass@k = 0
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> CalibrationConfig:
        lo, hi = self.base_band
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(f"base_band must satisfy 0 <= low < high <= 1, got {self.base_band}")
        if self.strong_samples < self.strong_k:
            raise ValueError(f"strong_samples ({self.strong_samples}) must be >= strong_k ({self.strong_k})")
        return self


class SyntheticSplitConfig(BaseModel):
    """Which side (SFT or RL) each synthetic instance trains on; a cluster never straddles."""
    model_config = ConfigDict(extra="forbid")
    rl_fraction: float = Field(0.5, ge=0.0, le=1.0, description="share of clusters assigned to RL")
    seed: int = 0


class SynthesizeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # M1 used ~53K samples over 41 tasks: about 1,300 per task
    per_task: int = Field(1300, ge=1)
    # instances for particular tasks instead of per_task (e.g. more of the families a run trains on)
    per_task_by_task: dict[str, int] = Field(default_factory=dict)
    # None: every own task; names are own task names or "rg:<reasoning-gym dataset>"
    tasks: list[str] | None = None
    reasoning_gym: list[str] = Field(default_factory=list)   # extra rg datasets (without "rg:")
    # levels per task when no calibration row exists; tasks not listed use default_levels
    levels: dict[str, list[int]] = Field(default_factory=dict)
    default_levels: list[int] | None = None   # None: every level the task has
    use_calibration: bool = True               # read task_calibration when it exists
    skip_too_hard: bool = True                 # calibrated "too_hard" tasks produce nothing
    # draw at most this many seeds per wanted instance before giving up on duplicates
    max_draws_per_instance: int = Field(3, ge=1)
    seed: int = 0
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    split: SyntheticSplitConfig = Field(default_factory=SyntheticSplitConfig)

    def task_names(self, own: list[str]) -> list[str]:
        names = list(self.tasks) if self.tasks is not None else list(own)
        names += [f"rg:{d}" for d in self.reasoning_gym if f"rg:{d}" not in names]
        return names
