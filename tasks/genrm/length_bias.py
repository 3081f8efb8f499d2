"""Length-bias monitor for GenRM rewards during RL.

A generative reward model can drift into preferring longer answers; then RL rewards
verbosity instead of quality. The monitor measures how much reward follows response
length *at fixed correctness* (so "long answers are more often right" does not count):
either Spearman's rho within each correctness group (pooled, weighted by group size) or
the partial correlation of reward and length given correctness. Above a threshold it
records a recalibration event: an MLflow metric and tag, a Prefect log line, and an
optional callback (the references flow's ``recalibrate_flow``).
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tasks import tracking
from tasks.genrm.config import LengthBiasConfig

EVENT_TAG = "posttrain.length_bias.recalibration"


def average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties sharing their average rank (as Spearman's rho needs)."""
    order = np.argsort(values, kind="mergesort")
    ranks = np.empty(len(values), dtype=np.float64)
    sorted_vals = values[order]
    start = 0
    for end in range(1, len(values) + 1):
        if end == len(values) or sorted_vals[end] != sorted_vals[start]:
            ranks[order[start:end]] = (start + end + 1) / 2.0
            start = end
    return ranks


def pearson(x: np.ndarray, y: np.ndarray) -> float | None:
    x, y = x - x.mean(), y - y.mean()
    denom = float(np.sqrt((x * x).sum() * (y * y).sum()))
    return None if denom == 0.0 else float((x * y).sum() / denom)


def spearman(x: np.ndarray, y: np.ndarray) -> float | None:
    return pearson(average_ranks(x), average_ranks(y))


def _arrays(rewards, lengths, correct) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r = np.asarray(rewards, dtype=np.float64)
    n = np.asarray(lengths, dtype=np.float64)
    c = np.asarray(correct, dtype=np.float64)
    if not (r.shape == n.shape == c.shape) or r.ndim != 1:
        raise ValueError(f"rewards, lengths and correct must be 1-D and equally long, got "
                         f"{r.shape}, {n.shape}, {c.shape}")
    keep = np.isfinite(r) & np.isfinite(n) & np.isfinite(c)
    return r[keep], n[keep], c[keep]


def within_group_spearman(rewards, lengths, correct, min_group_size: int = 16) -> tuple[float | None, dict]:
    """Size-weighted mean of Spearman(reward, length) inside each correctness group."""
    r, n, c = _arrays(rewards, lengths, correct)
    per_group, total, weighted = {}, 0, 0.0
    for value in np.unique(c):
        mask = c == value
        if mask.sum() < min_group_size:
            continue
        rho = spearman(r[mask], n[mask])
        if rho is None:  # constant reward or length in the group: no evidence either way
            continue
        per_group[f"correct={value:g}"] = rho
        weighted += rho * mask.sum()
        total += int(mask.sum())
    return (weighted / total if total else None), {"groups": per_group, "n": total}


def partial_correlation(rewards, lengths, correct, min_group_size: int = 16) -> tuple[float | None, dict]:
    """Pearson correlation of reward and length after removing each correctness group's mean."""
    r, n, c = _arrays(rewards, lengths, correct)
    if len(r) < min_group_size:
        return None, {"n": len(r)}
    r_res, n_res = r.copy(), n.copy()
    for value in np.unique(c):
        mask = c == value
        r_res[mask] -= r[mask].mean()
        n_res[mask] -= n[mask].mean()
    return pearson(r_res, n_res), {"n": len(r)}


STATISTICS = {"within_group_spearman": within_group_spearman, "partial_correlation": partial_correlation}


