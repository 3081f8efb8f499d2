"""Sampled completions and per-prompt pass rates: ``rollouts`` (offline sampling: the difficulty
stage, the policy's own samples for DPO), ``teacher_samples`` (reasoning for SFT), ``rl_rollouts``
(the RL stage's own samples) and ``difficulty``."""
from __future__ import annotations

import polars as pl

from data_specs.base import Column, TableSpec, register

FINISH_REASONS = ("stop", "length", "repetition")
DIFFICULTY_DECISIONS = ("keep", "too_easy", "unsolved", "unscored")

ROLLOUTS = register(TableSpec(
    "rollouts", version=1, key=("rollout_id",),
    description="One row per sampled completion: text, token ids, log-prob summary, reward.",
    columns=[
        Column("rollout_id", pl.Utf8, required=True, description="prompt_id:sample index:run"),
        Column("prompt_id", pl.Utf8, required=True),
        Column("source_table", pl.Utf8, required=True),
        Column("domain", pl.Utf8, required=True),
        Column("sample_index", pl.Int64, required=True, check=lambda c: c >= 0,
               check_reason="negative_sample_index"),
        Column("text", pl.Utf8),
        Column("token_ids", pl.List(pl.Int64)),
        Column("num_tokens", pl.Int64, required=True, check=lambda c: c >= 0,
               check_reason="negative_token_count"),
        Column("logprob_sum", pl.Float64, description="sum of sampled-token log-probs; null if unknown"),
        Column("logprob_mean", pl.Float64),
        Column("finish_reason", pl.Utf8, required=True, allowed=FINISH_REASONS),
        Column("truncated", pl.Boolean, required=True, description="M1 repetition early truncation"),
        Column("reward", pl.Float64, required=True, check=lambda c: (c >= 0) & (c <= 1),
               check_reason="reward_outside_0_1"),
        Column("verify_error", pl.Utf8, description="why the row could not be scored, if so"),
        Column("backend", pl.Utf8, required=True),
        Column("model", pl.Utf8, required=True),
        Column("temperature", pl.Float64),
        Column("top_p", pl.Float64),
        Column("seed", pl.Int64),
        Column("run_id", pl.Utf8),
    ],
))

RL_ROLLOUTS = register(TableSpec(
    "rl_rollouts", version=1, key=("rollout_id",),
    description="One row per completion the RL stage sampled and trained on, with the policy version "
                "(optimizer steps taken) that produced it.",
    columns=[*ROLLOUTS.columns,
             Column("train_run", pl.Utf8, required=True, description="the training run (models.run_name)"),
             Column("step", pl.Int64, required=True, check=lambda c: c >= 0, check_reason="negative_step"),
             Column("policy_version", pl.Int64, required=True, check=lambda c: c >= 0,
                    check_reason="negative_policy_version",
                    description="optimizer steps behind the weights that sampled this row"),
             Column("staleness", pl.Int64, required=True, check=lambda c: c >= 0, check_reason="negative_staleness",
                    description="optimizer steps the trainer's weights were ahead of policy_version when it trained "
                                "on this row (> 0: sampled ahead, asynchronously, or by a lagging engine)"),
             Column("policy_version_last", pl.Int64, check=lambda c: c >= 0,
                    check_reason="negative_policy_version",
                    description="the version that sampled the last token: above policy_version for a partial "
                                "rollout, whose generation went on across a weight update"),
             Column("version_boundary", pl.Int64, check=lambda c: c >= 1, check_reason="version_boundary_below_1",
                    description="a partial rollout's first token sampled by policy_version_last; null when one "
                                "version sampled every token")],
))

TEACHER_SAMPLES = register(TableSpec(
    "teacher_samples", version=1, key=("rollout_id",),
    description="A teacher's sampled responses to SFT-side prompts (rejection sampling), verified and cleaned: "
                "the kept ones are SFT targets.",
    columns=[*ROLLOUTS.columns,
             Column("kept", pl.Boolean, required=True, description="verified and clean: an SFT target"),
             Column("drop_reason", pl.Utf8, description="why not kept (wrong, truncated, no_reasoning, ...)")],
))

DIFFICULTY = register(TableSpec(
    "difficulty", version=1, key=("prompt_id", "run_id"),
    description="Per prompt: samples, correct count, unbiased pass@k and the band decision.",
    columns=[
        Column("prompt_id", pl.Utf8, required=True),
        Column("source_table", pl.Utf8, required=True),
        Column("domain", pl.Utf8, required=True),
        Column("n", pl.Int64, required=True, check=lambda c: c >= 0, check_reason="negative_n"),
        Column("correct", pl.Int64, required=True, check=lambda c: c >= 0, check_reason="negative_correct"),
        Column("k", pl.Int64),
        Column("pass_at_k", pl.Float64, check=lambda c: (c >= 0) & (c <= 1), check_reason="pass_at_k_outside_0_1"),
        Column("pass_at_1", pl.Float64, check=lambda c: (c >= 0) & (c <= 1), check_reason="pass_at_1_outside_0_1"),
        Column("band_low", pl.Float64),
        Column("band_high", pl.Float64),
        Column("truncated", pl.Int64, description="samples cut by the repetition rule"),
        Column("decision", pl.Utf8, required=True, allowed=DIFFICULTY_DECISIONS),
        Column("model", pl.Utf8, required=True),
        Column("run_id", pl.Utf8),
        Column("row_key", pl.Utf8, description="digest of what the decision depends on (tasks.difficulty.row_key)"),
        Column("reused_from", pl.Utf8, description="the run that sampled a decision this run reused (null: sampled here)"),
    ],
))
