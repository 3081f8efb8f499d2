"""Every row a training-table builder leaves out is a ``decisions`` row with its reason (issue #32).

``sft_data``, ``dpo_pairs`` and ``judge_data`` are built through ``write_training_tables`` (what
the train flow's build task calls) from a small warehouse holding a row for each way a builder
leaves one out. Each removed row is then in ``decisions`` under ``train.<table>`` with its prompt
(or synthetic instance) id and its reason, the reasons match the build report's counters, and
rows kept + rows removed = rows the builder was offered.
"""
from __future__ import annotations

import json

import polars as pl
import pytest
from scripted import ScriptedBackend

from tasks.synthesize import generate_task_instances
from tasks.train.config import TrainConfig

LONG_PROMPT = "Add these numbers carefully: " + " ".join(str(i % 10) for i in range(3000))


def synthetic_rows(task: str, n: int) -> list[dict]:
    rows = generate_task_instances(task, [0, 1], n, 0, 3, "configured")["rows"]
    assert len(rows) == n
    return [{**r, "split": "sft"} for r in rows]


def pool_row(pid: str, domain: str, prompt: str, answer: str | None = None, solution: str | None = None) -> dict:
    return {"id": pid, "source": "test", "domain": domain, "prompt": prompt, "answer": answer, "solution": solution,
            "content_hash": f"h-{pid}", "text_hash": f"t-{pid}", "cluster_id": f"c-{pid}", "pool": "sft",
            "verifiable": answer is not None}


def rollout(pid: str, text: str, reward: float, **extra) -> dict:
    return {"rollout_id": f"{pid}:0:r", "prompt_id": pid, "source_table": "sft_pool", "domain": "math",
            "sample_index": 0, "text": text, "num_tokens": 4, "finish_reason": "stop", "truncated": False,
            "reward": reward, "backend": "test", "model": "stand-in", **extra}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from transformers import AutoTokenizer

    from tasks.rollout.tiny_model import tiny_llama_path
    from warehouse import Warehouse

    wh = Warehouse(tmp_path_factory.mktemp("drops_are_decisions"))
    game = synthetic_rows("game_of_24", 2)
    meta = json.loads(game[0]["metadata"])
    meta.pop("target")                      # its checker fails on every answer, gold included
    broken = {**game[0], "id": "broken-g", "metadata": json.dumps(meta)}
    counting = synthetic_rows("object_counting", 4)
    long_counting = {**counting[0], "id": "long-oc", "prompt": counting[0]["prompt"] + " " + "x " * 1000}
    ghost = {**counting[1], "id": "ghost", "task": "no_such_task"}
    other = synthetic_rows("operation", 1)
    synth = game + [broken] + counting + [long_counting, ghost] + other
    wh.write("synthetic_tasks", pl.DataFrame(synth, infer_schema_length=None))
    pool = [pool_row("m-ok", "math", "What is 2+2?", "4"),
            pool_row("m-bad-chosen", "math", "What is 3+1?", "4"),
            pool_row("m-empty", "math", "What is 1+3?", "4"),
            pool_row("m-long", "math", LONG_PROMPT, "4"),
            pool_row("c-nosol", "code", "Write f(x) returning x.", None),
            pool_row("s-nofallback", "science", "Why is the sky blue?", "Rayleigh scattering")]
    wh.write("sft_pool", pl.DataFrame(pool))
    wh.write("rollouts", pl.DataFrame([rollout("m-ok", "\\boxed{5}", 0.0),
                                       rollout("m-bad-chosen", "\\boxed{7}", 1.0),   # "correct", but it is not
                                       rollout("m-long", "\\boxed{5}", 0.0)]))
    wh.write("teacher_samples", pl.DataFrame([rollout("m-empty", "   ", 1.0, kept=True, drop_reason=None)]))
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path(home=wh.home))
    return wh, {"pool": pool, "synth": synth, "counting": counting}, tokenizer