@dataclass
class LengthBiasEvent:
    step: int
    statistic: float
    method: str
    threshold: float
    n: int
    groups: dict = field(default_factory=dict)
    # the pooled window behind the statistic, so a recalibration can refit on it
    rewards: list[float] = field(default_factory=list)
    lengths: list[float] = field(default_factory=list)
    correct: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class LengthBiasMonitor:
    """Feed it once per RL step; it answers with an event when rewards follow length.

        monitor = LengthBiasMonitor(cfg.length_bias, on_event=trigger)
        event = monitor.update(rewards, lengths, correct)   # None while unbiased
    """

    def __init__(self, cfg: LengthBiasConfig | None = None, on_event: Callable[[LengthBiasEvent], None] | None = None,
                 run_id: str | None = None, logger: logging.Logger | None = None):
        self.cfg = cfg or LengthBiasConfig()
        self.on_event = on_event
        self.run_id = run_id
        self.logger = logger
        self.step = 0
        self.history: list[tuple[int, float | None]] = []
        self.events: list[LengthBiasEvent] = []
        self._window: deque[tuple[np.ndarray, np.ndarray, np.ndarray]] = deque(maxlen=self.cfg.window_steps)
        self._last_event_step: int | None = None

    def state_dict(self) -> dict:
        """What a checkpoint needs to resume the statistic exactly: step, window, cooldown."""
        return {"step": self.step, "last_event_step": self._last_event_step,
                "window": [[a.tolist() for a in part] for part in self._window]}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self._last_event_step = state.get("last_event_step")
        self._window.clear()
        for rewards, lengths, correct in state.get("window", []):
            self._window.append(_arrays(rewards, lengths, correct))

    def _log(self):
        # a `posttrain.*` logger: inside a flow run Prefect forwards it to the run's log
        return self.logger if self.logger is not None else logging.getLogger("posttrain.length_bias")

    def statistic(self) -> tuple[float | None, dict, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        r, n, c = (np.concatenate(parts) for parts in zip(*self._window)) if self._window else (
            np.empty(0), np.empty(0), np.empty(0))
        value, details = STATISTICS[self.cfg.method](r, n, c, self.cfg.min_group_size)
        return value, details, (r, n, c)

    def update(self, rewards: Sequence[float], lengths: Sequence[float], correct: Sequence[float]) -> LengthBiasEvent | None:
        self.step += 1
        self._window.append(_arrays(rewards, lengths, correct))
        value, details, (r, n, c) = self.statistic()
        self.history.append((self.step, value))
        run_id = self.run_id or tracking.current_run_id()
        if run_id and value is not None:
            tracking.log_counters({"statistic": value}, prefix="length_bias", step=self.step, run_id=run_id)
        cooling = self._last_event_step is not None and self.step - self._last_event_step <= self.cfg.cooldown_steps
        if value is None or abs(value) <= self.cfg.threshold or cooling:
            return None
        event = LengthBiasEvent(self.step, value, self.cfg.method, self.cfg.threshold, int(details.get("n", len(r))),
                                details.get("groups", {}), r.tolist(), n.tolist(), c.tolist())
        self._record(event, run_id)
        return event

    def _record(self, event: LengthBiasEvent, run_id: str | None) -> None:
        self._last_event_step = event.step
        self.events.append(event)
        self._log().warning("length bias: %s=%.3f over %d samples at step %d exceeds %.2f; recalibration event",
                            event.method, event.statistic, event.n, event.step, event.threshold)
        if run_id:
            tracking.log_counters({"event": 1.0, "event_statistic": event.statistic}, prefix="length_bias",
                                  step=event.step, run_id=run_id)
            tracking.set_tags({EVENT_TAG: f"step={event.step} {event.method}={event.statistic:.3f}"}, run_id=run_id)
        if self.on_event is not None and self.cfg.trigger_recalibration:
            self.on_event(event)


@dataclass(frozen=True)
class LengthCorrection:
    """reward' = clip(reward - slope * z, 0, 1), z the standardized log-length.

    The slope is the within-correctness-group least-squares slope of reward on z: the part
    of the reward that length alone explains once correctness is held fixed. ``groups``
    are the correctness values it corrects (None: all): a group whose reward never varied
    (a GenRM loss always pays the same) shows no length effect, and correcting it would
    create one.
    """
    slope: float
    log_length_mean: float
    log_length_std: float
    n: int
    groups: tuple[float, ...] | None = None

    def apply(self, rewards, lengths, correct=None) -> np.ndarray:
        z = (np.log1p(np.asarray(lengths, dtype=np.float64)) - self.log_length_mean) / self.log_length_std
        shift = self.slope * z
        if self.groups is not None:
            if correct is None:
                raise ValueError("this length correction applies to some correctness groups only: pass `correct`")
            shift = np.where(np.isin(np.asarray(correct, dtype=np.float64), self.groups), shift, 0.0)
        return np.clip(np.asarray(rewards, dtype=np.float64) - shift, 0.0, 1.0)

    def as_dict(self) -> dict:
        return {"slope": self.slope, "log_length_mean": self.log_length_mean, "log_length_std": self.log_length_std,
                "n": self.n, "correct_groups": None if self.groups is None else list(self.groups)}

    @classmethod
    def from_mapping(cls, row: dict) -> LengthCorrection:
        groups = row.get("correct_groups")
        return cls(float(row["slope"]), float(row["log_length_mean"]), float(row["log_length_std"] or 1.0),
                   int(row.get("n") or 0), None if groups is None else tuple(float(g) for g in groups))

    def on_top_of(self, base: LengthCorrection) -> LengthCorrection:
        """One correction equal to ``base`` followed by ``self`` (fitted on base-corrected rewards).

        Both subtract a line in x = log1p(length), so their sum is a line too: the slopes in
        x add up, and the mean is where the summed line crosses zero (clipping aside).
        """
        a = self.slope / self.log_length_std + base.slope / base.log_length_std
        c = (self.slope * self.log_length_mean / self.log_length_std
             + base.slope * base.log_length_mean / base.log_length_std)
        # lines that cancel leave at most a constant: keep the newest mean rather than divide by ~0
        mean = c / a if abs(a) > 1e-12 else self.log_length_mean
        # corrected groups: the union (a group only one of them corrects gets the summed line too)
        groups = None if self.groups is None or base.groups is None else tuple(sorted({*self.groups, *base.groups}))
        return LengthCorrection(a * self.log_length_std, mean, self.log_length_std, self.n + base.n, groups)


def fit_length_correction(rewards, lengths, correct) -> LengthCorrection:
    r, n, c = _arrays(rewards, lengths, correct)
    if len(r) < 3:
        raise ValueError(f"fitting a length correction needs at least 3 samples, got {len(r)}")
    log_n = np.log1p(n)
    mean, std = float(log_n.mean()), float(log_n.std()) or 1.0
    z = (log_n - mean) / std
    z_res, r_res, fitted = np.zeros_like(z), np.zeros_like(r), []
    for value in np.unique(c):
        mask = c == value
        if r[mask].max() == r[mask].min():
            continue  # a constant-reward group: no length effect, and its lengths would dilute the slope
        fitted.append(float(value))
        z_res[mask] = z[mask] - z[mask].mean()
        r_res[mask] = r[mask] - r[mask].mean()
    denom = float((z_res * z_res).sum())
    slope = float((z_res * r_res).sum() / denom) if denom > 0 else 0.0
    return LengthCorrection(slope, mean, std, len(r), tuple(fitted))


def event_correction(event: dict) -> tuple[LengthCorrection, LengthCorrection]:
    """(fitted, in force) for a length-bias event (``LengthBiasEvent.as_dict()`` plus the
    rewarder's ``base_calibration``): the fit on the window's rewards, and the correction to
    apply from then on, the fit on top of the base one the window's rewards already carried.
    The RL stage applies it from its next step; ``recalibrate_flow`` stores the same one."""
    fitted = fit_length_correction(event["rewards"], event["lengths"], event["correct"])
    base = event.get("base_calibration")
    return fitted, (fitted.on_top_of(LengthCorrection.from_mapping(base)) if base else fitted)


CALIBRATIONS_TABLE = "judge_calibrations"


def latest_length_correction(wh, judge_model: str | None, snapshot: str | None = None) -> LengthCorrection | None:
    """The newest recalibration for ``judge_model`` (rows naming no judge apply to any judge), as
    of the table's ``snapshot`` (default: its newest)."""
    if not wh.exists(CALIBRATIONS_TABLE):
        return None
    df = wh.read(CALIBRATIONS_TABLE, snapshot)
    if "judge_model" in df.columns and judge_model is not None:
        df = df.filter(df["judge_model"].is_null() | (df["judge_model"] == judge_model))
    # the table is only appended to: the last row is the newest
    return LengthCorrection.from_mapping(df.row(-1, named=True)) if df.height else None
