"""Difficulty calibration against a scripted solver whose accuracy falls with level,
the band rules, the curriculum, and the RolloutBackend adapter."""
import itertools
import json
import math

import pytest

from tasks.rollout.base import Completion, SamplingParams
from tasks.synth.calibration import (
    LevelProbe,
    calibrate_task,
    choose_band,
    curriculum_levels,
    mean_pass_at_k,
    probe_instances,
    rollout_solver,
)
from tasks.synth.config import CalibrationConfig, SynthesizeConfig
from tasks.synth.registry import get_task


@pytest.fixture(autouse=True)
def _fresh_tracking_store(monkeypatch):
    # mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI, which would keep later tests
    # logging into an earlier test's home; each test uses the store under its own home
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)



class ScriptedSolver:
    """A deterministic stand-in for a model: of n samples for a prompt at level L it answers
    round(n * accuracy(L)) correctly (the gold answer) and the rest wrongly."""

    def __init__(self, name, accuracy, tasks, cfg):
        self.name = name
        self.accuracy = accuracy
        self.gold = {}
        for task_name in tasks:
            task = get_task(task_name)
            for level in range(task.n_levels):
                for seed in (cfg.seed, cfg.seed + 1):   # the base and strong probe seeds
                    for inst in probe_instances(task, level, cfg.instances_per_level, seed):
                        self.gold[inst.prompt] = (inst.answer, level)
        self.calls = 0

    def __call__(self, prompts, n, seed):
        self.calls += 1
        out = []
        for prompt in prompts:
            answer, level = self.gold[prompt]
            right = round(n * max(0.0, min(1.0, self.accuracy(level))))
            out.append([f"<think>...</think><answer>{answer}</answer>"] * right
                       + ["<answer>I am not sure</answer>"] * (n - right))
        return out


def base_accuracy(level):
    return 0.8 - 0.2 * level      # 0.8, 0.6, 0.4, 0.2, 0.0, ...


def strong_accuracy(level):
    return 1.0 - 0.2 * level      # solvable up to level 4


CFG = CalibrationConfig(instances_per_level=2, base_samples=10, strong_samples=10, strong_k=10)


@pytest.mark.parametrize("name", ["sudoku", "word_sorting", "cipher", "campsite"])
def test_calibration_finds_the_m1_band(name):
    base = ScriptedSolver("base", base_accuracy, [name], CFG)
    strong = ScriptedSolver("strong", strong_accuracy, [name], CFG)
    result = calibrate_task(get_task(name), base, strong, CFG)
    # lower: first level with base pass rate in (0, 0.5) -> level 2 (0.4);
    # upper: last level with strong pass@10 > 0 -> level 4 (0.2 * 10 = 2 of 10 correct)
    assert (result.lower_level, result.upper_level, result.status) == (2, min(4, get_task(name).n_levels - 1), "band")
    rates = [p.base_pass_rate for p in result.probes]
    assert rates[:4] == pytest.approx([0.8, 0.6, 0.4, 0.2])
    assert result.probes[0].strong_pass_at_k == 1.0
    # probing stops at the first level the strong solver cannot solve
    assert len(result.probes) <= 6


def _probes(base, strong):
    return [LevelProbe(i, 4, b, s) for i, (b, s) in enumerate(zip(base, strong))]


def test_band_rules():
    assert choose_band(_probes([0.9, 0.3, 0.1], [1, 1, 0.5]), (0, 0.5)) == (1, 2, "band")
    assert choose_band(_probes([0.9, 0.0, 0.0], [1, 1, 0]), (0, 0.5)) == (1, 1, "base_zero")
    assert choose_band(_probes([0.9, 0.8, 0.7], [1, 1, 1]), (0, 0.5)) == (2, 2, "too_easy")
    assert choose_band(_probes([0.0], [0.0]), (0, 0.5)) == (0, 0, "too_hard")
    # a base-band level beyond the strong solver's reach does not count
    assert choose_band(_probes([0.9, 0.9, 0.3], [1, 1, 0]), (0, 0.5)) == (1, 1, "too_easy")


def test_pass_at_k_is_the_unbiased_estimator():
    assert mean_pass_at_k([(10, 0)], 10) == 0.0
    assert mean_pass_at_k([(10, 1)], 10) == 1.0
    assert mean_pass_at_k([(20, 2), (20, 0)], 10) == pytest.approx((1 - math.comb(18, 10) / math.comb(20, 10)) / 2)


def test_curriculum_moves_to_harder_levels_in_later_stages():
    row = {"task": "t", "lower_level": 1, "upper_level": 5}
    stages = [curriculum_levels(row, s, 3) for s in range(3)]
    assert stages[0][0] == 1 and stages[-1][-1] == 5
    assert all(min(a) <= min(b) and max(a) <= max(b) for a, b in itertools.pairwise(stages))
    assert set().union(*map(set, stages)) == {1, 2, 3, 4, 5}
    assert curriculum_levels({"lower_level": 2, "upper_level": 2}, 3, 4) == [2]
    many = [curriculum_levels(row, s, 10) for s in range(10)]
    assert all(len(levels) >= 1 for levels in many)
    with pytest.raises(ValueError, match="stage"):
        curriculum_levels(row, 3, 3)


