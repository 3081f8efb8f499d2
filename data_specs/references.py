"""Tables of the references stage: GenRM judgments, Swiss tournaments, chosen references,
the labelled judge benchmark and judge recalibrations."""
from __future__ import annotations

import polars as pl

from data_specs.base import Column, TableSpec, register

PARSE_STATUSES = ("ok", "unparseable", "out_of_range")
# how a game or a pair was decided (see tasks.genrm.consistency)
DECISION_STATUSES = ("consistent", "ok", "no_consensus", "position_disagreement", "unparseable", "rule", "bye")
JUDGMENT_KINDS = ("pairwise", "grade")
JUDGMENT_CONTEXTS = ("swiss", "benchmark", "bon", "rl")
JUDGMENT_ORDERS = ("forward", "backward", "grade")
TIE_BREAKS = ("points", "buchholz", "wins", "seed", "single_candidate")
BENCHMARK_KINDS = ("pairwise", "grade")

JUDGMENTS = register(TableSpec(
    "judgments", version=1, key=("judgment_id",),
    description="Every raw GenRM output with its parsed verdict; unparseable outputs are kept as such.",
    columns=[
        Column("judgment_id", pl.Utf8, required=True),
        Column("run_id", pl.Utf8),
        Column("context", pl.Utf8, required=True, allowed=JUDGMENT_CONTEXTS),
        Column("kind", pl.Utf8, required=True, allowed=JUDGMENT_KINDS),
        Column("prompt_id", pl.Utf8, required=True, description="prompt, or benchmark item id"),
        Column("match_id", pl.Utf8, description="swiss_matches.match_id, for tournament games"),
        Column("order", pl.Utf8, required=True, allowed=JUDGMENT_ORDERS),
        Column("attempt", pl.Int64, required=True),
        Column("sample_index", pl.Int64, required=True),
        Column("first_id", pl.Utf8, description="Answer 1 as shown in this order (or the graded response)"),
        Column("second_id", pl.Utf8, description="Answer 2 as shown in this order"),
        Column("raw_text", pl.Utf8),
        Column("verdict", pl.Int64, description="-1/0/1 (pairwise) or 1..5 (grade); null unless parsed"),
        Column("parse_status", pl.Utf8, required=True, allowed=PARSE_STATUSES),
        Column("judge_model", pl.Utf8, required=True),
    ],
))

SWISS_MATCHES = register(TableSpec(
    "swiss_matches", version=1, key=("match_id",),
    description="Every Swiss game (and bye): who met whom in which round, the verdict and the points.",
    columns=[
        Column("match_id", pl.Utf8, required=True),
        Column("run_id", pl.Utf8),
        Column("prompt_id", pl.Utf8, required=True),
        Column("round", pl.Int64, required=True, check=lambda c: c >= 1, check_reason="round_below_1"),
        Column("first_id", pl.Utf8, required=True),
        Column("second_id", pl.Utf8, description="null for a bye"),
        Column("verdict", pl.Int64, allowed=(-1, 0, 1), description="second vs first; null: bye or unreadable"),
        Column("status", pl.Utf8, required=True, allowed=DECISION_STATUSES),
        Column("agreement", pl.Float64),
        Column("attempts", pl.Int64),
        Column("points_first", pl.Float64, required=True),
        Column("points_second", pl.Float64),
        Column("judge_model", pl.Utf8),
    ],
))

TOURNAMENTS = register(TableSpec(
    "tournaments", version=1, key=("run_id", "prompt_id", "candidate_id"),
    description="Final standings of every candidate in every prompt's Swiss tournament.",
    columns=[
        Column("run_id", pl.Utf8),
        Column("prompt_id", pl.Utf8, required=True),
        Column("candidate_id", pl.Utf8, required=True),
        Column("candidate_source", pl.Utf8, required=True),
        Column("seed", pl.Int64, required=True, description="initial position: the last tie-break"),
        Column("text", pl.Utf8),
        Column("points", pl.Float64, required=True),
        Column("buchholz", pl.Float64, required=True),
        Column("wins", pl.Int64, required=True),
        Column("byes", pl.Int64, required=True),
        Column("rank", pl.Int64, required=True, check=lambda c: c >= 1, check_reason="rank_below_1"),
        Column("rounds_planned", pl.Int64, required=True),
        Column("rounds_played", pl.Int64, required=True),
        Column("stopped_early", pl.Boolean, required=True),
    ],
))

