"""The ``train`` profile section: one block per stage plus the shared engine settings.

Defaults are the paper's values (MiniMax-01 staged SFT/DPO, MiniMax-M1 CISPO with
eps_high 0.2 and no lower bound, AdamW beta = (0.9, 0.95), eps = 1e-15, output windows
40K -> 80K). ``configs/profiles/<profile>/train.yaml`` scales them.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from data_specs.stages import STAGE_NAMES, TRAIN_STAGES, TrainStage, stages_reading, train_stage
from tasks.cleaning import CleanConfig
from tasks.genrm.config import OPEN_DOMAINS, JudgeConfig, LengthBiasConfig

STAGE_ORDER = STAGE_NAMES
StageName = Literal[STAGE_NAMES]  # type: ignore[valid-type]  # the registry's names


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OptimizerConfig(_Strict):
    lr: float = Field(1e-5, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-15, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)


class EngineConfig(_Strict):
    """What the generated DeepSpeed JSON holds, and how ranks are started."""
    zero_stage: Literal[0, 1, 2, 3] = 2
    precision: Literal["fp32", "bf16"] = "bf16"
    gradient_clipping: float = Field(1.0, ge=0)
    micro_batch_size: int = Field(4, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    offload_optimizer: bool = False
    num_ranks: int = Field(1, ge=1)
    # "inprocess" runs one rank in this process (gloo on CPU); "process" one rank in a Python process
    # of its own; the launchers start num_ranks
    launcher: Literal["inprocess", "process", "torchrun", "deepspeed"] = "inprocess"
    accelerator: Literal["cpu", "cuda"] = "cpu"
    threads_per_rank: int | None = Field(1, ge=1)
    malloc_mmap_threshold: Literal["auto", "glibc"] | Annotated[int, Field(ge=0)] = Field(
        "auto", description="glibc's mmap threshold in launcher-started ranks (MALLOC_MMAP_THRESHOLD_, bytes; "
        "one set in the environment wins). 'auto': 1 MiB under ZeRO-3, glibc's dynamic one otherwise: zero.Init "
        "builds each module whole, keeps a partition and frees the rest, and under the dynamic threshold those "
        "freed blocks stay in the heap (bench/zero3_memory.py, SmolLM2 on 2 CPU ranks: loading peak 1.67x -> "
        "1.11x the model, training peak -30%, steps 4-9% slower). 'glibc': never set")

    @model_validator(mode="after")
    def _ranks_need_launcher(self) -> EngineConfig:
        if self.num_ranks > 1 and self.launcher in ("inprocess", "process"):
            raise ValueError("num_ranks > 1 needs launcher 'torchrun' or 'deepspeed'")
        return self


class StageCommon(_Strict):
    steps: int = Field(100, ge=1)
    checkpoint_every: int = Field(50, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    lr: float | None = Field(None, gt=0, description="overrides optimizer.lr for this stage")
    log_every: int = Field(1, ge=1)
    launcher: Literal["inprocess", "process"] | None = Field(
        None, description="this stage in this process (one rank) or in processes of its own: for one rank a "
                          "Python process of its own, for several the engine's launcher, which starts each rank "
                          "in its own (default: engine.launcher). A stage the pipeline runs beside others (the "
                          "judge beside the policy) keeps a core to itself in its own process, where in this one "
                          "their Python between ops contends for one interpreter lock")
    prefix_shared: bool = Field(True, description="encode the prompt prefix rows share once per forward (an RL "
                                "group's prompt, SFT prompts that open with the same instructions): same log-probs and "
                                "gradients as re-encoding, fewer tokens (re-encodes where a model's cache can't)")


class SFTStageConfig(StageCommon):
    # MiniMax-01 trains short and long contexts in separate stages: the token range of a stage
    min_tokens: int = Field(0, ge=0)
    max_tokens: int = Field(8192, ge=8)
    normalization: Literal["token", "sample"] = "token"
    prompt_loss_weight: float = Field(
        0.0, ge=0, description="weight of the prompt tokens' next-token loss beside the response's (0: response "
                               "only); with prefix sharing the shared opening is not scored")


class DPOStageConfig(StageCommon):
    min_tokens: int = Field(0, ge=0)
    max_tokens: int = Field(8192, ge=8)
    beta: float = Field(0.1, gt=0)


class LengthWindow(_Strict):
    """One output-length window of M1's staged extension with its own eps_high and clip."""
    max_tokens: int = Field(ge=1)
    eps_high: float = Field(0.2, gt=0)
    gradient_clipping: float = Field(1.0, ge=0)


