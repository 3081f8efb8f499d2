"""GenRM rewards and the length-bias monitor inside the CISPO RL loop.

(a) rewards dispatch by domain: verifiers for math/logic, the pairwise GenRM against the
    prompt's reference for instruction/general rows, one batched judge call per round,
    position switching and rule constraints flowing through to the reward;
(b) the monitor fires inside the loop on a reward that pays length at fixed correctness,
    and the event reaches the stage summary and MLflow;
(c) the stage corrects its own later GenRM rewards from the step after an event;
(d) the train flow's event handler runs the real recalibration flow for such an event.
"""
import json
import re

import polars as pl
import pytest
from mlflow.tracking import MlflowClient
from test_train_engine import seeded_sft_job

from tasks import tracking
from tasks.genrm.config import LengthBiasConfig
from tasks.genrm.length_bias import EVENT_TAG, LengthCorrection
from tasks.genrm.references import current_references
from tasks.rollout.base import Completion
from tasks.train.config import CurriculumPhase, FormatRewardConfig, GenRMRewardConfig, TrainConfig
from tasks.train.genrm_reward import (
    DomainReward,
    RewardCounters,
    references_by_prompt,
    verifier_correct,
)
from tasks.train.harness import StageHarness, StageJob
from tasks.train.rl import _monitor_inputs, train_rl

_ANSWERS = re.compile(r"\[Answer 1\]\n(.*?)\n\n\[Answer 2\]\n(.*)\Z", re.DOTALL)


class ScriptedJudgeBackend:
    """Test fake of a judge RolloutBackend: reads both answers out of the pairwise prompt and
    prefers the one containing ``good``; ``position_biased`` always says Answer 2 wins, and an
    answer containing ``garble`` gets an unreadable reply. Records every generate call."""

    name = "scripted"
    model_name = "scripted-judge"

    def __init__(self, position_biased: bool = False):
        self.position_biased = position_biased
        self.calls: list[list[str]] = []

    def format_chat(self, messages):
        return messages[-1]["content"]

    def verdict(self, prompt: str) -> str:
        first, second = _ANSWERS.search(prompt).groups()
        if "garble" in first + second:
            return "I cannot decide."
        if self.position_biased:
            return "Answer 2 reads better. [[1]]"
        return f"[[{('good' in second) - ('good' in first)}]]"

    def generate(self, prompts, params):
        self.calls.append(list(prompts))
        return [[Completion(self.verdict(p)) for _ in range(params.n)] for p in prompts]


def pool_row(prompt_id, domain, prompt, source_row):
    return {"prompt_id": prompt_id, "domain": domain, "prompt": prompt, "answer": source_row.get("answer"),
            "source_row": source_row}


ROWS = [
    pool_row("m1", "math", "What is 2 + 3?", {"id": "m1", "answer": "5"}),
    pool_row("i1", "instruction", "Describe tea.", {"id": "i1", "solution": "Tea is an infusion of leaves."}),
    pool_row("g1", "general", "Name a fruit and mention apple.",
             {"id": "g1", "solution": "an apple", "metadata": json.dumps({"constraints": {"required_words": ["apple"]}})}),
    pool_row("g2", "general", "Say something.", {"id": "g2"}),          # no reference anywhere
]


def groups_for(texts_by_row):
    return [[Completion(t, token_ids=list(range(len(t.split())))) for t in texts] for texts in texts_by_row]