def test_config_rejects_strong_samples_below_k():
    with pytest.raises(ValueError, match="strong_samples"):
        CalibrationConfig(strong_samples=4, strong_k=10)
    with pytest.raises(ValueError, match="base_band"):
        CalibrationConfig(base_band=(0.6, 0.5))
    with pytest.raises(ValueError):
        SynthesizeConfig(unknown_key=1)


class ScriptedBackend:
    """A RolloutBackend stand-in (no model): echoes a fixed completion, records its calls."""
    name = "scripted"

    def __init__(self):
        self.seen = []

    def format_chat(self, messages):
        return "USER: " + messages[-1]["content"]

    def generate(self, prompts, params):
        self.seen.append((prompts, params))
        return [[Completion(text=f"<answer>{i}</answer>") for i in range(params.n)] for _ in prompts]


def test_rollout_solver_adapts_a_backend():
    backend = ScriptedBackend()
    solve = rollout_solver(backend, SamplingParams(temperature=1.0, top_p=0.95, max_tokens=64))
    # synthetic prompts state their own <answer> format: rendered as every stage renders them
    tagged = ["p1 in <answer></answer>", "p2 in <answer></answer>"]
    out = solve(tagged, 3, 17)
    assert out == [["<answer>0</answer>", "<answer>1</answer>", "<answer>2</answer>"]] * 2
    prompts, params = backend.seen[0]
    assert prompts == [f"USER: {p}" for p in tagged]
    assert (params.n, params.seed, params.top_p) == (3, 17, 0.95)


def test_run_calibration_writes_task_calibration(wh):
    from tasks.synthesize import run_calibration
    names = ["operation", "kukurasu", "dyck_completion"]
    cfg = SynthesizeConfig(tasks=names, calibration=CFG)
    base = ScriptedSolver("base", base_accuracy, names, CFG)
    strong = ScriptedSolver("strong", strong_accuracy, names, CFG)
    ref = run_calibration(wh, cfg, base, strong)
    table = wh.read("task_calibration", ref.snapshot).sort("task")
    assert table["task"].to_list() == sorted(names)
    assert set(table["lower_level"].to_list()) == {2} and set(table["status"].to_list()) == {"band"}
    assert table["base_solver"].to_list() == ["base"] * 3
    probes = json.loads(table.filter(table["task"] == "operation")["probes"][0])
    assert [p["level"] for p in probes][:3] == [0, 1, 2]
    # the samples that decided each band are kept: every response of both solvers, scored
    samples = wh.read("calibration_samples")
    assert set(samples["task"]) == set(names) and set(samples["solver"]) == {"base", "strong"}
    assert samples["calibration_key"].n_unique() == 3 and samples.filter(samples["correct"])["score"].min() == 1.0
    op = samples.filter((samples["task"] == "operation") & (samples["level"] == 2) & (samples["solver"] == "base"))
    assert op.height == CFG.instances_per_level * CFG.base_samples and op["correct"].mean() == pytest.approx(0.4)
    # incremental: the same tasks, solvers and settings are not probed again
    calls = (base.calls, strong.calls)
    assert run_calibration(wh, cfg, base, strong) == ref and (base.calls, strong.calls) == calls
    # a changed solver recalibrates what it is asked about; the other rows carry over, with lineage
    stronger = ScriptedSolver("strong-v2", strong_accuracy, names, CFG)
    ref2 = run_calibration(wh, cfg, base, stronger, tasks=["operation"])
    table2 = wh.read("task_calibration", ref2.snapshot).sort("task")
    assert table2.height == 3 and stronger.calls > 0
    assert table2.filter(table2["task"] == "operation")["strong_solver"].item() == "strong-v2"
    assert table2.filter(table2["task"] != "operation")["calibration_key"].to_list() == \
        table.filter(table["task"] != "operation")["calibration_key"].to_list()
    assert any(ref.snapshot in str(p) for p in wh.lineage("task_calibration", ref2.snapshot))


def test_a_model_that_is_its_own_strong_solver_is_sampled_once_per_probe():
    """No stronger model (the smol profile): the strong solver is the base one, each probe
    instance is sampled strong_samples times once, and the base rate reads its first samples."""
    cfg = CalibrationConfig(instances_per_level=2, base_samples=4, strong_samples=10, strong_k=10)
    model = ScriptedSolver("smol", base_accuracy, ["operation"], cfg)
    drawn = []
    result = calibrate_task(get_task("operation"), model, model, cfg, drawn)
    assert model.calls == len(result.probes)                    # one call per level probed
    assert {d["solver"] for d in drawn} == {"strong"}
    assert len(drawn) == len(result.probes) * cfg.instances_per_level * cfg.strong_samples
    # ScriptedSolver puts the right answers first: 4 base samples at accuracy 0.8 are 4 of 4 right
    assert result.probes[0].base_pass_rate == 1.0 and result.probes[2].base_pass_rate == 1.0
    # level 3: 2 of 10 right, both among the first 4 (0.5, not below it); level 4: none, probing stops
    assert result.probes[3].base_pass_rate == 0.5 and len(result.probes) == 5
    assert (result.lower_level, result.upper_level, result.status) == (3, 3, "too_easy")
