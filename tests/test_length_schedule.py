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


def test_curriculum_settings_that_change_nothing_are_named():
    """A weighted domain the pool lacks (renormalized away) and a phase that starts after the
    stage's last step do nothing: ``unused`` names each, and the pool the phases do use is quiet."""
    phases = [CurriculumPhase(start_step=0, domains={"logic": 1.0, "math": 0.2, "code": 0.0}),
              CurriculumPhase(start_step=60, domains={"logic": 1.0, "general": 0.1})]
    cur = Curriculum(phases, ["logic"] * 4, seed=0)
    assert cur.unused(400) == [
        "curriculum phase at step 0 weights math, which the RL pool has none of (it has logic): renormalized away",
        ("curriculum phase at step 60 weights general, which the RL pool has none of (it has logic): "
         "renormalized away")]
    assert cur.unused(60)[1] == "curriculum phase at step 60 never starts (the stage trains 60 steps)"
    assert Curriculum(phases, ["logic", "math", "general"], seed=0).unused(400) == []


def test_later_phases_raise_each_synthetic_tasks_level_window_and_the_level_mix_shows_it():
    """M1's harder-later: two tasks with levels 0-3 and 2-5 in the pool, three phases over three
    level windows: each phase draws only its window of each task's levels (prompts without a
    level in every phase), and the level mix of what it draws rises phase by phase."""
    from tasks.train.curriculum import level_mix

    rows = ([{"domain": "logic", "task": "sudoku", "level": lv} for lv in range(4) for _ in range(5)]
            + [{"domain": "logic", "task": "cipher", "level": lv} for lv in range(2, 6) for _ in range(5)]
            + [{"domain": "math", "task": None, "level": None}] * 10)
    phases = [CurriculumPhase(start_step=0, domains={"logic": 1.0, "math": 0.5}, level_window=0),
              CurriculumPhase(start_step=10, domains={"logic": 1.0, "math": 0.5}, level_window=1),
              CurriculumPhase(start_step=20, domains={"logic": 1.0, "math": 0.5}, level_window=2)]
    cur = Curriculum(phases, [r["domain"] for r in rows], seed=0, tasks=[r["task"] for r in rows],
                     levels=[r["level"] for r in rows], level_windows=3)
    assert cur.levels_at(0) == {"cipher": [2, 3], "sudoku": [0, 1]}
    assert cur.levels_at(10) == {"cipher": [3, 4], "sudoku": [1, 2]}   # windows slide (and may overlap)
    assert cur.levels_at(25) == {"cipher": [4, 5], "sudoku": [2, 3]}   # the last holds the hardest
    means = []
    for step in (0, 10, 20):
        drawn = [rows[i] for i in cur.sample(step, 300)]
        windows = cur.levels_at(step)
        assert all(r["level"] in windows[r["task"]] for r in drawn if r["task"])
        assert any(r["domain"] == "math" for r in drawn)
        means.append(level_mix(drawn)["level_mean"])
    assert means[0] < means[1] < means[2], means
    mix = level_mix([rows[i] for i in cur.sample(0, 300)])
    assert set(mix) == {"level_mean", "level_share/0", "level_share/1", "level_share/2", "level_share/3"}
    assert abs(sum(v for k, v in mix.items() if k.startswith("level_share/")) - 1.0) < 1e-9
    assert level_mix([{"domain": "math", "task": None, "level": None}]) == {}
    # one window (the default): every level in every phase, as before
    flat = Curriculum(phases[:1], [r["domain"] for r in rows], seed=0, tasks=[r["task"] for r in rows],
                      levels=[r["level"] for r in rows])
    assert flat.levels_at(0) == {"cipher": [2, 3, 4, 5], "sudoku": [0, 1, 2, 3]}
    with pytest.raises(ValueError, match="level_window must be below"):
        RLStageConfig(curriculum=[{"start_step": 0, "domains": {"logic": 1.0}, "level_window": 1}])