class LengthGates(_Strict):
    """When to move to the next window (both gates must pass, M1 section 4)."""
    # perplexity of generated sequences converged: relative spread over the last
    # `ppl_patience` steps below `ppl_tolerance`
    ppl_patience: int = Field(3, ge=2)
    ppl_tolerance: float = Field(0.05, gt=0)
    # the 99th percentile of output lengths has reached this fraction of the window
    p99_fraction: float = Field(0.9, gt=0, le=1)
    min_steps_per_window: int = Field(1, ge=1)


class CurriculumPhase(_Strict):
    """From `start_step` on, draw prompts from these domains with these weights, and synthetic
    prompts from window `level_window` (of the stage's `level_windows`) of each task's levels:
    later phases can raise the window to harder levels (M1)."""
    start_step: int = Field(0, ge=0)
    domains: dict[str, float]
    level_window: int = Field(0, ge=0, description="which of rl.level_windows windows of each synthetic "
                                                   "task's levels in the pool this phase draws from")

    @model_validator(mode="after")
    def _weights(self) -> CurriculumPhase:
        if not self.domains or any(w < 0 for w in self.domains.values()) or sum(self.domains.values()) <= 0:
            raise ValueError(f"curriculum phase at step {self.start_step}: domain weights must be >= 0 "
                             f"and sum above 0, got {self.domains}")
        return self


class GenRMRewardConfig(_Strict):
    """The generative reward for prompts rules cannot check (M1: general / instruction)."""
    enabled: bool = True
    domains: list[str] = Field(default_factory=lambda: list(OPEN_DOMAINS),
                               description="prompt domains rewarded by the GenRM instead of a verifier")
    # M1: pairwise against the reference, both orders, k blind samples (tasks.genrm defaults)
    judge: JudgeConfig = Field(default_factory=JudgeConfig, description="judge model, sampling and consistency")
    # pairwise verdict of the response against the reference -> reward in [0, 1]
    verdict_rewards: dict[int, float] = Field(default_factory=lambda: {-1: 0.0, 0: 0.5, 1: 1.0})
    reference_fields: list[str] = Field(
        default_factory=lambda: ["solution", "answer"],
        description="row fields used as the reference when the references table has none for the prompt")
    # M1's STEM case: a prompt with a ground-truth answer no rule can check is graded against it
    grade_domains: list[str] = Field(
        default_factory=lambda: ["science"],
        description="prompt domains whose responses the GenRM grades against the row's ground truth on the "
                    "five-grade scale (judge.grade_rewards) instead of a verifier")
    grade_fields: list[str] = Field(default_factory=lambda: ["answer"],
                                    description="row fields read as the ground truth of a graded prompt")

    @model_validator(mode="after")
    def _verdicts(self) -> GenRMRewardConfig:
        if sorted(self.verdict_rewards) != [-1, 0, 1]:
            raise ValueError(f"rl.genrm.verdict_rewards must map -1, 0 and 1, got {sorted(self.verdict_rewards)}")
        if any(not 0.0 <= r <= 1.0 for r in self.verdict_rewards.values()):
            raise ValueError(f"rl.genrm.verdict_rewards values must lie in [0, 1], got {self.verdict_rewards}")
        both = sorted(set(self.domains) & set(self.grade_domains))
        if both:
            raise ValueError(f"rl.genrm: domain(s) {both} are in both domains (pairwise against a reference) and "
                             "grade_domains (graded against the ground truth); put each in one")
        return self


