"""No silent drops, no silent zeros (issue #32, item 7).

- A synthetic task's verifier that fails on an instance (its checker breaks on the instance's
  own gold answer too) is a counted error, not a 0 that passes for a wrong answer: through the
  registry (``verify_with_error``), in the RL reward's counters, and in the DPO builder, which
  no longer takes such a "rejected" perturbation as proven wrong.
- The judge builder says what became of every instance it was offered, and names the tasks that
  gave no example (reasoning-gym offers no perturbation), as the DPO builder does for its pairs.
- ``rl_prompts`` writes each RL-side row it leaves out as a ``decisions`` row with its reason.
- The RL stage reads the ``references`` and ``judge_calibrations`` snapshots it was handed.
"""
from __future__ import annotations

import dataclasses
import json

import polars as pl
import pytest

from data_specs import get_spec
from tasks.rollout.base import Completion
from tasks.synth.base import TaskVerifyError
from tasks.synth.registry import get_task
from tasks.synthesize import generate_task_instances
from tasks.train.config import GenRMRewardConfig, TrainConfig
from tasks.train.genrm_reward import DomainReward, RewardCounters
from tasks.verify.registry import synth_instance, verify_with_error


def synthetic_rows(task: str, n: int, split: str) -> list[dict]:
    rows = generate_task_instances(task, [0, 1], n, 0, 3, "configured")["rows"]
    assert len(rows) == n
    return [{**r, "split": split} for r in rows]


def broken(row: dict) -> dict:
    """A game_of_24 row whose metadata lost its target: the checker fails on every answer, gold included."""
    meta = json.loads(row["metadata"])
    meta.pop("target")
    return {**row, "id": f"broken-{row['id']}", "metadata": json.dumps(meta)}


# -- the verifier -----------------------------------------------------------------------------

def test_a_checker_that_fails_on_its_own_gold_is_an_error_garbage_is_a_wrong_answer():
    task = get_task("game_of_24")
    instance = task.generate(0, 1)
    gold = f"<answer>{instance.answer}</answer>"
    assert task.verify_strict(instance, gold) == 1.0
    # garbage the checker cannot parse is a wrong answer, the gold still checks: no error
    assert task.verify_strict(instance, "<answer>no idea</answer>") == 0.0
    bad = dataclasses.replace(instance, metadata={k: v for k, v in instance.metadata.items() if k != "target"})
    assert task.verify(bad, gold) == 0.0                       # verify still never raises
    with pytest.raises(TaskVerifyError, match="game_of_24.*gold answer"):
        task.verify_strict(bad, gold)


def test_the_registry_and_the_rl_reward_count_a_broken_synthetic_instance():
    row = broken(synthetic_rows("game_of_24", 1, "rl")[0])
    gold = f"<answer>{row['answer']}</answer>"
    score, error = verify_with_error("logic", row, gold)
    assert score == 0.0 and error is not None and error.startswith("TaskVerifyError"), error
    ok = synthetic_rows("game_of_24", 1, "rl")[0]
    assert verify_with_error("logic", ok, f"<answer>{ok['answer']}</answer>") == (1.0, None)

    counters = RewardCounters()
    pool = [{"prompt_id": r["id"], "domain": "logic", "prompt": r["prompt"], "source_row": r} for r in (row, ok)]
    scored = DomainReward(GenRMRewardConfig(enabled=False)).score(
        pool, [[Completion(gold, [1])], [Completion(f"<answer>{ok['answer']}</answer>", [1])]], counters)
    assert [[s.reward for s in g] for g in scored] == [[0.0], [1.0]]
    assert counters.metrics()["verify_errors.logic"] == 1.0 and "TaskVerifyError" in counters.first_verify_error


# -- DPO and judge builders ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def sft_side(tmp_path_factory):
    """A warehouse whose SFT side holds a normal task, a reasoning-gym task and broken instances."""
    from transformers import AutoTokenizer

    from tasks.rollout.tiny_model import tiny_llama_path
    from warehouse import Warehouse

    wh = Warehouse(tmp_path_factory.mktemp("drops"))
    game = synthetic_rows("game_of_24", 6, "sft")
    rows = game + [broken(r) for r in game[:2]] + synthetic_rows("rg:basic_arithmetic", 3, "sft")
    rows.append({**synthetic_rows("object_counting", 1, "sft")[0], "id": "ghost", "task": "no_such_task"})
    wh.write("synthetic_tasks", pl.DataFrame(rows, infer_schema_length=None))
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path(home=wh.home))
    return wh, rows, tokenizer