def build(wh, tokenizer, table: str, cfg: TrainConfig) -> tuple[pl.DataFrame, pl.DataFrame, object]:
    """Build ``table``; its frame, the decisions this build wrote, and its report."""
    from tasks.train.data import decision_stage, write_training_tables

    before = set(wh.read("decisions")["run_id"]) if wh.exists("decisions") else set()
    refs, reports = write_training_tables(wh, cfg, tokenizer, [table])
    frame = wh.read_ref(refs[table]) if table in refs else pl.DataFrame()
    decisions = wh.read("decisions").filter(~pl.col("run_id").is_in(list(before)))
    assert set(decisions["stage"]) == {decision_stage(table)} == {f"train.{table}"}
    assert set(decisions["decision"]) == {"removed"} and decisions["run_id"].n_unique() == 1
    assert decisions["row_id"].null_count() == 0 and decisions["reason"].null_count() == 0
    report = reports[table]
    # kept + removed = offered, and every removal counted is a decision with that reason
    assert frame.height == report.kept and frame.height + decisions.height == report.seen
    assert dict(decisions["reason"].value_counts().iter_rows()) == report.dropped
    return frame, decisions, report


def reasons_of(decisions: pl.DataFrame) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in decisions.iter_rows(named=True):
        out.setdefault(r["row_id"], []).append(r["reason"])
    return out


def over_cap(counting: list[dict], cap: int) -> set[str]:
    """The object_counting instances past ``cap`` (by id): the per-task cap leaves them out."""
    return set(sorted([r["id"] for r in counting] + ["long-oc"])[cap:])


def test_sft_data_drops_are_decisions(built):
    wh, rows, tokenizer = built
    cfg = TrainConfig(data={"synthetic_per_task": 3, "gold_fallback_domains": ["math", "logic", "code"],
                            "max_sft_examples": 5},
                      sft_short={"max_tokens": 1024}, sft_long={"min_tokens": 1025, "max_tokens": 2048})
    frame, decisions, report = build(wh, tokenizer, "sft_data", cfg)
    why = reasons_of(decisions)
    offered = [r["id"] for r in rows["pool"] + rows["synth"]]
    # one row in per prompt: each is kept or removed, never both, never lost
    assert all(len(v) == 1 for v in why.values())
    assert set(frame["source_id"]) | set(why) == set(offered) and not set(frame["source_id"]) & set(why)
    assert frame.height + decisions.height == len(offered)
    assert why["c-nosol"] == ["no_gold_answer"]                 # code without a solution: nothing to show
    assert why["s-nofallback"] == ["no_teacher_sample"]         # its domain has no gold fallback
    assert why["m-empty"] == ["empty"]                          # its teacher sample is blank
    assert why["m-long"] == ["outside_length_ranges"]
    for pid in over_cap(rows["counting"], 3):
        assert why[pid] == ["over_synthetic_per_task"]
    assert report.dropped["over_max_sft_short"] == len([r for r in why.values() if r == ["over_max_sft_short"]]) > 0
    assert set(frame["stage"]) == {"sft_short"} and frame.height == 5
    # the reference names what the row matched: its task, or the example it would have been
    refs = dict(zip(decisions["row_id"], decisions["reference_id"]))
    assert refs["m-long"] and refs["c-nosol"] is None
    assert all(refs[pid] == "task:object_counting" for pid in over_cap(rows["counting"], 3))
    # the build counters the flow logs are still there
    assert report.counters()["dropped_no_gold_answer"] == 1.0 and report.counters()["source_gold"] == 5.0


def test_dpo_pairs_drops_are_decisions(built):
    wh, rows, tokenizer = built
    cfg = TrainConfig(data={"synthetic_per_task": 3, "max_dpo_pairs": 2},
                      dpo_short={"max_tokens": 1024}, dpo_long={"min_tokens": 1025, "max_tokens": 2048})
    frame, decisions, report = build(wh, tokenizer, "dpo_pairs", cfg)
    why = reasons_of(decisions)
    offered = [r["id"] for r in rows["pool"] + rows["synth"]]
    assert all(len(v) == 1 for v in why.values())
    assert set(frame["prompt_id"]) | set(why) == set(offered) and not set(frame["prompt_id"]) & set(why)
    assert frame.height + decisions.height == len(offered) == report.seen
    assert why["c-nosol"] == ["no_chosen"]                      # no correct rollout, no gold
    assert why["m-bad-chosen"] == ["chosen_not_verified"]       # its "correct" rollout is wrong
    assert why["broken-g"] == ["chosen_verify_error"] and why["ghost"] == ["chosen_verify_error"]
    assert why["s-nofallback"] == ["no_rejected_not_synthetic"] and why["m-empty"] == ["no_rejected_not_synthetic"]
    assert why["m-long"] == ["outside_length_ranges"]
    for pid in over_cap(rows["counting"], 3):
        assert why[pid] == ["over_synthetic_per_task"]
    assert "over_max_dpo_short" in report.dropped and frame.height == 2
    refs = dict(zip(decisions["row_id"], decisions["reference_id"]))
    assert refs["m-long"] and refs["c-nosol"] is None            # the pair it would have made