def test_the_window_refresh_drops_what_the_last_window_solved_and_moves_to_harder_levels():
    """M1's per-window refresh: prompts solved at every one of at least ``min_samples`` samples
    leave the pool at the advance (open prompts never), every phase moves up a level window, the
    metrics give the drop and the new mix, and the state survives a resume."""
    from types import SimpleNamespace

    from tasks.train.config import WindowRefreshConfig
    from tasks.train.curriculum import WindowRefresh

    pool = ([{"prompt_id": f"a{lv}-{k}", "domain": "logic", "task": "a", "level": lv} for lv in range(4) for k in range(2)]
            + [{"prompt_id": "open", "domain": "general", "task": None, "level": None}])
    phases = [CurriculumPhase(start_step=0, domains={"logic": 1.0, "general": 0.1})]

    def curriculum():
        return Curriculum(phases, [r["domain"] for r in pool], seed=0, tasks=[r["task"] for r in pool],
                          levels=[r["level"] for r in pool], level_windows=2)

    def seen(prompt_id, verdicts, scorer="verifier"):
        row = next(r for r in pool if r["prompt_id"] == prompt_id)
        return (row, [None] * len(verdicts), [SimpleNamespace(scorer=scorer, correct=v) for v in verdicts], 0)

    cur = curriculum()
    refresh = WindowRefresh(WindowRefreshConfig(enabled=True, min_samples=4, level_window_step=1), pool, cur)
    assert {pool[i]["level"] for i in cur.sample(0, 200) if pool[i]["task"]} == {0, 1}
    refresh.observe([seen("a0-0", [1.0] * 4), seen("a0-1", [1.0] * 3),            # too few samples
                     seen("a1-0", [1.0, 1.0, 0.0, 1.0]), seen("open", [None] * 4, "genrm")])
    refresh.observe([seen("a0-1", [0.0])])                                        # now 4, one wrong
    state = refresh.state_dict()
    metrics = refresh.advance()
    assert cur.dropped == {0} and metrics["refresh_solved"] == 1 and metrics["refresh_dropped"] == 1
    assert metrics["refresh_pool"] == 8 and metrics["refresh_level_offset"] == 1
    assert metrics["refresh_domain_share/general"] == pytest.approx(1 / 8)
    assert metrics["refresh_level_mean"] == pytest.approx((0 + 2 * 1 + 2 * 2 + 2 * 3) / 7)
    drawn = cur.sample(1, 200)
    assert 0 not in drawn and {pool[i]["level"] for i in drawn if pool[i]["task"]} == {2, 3}
    # a resumed stage: the same tallies give the same drop
    again = WindowRefresh(WindowRefreshConfig(enabled=True, min_samples=4, level_window_step=1), pool, curriculum())
    again.load_state_dict(state)
    assert again.advance() == metrics and again.curriculum.sample(1, 50) == cur.sample(1, 50)
    # a domain is never emptied: its last prompt stays however solved
    assert cur.drop({8}) == set() and cur.remaining()[-1] == 8


def test_adaptive_levels_follow_each_tasks_pass_rate_on_the_improving_policy():
    """Every ``every_steps`` steps a task whose RL samples pass above ``raise_above`` moves up a
    level window and one below ``lower_below`` moves down, each task on its own, within the
    pool's windows; too few samples move nothing; the state survives a resume."""
    from types import SimpleNamespace

    from tasks.train.config import AdaptiveLevelsConfig
    from tasks.train.curriculum import AdaptiveLevels

    pool = [{"prompt_id": f"{t}{lv}", "domain": "logic", "task": t, "level": lv} for t in "ab" for lv in range(4)]
    cfg = AdaptiveLevelsConfig(enabled=True, every_steps=5, min_samples=4, raise_above=0.7, lower_below=0.2)

    def curriculum():
        return Curriculum([CurriculumPhase(start_step=0, domains={"logic": 1.0}, level_window=1)],
                          ["logic"] * len(pool), seed=0, tasks=[r["task"] for r in pool],
                          levels=[r["level"] for r in pool], level_windows=3)

    def seen(prompt_id, verdicts):
        row = next(r for r in pool if r["prompt_id"] == prompt_id)
        return (row, [None] * len(verdicts), [SimpleNamespace(scorer="verifier", correct=v) for v in verdicts], 0)

    cur = curriculum()
    adaptive = AdaptiveLevels(cfg, pool, cur)
    start = cur.levels_at(0)
    assert not adaptive.due(3) and adaptive.due(4)
    adaptive.observe([seen("a1", [1.0] * 5), seen("b1", [0.0, 0.0, 0.0, 1.0, 0.0, 0.0])])
    state = adaptive.state_dict()
    metrics = adaptive.measure(4)
    assert metrics["adaptive_moves"] == 2 and metrics["adaptive_pass_rate/b"] == pytest.approx(1 / 6)
    assert metrics["adaptive_window/a"] == 2 and metrics["adaptive_window/b"] == 0
    after = cur.levels_at(5)
    assert min(after["a"]) > min(start["a"]) and max(after["b"]) < max(start["b"])
    assert {pool[i]["level"] for i in cur.sample(5, 200) if pool[i]["task"] == "a"} == set(after["a"])
    # at the top a task stays; too few samples leave b where it is
    adaptive.observe([seen("a3", [1.0] * 4), seen("b0", [1.0] * 3)])
    assert adaptive.measure(9)["adaptive_moves"] == 0 and cur.levels_at(10) == after
    again = AdaptiveLevels(cfg, pool, curriculum())
    again.load_state_dict(state)
    assert again.measure(4) == metrics and again.curriculum.levels_at(5) == after