def test_rewards_dispatch_by_domain_with_one_batched_position_switched_judge_call():
    backend = ScriptedJudgeBackend()
    cfg = GenRMRewardConfig(judge={"consistency": {"position_switch": True, "blind_samples": 2}},
                            verdict_rewards={-1: 0.0, 0: 0.4, 1: 1.0})
    reward = DomainReward(cfg, references={"i1": "a good reference"}, judge_backend=lambda: backend)
    groups = groups_for([["\\boxed{5}", "\\boxed{6}"],
                         ["a good and thorough answer", "meh", "garble"],
                         ["a good apple", "a good pear"],
                         ["anything"]])
    counters = RewardCounters()
    scored = reward.score(ROWS, groups, counters, step=3, round_=0)

    assert [(s.reward, s.correct, s.scorer) for s in scored[0]] == [(1.0, 1.0, "verifier"), (0.0, 0.0, "verifier")]
    # i1 is judged against the references-table text, not its stored solution: both contain
    # "good", so a consistent tie; "meh" loses in both orders; "garble" cannot be read -> paid as
    # a tie, its correctness unknown (None, not "correct")
    assert [(s.verdict, s.status, s.reward, s.correct) for s in scored[1]] == [
        (0, "consistent", 0.4, 1.0), (-1, "consistent", 0.0, 0.0), (None, "unparseable", 0.4, None)]
    # g1 (stored solution "an apple"): "a good apple" wins in both orders; "a good pear" breaks
    # the required word and loses by rule, without asking the model
    assert [(s.verdict, s.status, s.reward) for s in scored[2]] == [(1, "consistent", 1.0), (-1, "rule", 0.0)]
    assert [(s.status, s.reward, s.correct) for s in scored[3]] == [("no_reference", 0.4, None)]
    # one generate call for the round: 4 model-judged pairs x 2 orders, each with 2 blind samples
    assert len(backend.calls) == 1 and len(backend.calls[0]) == 8
    assert all("[Answer 1]\na good reference" in p or "[Answer 2]\na good reference" in p
               for p in backend.calls[0] if "Describe tea." in p)
    m = counters.metrics()
    assert m["genrm_scored"] == 6 and m["genrm_unparseable_fraction"] == pytest.approx(1 / 6)
    assert m["genrm_rule_decided_fraction"] == pytest.approx(1 / 6) and m["genrm_judge_calls"] == 1
    assert m["genrm_no_reference"] == 1 and m["genrm_unread_fraction"] == pytest.approx(2 / 6)


def test_unread_verdicts_stay_out_of_the_length_bias_monitor_and_its_correction():
    """An unreadable verdict and a prompt without a reference are paid as ties but are not
    "correct" samples: the monitor sees only the judged samples whose verdict was read, and a
    correction of the correct group leaves the unread ones alone."""
    reward = DomainReward(GenRMRewardConfig(judge={"consistency": {"blind_samples": 1}}),
                          references={"i1": "a good reference"}, judge_backend=ScriptedJudgeBackend)
    groups = groups_for([["a good long answer here", "garble garble garble garble garble garble"], ["anything at all"]])
    scored = reward.score([ROWS[1], ROWS[3]], groups, RewardCounters())
    seen = [(row, g, s, 0) for row, g, s in zip([ROWS[1], ROWS[3]], groups, scored)]
    rewards, lengths, correct = _monitor_inputs(seen)
    assert (rewards, lengths, correct) == ([scored[0][0].reward], [5], [1.0])

    reward.use_correction(LengthCorrection(slope=0.1, log_length_mean=1.0, log_length_std=1.0, n=32))
    counters = RewardCounters()
    corrected = reward.score([ROWS[1], ROWS[3]], groups, counters)
    assert corrected[0][0].reward < scored[0][0].reward          # read and correct: corrected
    assert corrected[0][1].reward == scored[0][1].reward          # unreadable: left alone
    assert corrected[1][0].reward == scored[1][0].reward          # no reference: left alone
    assert counters.genrm_length_corrected == 1 and counters.genrm_unread == 2


