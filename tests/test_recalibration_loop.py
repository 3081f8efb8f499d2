"""The length-bias loop is closed: a recalibration changes the GenRM rewards of the next RL steps.

A length-biased judge (a test fake that prefers longer answers among acceptable ones) makes
GenRM rewards follow length at fixed correctness. The length-bias monitor fires on them,
the real ``recalibrate_flow`` writes ``judge_calibrations`` in a real warehouse, and the
rewarder (the running one and a freshly built one) applies the stored correction to the
rewards of a new batch, whose length effect is then measurably smaller.
"""
import logging
import math
import re
import zlib

import numpy as np
import polars as pl
import pytest

import warehouse.store
from flows.references import append_calibration, recalibrate_flow
from tasks.genrm.config import LengthBiasConfig
from tasks.genrm.length_bias import LengthBiasMonitor, fit_length_correction, within_group_spearman
from tasks.rollout.base import Completion
from tasks.train.config import GenRMRewardConfig
from tasks.train.genrm_reward import DomainReward, RewardCounters

_ANSWERS = re.compile(r"\[Answer 1\]\n(.*?)\n\n\[Answer 2\]\n(.*)\Z", re.DOTALL)
REFERENCE = "The reference answer."
PROMPTS = 8
CFG = GenRMRewardConfig(judge={"consistency": {"blind_samples": 1}})
REFERENCES = {f"g{i}": REFERENCE for i in range(PROMPTS)}


class LengthLovingJudgeBackend:
    """Test fake of a judge RolloutBackend with a length bias. A response containing "wrong"
    loses to the reference; any other response ties or wins, and wins more often the longer
    it is (P(win) a logistic in log word count, centred on 12 words, drawn from a hash of
    the text so each response gets one verdict in both orders)."""

    name = "length-loving"

    def format_chat(self, messages):
        return messages[-1]["content"]

    @staticmethod
    def response_vs_reference(response: str) -> int:
        if "wrong" in response:
            return -1
        p_win = 1 / (1 + math.exp(-2.0 * (math.log(len(response.split())) - math.log(12))))
        return 1 if zlib.crc32(response.encode()) / 2**32 < p_win else 0

    def verdict(self, prompt: str) -> str:
        first, second = _ANSWERS.search(prompt).groups()
        v = self.response_vs_reference(second) if first == REFERENCE else -self.response_vs_reference(first)
        return f"[[{v}]]"

    def generate(self, prompts, params):
        return [[Completion(self.verdict(p)) for _ in range(params.n)] for p in prompts]


def sampling_round(seed: int, group_size: int = 16):
    """Open-domain rows and responses of log-uniform length (2..80 words), 30% of them wrong."""
    rng = np.random.default_rng(seed)
    rows, groups = [], []
    for i in range(PROMPTS):
        rows.append({"prompt_id": f"g{i}", "domain": "general", "prompt": f"Explain topic {i}.", "answer": None,
                     "source_row": {"id": f"g{i}"}})
        group = []
        for k in range(group_size):
            words = int(np.exp(rng.uniform(np.log(2), np.log(80))))
            text = f"s{seed}p{i}k{k} " + ("wrong " if rng.random() < 0.3 else "") + " ".join(["word"] * words)
            group.append(Completion(text, token_ids=[7] * len(text.split())))
        groups.append(group)
    return rows, groups


def score(reward: DomainReward, seeds, step: int = 0):
    """(rewards, lengths, correct, samples, counters) of one step's sampling rounds, one per seed."""
    counters, samples = RewardCounters(), []
    for round_, seed in enumerate(seeds):
        rows, groups = sampling_round(seed)
        scored = reward.score(rows, groups, counters, step=step, round_=round_)
        samples += [(len(c.token_ids), s) for g, ss in zip(groups, scored) for c, s in zip(g, ss)]
    return ([s.reward for _, s in samples], [n for n, _ in samples], [s.correct for _, s in samples],
            [s for _, s in samples], counters)


def rewarder(judge_model: str | None = None, **kw) -> DomainReward:
    judge = LengthLovingJudgeBackend()
    cfg = CFG
    if judge_model is not None:
        rollout = CFG.judge.rollout.model_copy(update={"model": judge_model})
        cfg = CFG.model_copy(update={"judge": CFG.judge.model_copy(update={"rollout": rollout})})
    return DomainReward(cfg, REFERENCES, judge_backend=lambda: judge, **kw)


def length_effect(rewards, lengths, correct) -> tuple[float, float]:
    """(within-correctness-group Spearman, within-group slope of reward on standardized log-length)."""
    return within_group_spearman(rewards, lengths, correct, 8)[0], fit_length_correction(rewards, lengths, correct).slope


