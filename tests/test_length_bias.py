"""Length-bias monitor: fires on rewards that follow length at fixed correctness, quiet otherwise."""
import itertools
import logging

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from tasks import tracking
from tasks.genrm.config import LengthBiasConfig
from tasks.genrm.length_bias import (
    EVENT_TAG,
    LengthBiasMonitor,
    LengthCorrection,
    average_ranks,
    fit_length_correction,
    partial_correlation,
    spearman,
    within_group_spearman,
)


def rl_step(rng, biased: bool, n: int = 64):
    """One RL batch. Longer answers are more often correct in both streams (a real effect
    the monitor must not flag); only the biased stream adds reward for length itself."""
    lengths = rng.lognormal(6.0, 0.6, n)
    z = (np.log(lengths) - 6.0) / 0.6
    correct = (rng.random(n) < 1 / (1 + np.exp(-1.5 * z))).astype(float)
    reward = 0.7 * correct + rng.normal(0, 0.08, n) + (0.12 * z if biased else 0.0)
    return np.clip(reward, 0, 1), lengths, correct


def test_rank_statistics_match_definitions():
    assert average_ranks(np.array([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]
    x = np.arange(10.0)
    assert spearman(x, x ** 3) == pytest.approx(1.0)
    assert spearman(x, -x) == pytest.approx(-1.0)
    assert spearman(x, np.ones(10)) is None


def test_within_group_statistics_ignore_the_correctness_confound():
    rng = np.random.default_rng(0)
    r, n, c = rl_step(rng, biased=False, n=2000)
    assert spearman(r, n) > 0.3                     # raw reward does follow length ...
    rho, details = within_group_spearman(r, n, c)
    assert abs(rho) < 0.1 and details["n"] == 2000  # ... but not at fixed correctness
    assert abs(partial_correlation(r, n, c)[0]) < 0.1
    r, n, c = rl_step(rng, biased=True, n=2000)
    assert within_group_spearman(r, n, c)[0] > 0.5
    assert partial_correlation(r, n, c)[0] > 0.5


@pytest.mark.parametrize("method", ["within_group_spearman", "partial_correlation"])
def test_monitor_fires_on_a_biased_stream_and_stays_quiet_on_an_unbiased_one(method, caplog):
    cfg = LengthBiasConfig(method=method, threshold=0.3, window_steps=5, min_group_size=16, cooldown_steps=10)
    rng = np.random.default_rng(1)
    quiet = LengthBiasMonitor(cfg, logger=logging.getLogger("test.quiet"))
    assert all(quiet.update(*rl_step(rng, biased=False)) is None for _ in range(30))
    assert quiet.events == [] and all(abs(v) < 0.3 for _, v in quiet.history if v is not None)

    received = []
    loud = LengthBiasMonitor(cfg, on_event=received.append, logger=logging.getLogger("test.loud"))
    with caplog.at_level(logging.WARNING, logger="test.loud"):
        events = [loud.update(*rl_step(rng, biased=True)) for _ in range(30)]
    fired = [e for e in events if e is not None]
    assert fired and fired[0].step <= 3
    assert received == fired
    assert all(b.step - a.step > cfg.cooldown_steps for a, b in itertools.pairwise(fired))
    assert fired[0].statistic > 0.3 and len(fired[0].rewards) == fired[0].n
    assert "recalibration event" in caplog.text


def test_monitor_logs_metric_and_tag_to_mlflow(home):
    cfg = LengthBiasConfig(threshold=0.3, window_steps=3, min_group_size=16, trigger_recalibration=False)
    rng = np.random.default_rng(2)
    with tracking.tracked_run("rl") as run_id:
        monitor = LengthBiasMonitor(cfg, on_event=lambda e: pytest.fail("trigger is disabled"))
        events = [monitor.update(*rl_step(rng, biased=True)) for _ in range(4)]
    assert any(events)
    run = MlflowClient().get_run(run_id)
    assert run.data.metrics["length_bias.event"] == 1.0
    assert run.data.metrics["length_bias.statistic"] > 0.3
    assert run.data.tags[EVENT_TAG].startswith("step=")


def test_fitted_length_correction_removes_the_bias():
    rng = np.random.default_rng(3)
    r, n, c = rl_step(rng, biased=True, n=3000)
    correction = fit_length_correction(r, n, c)
    assert correction.slope > 0.05
    assert abs(within_group_spearman(correction.apply(r, n, c), n, c)[0]) < 0.15
    with pytest.raises(ValueError, match="equally long"):
        within_group_spearman([1.0, 0.0], [1.0], [1.0, 0.0])


def test_monitor_state_round_trip_resumes_the_same_statistic_and_cooldown():
    """A resumed RL stage restores the monitor from its checkpoint: same values, same events."""
    cfg = LengthBiasConfig(threshold=0.3, window_steps=5, min_group_size=16, cooldown_steps=6)
    batches = [rl_step(np.random.default_rng(100 + i), biased=True) for i in range(20)]
    whole = LengthBiasMonitor(cfg, logger=logging.getLogger("test.whole"))
    whole_events = [whole.update(*b) for b in batches]

    first = LengthBiasMonitor(cfg, logger=logging.getLogger("test.first"))
    early = [first.update(*b) for b in batches[:9]]
    resumed = LengthBiasMonitor(cfg, logger=logging.getLogger("test.resumed"))
    resumed.load_state_dict(first.state_dict())
    late = [resumed.update(*b) for b in batches[9:]]

    assert [e.step if e else None for e in early + late] == [e.step if e else None for e in whole_events]
    assert [v for _, v in resumed.history] == pytest.approx([v for _, v in whole.history[9:]])
    assert any(e is not None for e in late)


def test_corrections_compose_and_leave_constant_reward_groups_alone():
    rng = np.random.default_rng(4)
    lengths = rng.lognormal(5.0, 0.7, 400)
    z = (np.log1p(lengths) - 5.0) / 0.7
    correct = (rng.random(400) < 0.6).astype(float)
    # like GenRM: an accepted answer's reward follows length, a lost one always pays 0
    rewards = np.where(correct == 1.0, 0.6 + 0.1 * z + rng.normal(0, 0.05, 400), 0.0)
    fitted = fit_length_correction(rewards, lengths, correct)
    assert fitted.groups == (1.0,) and fitted.slope == pytest.approx(0.1, abs=0.02)
    corrected = fitted.apply(rewards, lengths, correct)
    assert (corrected[correct == 0.0] == 0.0).all()           # no length effect created among losses
    with pytest.raises(ValueError, match="pass `correct`"):
        fitted.apply(rewards, lengths)

    base = LengthCorrection(0.05, 4.0, 0.5, 10, (1.0,))
    x = np.linspace(2.0, 800.0, 50)
    r = np.full(50, 0.5)
    on = np.ones(50)
    # away from the clip, base then fitted equals the one composed correction
    step_by_step = fitted.apply(base.apply(r, x, on), x, on)
    composed = fitted.on_top_of(base)
    inside = (step_by_step > 0) & (step_by_step < 1)
    assert inside.sum() > 10
    assert composed.apply(r, x, on)[inside] == pytest.approx(step_by_step[inside])
    assert composed.groups == (1.0,) and composed.n == fitted.n + 10
