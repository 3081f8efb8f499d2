"""Tables of the train stage: what each stage consumed, and the models it produced.

RL rollouts go to the shared ``rollouts`` table (data_specs/rollouts.py) with
``source_table = 'rl_prompts'``.
"""
from __future__ import annotations

import polars as pl

from data_specs.base import Column, TableSpec, register

SFT_STAGES = ("sft_short", "sft_long")
DPO_STAGES = ("dpo_short", "dpo_long")
TRAIN_STAGES = ("sft_short", "sft_long", "dpo_short", "dpo_long", "rl")


def _non_negative(c: pl.Expr) -> pl.Expr:
    return c >= 0


SFT_DATA = register(TableSpec(
    "sft_data", version=1, key=("example_id",),
    description="SFT examples (prompt, response) with their token length and the stage that trains on them.",
    columns=[
        Column("example_id", pl.Utf8, required=True),
        Column("stage", pl.Utf8, required=True, allowed=SFT_STAGES),
        Column("source_table", pl.Utf8, required=True),
        Column("source_id", pl.Utf8, required=True),
        Column("domain", pl.Utf8, required=True),
        Column("prompt", pl.Utf8, required=True),
        Column("response", pl.Utf8, required=True),
        Column("num_tokens", pl.Int64, required=True, check=_non_negative, check_reason="negative_token_count"),
        Column("response_tokens", pl.Int64, required=True, check=_non_negative, check_reason="negative_token_count"),
    ],
))

DPO_PAIRS = register(TableSpec(
    "dpo_pairs", version=1, key=("pair_id",),
    description="Preference pairs: a verified or GenRM-preferred response against a wrong one.",
    columns=[
        Column("pair_id", pl.Utf8, required=True),
        Column("stage", pl.Utf8, required=True, allowed=DPO_STAGES),
        Column("prompt_id", pl.Utf8, required=True),
        Column("source_table", pl.Utf8, required=True),
        Column("domain", pl.Utf8, required=True),
        Column("prompt", pl.Utf8, required=True),
        Column("chosen", pl.Utf8, required=True),
        Column("rejected", pl.Utf8, required=True),
        Column("chosen_source", pl.Utf8, required=True, allowed=("rollout_correct", "reference", "gold")),
        Column("rejected_source", pl.Utf8, required=True, allowed=("rollout_wrong", "perturbed")),
        Column("num_tokens", pl.Int64, required=True, check=_non_negative, check_reason="negative_token_count",
               description="prompt plus the longer of the two responses"),
    ],
))

RL_PROMPTS = register(TableSpec(
    "rl_prompts", version=1, key=("prompt_id",),
    description="The RL pool: prompts with what their verifier needs (the source row as JSON).",
    columns=[
        Column("prompt_id", pl.Utf8, required=True),
        Column("source_table", pl.Utf8, required=True),
        Column("domain", pl.Utf8, required=True),
        Column("prompt", pl.Utf8, required=True),
        Column("answer", pl.Utf8),
        Column("level", pl.Int64),
        Column("row_json", pl.Utf8, required=True, description="the source row, for verify(domain, row, response)"),
        Column("selected_by", pl.Utf8, required=True, allowed=("difficulty_keep", "rl_pool", "synthetic_tasks", "prompts")),
    ],
))

MODELS = register(TableSpec(
    "models", version=1, key=("model_id",),
    description="Trained checkpoints (Hugging Face format) with lineage to the snapshots they saw.",
    columns=[
        Column("model_id", pl.Utf8, required=True, description="<run>/<stage>"),
        Column("run_name", pl.Utf8, required=True),
        Column("stage", pl.Utf8, required=True, allowed=TRAIN_STAGES),
        Column("path", pl.Utf8, required=True, description="Hugging Face model directory"),
        Column("init_model", pl.Utf8, required=True, description="directory the stage started from"),
        Column("profile", pl.Utf8, required=True),
        Column("steps", pl.Int64, required=True, check=_non_negative, check_reason="negative_steps"),
        Column("final_loss", pl.Float64),
        Column("data_snapshots", pl.Utf8, required=True, description="JSON list of name@snapshot inputs"),
        Column("config_hash", pl.Utf8, required=True),
        Column("mlflow_run_id", pl.Utf8),
        Column("num_parameters", pl.Int64),
    ],
))