def test_dpo_takes_no_rejected_side_from_a_failed_verifier_and_says_why(sft_side):
    from tasks.train.data import Sources, _perturbed_negative, build_dpo_pairs

    wh, rows, tokenizer = sft_side
    game, bad = rows[0], rows[6]
    response, why = _perturbed_negative({**game, "_table": "synthetic_tasks"}, 0)
    assert why is None and get_task("game_of_24").verify_strict(get_task("game_of_24").generate(0, 0), response) < 1
    # the broken instance's checker rejects everything: that is no proof the perturbation is wrong
    assert _perturbed_negative({**bad, "_table": "synthetic_tasks"}, 0) == (None, "verify_error")
    # a reasoning-gym instance's rejected side is an edit of its gold that score_answer rejects
    rg = next(r for r in rows if r["task"].startswith("rg:"))
    response, why = _perturbed_negative({**rg, "_table": "synthetic_tasks"}, 0)
    task = get_task(rg["task"])
    assert why is None and task.verify_strict(synth_instance(rg), response) < 1.0

    frame, _, report = build_dpo_pairs(Sources(wh, "dpo_pairs"), TrainConfig(data={"verify_chosen": True}), tokenizer)
    rg_ids = {r["id"] for r in rows if r["task"].startswith("rg:")}
    assert frame.height == 9 and set(frame["prompt_id"]) == {r["id"] for r in rows[:6]} | rg_ids
    assert set(frame["rejected_source"]) == {"perturbed"}
    # the broken instances' gold (and the unknown task's) cannot be checked: counted as the
    # verifier's failure, not as a chosen side it rejected
    assert report.dropped == {"chosen_verify_error": 3}, report.dropped
    assert report.seen == report.kept + sum(report.dropped.values())


def test_the_judge_builder_accounts_for_every_instance_it_was_offered(sft_side, caplog):
    from tasks.train.data import BuildReport, Sources, judge_rows
    from tasks.train.judge_data import JudgeAccount, judge_sft_rows

    wh, rows, _ = sft_side
    side = {r["id"]: {**r, "_table": "synthetic_tasks"} for r in rows}
    account = JudgeAccount()
    with caplog.at_level("WARNING", logger="posttrain.train.judge_data"):
        examples = judge_sft_rows(side, per_task=20, seed=0, pairwise_share=0.5, account=account)
    # the accounting changes nothing: the same examples as without it
    assert examples == judge_sft_rows(side, per_task=20, seed=0, pairwise_share=0.5)
    rg_ids = {r["id"] for r in rows if r["task"].startswith("rg:")}
    assert examples and {e["source_id"] for e in examples} == {r["id"] for r in rows[:6]} | rg_ids
    # every instance was needed: the good ones used (reasoning-gym's against an edit its
    # score_answer rejects), the broken ones skipped as the verifier's failure; the unknown task
    # gave none at all
    assert (account.offered, account.used, account.unused) == (len(rows), 9, 0)
    assert account.skipped == {"verify_error": 2, "unknown_task": 1}
    assert account.tasks_without_examples == ["no_such_task"]
    assert any("no_such_task" in r.getMessage() for r in caplog.records)

    # a profile may choose the tasks that teach the judge: the others' instances are counted, not lost
    chosen = JudgeAccount()
    only = judge_sft_rows(side, per_task=20, seed=0, pairwise_share=0.5, account=chosen, tasks=["game_of_24"])
    assert {e["source_id"] for e in only} == {r["id"] for r in rows[:6]}
    assert only == [e for e in examples if e["source_id"] in {r["id"] for r in rows[:6]}]   # the same examples
    assert chosen.skipped["task_not_chosen"] == 4 and chosen.offered == len(rows)

    report = BuildReport()
    judge_rows(Sources(wh, "judge_data"), TrainConfig(data={"judge_examples_per_task": 4,
                                                             "judge_pairwise_share": 0.5}), [], report)
    # 4 examples a task: game_of_24 leaves instances unused, and they are counted too
    counts = report.counters()
    assert counts["judge_tasks_without_examples"] == 1 and "judge_instances_skipped_no_perturbation" not in counts
    assert counts["judge_instances_offered"] == counts["judge_instances_used"] + counts["judge_instances_unused"] + \
        sum(v for k, v in counts.items() if k.startswith("judge_instances_skipped_"))


