"""The length-extension gates on synthetic metric streams, and the curriculum schedule."""
import pytest

from tasks.train.config import CurriculumPhase, LengthGates, LengthWindow, RLStageConfig
from tasks.train.curriculum import Curriculum
from tasks.train.length_schedule import LengthSchedule

WINDOWS = [LengthWindow(max_tokens=32, eps_high=0.2, gradient_clipping=1.0),
           LengthWindow(max_tokens=48, eps_high=0.18, gradient_clipping=0.8),
           LengthWindow(max_tokens=64, eps_high=0.16, gradient_clipping=0.6)]
GATES = LengthGates(ppl_patience=3, ppl_tolerance=0.05, p99_fraction=0.9, min_steps_per_window=2)


def test_no_step_up_while_perplexity_still_moves():
    s = LengthSchedule(WINDOWS, GATES)
    # p99 sits at the window, but perplexity keeps falling fast
    for ppl in (10.0, 8.0, 6.0, 4.5, 3.5):
        reading = s.observe(ppl, p99_length=32)
        assert reading.length_near_window and not reading.perplexity_converged and not reading.advanced
    assert s.window.max_tokens == 32


def test_no_step_up_while_outputs_are_short():
    s = LengthSchedule(WINDOWS, GATES)
    readings = [s.observe(3.0, p99_length=20) for _ in range(6)]   # flat, but far from 32 tokens
    assert [r.perplexity_converged for r in readings] == [False, False, True, True, True, True]
    assert not any(r.length_near_window or r.advanced for r in readings)
    assert s.index == 0


def test_steps_up_when_both_gates_pass_and_resets_history():
    s = LengthSchedule(WINDOWS, GATES)
    stream = [(5.0, 20), (3.1, 25), (3.0, 30), (3.05, 31)]
    readings = [s.observe(p, l) for p, l in stream]
    assert [r.advanced for r in readings] == [False, False, False, True]
    assert s.window.max_tokens == 48 and s.window.eps_high == 0.18 and s.window.gradient_clipping == 0.8
    # right after a step up the perplexity history restarts: no immediate second step
    assert not s.observe(3.0, 48).advanced and not s.observe(3.0, 48).advanced
    assert s.observe(3.0, 48).advanced and s.window.max_tokens == 64
    # the last window is final
    for _ in range(5):
        assert not s.observe(3.0, 64).advanced


def test_nan_perplexity_is_no_evidence_and_state_round_trips():
    s = LengthSchedule(WINDOWS, GATES)
    s.observe(float("nan"), 32)
    assert s.perplexities == []
    s.observe(3.0, 10)
    restored = LengthSchedule(WINDOWS, GATES)
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()


def test_profile_validation_rejects_shrinking_windows():
    with pytest.raises(ValueError, match="strictly increasing"):
        RLStageConfig(windows=[{"max_tokens": 64}, {"max_tokens": 32}])
    m1 = RLStageConfig()
    assert [w.max_tokens for w in m1.windows] == [40960, 49152, 57344, 65536, 73728, 81920]


def test_curriculum_mixes_general_tasks_in_later_and_is_deterministic():
    phases = [CurriculumPhase(start_step=0, domains={"logic": 1.0, "math": 1.0}),
              CurriculumPhase(start_step=5, domains={"logic": 1.0, "general": 1.0})]
    domains = ["logic"] * 10 + ["math"] * 10 + ["general"] * 10
    cur = Curriculum(phases, domains, seed=0)
    early = {domains[i] for i in cur.sample(0, 200)}
    late = {domains[i] for i in cur.sample(7, 200)}
    assert early == {"logic", "math"} and late == {"logic", "general"}
    assert cur.sample(3, 16) == cur.sample(3, 16) and cur.sample(3, 16) != cur.sample(4, 16)
    with pytest.raises(ValueError, match="only has"):
        Curriculum([CurriculumPhase(start_step=0, domains={"code": 1.0})], ["logic"]).sample(0, 1)