def test_judge_data_drops_are_decisions(built):
    wh, rows, tokenizer = built
    instances = {r["id"] for r in rows["synth"]}
    # every instance pulled: the broken one, the unknown task's, the unchosen task's and the one too
    # long for the judge's prompt give no example; examples past the stage's cap are left out too
    cfg = TrainConfig(data={"judge_examples_per_task": 20, "judge_pairwise_share": 0.5, "judge_max_chars": 1000,
                            "judge_tasks": ["game_of_24", "object_counting", "no_such_task"],
                            "max_sft_examples": 5})
    frame, decisions, report = build(wh, tokenizer, "judge_data", cfg)
    why = reasons_of(decisions)
    assert why["broken-g"] == ["judge_verify_error"] and why["ghost"] == ["judge_unknown_task"]
    assert why["long-oc"] == ["judge_too_long"] and why[rows["synth"][-1]["id"]] == ["judge_task_not_chosen"]
    assert report.dropped["over_max_judge"] > 0 and frame.height == 5
    assert set(frame["source_id"]) | set(why) == instances
    assert decisions.filter(pl.col("row_id") == "ghost")["reference_id"].to_list() == ["task:no_such_task"]
    # the instance counts the flow logs agree with the decisions
    counts = report.counters()
    skipped = {k.removeprefix("judge_instances_skipped_"): v for k, v in counts.items()
               if k.startswith("judge_instances_skipped_")}
    judged = decisions.filter(pl.col("reason").str.starts_with("judge_"))
    assert skipped == {k.removeprefix("judge_"): float(v) for k, v in judged["reason"].value_counts().iter_rows()}
    assert counts["judge_instances_offered"] == len(instances)

    # a few examples a task: the instances never reached are left out as unused, by id
    few = TrainConfig(data={"judge_examples_per_task": 2, "judge_pairwise_share": 0.0})
    frame, decisions, report = build(wh, tokenizer, "judge_data", few)
    why = reasons_of(decisions)
    unused = {pid for pid, r in why.items() if r == ["judge_unused"]}
    assert len(unused) == report.counters()["judge_instances_unused"] > 0
    assert set(frame["source_id"]) | set(why) == instances and not set(frame["source_id"]) & set(why)

    # the policy as its own judge: the same instance decisions, as sft_data's
    mixed = TrainConfig(data={"judge_examples_per_task": 2, "judge_pairwise_share": 0.0, "judge_in_sft": True})
    _, decisions, _ = build(wh, tokenizer, "sft_data", mixed)
    assert {r for r in decisions.filter(pl.col("reason") == "judge_unused")["row_id"]} == unused


def test_gold_worked_solutions_are_cleaned_like_teacher_samples(tmp_path):
    """A gold worked solution SFT falls back to passes the teacher samples' cleaning: a solution
    that boxes another answer than the row's (the nonsense algebra of a smol run's sft_data), one
    that repeats itself, and one with no reasoning before its answer are removed with their
    reason, counted as decisions; a bare gold answer (no solution) trains as before."""
    from transformers import AutoTokenizer

    from tasks.rollout.tiny_model import tiny_llama_path
    from warehouse import Warehouse

    wh = Warehouse(tmp_path)
    repeated = "\n".join(["Add the two numbers."] * 4 + ["So the sum is \\boxed{4}."])
    pool = [pool_row("m-good", "math", "What is 2+2?", "4", "Two plus two: count two more from two, \\boxed{4}."),
            pool_row("m-nonsense", "math", "Find the smallest value.", "4",
                     "2(a^2+b^2+c^2-(ab+bc+ac)) = (a^2-2ab-b^2)(b^2-2bc-c^2), so the smallest value is \\boxed{-9}."),
            pool_row("m-repeats", "math", "What is 1+3?", "4", repeated),
            pool_row("m-terse", "math", "What is 3+1?", "4", "\\boxed{4}"),
            pool_row("m-bare", "math", "What is 0+4?", "4")]
    wh.write("sft_pool", pl.DataFrame(pool))
    wh.write("synthetic_tasks", pl.DataFrame(synthetic_rows("object_counting", 2), infer_schema_length=None))
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path(home=wh.home))
    cfg = TrainConfig(data={"gold_fallback_domains": ["math", "logic"]})
    frame, decisions, _ = build(wh, tokenizer, "sft_data", cfg)
    why = reasons_of(decisions)
    assert why == {"m-nonsense": ["gold_wrong"], "m-repeats": ["gold_repetitive"], "m-terse": ["gold_no_reasoning"]}
    kept = dict(zip(frame["source_id"], frame["response"]))
    assert kept["m-good"] == pool[0]["solution"] and kept["m-bare"] == "The final answer is \\boxed{4}."
    assert set(kept) == {"m-good", "m-bare", *(r["id"] for r in synthetic_rows("object_counting", 2))}
    # off: the gold trains unchecked, as before
    from tasks.train.data import write_training_tables

    refs, _ = write_training_tables(wh, TrainConfig(data={"gold_fallback_domains": ["math", "logic"],
                                                          "gold_clean": None}), tokenizer, ["sft_data"])
    assert {"m-nonsense", "m-repeats", "m-terse"} <= set(wh.read_ref(refs["sft_data"])["source_id"])


