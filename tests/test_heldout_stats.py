"""Paired intervals of what a stage changed, families never trained on, stages that did nothing."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from flows.compare import DELTA_METRIC
from flows.pipeline import idle_stages, run_summary_markdown
from tasks.evaluate import (
    SYNTHETIC_BENCHMARK,
    UNTRAINED_BENCHMARK,
    EvalItem,
    ItemResult,
    SyntheticHeldout,
    heldout_group,
    heldout_synthetic_items,
    ladder_intervals,
    ladder_order,
    ladder_verdict,
)
from tasks.heldout_stats import (
    Interval,
    comparison_pairs,
    interval_metrics,
    interval_table,
    paired_bootstrap,
    stage_intervals,
)

LADDER = ["base", "sft_long", "dpo_long", "rl", "agent"]


def reference_paired_bootstrap(diffs: list[float], reps: int, seed: int) -> tuple[float, float]:
    """An independent reference: resample item indices with Python's own RNG, one mean per draw,
    the 2.5% and 97.5% order statistics."""
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(reps))
    return means[int(0.025 * reps)], means[int(0.975 * reps) - 1]


def test_bootstrap_agrees_with_an_independent_reference_and_the_normal_interval():
    rng = np.random.default_rng(3)
    diffs = rng.choice([-0.5, -0.25, 0.0, 0.25, 0.5, 0.75], size=300).tolist()
    point, lo, hi = paired_bootstrap([np.array(diffs)], reps=4000, seed=1)
    assert point == pytest.approx(np.mean(diffs))
    ref_lo, ref_hi = reference_paired_bootstrap(diffs, reps=4000, seed=2)
    se = np.std(diffs, ddof=1) / math.sqrt(len(diffs))
    # two bootstraps of different RNGs agree to a fraction of a standard error, and both match the
    # normal-approximation interval of a mean of 300 items
    assert lo == pytest.approx(ref_lo, abs=0.15 * se) and hi == pytest.approx(ref_hi, abs=0.15 * se)
    assert lo == pytest.approx(point - 1.96 * se, abs=0.2 * se)
    assert hi == pytest.approx(point + 1.96 * se, abs=0.2 * se)


def test_pairing_sees_a_gain_that_two_independent_samples_would_call_noise():
    """Items differ a lot in difficulty, the stage adds +0.05 to each: paired over items the gain
    is clear, though the spread between items is far wider than the gain."""
    rng = np.random.default_rng(0)
    a = rng.uniform(0.0, 0.9, size=64)
    b = a + 0.05 + rng.normal(0, 0.02, size=64)
    _, lo, hi = paired_bootstrap([b - a], seed=0)
    assert lo > 0.03 and hi < 0.07
    unpaired_se = math.sqrt(a.var(ddof=1) / 64 + b.var(ddof=1) / 64)
    assert (b.mean() - a.mean()) - 1.96 * unpaired_se < 0   # an unpaired interval would contain 0


def test_pooled_interval_weighs_each_family_equally():
    big = np.full(100, 0.2)   # a family of 100 items gaining 0.2 each
    small = np.full(10, -0.2)   # one of 10 items losing 0.2 each
    point, lo, hi = paired_bootstrap([big, small], seed=0)
    assert point == pytest.approx(0.0) and lo == pytest.approx(0.0) and hi == pytest.approx(0.0)


def test_paired_bootstrap_refuses_nothing_to_pair():
    with pytest.raises(ValueError, match="no paired items"):
        paired_bootstrap([np.array([])])


def test_comparison_pairs_of_the_ladder():
    pairs = comparison_pairs(LADDER)
    assert pairs[:4] == [("base", "sft_long"), ("sft_long", "dpo_long"), ("dpo_long", "rl"), ("rl", "agent")]
    assert ("sft_long", "rl") in pairs and ("base", "agent") in pairs and len(pairs) == 6
    assert comparison_pairs(["base", "rl"]) == [("base", "rl")]


def _scores(per_stage: dict[str, list[float]], bench: str = "f") -> dict:
    return {stage: {(bench, str(i)): v for i, v in enumerate(vals)} for stage, vals in per_stage.items()}


def test_stage_intervals_pair_only_items_both_stages_scored_and_are_deterministic():
    scores = _scores({"base": [0.0, 0.25, 0.5, 1.0], "rl": [0.5, 0.5, 0.75, 1.0]})
    del scores["rl"][("f", "3")]   # an item scored on one side only is not paired
    ivs = stage_intervals(scores, {"f": ["f"]}, seed=7)
    assert len(ivs) == 1 and ivs[0].items == 3 and ivs[0].diff == pytest.approx((0.5 + 0.25 + 0.25) / 3)
    assert ivs == stage_intervals(scores, {"f": ["f"]}, seed=7)
    # an interval does not depend on which other comparisons were asked for
    three = _scores({"base": [0.0, 0.25, 0.5], "sft_long": [0.25, 0.25, 0.5], "rl": [0.5, 0.5, 0.75]})
    alone = stage_intervals(three, {"f": ["f"]}, pairs=[("base", "rl")], seed=7)
    together = stage_intervals(three, {"f": ["f"]}, seed=7)
    assert alone[0] in together


def _results(stage_scores: dict[str, dict[str, list[int]]], n: int = 4) -> dict[str, list[ItemResult]]:
    """ItemResults per stage: benchmark -> correct counts (of ``n``) per item."""
    return {stage: [ItemResult(EvalItem(bench, f"{bench}/{i}", "logic", {}), n, c, 10.0, 0, None)
                    for bench, counts in by_bench.items() for i, c in enumerate(counts)]
            for stage, by_bench in stage_scores.items()}


T1, T2 = f"{SYNTHETIC_BENCHMARK}/a", f"{SYNTHETIC_BENCHMARK}/b"
U1 = f"{UNTRAINED_BENCHMARK}/u"


def test_ladder_intervals_per_family_and_per_pooled_group():
    res = _results({"base": {T1: [0, 0, 1, 0] * 8, T2: [0, 1] * 16, U1: [2, 2] * 16},
                    "rl": {T1: [3, 4, 2, 3] * 8, T2: [2, 3] * 16, U1: [2, 2] * 16}})
    ivs = {iv.benchmark: iv for iv in ladder_intervals(res, seed=0)}
    assert set(ivs) == {T1, T2, U1, SYNTHETIC_BENCHMARK, UNTRAINED_BENCHMARK}
    assert ivs[SYNTHETIC_BENCHMARK].items == 64 and ivs[SYNTHETIC_BENCHMARK].lo > 0
    assert ivs[SYNTHETIC_BENCHMARK].diff == pytest.approx((ivs[T1].diff + ivs[T2].diff) / 2)
    assert ivs[UNTRAINED_BENCHMARK].within_noise and ivs[U1].diff == 0.0


def _ladder(values: dict[str, tuple[float, float]]) -> dict:
    return {b: {"sft_long": v[0], "rl": v[1]} for b, v in values.items()}


def test_verdict_says_within_noise_when_the_interval_contains_zero():
    ladder = _ladder({T1: (0.30, 0.34), T2: (0.30, 0.34), SYNTHETIC_BENCHMARK: (0.30, 0.34)})
    assert ladder_verdict(ladder).startswith("Training helped")   # no intervals: the old line
    noisy = [Interval(SYNTHETIC_BENCHMARK, "sft_long", "rl", 0.04, -0.03, 0.11, 64)]
    line = ladder_verdict(ladder, True, noisy)
    assert line.startswith("Training's effect is within noise")
    assert "+0.04 [-0.03, +0.11] within noise" in line and "audit passed" in line
    clear = [Interval(SYNTHETIC_BENCHMARK, "sft_long", "rl", 0.04, 0.01, 0.07, 64)]
    line = ladder_verdict(ladder, None, clear)
    assert line.startswith("Training helped") and "within noise" not in line


def test_verdict_flags_a_never_trained_family_that_fell_beyond_its_interval():
    ladder = _ladder({T1: (0.2, 0.5), SYNTHETIC_BENCHMARK: (0.2, 0.5), U1: (0.3, 0.1),
                      UNTRAINED_BENCHMARK: (0.3, 0.1)})
    ivs = [Interval(SYNTHETIC_BENCHMARK, "sft_long", "rl", 0.3, 0.2, 0.4, 48),
           Interval(U1, "sft_long", "rl", -0.2, -0.3, -0.1, 48)]
    assert "never-trained families FELL: u -0.20 [-0.30, -0.10] (sft_long -> rl)" in ladder_verdict(ladder, None, ivs)
    ivs[1] = Interval(U1, "sft_long", "rl", -0.2, -0.4, 0.01, 48)
    assert "no never-trained family (1) fell beyond its interval" in ladder_verdict(ladder, None, ivs)


def test_never_trained_families_are_shown_apart_after_the_trained():
    ladder = {b: {"base": 0.1} for b in ["aime2024", U1, SYNTHETIC_BENCHMARK, T2, UNTRAINED_BENCHMARK, T1]}
    assert ladder_order(ladder) == [T1, T2, SYNTHETIC_BENCHMARK, U1, UNTRAINED_BENCHMARK, "aime2024"]
    assert heldout_group(U1) == UNTRAINED_BENCHMARK and heldout_group("aime2024") is None


def test_untrained_family_is_drawn_apart_and_refused_when_training_uses_it():
    spec = SyntheticHeldout(tasks=["web_of_lies"], untrained=["object_counting"], per_task=3, levels=[0])
    draw = heldout_synthetic_items(spec, set(), {"web_of_lies"})
    assert sorted({it.benchmark for it in draw.items}) == [f"{SYNTHETIC_BENCHMARK}/web_of_lies",
                                                           f"{UNTRAINED_BENCHMARK}/object_counting"]
    with pytest.raises(ValueError, match=r"\['object_counting'\] are in this home's training data"):
        heldout_synthetic_items(spec, set(), {"web_of_lies", "object_counting"})
    with pytest.raises(ValueError, match="both in tasks"):
        SyntheticHeldout(tasks=["web_of_lies"], untrained=["web_of_lies"])


def test_interval_metrics_parse_back_in_compare():
    ivs = [Interval(f"{UNTRAINED_BENCHMARK}/rg:gcd", "sft_long", "rl", 0.1, -0.1, 0.3, 48)]
    names = interval_metrics(ivs)
    assert set(names) == {f"delta.rl_vs_sft_long.{UNTRAINED_BENCHMARK}/rg:gcd.{w}" for w in ("diff", "lo", "hi")}
    m = DELTA_METRIC.match(f"eval.delta.rl_vs_sft_long.{UNTRAINED_BENCHMARK}/rg:gcd.lo")
    assert (m["a"], m["b"], m["benchmark"], m["what"]) == ("sft_long", "rl", f"{UNTRAINED_BENCHMARK}/rg:gcd", "lo")


def test_interval_table_shows_every_pooled_comparison_and_the_key_ones_per_family():
    stages = ["base", "sft_long", "rl"]
    ivs = [Interval(g, a, b, 0.1, 0.0 if g == T1 else 0.05, 0.2, 16) for g in (T1, SYNTHETIC_BENCHMARK)
           for a, b in comparison_pairs(stages)]
    rows = interval_table(ivs, [T1, SYNTHETIC_BENCHMARK])
    assert [(r["benchmark"], r["comparison"]) for r in rows if r["benchmark"] == T1] == \
        [(T1, "rl - sft_long"), (T1, "rl - base")]
    assert len([r for r in rows if r["benchmark"] == SYNTHETIC_BENCHMARK]) == 3
    assert {r["verdict"] for r in rows if r["benchmark"] == T1} == {"within noise"}
    assert {r["verdict"] for r in rows if r["benchmark"] == SYNTHETIC_BENCHMARK} == {"gain"}


def test_stages_that_did_nothing_are_named_with_their_reason_in_the_summary():
    results = {"mlflow_run_id": "r", "report": "x",
               # each train stage's pipeline result is a train flow's, its stages inside
               "sft_long": {"stages": {"sft_long": {"steps": 12}}},
               "dpo_long": {"stages": {"dpo_long": {"steps": 0, "passed_through": True,
                                                    "reason": "no row of dpo_pairs is assigned to it"}}},
               "judge": {"stages": {"judge": {"steps": 0, "no_data": True, "reason": "no judge_pairs rows"}}},
               "evaluate": {"ladder": _ladder({T1: (0.2, 0.5), SYNTHETIC_BENCHMARK: (0.2, 0.5)}),
                            "intervals": [Interval(SYNTHETIC_BENCHMARK, "sft_long", "rl", 0.3, 0.2, 0.4, 48).as_dict()]}}
    assert idle_stages(results) == [{"stage": "dpo_long", "reason": "no row of dpo_pairs is assigned to it"},
                                    {"stage": "judge", "reason": "no judge_pairs rows"}]
    md = run_summary_markdown(results)
    assert "## Stages that did nothing" in md and "- dpo_long: no row of dpo_pairs is assigned to it" in md
    assert f"| {SYNTHETIC_BENCHMARK} | rl - sft_long | +0.300 | [+0.200, +0.400] | gain |" in md
    assert "+0.30 [+0.20, +0.40]" in md.splitlines()[2]


def test_a_benchmark_scored_at_some_stages_does_not_reorder_the_ladder():
    from tasks.evaluate import ladder_stages

    ladder = {"aime2024": {"base": 0.0, "rl": 0.0, "agent": 0.0},
              "synthetic_heldout": {"base": 0.1, "sft_long": 0.2, "dpo_long": 0.2, "rl": 0.3, "agent": 0.1}}
    assert ladder_stages(ladder) == ["base", "sft_long", "dpo_long", "rl", "agent"]