# -- rl_prompts -----------------------------------------------------------------------------

def test_every_rl_side_row_rl_prompts_leaves_out_is_a_decision(tmp_path):
    from transformers import AutoTokenizer

    from tasks.rollout.tiny_model import tiny_llama_path
    from tasks.train.data import RL_PROMPTS_STAGE, write_training_tables
    from warehouse import Warehouse

    wh = Warehouse(tmp_path)
    rows = synthetic_rows("object_counting", 6, "rl") + synthetic_rows("operation", 2, "rl")
    wh.write("synthetic_tasks", pl.DataFrame(rows, infer_schema_length=None))
    verdicts = {rows[0]["id"]: "too_easy", rows[1]["id"]: "unsolved", **{r["id"]: "keep" for r in rows[2:]}}
    verdicts.pop(rows[7]["id"])                          # never scored
    wh.append("difficulty", get_spec("difficulty").conform(pl.DataFrame(
        [{"prompt_id": pid, "source_table": "synthetic_tasks", "domain": "logic", "n": 4, "correct": 2,
          "decision": d, "model": "stand-in", "run_id": "d1"} for pid, d in verdicts.items()])))
    cfg = TrainConfig(data={"synthetic_per_task": 3}, rl={"max_prompts": 3})
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path(home=tmp_path))
    refs, reports = write_training_tables(wh, cfg, tokenizer, ["rl_prompts"])
    kept = wh.read_ref(refs["rl_prompts"])
    decisions = wh.read("decisions").filter(pl.col("stage") == RL_PROMPTS_STAGE)
    reasons = dict(zip(decisions["row_id"], decisions["reason"]))
    # rows in = rows kept + rows removed, each removal with its reason
    assert kept.height + decisions.height == len(rows) and not set(kept["prompt_id"]) & set(reasons)
    assert reasons[rows[0]["id"]] == "difficulty_too_easy" and reasons[rows[1]["id"]] == "difficulty_unsolved"
    assert reasons[rows[7]["id"]] == "difficulty_missing"
    assert sorted(reasons.values()).count("over_synthetic_per_task") == 1     # object_counting's 4th keep
    assert sorted(reasons.values()).count("over_max_prompts") == 1
    assert dict(pl.Series(list(reasons.values())).value_counts().iter_rows()) == reports["rl_prompts"].dropped
    assert set(decisions["decision"]) == {"removed"} and decisions["run_id"].n_unique() == 1
    assert decisions.filter(pl.col("reason").str.starts_with("difficulty_t"))["reference_id"][0].startswith("difficulty@")
    # an up-to-date table is not rebuilt, and a rebuild (other RL settings) that leaves out the same
    # rows records them once; other drops are a build of their own
    write_training_tables(wh, cfg, tokenizer, ["rl_prompts"])
    rebuilt = cfg.model_copy(update={"rl": cfg.rl.model_copy(update={"steps": cfg.rl.steps + 1})})
    write_training_tables(wh, rebuilt, tokenizer, ["rl_prompts"])
    assert wh.read("decisions").filter(pl.col("stage") == RL_PROMPTS_STAGE).height == decisions.height
    wider = cfg.model_copy(update={"rl": cfg.rl.model_copy(update={"max_prompts": 4})})
    _, again = write_training_tables(wh, wider, tokenizer, ["rl_prompts"])
    assert "over_max_prompts" not in again["rl_prompts"].dropped
    assert wh.read("decisions").filter(pl.col("stage") == RL_PROMPTS_STAGE)["run_id"].n_unique() == 2


# -- what RL reads while it trains ---------------------------------------------------------------