def test_a_right_answer_out_of_format_scores_below_the_same_answer_in_format():
    """M1's format reward: math asks for \\boxed{}, logic for <answer> tags. The verifiers accept a
    right answer in either wrapper, so without the format reward both score 1; with it, the one
    out of format keeps ``out_of_format_scale`` of its reward, its correctness stays the
    verifier's, and the counters say how often the format cost a right answer."""
    rows = [pool_row("m1", "math", "What is 2 + 3?", {"id": "m1", "answer": "5"}),
            pool_row("l1", "logic", "Is the sky blue? Answer yes or no.", {"id": "l1", "answer": "yes"})]
    groups = groups_for([["so \\boxed{5}", "<answer>5</answer>", "\\boxed{6}"],
                         ["<answer>yes</answer>", "\\boxed{yes}", "<answer>no</answer>"]])
    plain = DomainReward(GenRMRewardConfig(enabled=False)).score(rows, groups, RewardCounters())
    assert [[s.reward for s in g] for g in plain] == [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]

    counters = RewardCounters()
    shaped = DomainReward(GenRMRewardConfig(enabled=False),
                          format=FormatRewardConfig(enabled=True, out_of_format_scale=0.25)).score(rows, groups, counters)
    assert [[(s.reward, s.correct, s.in_format) for s in g] for g in shaped] == [
        [(1.0, 1.0, True), (0.25, 1.0, False), (0.0, 0.0, True)],
        [(1.0, 1.0, True), (0.25, 1.0, False), (0.0, 0.0, True)]]
    m = counters.metrics()
    assert m["format_miss_fraction"] == pytest.approx(2 / 6) and m["format_cost_correct_fraction"] == pytest.approx(2 / 6)
    # M1's strict form: right and in format, or nothing; a domain left out of `domains` is not checked
    strict = DomainReward(GenRMRewardConfig(enabled=False), format=FormatRewardConfig(enabled=True, domains=["math"]))
    scored = strict.score(rows, groups, RewardCounters())
    assert [s.reward for s in scored[0]] == [1.0, 0.0, 0.0] and [s.reward for s in scored[1]] == [1.0, 1.0, 0.0]


def test_verdicts_decided_ahead_are_the_rewards_and_are_not_decided_again(monkeypatch):
    """The verifier verdicts of a batch sampled ahead, decided in the engine's request thread
    while earlier steps train, give the same rewards as deciding them in ``score``; ``score``
    decides only what was not decided ahead (another step's, a later round's)."""
    rows = [pool_row("m1", "math", "What is 2 + 3?", {"id": "m1", "answer": "5"}),
            pool_row("m2", "math", "What is 2 + 2?", {"id": "m2", "answer": "4"})]
    groups = groups_for([["\\boxed{5}", "\\boxed{6}", "\\boxed{5}"], ["\\boxed{4}", "no answer"]])
    fresh = DomainReward(GenRMRewardConfig(enabled=False)).score(rows, groups, RewardCounters(), step=7)
    ahead = DomainReward(GenRMRewardConfig(enabled=False), verify_workers=2)
    ahead.verify_ahead(7, rows, groups)
    decided = []
    real = ahead._verify_all
    monkeypatch.setattr(ahead, "_verify_all", lambda items: decided.append(len(items)) or real(items))
    scored = ahead.score(rows, groups, RewardCounters(), step=7, round_=0)
    assert [[(s.reward, s.correct) for s in g] for g in scored] == [[(s.reward, s.correct) for s in g] for g in fresh]
    assert [s.reward for s in scored[0]] == [1.0, 0.0, 1.0] and decided == [0]
    ahead.score(rows, groups, RewardCounters(), step=7, round_=1)   # a second round: nothing decided ahead
    ahead.score(rows, groups, RewardCounters(), step=8, round_=0)   # another step
    assert decided == [0, 5, 5]


def test_position_bias_of_the_judge_becomes_a_tie():
    backend = ScriptedJudgeBackend(position_biased=True)
    reward = DomainReward(GenRMRewardConfig(judge={"consistency": {"blind_samples": 1}}),
                          judge_backend=lambda: backend)
    counters = RewardCounters()
    scored = reward.score(ROWS[1:2], groups_for([["a good answer", "meh"]]), counters)
    # "Answer 2 wins" in both orders contradicts itself once the swap is undone
    assert [(s.verdict, s.status, s.reward) for s in scored[0]] == [(0, "position_disagreement", 0.5)] * 2
    assert counters.metrics()["genrm_position_disagreement_fraction"] == 1.0

    # with the switch off, the same biased judge's forward verdict would stand
    one_order = DomainReward(GenRMRewardConfig(judge={"consistency": {"blind_samples": 1, "position_switch": False}}),
                             judge_backend=lambda: backend)
    assert [s.reward for s in one_order.score(ROWS[1:2], groups_for([["meh"]]), RewardCounters())[0]] == [1.0]