def reasoning_grade(prompt: str) -> str:
    """A scripted judge's grade of a worked solution's reasoning: [[5]] when it says 'because',
    [[1]] when it says 'nonsense', unreadable otherwise."""
    solution = prompt.split("[Worked solution]\n")[1]
    return "[[5]]" if "because" in solution else "[[1]]" if "nonsense" in solution else "hmm"


def test_a_judge_model_checks_the_reasoning_of_gold_worked_solutions(tmp_path, monkeypatch):
    """M2's rule-plus-LLM-judge cleaning: the gold solutions the rules pass go to the judge, which
    grades their reasoning; below min_grade they are removed (gold_judge_rejected), an unread
    grade is kept or dropped as configured (gold_judge_unread); bare answers and solutions the
    rules already removed never reach it."""
    from transformers import AutoTokenizer

    from tasks.rollout import factory
    from tasks.rollout.tiny_model import tiny_llama_path
    from warehouse import Warehouse

    wh = Warehouse(tmp_path)
    pool = [pool_row("m-sound", "math", "What is 2+2?", "4", "Two and two make four because 2+2=4, \\boxed{4}."),
            pool_row("m-bogus", "math", "What is 1+3?", "4", "By some nonsense identity x = y we get \\boxed{4}."),
            pool_row("m-mute", "math", "What is 3+1?", "4", "Three plus one is the number four, \\boxed{4}."),
            pool_row("m-terse", "math", "What is 0+4?", "4", "\\boxed{4}"),        # the rules remove it
            pool_row("m-bare", "math", "What is 4+0?", "4")]                       # no worked solution
    wh.write("sft_pool", pl.DataFrame(pool))
    wh.write("synthetic_tasks", pl.DataFrame(synthetic_rows("object_counting", 2), infer_schema_length=None))
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path(home=wh.home))
    judge = ScriptedBackend(reasoning_grade)
    monkeypatch.setattr(factory, "make_backend", lambda rollout: judge)
    judged = {"gold_fallback_domains": ["math", "logic"],
              "gold_judge": {"enabled": True, "judge": {"consistency": {"blind_samples": 2}}}}
    frame, decisions, _ = build(wh, tokenizer, "sft_data", TrainConfig(data=judged))
    why = reasons_of(decisions)
    assert why == {"m-bogus": ["gold_judge_rejected"], "m-terse": ["gold_no_reasoning"]}
    assert {"m-sound", "m-mute", "m-bare"} <= set(frame["source_id"])
    # one call: the three worked solutions the rules passed (two blind samples each), answer shown
    assert len(judge.prompts) == 3 and all("[Final answer]\n4" in p for p in judge.prompts)
    assert not any("What is 0+4?" in p or "What is 4+0?" in p for p in judge.prompts)

    strict = {**judged, "gold_judge": {**judged["gold_judge"], "on_unread": "drop"}}
    frame, decisions, _ = build(wh, tokenizer, "sft_data", TrainConfig(data=strict))
    assert reasons_of(decisions)["m-mute"] == ["gold_judge_unread"] and "m-mute" not in set(frame["source_id"])