def test_rl_reads_the_references_and_calibrations_it_was_handed(tmp_path):
    from flows.references import append_calibration
    from flows.train import runtime_sources
    from tasks.train.harness import StageHarness, StageJob
    from tasks.train.rl import make_rewarder
    from warehouse import TableRef, Warehouse

    wh = Warehouse(tmp_path)
    base = {"source_table": "rl_pool", "prompt": "p", "n_candidates": 2, "rounds_played": 1, "run_id": "r",
            "decided_by": "points", "judge_model": "m", "candidate_source": "policy", "candidate_id": "policy:0"}
    handed = wh.append("references", pl.DataFrame([{**base, "prompt_id": "i1", "reference": "handed"}]))
    calibration = {"judge_model": None, "method": "within_group_spearman", "statistic": 0.6, "threshold": 0.3,
                   "log_length_mean": 3.0, "log_length_std": 1.0, "n": 64, "correct_groups": [1.0]}
    cal = append_calibration(wh, {**calibration, "run_id": "handed", "slope": 0.1})
    sources = runtime_sources(wh, "rl", {"references": handed})
    assert sources == {"references": str(handed), "judge_calibrations": str(cal)}
    assert runtime_sources(wh, "sft_short", None) == {}
    # what RL reads is in its fingerprint: other references retrain it, the same ones re-stored do not
    from flows.train import stage_fingerprint
    data = TableRef("rl_prompts", "x", 1, "data-hash")
    first = stage_fingerprint(wh, "cfg", "rl", data, "/init", sources)
    same = wh.write("references", wh.read_ref(handed))
    assert stage_fingerprint(wh, "cfg", "rl", data, "/init", {**sources, "references": str(same)}) == first
    other = wh.append("references", pl.DataFrame([{**base, "prompt_id": "i2", "reference": "more"}]))
    assert stage_fingerprint(wh, "cfg", "rl", data, "/init", {**sources, "references": str(other)}) != first
    assert stage_fingerprint(wh, "cfg", "sft_short", data, "/init", {}) != first
    # another run writes newer snapshots while this stage trains
    wh.append("references", pl.DataFrame([{**base, "prompt_id": "i1", "reference": "another run's"}]))
    append_calibration(wh, {**calibration, "run_id": "another", "slope": 0.4})

    pool = [{"prompt_id": "i1", "domain": "general", "prompt": "p", "source_row": {"id": "i1"}}]

    def rewarder(extra: dict):
        job = StageJob(stage="rl", home=str(tmp_path), run_name="pinned", profile="test", init_model="(unused)",
                       data_ref=TableRef("rl_prompts", "unused"), config=TrainConfig().model_dump(),
                       fingerprint="pinned", extra=extra)
        return make_rewarder(StageHarness(job), pool, None, judge_backend=lambda: None)

    pinned = rewarder({"sources": sources})
    assert pinned.references == {"i1": "handed"} and pinned.refresh_calibration().slope == 0.1
    append_calibration(wh, {**calibration, "run_id": "later", "slope": 0.7})
    assert pinned.refresh_calibration().slope == 0.1          # still the handed one
    # handed none: none read, whatever appears
    assert rewarder({"sources": {"references": None, "judge_calibrations": None}}).refresh_calibration() is None
    # a job made outside the flow (no sources) reads the newest when it starts
    unpinned = rewarder({})
    assert unpinned.references == {"i1": "another run's"} and unpinned.refresh_calibration().slope == 0.7


# -- the judge's Best-of-N check -------------------------------------------------------------------

def test_the_bon_check_counts_candidates_its_verifier_cannot_score(tmp_path):
    from tasks.genrm.config import JudgeConfig, ReferencesConfig
    from tasks.genrm.judge import GenRMJudge
    from tasks.genrm.validation import best_of_n_gap
    from tasks.rollout.config import LocalConfig, RolloutConfig
    from tasks.rollout.local import LocalBackend
    from tasks.rollout.tiny_model import tiny_llama_path

    judge_cfg = JudgeConfig(rollout=RolloutConfig(backend="local", model="tiny-llama", n=1, max_tokens=4,
                                                  repetition_window=None),
                            consistency={"blind_samples": 1})
    judge = GenRMJudge(LocalBackend.from_path(tiny_llama_path(home=tmp_path), LocalConfig(batch_size=4)), judge_cfg)
    # a math prompt whose stored answer is blank: its verifier cannot score any candidate
    prompts = pl.DataFrame([{"id": "ok", "domain": "math", "prompt": "What is 2 + 3?", "answer": "5"},
                            {"id": "blank", "domain": "math", "prompt": "What is 1 + 1?", "answer": ""}])
    cfg = ReferencesConfig(validation={"bon_prompts": 2, "bon_n": 2, "bon_include_constructed": True})
    metrics = best_of_n_gap(judge, prompts, None, cfg, None).metrics
    assert metrics["bon_prompts"] == 2 and metrics["pass_at_n"] == 0.5     # only "ok" has a right candidate
    assert metrics["bon_verify_errors"] == 2                                # both of "blank"'s, counted