def test_references_table_rows_map_to_the_pool(wh):
    base = {"source_table": "prompts", "prompt": "p", "n_candidates": 2, "rounds_played": 1, "run_id": "r",
            "decided_by": "points", "judge_model": "m", "candidate_source": "policy", "candidate_id": "policy:0"}
    wh.append("references", pl.DataFrame([{**base, "prompt_id": "i1", "reference": "old"},
                                          {**base, "prompt_id": "x", "reference": "not in pool"}]))
    wh.append("references", pl.DataFrame([{**base, "prompt_id": "i1", "reference": "newest"}]))
    assert references_by_prompt(current_references(wh), {"i1", "m1"}) == {"i1": "newest"}
    with pytest.raises(ValueError, match="verdict_rewards"):
        GenRMRewardConfig(verdict_rewards={-1: 0.0, 1: 1.0})


# -- inside the loop -------------------------------------------------------------------------

WINDOW = 6


def length_paying_reward(row, text, token_ids):
    """At fixed correctness, pays for length: the biased GenRM the monitor must catch."""
    return 0.5 * verifier_correct(row, text) + 0.5 * len(token_ids) / WINDOW


def rl_config(steps: int) -> TrainConfig:
    return TrainConfig(
        seed=0,
        base_model={"kind": "hybrid", "name": "test-base", "tokenizer_texts": 200},
        optimizer={"lr": 1e-3},
        engine={"zero_stage": 2, "precision": "fp32", "micro_batch_size": 2},
        rl={"steps": steps, "checkpoint_every": 100, "prompts_per_step": 3, "group_size": 4, "updates_per_batch": 1,
            "windows": [{"max_tokens": WINDOW, "eps_high": 0.2, "gradient_clipping": 1.0}],
            "curriculum": [{"start_step": 0, "domains": {"logic": 1.0, "instruction": 1.0}}],
            # a low repetition threshold truncates some samples early: lengths vary
            "repetition_window": 2, "repetition_prob": 0.02, "max_sampling_rounds": 1,
            "genrm": {"judge": {"consistency": {"blind_samples": 1}}},
            "length_bias": {"threshold": 0.3, "window_steps": 3, "min_group_size": 8, "cooldown_steps": 10}})


def add_instruction_prompts(wh, rl_ref: str) -> str:
    """The synthetic (logic) pool plus two instruction prompts with stored answers."""
    name, snapshot = rl_ref.split("@")
    df = wh.read(name, snapshot)
    extra = [{"prompt_id": f"ins{i}", "source_table": "prompts", "domain": "instruction", "prompt": p,
              "solution": s, "selected_by": "prompts"}
             for i, (p, s) in enumerate([("Describe tea.", "good tea"), ("Describe rain.", "good rain")])]
    ref = wh.write(name, pl.concat([df, pl.DataFrame(extra)], how="diagonal_relaxed"))
    return str(ref)


def test_monitor_in_the_loop_fires_on_a_length_paying_reward_and_reports_it(wh):
    cfg = rl_config(steps=4)
    sft_job = seeded_sft_job(wh, cfg)
    refs = {r["name"]: f"{r['name']}@{r['snapshot']}" for r in wh.tables().iter_rows(named=True)}
    with tracking.tracked_run("rl-genrm") as run_id:
        job = StageJob(stage="rl", home=str(wh.home), run_name="bias", profile="test",
                       init_model=sft_job.init_model, data_ref=refs["rl_prompts"], config=cfg.model_dump(),
                       fingerprint="bias", mlflow_run_id=run_id)
        result = train_rl(StageHarness(job), reward_fn=length_paying_reward)

    events = result["length_bias_events"]
    assert events, StageHarness(job).steps.records()
    first = events[0]
    assert first["statistic"] > 0.3 and first["method"] == "within_group_spearman"
    assert first["rl_step"] + 1 == first["step"] and len(first["rewards"]) == len(first["lengths"]) == first["n"]
    curve = StageHarness(job).steps.records()
    assert any(r.get("length_bias_statistic", 0) > 0.3 for r in curve)
    assert all(r["genrm_scored"] == 0 for r in curve)    # a custom reward replaces the GenRM
    run = MlflowClient().get_run(run_id)
    assert run.data.metrics["length_bias.event"] == 1.0
    assert run.data.tags[EVENT_TAG].startswith(f"step={first['step']}")
    assert "rl.length_bias_statistic" in run.data.metrics