class RolloutEngineConfig(_Strict):
    """Who samples the RL stage's rollouts. ``inprocess``: the training module itself (always
    the current weights). ``serve-model``: a separate ``posttrain serve-model`` process fed the
    trainer's weights (streamed from rank memory, or through a Hugging Face directory), which
    can sample the next batches while the ranks train (``max_staleness``)."""
    kind: Literal["inprocess", "serve-model"] = "inprocess"
    max_staleness: int = Field(
        0, ge=0, description="policy versions (optimizer steps) a sample may lag the weights it is trained with. "
                             "0: synchronous (the engine gets the weights before every step's sampling); "
                             "k >= updates_per_batch x epochs_per_batch: the engine samples "
                             "k // (updates_per_batch x epochs_per_batch) batches ahead while the ranks train")
    partial_rollout_tokens: int | None = Field(
        None, ge=1, description="partial rollouts (needs sampling ahead): a batch sampled ahead is sampled up to "
                                "this many tokens with the weights it began under; its generations still running "
                                "there continue under the next update's weights (each token's version is kept). "
                                "None: every batch is sampled by one version")
    weight_sync: Literal["shm", "stream", "disk"] = Field(
        "shm", description="how weights reach the engine, as one safetensors blob of the state dict: 'shm' in "
                           "shared memory (/dev/shm; 'stream' where it is missing or too small), 'stream' in the "
                           "request body; 'disk': a Hugging Face directory under the stage")
    device: str = Field("cpu", description="where the engine samples (cuda on a GPU machine)")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    threads: int | None = Field(1, ge=1, description="torch threads of the engine process")
    batch_size: int = Field(64, ge=1, description="sequences the engine samples together")
    concurrency: int = Field(4, ge=1, description="requests in flight to the engine")
    prompts_per_request: int = Field(8, ge=1)
    startup_timeout_s: float = Field(180.0, gt=0)
    restarts: int = Field(1, ge=0, description="times a dead engine is restarted (with the current weights) in a stage")


# how a policy loss reduces its per-token terms (model.losses.normalized); None: the loss's own
# (cispo: group_token, M1 Eq. 4; grpo: sample; dapo: batch_token)
POLICY_NORMALIZATION = Field(
    None, description="group_token: each group's summed terms over its token count, groups averaged (M1); "
                      "sample: each response's token mean, responses averaged (GRPO); batch_token: every "
                      "token of the batch alike (DAPO); none: the loss's own")


class FormatRewardConfig(_Strict):
    """M1's format reward: a rule-verified answer earns its reward only when it is also given in
    the format its domain's instruction asks for (``tasks.verify.registry.in_format``: math in
    \\boxed{}, logic in <answer> tags, code in one ```python block); a right answer out of format
    earns ``out_of_format_scale`` of it. The verifier's correctness (what the length-bias monitor
    holds fixed) is unchanged."""
    enabled: bool = False
    domains: list[str] = Field(default_factory=lambda: ["math", "logic", "code"])
    out_of_format_scale: float = Field(0.0, ge=0, le=1, description="share of the reward a right answer out of "
                                                                     "format keeps (M1: 0, right and in format)")


class WindowRefreshConfig(_Strict):
    """M1's per-window data refresh (``tasks.train.curriculum.WindowRefresh``): at each length
    window the stage advances to, drop the prompts the last window solved at every sample."""
    enabled: bool = False
    min_samples: int = Field(4, ge=1, description="samples a prompt needs in the window to count as solved")
    level_window_step: int = Field(0, ge=0, description="level windows every curriculum phase moves up at each "
                                                        "advance (harder synthetic levels; the last window caps it)")


class AdaptiveLevelsConfig(_Strict):
    """Calibration against the improving policy (``tasks.train.curriculum.AdaptiveLevels``): every
    ``every_steps`` RL steps each synthetic task's pass rate on its own RL samples moves its
    level window (of ``rl.level_windows``) up or down one."""
    enabled: bool = False
    every_steps: int = Field(20, ge=1)
    min_samples: int = Field(16, ge=1, description="samples of a task since the last measure needed to move it")
    raise_above: float = Field(0.7, gt=0, le=1, description="a pass rate above this moves the task up a window")
    lower_below: float = Field(0.05, ge=0, lt=1, description="a pass rate below this moves it down a window")


