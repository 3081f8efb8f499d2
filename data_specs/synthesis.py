"""Tables of the synthesize stage: generated logic instances and per-task difficulty bands."""
from __future__ import annotations

import polars as pl

from data_specs.base import Column, TableSpec, register

CALIBRATION_STATUSES = ("band", "base_zero", "too_easy", "too_hard")

SYNTHETIC_TASKS = register(TableSpec(
    "synthetic_tasks", version=2, key=("id",),
    description="SynLogic-style generated instances with gold answers, levels and seeds.",
    columns=[
        Column("id", pl.Utf8, required=True, description="content hash of (task, prompt, answer)"),
        Column("task", pl.Utf8, required=True),
        Column("family", pl.Utf8, required=True),
        Column("level", pl.Int64, required=True, check=lambda c: c >= 0, check_reason="negative_level"),
        Column("seed", pl.Int64, required=True),
        Column("prompt", pl.Utf8, required=True),
        Column("question", pl.Utf8, required=True),
        Column("answer", pl.Utf8, required=True, description="gold answer as the text inside <answer>"),
        Column("metadata", pl.Utf8, required=True, description="JSON: what the verifier needs"),
        Column("domain", pl.Utf8, required=True, allowed=("logic",)),
        Column("level_source", pl.Utf8, required=True, allowed=("calibrated", "configured"),
               description="whether the level came from task_calibration or the profile"),
        Column("cluster_id", pl.Utf8, required=True,
               description="instances with the same task and normalized question share a cluster"),
        Column("split", pl.Utf8, required=True, allowed=("sft", "rl"),
               description="the training side this instance may feed; a cluster is on one side only"),
    ],
))

TASK_CALIBRATION = register(TableSpec(
    "task_calibration", version=2, key=("task",),
    description="Per task: the level band between base pass rate in (0, 0.5) and strong pass@k > 0.",
    columns=[
        Column("task", pl.Utf8, required=True),
        Column("n_levels", pl.Int64, required=True, check=lambda c: c >= 1, check_reason="no_levels"),
        Column("lower_level", pl.Int64, required=True, check=lambda c: c >= 0, check_reason="negative_level"),
        Column("upper_level", pl.Int64, required=True, check=lambda c: c >= 0, check_reason="negative_level"),
        Column("status", pl.Utf8, required=True, allowed=CALIBRATION_STATUSES),
        Column("probes", pl.Utf8, required=True,
               description="JSON list: level, instances, base_pass_rate, strong_pass_at_k"),
        Column("instances_per_level", pl.Int64, required=True),
        Column("base_samples", pl.Int64, required=True),
        Column("strong_samples", pl.Int64, required=True),
        Column("strong_k", pl.Int64, required=True),
        Column("base_solver", pl.Utf8, required=True),
        Column("strong_solver", pl.Utf8, required=True),
        Column("calibration_key", pl.Utf8,
               description="digest of the task (its levels and probe instances), both solvers and the settings: "
                           "a task is probed again only when it changes (null: calibrated before keys were kept)"),
    ],
))

CALIBRATION_SAMPLES = register(TableSpec(
    "calibration_samples", version=1, key=("calibration_key", "solver", "instance_id", "sample"),
    description="The samples that decided each task's calibrated band: every response of either solver to a "
                "probe instance, with the verifier's score.",
    columns=[
        Column("task", pl.Utf8, required=True),
        Column("calibration_key", pl.Utf8, required=True, description="task_calibration.calibration_key"),
        Column("level", pl.Int64, required=True, check=lambda c: c >= 0, check_reason="negative_level"),
        Column("solver", pl.Utf8, required=True, allowed=("base", "strong")),
        Column("solver_name", pl.Utf8, required=True),
        Column("instance_id", pl.Utf8, required=True),
        Column("sample", pl.Int64, required=True),
        Column("response", pl.Utf8),
        Column("score", pl.Float64, required=True),
        Column("correct", pl.Boolean, required=True),
    ],
))