def test_loop_rewards_instruction_prompts_with_the_judge_one_call_per_round(wh):
    cfg = rl_config(steps=2)
    sft_job = seeded_sft_job(wh, cfg)
    rl_ref = add_instruction_prompts(wh, f"rl_prompts@{wh.latest('rl_prompts').snapshot}")
    job = StageJob(stage="rl", home=str(wh.home), run_name="genrm", profile="test", init_model=sft_job.init_model,
                   data_ref=rl_ref, config=cfg.model_dump(), fingerprint="genrm")
    backend = ScriptedJudgeBackend()
    train_rl(StageHarness(job), judge_backend=lambda: backend)

    curve = StageHarness(job).steps.records()
    scored = sum(r["genrm_scored"] for r in curve)
    assert scored > 0 and sum(r["genrm_judge_calls"] for r in curve) == len(backend.calls) <= len(curve)
    # both references contain "good": a response without it loses in both orders (0.0), one
    # with it ties (0.5) — the scripted verdicts came through the loop into the rollouts
    judged = wh.read("rl_rollouts").filter(pl.col("domain") == "instruction")
    assert judged.height == scored
    for text, reward in judged.select("text", "reward").iter_rows():
        assert reward == (0.5 if "good" in text or "garble" in text else 0.0), text
    logic = wh.read("rl_rollouts").filter(pl.col("domain") == "logic")
    assert logic.height > 0 and set(logic["reward"]) <= {0.0, 1.0}   # verifier rewards
    # verifier errors are step metrics (to MLflow): the synthetic rows all verify
    assert all(r["verify_error_fraction"] == 0.0 and r.get("verify_errors.logic", 0.0) == 0.0 for r in curve)
    assert any("verify_errors.logic" in r for r in curve)
    # every raw judge output is stored, naming the rollout it judged
    judgments = wh.read("judgments").filter(pl.col("context") == "rl")
    assert judgments.height >= scored and set(judgments["order"]) == {"forward", "backward"}
    judged_ids = set(judged["rollout_id"])
    assert {j for j in judgments["second_id"].to_list() + judgments["first_id"].to_list()
            if j != "reference"} == judged_ids


# -- the flow's handler ----------------------------------------------------------------------

def test_flow_handler_runs_the_recalibration_flow_for_each_event(home, wh):
    from flows.train import handle_length_bias_events

    # reward grows with log-length inside both correctness groups (plus a little fixed jitter)
    correct = [float(i % 2) for i in range(40)]
    biased = [{"step": 5, "rl_step": 4, "statistic": 1.0, "method": "within_group_spearman", "threshold": 0.3,
               "n": 40, "groups": {}, "correct": correct, "lengths": [round(10 * 1.1 ** i) for i in range(40)],
               "rewards": [0.1 + 0.3 * c + 0.01 * i + (i * 37 % 11) / 200 for i, c in enumerate(correct)]}]
    assert handle_length_bias_events(biased, LengthBiasConfig(trigger_recalibration=False), "tiny", str(home)) == []
    assert not wh.exists("judge_calibrations")

    done = handle_length_bias_events(biased, LengthBiasConfig(), "tiny", str(home))
    assert len(done) == 1 and done[0]["rl_step"] == 4 and done[0]["slope"] > 0
    calibrations = wh.read("judge_calibrations")
    assert calibrations["trigger_step"].to_list() == [5]
    assert abs(calibrations["statistic_after"][0]) < 0.3
    run = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}").get_run(done[0]["mlflow_run_id"])
    assert run.data.tags[EVENT_TAG] == "recalibrated"


class LengthLovingJudge(ScriptedJudgeBackend):
    """Test fake of a length-biased judge: an answer longer (in characters) than the other
    wins, else a tie, so at fixed correctness (no answer loses) the GenRM reward follows length."""

    def verdict(self, prompt: str) -> str:
        first, second = _ANSWERS.search(prompt).groups()
        return f"[[{int(len(second) > len(first)) - int(len(first) > len(second))}]]"