class RLStageConfig(StageCommon):
    loss: Literal["cispo", "grpo", "dapo"] = "cispo"
    cispo_variant: Literal["clip", "mask"] = "clip"
    normalization: Literal["group_token", "sample", "batch_token"] | None = POLICY_NORMALIZATION
    prompts_per_step: int = Field(32, ge=1)
    group_size: int = Field(16, ge=2)
    # M1: several off-policy updates per generation batch; each minibatch is one optimizer step
    updates_per_batch: int = Field(16, ge=1)
    epochs_per_batch: int = Field(
        1, ge=1, description="passes over each sampled batch (PPO epochs; GRPO's mu, TRL's num_iterations): "
                             "every pass runs the updates_per_batch minibatches again against the behaviour log-probs "
                             "of sampling time, so later passes are off-policy on the very tokens they train")
    rollout_engine: RolloutEngineConfig = Field(default_factory=RolloutEngineConfig)
    eps_low: float = Field(1.0, gt=0, description="M1 imposes no lower bound in practice")
    dynamic_sampling: bool = True
    max_sampling_rounds: int = Field(3, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    repetition_window: int | None = Field(3000, ge=1)
    repetition_prob: float = Field(0.99, gt=0, lt=1)
    windows: list[LengthWindow] = Field(default_factory=lambda: [
        LengthWindow(max_tokens=n * 1024, eps_high=e, gradient_clipping=c)
        for n, e, c in ((40, 0.2, 1.0), (48, 0.18, 0.8), (56, 0.16, 0.6), (64, 0.14, 0.5),
                        (72, 0.12, 0.4), (80, 0.1, 0.3))])
    gates: LengthGates = Field(default_factory=LengthGates)
    curriculum: list[CurriculumPhase] = Field(default_factory=lambda: [
        CurriculumPhase(start_step=0, domains={"math": 1.0, "logic": 1.0, "code": 1.0}),
        CurriculumPhase(start_step=1000, domains={"math": 1.0, "logic": 1.0, "code": 1.0, "general": 1.0})])
    # each synthetic task's levels in the pool, easiest first, cut into this many sliding windows
    # (tasks.synth.calibration.curriculum_levels); 1: every phase draws every level
    level_windows: int = Field(1, ge=1)
    tis_cap: float | None = Field(
        None, gt=0, description="truncated importance sampling: weight each token's advantage by "
                                "min(pi_train / pi_sampler, tis_cap) where the sampler's log-probs differ from the "
                                "trainer's own (a bf16 engine, another kernel); None: off")
    max_logprob_gap: float | None = Field(
        None, gt=0, description="flag a step whose mean |trainer - sampler| token log-prob gap exceeds this "
                                "(metric logprob_gap_exceeded and a warning); None: not checked")
    max_prompts: int | None = Field(None, ge=1, description="cap on the RL pool size")
    verify_workers: int = Field(
        2, ge=1, description="threads verifying a sampling round's responses on rank 0 (math answers decided in "
                             "worker processes, one per thread; code in one sandbox per thread)")
    genrm: GenRMRewardConfig = Field(default_factory=GenRMRewardConfig)
    format_reward: FormatRewardConfig = Field(default_factory=FormatRewardConfig)
    window_refresh: WindowRefreshConfig = Field(default_factory=WindowRefreshConfig)
    adaptive_levels: AdaptiveLevelsConfig = Field(default_factory=AdaptiveLevelsConfig)
    # does the reward follow response length at fixed correctness? (events -> recalibration)
    length_bias: LengthBiasConfig = Field(default_factory=LengthBiasConfig)

    @model_validator(mode="after")
    def _windows_grow(self) -> RLStageConfig:
        sizes = [w.max_tokens for w in self.windows]
        if not sizes or sizes != sorted(set(sizes)):
            raise ValueError(f"rl.windows must be non-empty and strictly increasing, got {sizes}")
        starts = [p.start_step for p in self.curriculum]
        if not starts or starts[0] != 0 or starts != sorted(set(starts)):
            raise ValueError(f"rl.curriculum must start at step 0 with increasing start steps, got {starts}")
        windows = [p.level_window for p in self.curriculum]
        if max(windows) >= self.level_windows:
            raise ValueError(f"rl.curriculum level_window must be below rl.level_windows ({self.level_windows}), "
                             f"got {windows}")
        engine = self.rollout_engine
        if engine.partial_rollout_tokens is not None and self.batches_ahead == 0:
            raise ValueError(f"rl.rollout_engine.partial_rollout_tokens needs batches sampled ahead: a serve-model "
                             f"engine and max_staleness >= updates_per_batch x epochs_per_batch "
                             f"({self.updates_per_batch * self.epochs_per_batch}), got kind {engine.kind!r}, "
                             f"max_staleness {engine.max_staleness}")
        return self

    @property
    def batches_ahead(self) -> int:
        """Batches the rollout engine samples ahead of the step training (0: synchronous): a batch
        sampled d steps ahead is trained at most d x updates_per_batch x epochs_per_batch versions later."""
        if self.rollout_engine.kind != "serve-model":
            return 0
        return self.rollout_engine.max_staleness // (self.updates_per_batch * self.epochs_per_batch)


class AgentEnvironment(_Strict):
    """One environment the agent stage trains on: its registry name, its settings, and how many
    training seeds (0 .. train_seeds-1; held-out evaluation seeds lie in another range)."""
    name: str
    settings: dict = Field(default_factory=dict)
    train_seeds: int = Field(64, ge=1)

    @model_validator(mode="after")
    def _known(self) -> AgentEnvironment:
        from tasks.agents.envs import make_env

        make_env(self.name, **self.settings).close()   # an unknown name or setting fails at load time
        return self


class AgentStageConfig(StageCommon):
    """The agent stage (MiniMax-M2/M2.5): CISPO over multi-turn tool-use trajectories."""
    environments: list[AgentEnvironment] = Field(
        default_factory=list, description="the environments trained on; none: the stage is not trained")
    loss: Literal["cispo", "grpo", "dapo"] = "cispo"
    normalization: Literal["group_token", "sample", "batch_token"] | None = POLICY_NORMALIZATION
    eps_low: float = Field(1.0, gt=0)
    eps_high: float = Field(0.2, gt=0)
    group_size: int = Field(8, ge=2, description="trajectories per task (the group its advantage compares)")
    tasks_per_step: int = Field(4, ge=1, description="complete groups each optimizer step trains on")
    window: int = Field(32, ge=1, description="the windowed FIFO's live trajectories (one sampling batch)")
    max_live_rounds: int = Field(
        4, ge=1, description="turns a trajectory may take in a row while others wait before it is paused "
                             "(kept, resumed later)")
    max_staleness: int = Field(
        2, ge=0, description="a trajectory whose first turn is this many versions behind is never paused again")
    max_turn_tokens: int = Field(256, ge=1, description="sampled tokens per policy turn")
    max_tokens: int = Field(2048, ge=8, description="a trajectory's whole length, prompt and observations included")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    keep_thinking: bool = Field(
        True, description="interleaved thinking: earlier turns' <think> stays in the history (M2); off: cut from "
                          "the context, each turn then trains as its own sequence (merged in the prefix trie)")
    process_reward: float = Field(0.0, ge=0, description="weight of the environments' per-step process rewards")
    time_cost: float = Field(0.0, ge=0, description="reward taken off per turn (the task-completion-time reward)")
    reward_to_go: bool = Field(False, description="each turn's tokens carry the return from that turn on")
    dynamic_sampling: bool = Field(True, description="groups whose rewards all agree train nothing")
    expert_steps: int = Field(0, ge=0, description="agent SFT steps on the environments' expert solutions first")
    expert_batch: int = Field(8, ge=1)
    expert_lr: float | None = Field(
        None, gt=0, description="the learning rate of the expert steps (constant after the warm-up); none: the "
                                "stage's schedule runs over every step. Set: RL's schedule starts after them")
    max_tokens_per_row: int | None = Field(4096, ge=8, description="trie tokens packed per forward row")
    replay_batch: int = Field(
        0, ge=0, description="single-turn sequences rehearsed at every step that trains: the RL stage's own verified "
                             "samples of this run (rl_rollouts with reward 1), their NLL added to the step's loss, so "
                             "agent training does not wipe out what RL taught (M2.5 trains reasoning beside agent "
                             "tasks); 0: none")
    replay_weight: float = Field(1.0, ge=0, description="the replayed sequences' loss weight")

    @model_validator(mode="after")
    def _steps(self) -> AgentStageConfig:
        if self.environments and self.expert_steps >= self.steps:
            raise ValueError(f"agent.expert_steps ({self.expert_steps}) leaves no RL step of {self.steps}")
        return self


class BaseModelConfig(_Strict):
    """Where the model trained in the first stage comes from."""
    # "hybrid": the in-house model sized by the profile's model.yaml, with a tokenizer trained
    # on warehouse text (cached under $POSTTRAIN_HOME/models/<name>); "pretrained": an alias
    # ("smol"), a local Hugging Face directory or a .gguf file (as a rollout model is named)
    kind: Literal["hybrid", "pretrained"] = "hybrid"
    name: str = "tiny-base"
    pretrained_path: str | None = None
    tokenizer_texts: int = Field(4000, ge=10, description="warehouse texts the tokenizer is trained on")

    @model_validator(mode="after")
    def _path(self) -> BaseModelConfig:
        if self.kind == "pretrained" and not self.pretrained_path:
            raise ValueError("base_model.kind 'pretrained' needs base_model.pretrained_path")
        return self


class GoldJudgeConfig(_Strict):
    """M2's rule-plus-LLM-judge cleaning of gold worked solutions: after the rules (``gold_clean``)
    pass one, a judge model grades its reasoning on the five-grade scale (``tasks.genrm.prompts.
    REASONING_TEMPLATE``); below ``min_grade`` it does not train."""
    enabled: bool = False
    judge: JudgeConfig = Field(default_factory=JudgeConfig, description="the judge model, sampling and blind samples")
    domains: list[str] = Field(default_factory=lambda: ["math", "logic", "code"],
                               description="the domains whose gold worked solutions the judge checks")
    min_grade: int = Field(4, ge=1, le=5, description="the lowest grade (mean over blind samples) that trains")
    on_unread: Literal["keep", "drop"] = Field(
        "keep", description="a solution whose grade the judge did not give readably: keep it (the rules passed it) "
                            "or drop it; counted either way (gold_judge_unread)")


class DataConfig(_Strict):
    max_sft_examples: int = Field(100_000, ge=1, description="per SFT stage (short, long)")
    max_dpo_pairs: int = Field(50_000, ge=1, description="per DPO stage (short, long)")
    synthetic_per_task: int | None = Field(None, ge=1, description="cap per synthetic task in SFT and RL")
    teacher_samples_per_prompt: int = Field(
        1, ge=1, description="verified teacher samples (teacher_samples, kept) per SFT prompt taken as SFT targets")
    gold_fallback: bool = Field(
        True, description="an SFT prompt with no kept teacher sample trains on its stored gold answer (counted as "
                          "response_source gold); off: it is dropped (no_teacher_sample)")
    gold_clean: CleanConfig | None = Field(
        default_factory=CleanConfig,
        description="the cleaning a gold worked solution passes before SFT falls back to it, as a teacher sample "
                    "does (tasks.cleaning): verified, not repetitive, its answer in the domain's format, reasoning "
                    "before it; a rejected one is counted as gold_<reason> (a bare gold answer is not checked). "
                    "None: gold trains unchecked")
    gold_judge: GoldJudgeConfig = Field(default_factory=GoldJudgeConfig,
                                        description="the LLM-judge check of a gold solution's reasoning (off: rules only)")
    gold_fallback_domains: list[str] | None = Field(
        None, description="the domains whose prompts fall back to gold (None: every domain): e.g. keep math, whose "
                          "stored solutions reason, and drop logic, whose gold is a bare answer")
    dpo_perturbed_negatives: bool = Field(True, description="wrong answers from task perturbations when no wrong rollout exists")
    verify_chosen: bool = Field(True, description="check chosen responses with the verifiers")
    rl_requires_difficulty: bool = Field(
        True, description="RL trains only on prompts a difficulty run kept; off: undecided prompts train too")
    judge_examples_per_task: int = Field(
        0, ge=0, description="GenRM judge examples per SFT-side synthetic task in judge_data, which the judge stage "
                             "trains on (grade: gold or a rejected perturbation vs the ground truth; pairwise: gold vs "
                             "perturbation); 0 = none, and no judge stage. Drawn from every SFT-side instance, not "
                             "capped by synthetic_per_task")
    judge_in_sft: bool = Field(
        False, description="also add the judge examples to sft_data: the policy is then its own judge (`model: policy`)")
    judge_tasks: list[str] | None = Field(
        None, description="the synthetic tasks whose SFT-side instances give judge examples (None: every one)")
    judge_pairwise_share: float = Field(
        0.2, ge=0.0, le=1.0, description="share of the judge examples that are pairwise (the rest are grade)")
    judge_open_pairs: int = Field(
        0, ge=0, description="pairwise judge examples on the SFT pool's open prompts (general / instruction): the "
                             "prompt's own reference answer against the reference answer of another open prompt, in "
                             "either order, with a bare verdict (an open answer is too long to restate before it). "
                             "They teach the verdict format on requests no verifier checks, where the reference "
                             "tournaments and the RL GenRM ask for it")
    judge_max_chars: int = Field(
        JudgeConfig.model_fields["max_response_chars"].default, ge=100, description="text cut in the judge examples' prompts; match the judge's max_response_chars")


class _TrainSettings(_Strict):
    """What all stages share; ``TrainConfig`` adds one block per registered stage."""
    seed: int = 0
    stages: list[StageName] = Field(default_factory=lambda: list(STAGE_ORDER))
    base_model: BaseModelConfig = Field(default_factory=BaseModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    log_weights_max_mb: float = Field(64.0, ge=0, description="final weights up to this size are MLflow artifacts")

    @model_validator(mode="after")
    def _stage_launchers(self) -> _TrainSettings:
        for name in STAGE_NAMES:
            block = getattr(self, name, None)
            if block is not None and block.launcher == "inprocess" and self.engine.num_ranks > 1:
                raise ValueError(f"{name}.launcher 'inprocess' runs one rank; engine.num_ranks is "
                                 f"{self.engine.num_ranks} (drop it to use engine.launcher)")
        return self

    def engine_for(self, name: str) -> EngineConfig:
        """The engine settings stage ``name`` runs with: ``engine``, with the stage's own launcher
        for one rank (several ranks run in processes of their own under the engine's launcher)."""
        launcher = self.stage(name).launcher
        if launcher is None or self.engine.num_ranks > 1:
            return self.engine
        return self.engine.model_copy(update={"launcher": launcher})

    def stage(self, name: str) -> StageCommon:
        train_stage(name)   # a clear error for an unknown name
        return getattr(self, name)

    def stage_lr(self, name: str) -> float:
        return self.stage(name).lr or self.optimizer.lr

    def token_ranges(self, table: str) -> dict[str, tuple[int, int]]:
        """Each stage training on ``table`` -> its (min_tokens, max_tokens): how a builder splits rows."""
        return {name: (self.stage(name).min_tokens, self.stage(name).max_tokens) for name in stages_reading(table)}


STAGE_CONFIG: dict[str, type[StageCommon]] = {"sft": SFTStageConfig, "dpo": DPOStageConfig, "rl": RLStageConfig,
                                               "agent": AgentStageConfig}


def _stage_block(stage: TrainStage):
    cls = STAGE_CONFIG[stage.recipe]
    return cls, Field(default_factory=lambda: cls(**stage.defaults), description=stage.description)


# one block per stage of the registry (data_specs.stages), named like the stage
TrainConfig = create_model("TrainConfig", __base__=_TrainSettings, __module__=__name__,
                           **{s.name: _stage_block(s) for s in TRAIN_STAGES})
