"""Tables of the train stage: what each stage consumed, and the models it produced.

The stages themselves (names, the table each reads) are declared in ``data_specs.stages``.
RL's own rollouts go to ``rl_rollouts`` (data_specs/rollouts.py).
"""
from __future__ import annotations

import polars as pl

from data_specs.base import Column, TableSpec, register
from data_specs.stages import STAGE_NAMES, stages_reading


def _non_negative(c: pl.Expr) -> pl.Expr:
    return c >= 0


RESPONSE_SOURCES = ("teacher", "gold", "judge")


def _sft_examples(name: str, description: str) -> TableSpec:
    return TableSpec(
        name, version=1, key=("example_id",), description=description,
        columns=[
            Column("example_id", pl.Utf8, required=True),
            Column("stage", pl.Utf8, required=True, allowed=stages_reading(name)),
            Column("source_table", pl.Utf8, required=True),
            Column("source_id", pl.Utf8, required=True),
            Column("domain", pl.Utf8, required=True),
            Column("prompt", pl.Utf8, required=True),
            Column("response", pl.Utf8, required=True),
            Column("num_tokens", pl.Int64, required=True, check=_non_negative, check_reason="negative_token_count"),
            Column("response_tokens", pl.Int64, required=True, check=_non_negative,
                   check_reason="negative_token_count"),
            Column("response_source", pl.Utf8, allowed=RESPONSE_SOURCES,
                   description="teacher: a verified teacher sample; gold: the stored answer (the counted "
                               "fallback); judge: a GenRM verdict example"),
            Column("sample_id", pl.Utf8, description="the teacher_samples row (rollout_id) of a teacher target"),
            Column("sample_model", pl.Utf8, description="the teacher model that sampled it"),
        ],
    )


SFT_DATA = register(_sft_examples(
    "sft_data", "SFT examples (prompt, response) with their token length and the stage that trains on them."))

JUDGE_DATA = register(_sft_examples(
    "judge_data", "GenRM judge examples (the judge's prompt, the verdict it should give) for the judge stage."))

DPO_PAIRS = register(TableSpec(
    "dpo_pairs", version=2, key=("pair_id",),
    description="Preference pairs: a verified response (correct rollout or gold) against a wrong one.",
    columns=[
        Column("pair_id", pl.Utf8, required=True),
        Column("stage", pl.Utf8, required=True, allowed=stages_reading("dpo_pairs")),
        Column("prompt_id", pl.Utf8, required=True),
        Column("source_table", pl.Utf8, required=True),
        Column("domain", pl.Utf8, required=True),
        Column("prompt", pl.Utf8, required=True),
        Column("chosen", pl.Utf8, required=True),
        Column("rejected", pl.Utf8, required=True),
        Column("chosen_source", pl.Utf8, required=True, allowed=("rollout_correct", "gold")),
        Column("rejected_source", pl.Utf8, required=True, allowed=("rollout_wrong", "perturbed")),
        Column("num_tokens", pl.Int64, required=True, check=_non_negative, check_reason="negative_token_count",
               description="prompt plus the longer of the two responses"),
    ],
))

RL_PROMPTS = register(TableSpec(
    "rl_prompts", version=2, key=("prompt_id",),
    description="The RL pool: prompts with what their verifier and the GenRM reference need.",
    columns=[
        Column("prompt_id", pl.Utf8, required=True),
        Column("source_table", pl.Utf8, required=True),
        Column("domain", pl.Utf8, required=True),
        Column("prompt", pl.Utf8, required=True),
        Column("answer", pl.Utf8),
        Column("solution", pl.Utf8, description="reference solution (GenRM reference when none was chosen)"),
        Column("tests", pl.Utf8, description="executable tests (code)"),
        Column("entry_point", pl.Utf8, description="function the code tests call"),
        Column("task", pl.Utf8, description="synthetic task whose verifier scores the row"),
        Column("level", pl.Int64),
        Column("seed", pl.Int64, description="synthetic instance seed"),
        Column("question", pl.Utf8, description="synthetic instance question (without the answer format)"),
        Column("metadata", pl.Utf8, description="JSON object, as in the source table"),
        Column("selected_by", pl.Utf8, required=True, allowed=("difficulty_keep", "rl_pool", "synthetic_tasks", "prompts")),
    ],
))

MODELS = register(TableSpec(
    "models", version=2, key=("model_id",),
    description="Trained checkpoints (Hugging Face format) with lineage to the snapshots they saw.",
    columns=[
        Column("model_id", pl.Utf8, required=True, description="<run>/<stage>"),
        Column("run_name", pl.Utf8, required=True),
        Column("stage", pl.Utf8, required=True, allowed=STAGE_NAMES),
        Column("path", pl.Utf8, required=True, description="Hugging Face model directory"),
        Column("init_model", pl.Utf8, required=True, description="directory the stage started from"),
        Column("profile", pl.Utf8, required=True),
        Column("steps", pl.Int64, required=True, check=_non_negative, check_reason="negative_steps"),
        Column("final_loss", pl.Float64),
        Column("data_snapshots", pl.Utf8, required=True, description="JSON list of name@snapshot inputs"),
        Column("config_hash", pl.Utf8, required=True),
        Column("mlflow_run_id", pl.Utf8),
        Column("num_parameters", pl.Int64),
        Column("audit", pl.Utf8, allowed=("passed", "failed"),
               description="the training-data audit of what this model saw, run before it was registered "
                           "(null: registered before the gate existed); a failed model is refused unless forced"),
        Column("audit_violations", pl.Int64, check=_non_negative, check_reason="negative_violations"),
    ],
))