REFERENCES = register(TableSpec(
    "references", version=2, key=("prompt_id", "run_id"),
    description="The chosen reference answer per open prompt (the Swiss winner).",
    columns=[
        Column("prompt_id", pl.Utf8, required=True),
        Column("run_id", pl.Utf8),
        Column("source_table", pl.Utf8, required=True),
        Column("domain", pl.Utf8),
        Column("prompt", pl.Utf8, required=True),
        Column("reference", pl.Utf8, required=True),
        Column("candidate_id", pl.Utf8, required=True),
        Column("candidate_source", pl.Utf8, required=True),
        Column("points", pl.Float64),
        Column("buchholz", pl.Float64),
        Column("n_candidates", pl.Int64, required=True),
        Column("rounds_played", pl.Int64, required=True),
        Column("decided_by", pl.Utf8, required=True, allowed=TIE_BREAKS,
               description="the first ranking key that separated the winner from the runner-up"),
        Column("judge_model", pl.Utf8, required=True),
        Column("row_key", pl.Utf8, description="digest of what the reference depends on (prompt, candidate sources "
                                               "and their models, judge and its settings, Swiss settings, seed): a "
                                               "later run with the same key reuses it. v2"),
    ],
))

JUDGE_BENCHMARK = register(TableSpec(
    "judge_benchmark", version=2, key=("item_id",),
    description="Labelled judge items: pairwise (label = Answer 2 vs Answer 1) and grade (label 1 correct, 0 wrong).",
    columns=[
        Column("item_id", pl.Utf8, required=True),
        Column("origin", pl.Utf8, required=True, description="math_perturbed, or the labelled file's name"),
        Column("kind", pl.Utf8, required=True, allowed=BENCHMARK_KINDS),
        Column("prompt", pl.Utf8, required=True),
        Column("ground_truth", pl.Utf8, description="grade items: the gold answer"),
        Column("first", pl.Utf8, description="pairwise: Answer 1"),
        Column("second", pl.Utf8, required=True, description="pairwise: Answer 2; grade: the response"),
        Column("label", pl.Int64, required=True, allowed=(-1, 0, 1)),
        Column("dimension", pl.Utf8, description="pairwise: the judge dimension the label is about (correctness, "
                                                 "...); null: the overall verdict. v2"),
        Column("source_id", pl.Utf8, description="prompts.id the item was built from"),
        Column("file", pl.Utf8),
        Column("line", pl.Int64),
    ],
))

JUDGE_CALIBRATIONS = register(TableSpec(
    "judge_calibrations", version=2,
    description="Recalibrations triggered by the length-bias monitor: the length correction GenRM rewards get "
                "from then on (cumulative over earlier ones) and its checks.",
    columns=[
        Column("run_id", pl.Utf8),
        # v2: the judge the correction belongs to (null: any judge); RL applies the newest one
        Column("judge_model", pl.Utf8, description="the RL judge whose rewards were fitted; null = any judge"),
        Column("trigger_step", pl.Int64),
        Column("method", pl.Utf8, required=True),
        Column("statistic", pl.Float64, required=True),
        Column("threshold", pl.Float64, required=True),
        Column("slope", pl.Float64, required=True,
               description="reward' = clip(reward - slope * (log1p(length) - log_length_mean) / log_length_std)"),
        Column("log_length_mean", pl.Float64, required=True),
        Column("log_length_std", pl.Float64, required=True),
        Column("n", pl.Int64, required=True),
        Column("correct_groups", pl.List(pl.Float64),
               description="the correctness groups the slope corrects (reward varied there); null = all"),
        Column("fitted_slope", pl.Float64,
               description="the slope fitted on this event's window alone (slope adds any earlier correction)"),
        Column("statistic_after", pl.Float64, description="the monitor statistic on corrected rewards"),
        Column("judge_accuracy", pl.Float64, description="benchmark accuracy re-measured, when a judge ran"),
    ],
))
