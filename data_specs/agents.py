"""Agent trajectories (the recipe's M2 -> M2.5 half): ``agent_tasks``, the environment episodes
the agent stage trains on, and ``trajectories``, one row per multi-turn episode it sampled (or an
expert demonstration), kept token-exact: the ids as sampled, the loss mask, the sampler's log-probs
and the policy version of every turn."""
from __future__ import annotations

import polars as pl

from data_specs.base import Column, TableSpec, register

# why an episode ended
END_REASONS = ("answered", "max_turns", "max_tokens", "tool_error", "timeout")
TRAJECTORY_KINDS = ("policy", "expert")
# held-out evaluation episodes use seeds from here on; training seeds stay below it
HELDOUT_SEED_BASE = 1_000_000_000

AGENT_TASKS = register(TableSpec(
    "agent_tasks", version=1, key=("task_id",),
    description="The environment episodes the agent stage trains on: an environment, its settings and a seed "
                "(held-out evaluation seeds never appear here).",
    columns=[
        Column("task_id", pl.Utf8, required=True, description="<environment>:<settings digest>:<seed>"),
        Column("stage", pl.Utf8, required=True),
        Column("environment", pl.Utf8, required=True),
        Column("settings", pl.Utf8, required=True, description="the environment's settings, JSON"),
        Column("seed", pl.Int64, required=True, check=lambda c: c >= 0, check_reason="negative_seed"),
        Column("prompt", pl.Utf8, required=True, description="the episode's opening user message (for the audit)"),
    ],
))

TRAJECTORIES = register(TableSpec(
    "trajectories", version=1, key=("trajectory_id",),
    description="One row per multi-turn trajectory: its turns, the token ids exactly as sampled with the per-token "
                "loss mask (1 on the policy's own tokens, thinking included; 0 on the prompt, tool outputs, environment "
                "text and template tokens), the sampler's log-probs, each turn's policy version, every reward "
                "component and why it ended.",
    columns=[
        Column("trajectory_id", pl.Utf8, required=True),
        Column("train_run", pl.Utf8, required=True),
        Column("stage", pl.Utf8, required=True),
        Column("kind", pl.Utf8, required=True, allowed=TRAJECTORY_KINDS,
               description="policy: sampled by the policy; expert: a scripted demonstration (agent SFT)"),
        Column("step", pl.Int64, required=True, check=lambda c: c >= 0, check_reason="negative_step",
               description="the optimizer step that trained on it"),
        Column("group_id", pl.Utf8, required=True, description="trajectories of one task compared with each other"),
        Column("task_id", pl.Utf8, required=True),
        Column("environment", pl.Utf8, required=True),
        Column("seed", pl.Int64, required=True),
        Column("sample_index", pl.Int64, required=True, check=lambda c: c >= 0, check_reason="negative_sample_index"),
        Column("turns", pl.Utf8, required=True,
               description="JSON list of messages: role, content, thinking, tool_calls, tool results"),
        Column("token_ids", pl.List(pl.Int64), required=True),
        Column("loss_mask", pl.List(pl.Int8), required=True),
        Column("sampler_logprobs", pl.List(pl.Float64), required=True),
        Column("turn_spans", pl.Utf8, required=True,
               description="JSON [[start, end, thinking_end, policy_version], ...]: each policy turn's sampled ids"),
        Column("prompt_tokens", pl.Int64, required=True),
        Column("num_tokens", pl.Int64, required=True),
        Column("trained_tokens", pl.Int64, required=True, description="tokens with loss (mask 1)"),
        Column("num_turns", pl.Int64, required=True),
        Column("num_tool_calls", pl.Int64, required=True),
        Column("num_tool_errors", pl.Int64, required=True),
        Column("outcome", pl.Float64, required=True, check=lambda c: (c >= 0) & (c <= 1),
               check_reason="outcome_outside_0_1"),
        Column("success", pl.Boolean, required=True),
        Column("process_rewards", pl.List(pl.Float64), required=True, description="per step"),
        Column("time_cost", pl.Float64, required=True, description="the task-completion-time penalty"),
        Column("reward", pl.Float64, required=True, description="outcome + process + time components, as trained"),
        Column("reward_to_go", pl.List(pl.Float64), required=True, description="per turn"),
        Column("ended", pl.Utf8, required=True, allowed=END_REASONS),
        Column("keep_thinking", pl.Boolean, required=True),
        Column("pauses", pl.Int64, required=True, description="times the windowed FIFO paused it"),
        Column("policy_version", pl.Int64, required=True, description="the version of its first turn"),
        Column("policy_version_last", pl.Int64, required=True, description="the version of its last turn"),
        Column("staleness", pl.Int64, required=True, check=lambda c: c >= 0, check_reason="negative_staleness",
               description="versions the trainer was ahead of its first turn when it trained on it"),
        Column("model", pl.Utf8, required=True),
        Column("run_id", pl.Utf8),
    ],
))
