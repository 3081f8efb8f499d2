"""The training stages, declared once: what each trains on, what it starts from, what it writes.

Every other place that needs a stage reads this registry: the ``stage`` columns of the
training tables (``data_specs.training``), the profile's ``train`` section (one block per
stage, ``tasks.train.config``), the data builders (which table, which token range), the
runner (which recipe), the ``train`` flow and its per-stage entry points, the pipeline
(cache inputs and ordering) and the CLI help. Adding a stage is one ``TrainStage`` here.

A training table's ``sources`` are the tables its builder reads; the pipeline keys its
cache on them and a test holds the builders to them (the warehouse records every read).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Recipe = Literal["sft", "dpo", "rl", "agent"]
# policy: a link of the chain of models that ends in the trained policy (each follows the one
# before); judge: a GenRM judge, trained beside that chain, that references and RL grade with
Role = Literal["policy", "judge"]


@dataclass(frozen=True)
class TrainingTable:
    name: str
    sources: tuple[str, ...]      # every table its builder reads
    description: str


@dataclass(frozen=True)
class TrainStage:
    name: str
    recipe: Recipe                # the training loop: tasks.train.<recipe>
    table: str                    # the training table it reads (rows of this stage only)
    follows: str | None           # the stage whose model it starts from (None: the base model)
    writes: tuple[str, ...]       # tables it appends to besides its model directory
    description: str
    defaults: dict = field(default_factory=dict)   # the paper's values for this stage's profile block
    after: tuple[str, ...] = ()   # pipeline stages (not training) whose output it also builds on
    # pipeline stages it builds on only when its table holds prompts a GenRM judges (the judge's
    # model and the references it compares against): followed only then, so a run without such
    # prompts trains beside the judge instead of waiting for it
    genrm_after: tuple[str, ...] = ()
    optional: bool = False        # trained only when its table has rows (a profile may ask for none)
    role: Role = "policy"


TRAINING_TABLES: dict[str, TrainingTable] = {t.name: t for t in (
    TrainingTable("sft_data", ("sft_pool", "synthetic_tasks", "teacher_samples"),
                  "SFT examples from the SFT-side pool and synthetic instances: a teacher's verified reasoning "
                  "(rejection sampling), the gold answer as the counted fallback"),
    TrainingTable("dpo_pairs", ("sft_pool", "synthetic_tasks", "rollouts"),
                  "chosen/rejected pairs on SFT-side prompts: the policy's own verified-correct vs verified-wrong "
                  "samples, gold and verifier-rejected perturbations as counted fallbacks"),
    TrainingTable("rl_prompts", ("rl_pool", "synthetic_tasks", "difficulty"),
                  "RL-side prompts whose latest difficulty decision is keep"),
    TrainingTable("judge_data", ("synthetic_tasks", "sft_pool"),
                  "GenRM judge examples: verdicts on the gold or a verifier-rejected answer of SFT-side "
                  "synthetic instances, and on open SFT-pool prompts' reference answers against another's"),
    TrainingTable("agent_tasks", (),
                  "environment episodes (environment, settings, training seed) the agent stage plays: built from "
                  "the profile's agent.environments, no warehouse table"),
)}

_SHORT, _LONG = {"max_tokens": 8192}, {"min_tokens": 8193, "max_tokens": 131072}

TRAIN_STAGES: tuple[TrainStage, ...] = (
    # the GenRM judge (M1: a generative reward model for what rules cannot check), trained from
    # the base model on verdicts its data can vouch for; profiles name it as a judge with
    # `model: judge`. Its own lineage: no policy stage follows it.
    TrainStage("judge", "sft", "judge_data", None, ("models",),
               "the GenRM judge: SFT from the base model on gold-vs-rejected verdicts", optional=True,
               role="judge"),
    TrainStage("sft_short", "sft", "sft_data", None, ("models",),
               "SFT on examples up to the short length", _SHORT, after=("teacher",)),
    TrainStage("sft_long", "sft", "sft_data", "sft_short", ("models",),
               "SFT on the long examples", _LONG),
    TrainStage("dpo_short", "dpo", "dpo_pairs", "sft_long", ("models",), "DPO on short pairs", _SHORT,
               after=("on_policy",)),
    TrainStage("dpo_long", "dpo", "dpo_pairs", "dpo_short", ("models",), "DPO on long pairs", _LONG),
    TrainStage("rl", "rl", "rl_prompts", "dpo_long", ("models", "rl_rollouts", "judgments"),
               "CISPO RL with staged output-length windows", after=("difficulty",),
               genrm_after=("judge", "references")),
    # agent-native RL (MiniMax-M2 -> M2.5): multi-turn tool use in environments, after RL; trained only
    # where the profile names environments
    TrainStage("agent", "agent", "agent_tasks", "rl", ("models", "trajectories"),
               "CISPO over multi-turn tool-use trajectories in environments (windowed FIFO, prefix trie)",
               optional=True),
)

STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in TRAIN_STAGES)


def train_stage(name: str) -> TrainStage:
    for stage in TRAIN_STAGES:   # read at call time: a test may extend the registry
        if stage.name == name:
            return stage
    raise ValueError(f"unknown training stage {name!r}; expected one of {[s.name for s in TRAIN_STAGES]}")


def final_policy_stage() -> str:
    """The policy's last training stage: the end of the chain of stages that follow each other
    from the first policy stage (RL today; a stage appended after it would be the new end)."""
    followed = {s.follows for s in TRAIN_STAGES if s.follows}
    ends = [s.name for s in TRAIN_STAGES if s.follows and s.name not in followed]
    if len(ends) != 1:
        raise ValueError(f"the policy's stages do not form one chain: it ends at {ends}")
    return ends[0]


def policy_chain() -> tuple[str, ...]:
    """The policy's stages in training order, each starting from the one before
    (``("sft_short", "sft_long", "dpo_short", "dpo_long", "rl")``); judges are not in it."""
    final = final_policy_stage()
    return (*reversed(earlier_stages(final)), final)


def stages_of(recipe: Recipe) -> tuple[str, ...]:
    """The policy's stages a recipe trains, in chain order (``stages_of("sft") == ("sft_short",
    "sft_long")``: the judge, an SFT of its own lineage, is not a policy stage)."""
    return tuple(n for n in policy_chain() if train_stage(n).recipe == recipe)


def phase_ends() -> tuple[str, ...]:
    """The last stage of each run of same-recipe stages along the policy chain: the evaluation
    ladder's rungs (``("sft_long", "dpo_long", "rl")``; a DPO stage appended after RL adds a
    fourth rung instead of replacing the second)."""
    chain = policy_chain()
    return tuple(n for i, n in enumerate(chain)
                 if i + 1 == len(chain) or train_stage(chain[i + 1]).recipe != train_stage(n).recipe)


def first_of(recipe: Recipe) -> str:
    """The first policy stage a recipe trains (``first_of("dpo") == "dpo_short"``)."""
    stages = stages_of(recipe)
    if not stages:
        raise ValueError(f"no training stage has recipe {recipe!r}")
    return stages[0]


def last_of(recipe: Recipe) -> str:
    """The end of the recipe's first phase along the policy chain (``last_of("sft") ==
    "sft_long"``): what the next recipe starts from. A stage of the same recipe after another
    recipe (an SFT stage appended after RL) starts a new phase and does not move it."""
    chain = policy_chain()
    start = chain.index(first_of(recipe))
    return next(n for n in phase_ends() if chain.index(n) >= start)


def judge_stages() -> tuple[str, ...]:
    """The stages that train a GenRM judge (``role="judge"``)."""
    return tuple(s.name for s in TRAIN_STAGES if s.role == "judge")


def stages_reading(table: str) -> tuple[str, ...]:
    return tuple(s.name for s in TRAIN_STAGES if s.table == table)


def earlier_stages(name: str) -> tuple[str, ...]:
    """The chain of stages ``name`` builds on, nearest first (through ``follows``)."""
    out, prev = [], train_stage(name).follows
    while prev is not None:
        out.append(prev)
        prev = train_stage(prev).follows
    return tuple(out)


def _check() -> None:
    for s in TRAIN_STAGES:
        if s.table not in TRAINING_TABLES:
            raise ValueError(f"stage {s.name}: table {s.table!r} is not a training table")
        if s.follows is not None and STAGE_NAMES.index(s.follows) >= STAGE_NAMES.index(s.name):
            raise ValueError(f"stage {s.name} follows {s.follows}, which is not declared before it")


_check()