def recalibrate(reward: DomainReward, window, home, threshold: float = 0.3) -> dict:
    """The monitor's event on ``window`` (one step), handed to the real recalibration flow."""
    monitor = LengthBiasMonitor(LengthBiasConfig(threshold=threshold, window_steps=1, min_group_size=8),
                                logger=logging.getLogger("test.recalibration"))
    event = monitor.update(*window)
    assert event is not None, monitor.history
    return recalibrate_flow({**event.as_dict(), **reward.event_context()}, profile="tiny", home=str(home),
                            remeasure_judge=False)


FIT_SEEDS, FRESH_SEEDS = (1, 2, 3), (100, 101, 102, 103)


def test_a_recalibration_shrinks_the_length_effect_of_the_next_rewards(home, wh):
    running = rewarder(home=str(home))
    r, n, c, _, counters = score(running, FIT_SEEDS)
    rho_fit, slope_fit = length_effect(r, n, c)
    assert rho_fit > 0.5 and slope_fit > 0.1 and counters.metrics()["genrm_length_corrected"] == 0

    result = recalibrate(running, (r, n, c), home)
    assert result["judge_model"] == running.judge_model and result["slope"] == pytest.approx(slope_fit)
    assert result["correct_groups"] == [1.0]      # losses always pay 0: nothing to correct there
    assert wh.read("judge_calibrations").height == 1

    # fresh rounds: scored by the running rewarder (its next steps), by a new one (the next RL
    # stage) and, for comparison, by one that reads no calibration
    uncorrected = score(rewarder(), FRESH_SEEDS)
    next_steps = score(running, FRESH_SEEDS, step=1)
    next_stage = score(rewarder(home=str(home)), FRESH_SEEDS)
    rho_before, slope_before = length_effect(*uncorrected[:3])
    rho_after, slope_after = length_effect(*next_steps[:3])
    assert rho_before > 0.5 and slope_before > 0.1                # the judge is as biased as ever: 0.69, 0.167
    assert rho_after < 0.25 and rho_after < 0.35 * rho_before     # measured: 0.69 -> 0.06
    assert abs(slope_after) < 0.15 * slope_before                 # measured: 0.167 -> 0.002
    assert next_stage[0] == next_steps[0]
    # verdicts and correctness stay the judge's; only accepted answers' rewards move
    assert next_steps[2] == uncorrected[2]
    for corrected, raw in zip(next_steps[3], uncorrected[3]):
        assert corrected.verdict == raw.verdict and 0.0 <= corrected.reward <= 1.0
        if raw.verdict == -1:
            assert corrected.reward == raw.reward
    m = next_steps[4].metrics()
    assert m["genrm_length_correction_slope"] == pytest.approx(result["slope"])
    assert m["genrm_length_corrected"] == sum(next_steps[2])

    # another judge's rewards are not corrected by this judge's calibration
    assert score(rewarder("another-judge", home=str(home)), FRESH_SEEDS)[0] == uncorrected[0]


def test_a_second_recalibration_builds_on_the_first(home, wh):
    running = rewarder(home=str(home))
    first = recalibrate(running, score(running, FIT_SEEDS)[:3], home)
    # the corrected rewards' residual is below the usual threshold: a low one forces the event
    second = recalibrate(running, score(running, (4, 5, 6), step=1)[:3], home, threshold=0.01)
    # the stored correction is the first plus what was left, not the small residual alone
    assert abs(second["fitted_slope"]) < 0.05
    assert second["slope"] == pytest.approx(first["slope"] + second["fitted_slope"], abs=0.01)
    assert wh.read("judge_calibrations")["slope"].to_list() == pytest.approx([first["slope"], second["slope"]])
    rho, slope = length_effect(*score(running, FRESH_SEEDS, step=2)[:3])
    assert abs(rho) < 0.25 and abs(slope) < 0.02


def test_a_calibrations_table_of_the_older_spec_is_kept_when_appending(wh, monkeypatch):
    v1 = pl.DataFrame([{"run_id": "old", "trigger_step": 3, "method": "within_group_spearman", "statistic": 0.5,
                        "threshold": 0.3, "slope": 0.2, "log_length_mean": 3.0, "log_length_std": 1.0, "n": 64,
                        "statistic_after": 0.01, "judge_accuracy": None}],
                      schema_overrides={"judge_accuracy": pl.Float64})
    with monkeypatch.context() as m:        # written before judge_model & co existed
        m.setattr(warehouse.store, "get_spec", lambda name: None)
        wh.write("judge_calibrations", v1)
    append_calibration(wh, {"run_id": "new", "judge_model": "smol", "method": "within_group_spearman",
                            "statistic": 0.6, "threshold": 0.3, "slope": 0.1, "log_length_mean": 3.0,
                            "log_length_std": 1.0, "n": 64, "correct_groups": [1.0]})
    table = wh.read("judge_calibrations")
    assert table["run_id"].to_list() == ["old", "new"] and table["judge_model"].to_list() == [None, "smol"]
    # the old row names no judge, so it applied to any judge until the new one came
    assert rewarder(home=str(wh.home)).refresh_calibration().slope == 0.1
    assert rewarder("another-judge", home=str(wh.home)).refresh_calibration().slope == 0.2