def test_a_length_bias_event_corrects_the_rewards_of_the_stages_next_steps(wh):
    """Issue #32 item 5: the correction is in force from the step after the event, inside the
    stage that tripped the monitor, and it is the one the recalibration flow stores."""
    from tasks.genrm.length_bias import event_correction

    cfg = rl_config(steps=6)
    rl = cfg.rl.model_copy(update={
        "curriculum": [CurriculumPhase(start_step=0, domains={"instruction": 1.0})],
        # the untrained model samples tokens near 1/320 each: stopping at one above 0.0035
        # ends responses at every length up to the window
        "repetition_window": 1, "repetition_prob": 0.0035,
        "length_bias": cfg.rl.length_bias.model_copy(update={"threshold": 0.2, "window_steps": 2, "min_group_size": 4})})
    cfg = cfg.model_copy(update={"rl": rl})
    sft_job = seeded_sft_job(wh, cfg)
    rl_ref = add_instruction_prompts(wh, f"rl_prompts@{wh.latest('rl_prompts').snapshot}")
    job = StageJob(stage="rl", home=str(wh.home), run_name="lengthy", profile="test", init_model=sft_job.init_model,
                   data_ref=rl_ref, config=cfg.model_dump(), fingerprint="lengthy")
    result = train_rl(StageHarness(job), judge_backend=LengthLovingJudge)

    curve = StageHarness(job).steps.records()
    events = result["length_bias_events"]
    assert events, curve
    first = events[0]
    assert first["applied_from_step"] == first["rl_step"] + 1 < 6 and first["base_calibration"] is None
    _, correction = event_correction(first)
    before = [r for r in curve if r["step"] <= first["rl_step"]]
    after = [r for r in curve if r["step"] > first["rl_step"]]
    assert before and after
    assert all(r["genrm_scored"] > 0 and r["genrm_length_corrected"] == 0 for r in before)
    assert sum(r["genrm_length_corrected"] for r in after) > 0
    assert all(r["genrm_length_correction_slope"] == pytest.approx(correction.slope) for r in after
               if r["genrm_scored"])
    assert abs(correction.slope) > 0.05   # a real correction, not a no-op


def test_a_correction_the_stage_fitted_outlives_pinned_table_reads(wh):
    from tasks.genrm.length_bias import LengthCorrection

    reward = DomainReward(GenRMRewardConfig(), {}, home=str(wh.home))
    reward.pin_calibrations(None)
    assert reward.refresh_calibration() is None and reward.in_stage_correction() is None
    mine = LengthCorrection(0.2, 2.0, 1.0, 40, (1.0,))
    reward.use_correction(mine)
    assert reward.refresh_calibration() == mine
    assert LengthCorrection.from_mapping(reward.in_stage_correction()) == mine   # what a checkpoint keeps


def test_the_rl_stage_runs_the_judge_checkpoint_it_was_handed(wh, monkeypatch):
    """``extra["judge_model"]`` (the train flow's hand-over) is the model the judge backend loads,
    instead of the profile's name resolved against whatever is newest while RL trains."""
    from tasks.train import rl

    cfg = rl_config(steps=2)
    sft_job = seeded_sft_job(wh, cfg)
    rl_ref = add_instruction_prompts(wh, f"rl_prompts@{wh.latest('rl_prompts').snapshot}")
    built = []
    monkeypatch.setattr(rl, "judge_backend_factory", lambda rollout, home: built.append(rollout.model) or (lambda: None))
    for extra, want in (({"judge_model": "/handed/judge"}, "/handed/judge"), ({}, cfg.rl.genrm.judge.rollout.model)):
        job = StageJob(stage="rl", home=str(wh.home), run_name="handed", profile="test",
                       init_model=sft_job.init_model, data_ref=rl_ref, config=cfg.model_dump(), fingerprint="h",
                       extra=extra)
        h = StageHarness(job)
        rl.make_rewarder(h, rl.load_pool(h), None, None)
        assert built[-1] == want


def test_the_format_each_domain_asks_for():
    """in_format reads what follows the last </think>, as the answer extractors do."""
    from tasks.verify.registry import in_format

    fence = "```python\ndef f():\n    return 1\n```"
    assert in_format("math", "<think>maybe \\boxed{4}</think> it is 5") is False
    assert in_format("math", "<think>hm</think> \\boxed{5}") is True
    assert in_format("logic", "<answer>yes</answer>") and not in_format("logic", "yes")
    assert in_format("code", f"Here:\n{fence}") and not in_format("code", f"{fence}\n{fence}")
    assert not in_format("code", "def f():\n    return 1")
    assert in_format("general", "anything") is None and in_format("instruction", "") is None
