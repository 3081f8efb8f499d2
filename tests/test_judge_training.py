"""The GenRM judge learned inside SFT: well-formed verdict examples, the held-out judge
benchmark, the ``policy`` judge model, and a small SFT-trained model that answers in the
verdict format."""
import random

import polars as pl
import pytest
import torch

from tasks.genrm.config import JUDGE_DOMAIN
from tasks.genrm.parse import parse_grade, parse_pairwise
from tasks.genrm.prompts import grade_prompt, pairwise_prompt
from tasks.genrm.synthetic import answer_text, judge_pair, verdict_text
from tasks.synth.registry import get_task
from tasks.synthesize import generate_task_instances
from tasks.train.config import TrainConfig
from tasks.train.judge_data import judge_sft_rows

TASKS = ["web_of_lies", "object_properties", "object_counting"]


def synthetic_rows(per_task: int = 40) -> list[dict]:
    rows = []
    for name in TASKS:
        rows += generate_task_instances(name, [0], per_task, 0, 3, "configured")["rows"]
    return rows


def side(rows: list[dict], split: str = "sft") -> dict[str, dict]:
    return {r["id"]: {**r, "_table": "synthetic_tasks"} for r in rows if r["split"] == split}


def test_verdict_text_reads_back_as_its_label():
    for label in (-1, 0, 1):
        assert parse_pairwise(verdict_text(label)).value == label


def _answer_slots(prompt: str) -> tuple[str, str]:
    _, tail = prompt.split("[Answer 1]\n", 1)
    first, second = tail.split("\n\n[Answer 2]\n", 1)
    return first, second.split("\n\nDecide whether", 1)[0]


def test_pairwise_judge_examples_are_well_formed_balanced_and_from_sft_instances():
    rows = synthetic_rows()
    sft = side(rows)
    examples = judge_sft_rows(sft, per_task=12, seed=0, pairwise_share=1.0)
    assert examples == judge_sft_rows(sft, per_task=12, seed=0, pairwise_share=1.0)   # seeded
    assert len(examples) == 12 * len(TASKS)
    labels = []
    for ex in examples:
        row = sft[ex["source_id"]]                                        # an SFT-side instance
        assert ex["source_table"] == "synthetic_tasks" and ex["domain"] == JUDGE_DOMAIN
        label = parse_pairwise(ex["response"]).value
        gold = answer_text(row["answer"])
        assert label in (-1, 1) and ex["response"] == f"{gold} {verdict_text(label)}"   # short: answer, verdict
        task = get_task(row["task"])
        # the exact inference prompt, rebuilt; the gold sits where the label says
        first, second = _answer_slots(ex["prompt"])
        assert ex["prompt"] == pairwise_prompt(row["prompt"], first, second, 8000)
        assert row["prompt"] in ex["prompt"]                              # what the audit should accept
        right, wrong = (second, first) if label == 1 else (first, second)
        assert right == gold and task.verify(_instance(row), right) == 1.0
        assert task.verify(_instance(row), wrong) < 1.0
        labels.append(label)
    for name in TASKS:  # both orders, balanced, within every task
        mine = [lab for ex, lab in zip(examples, labels) if sft[ex["source_id"]]["task"] == name]
        assert mine.count(1) == mine.count(-1) == 6


def test_grade_judge_examples_pair_the_gold_with_a_rejected_answer_of_the_same_instance():
    rows = synthetic_rows()
    sft = side(rows)
    examples = judge_sft_rows(sft, per_task=10, seed=0, pairwise_share=0.2)
    assert len(examples) == 10 * len(TASKS)
    grades = [ex for ex in examples if "[Ground-truth answer]" in ex["prompt"]]
    assert len(grades) == 8 * len(TASKS)                                  # 0.2 of 10 pairwise, 8 grade
    pairwise_sources = {ex["source_id"] for ex in examples if ex not in grades}
    assert not pairwise_sources & {ex["source_id"] for ex in grades}      # different instances
    by_source: dict[str, list[dict]] = {}
    for ex in grades:
        by_source.setdefault(ex["source_id"], []).append(ex)
    for source_id, pair in by_source.items():
        row = sft[source_id]
        task = get_task(row["task"])
        assert sorted(parse_grade(ex["response"]).value for ex in pair) == [1, 5]   # both, bare verdicts
        for ex in pair:
            assert ex["response"] in ("[[1]]", "[[5]]") and row["prompt"] in ex["prompt"]
            shown = ex["prompt"].split("[Response]\n", 1)[1].split("\n\nJudge only", 1)[0]
            assert ex["prompt"] == grade_prompt(row["prompt"], row["answer"], shown, 8000)
            consistent = ex["response"] == "[[5]]"
            assert (task.verify(_instance(row), shown) == 1.0) == consistent


def _instance(row):
    from tasks.verify.registry import synth_instance
    return synth_instance(row)


def test_sft_data_gets_judge_examples_only_when_configured(wh):
    from tasks.train.data import Sources, sft_source_rows

    wh.write("synthetic_tasks", pl.DataFrame(synthetic_rows(20)))
    plain, _ = sft_source_rows(Sources(wh, "sft_data"), TrainConfig())
    assert not [r for r in plain if r["domain"] == JUDGE_DOMAIN]
    # the judge stage's examples stay in judge_data unless the policy is to be its own judge
    separate, _ = sft_source_rows(Sources(wh, "sft_data"), TrainConfig(data={"judge_examples_per_task": 4}))
    assert not [r for r in separate if r["domain"] == JUDGE_DOMAIN]
    with_judge, _ = sft_source_rows(Sources(wh, "sft_data"), TrainConfig(data={"judge_examples_per_task": 4,
                                                                              "judge_in_sft": True}))
    judge = [r for r in with_judge if r["domain"] == JUDGE_DOMAIN]
    assert len(with_judge) == len(plain) + len(judge) and len(judge) == 4 * len(TASKS)
    sft_ids = set(wh.read("synthetic_tasks").filter(pl.col("split") == "sft")["id"])
    assert {r["source_id"] for r in judge} <= sft_ids
    # the policy's answer rows are capped per task; the judge draws on every SFT-side instance
    capped, _ = sft_source_rows(Sources(wh, "sft_data"), TrainConfig(data={"judge_examples_per_task": 12, "synthetic_per_task": 2,
                                                      "judge_pairwise_share": 0.0, "judge_in_sft": True}))
    judge = [r for r in capped if r["domain"] == JUDGE_DOMAIN]
    assert len(capped) - len(judge) <= 2 * len(TASKS) and len(judge) == 12 * len(TASKS)
    assert {r["source_id"] for r in judge} <= sft_ids


def test_benchmark_pairs_are_held_out_balanced_and_labelled():
    from tasks.genrm.validation import synthetic_benchmark_items

    training = {r["id"] for r in synthetic_rows(40)}
    pairs_only = synthetic_benchmark_items(TASKS, 10, [0], seed=0, training_ids=training)
    items = synthetic_benchmark_items(TASKS, 10, [0], seed=0, training_ids=training, kinds=("pairwise", "grade"))
    assert [it for it in items if it["kind"] == "pairwise"] == pairs_only   # adding grade items moves no pair
    assert len(items) == 2 * 10 * len(TASKS) and len({it["item_id"] for it in items}) == len(items)
    assert not {it["source_id"] for it in items} & training
    for name in TASKS:
        mine = [it for it in items if it["origin"] == f"synthetic:{name}"]
        pairs = [it for it in mine if it["kind"] == "pairwise"]
        grades = [it for it in mine if it["kind"] == "grade"]
        assert [it["label"] for it in pairs].count(1) == 5 and [it["label"] for it in grades].count(1) == 5
        task = get_task(name)
        for it in pairs:
            gold = answer_text(it["ground_truth"])
            assert (it["second"] if it["label"] == 1 else it["first"]) == gold
        for it in grades:
            instance = next(task.generate(s, 0) for s in range(-1, -200, -1)
                            if task.generate(s, 0).id == it["source_id"])
            assert it["first"] is None and (task.verify(instance, it["second"]) == 1.0) == (it["label"] == 1)


def test_pairs_skip_tasks_that_cannot_be_perturbed():
    task = get_task("web_of_lies")
    inst = task.generate(3, 0)
    pair = judge_pair(task, inst, gold_second=True, rng=random.Random(0))
    assert pair is not None and pair.label == 1 and pair.second == answer_text(inst.answer)

    class Stubborn:
        def verify(self, instance, response):
            return 1.0
        def perturbations(self, instance, rng):
            return ["anything"]
    assert judge_pair(Stubborn(), inst, gold_second=False, rng=random.Random(0)) is None


def test_policy_and_stage_judge_models_resolve_in_the_home(wh):
    from tasks.genrm.models import resolve_rollout
    from tasks.model_registry import POLICY_MODEL
    from tasks.rollout.config import RolloutConfig

    rollout = RolloutConfig(backend="local", model=POLICY_MODEL)
    with pytest.raises(LookupError, match="policy"):
        resolve_rollout(rollout, str(wh.home))
    rows = [{"model_id": f"r/{s}", "run_name": "r", "stage": s, "path": f"/models/{s}", "init_model": "base",
             "profile": "test", "steps": 1, "data_snapshots": "[]", "config_hash": "h"}
            for s in ("sft_long", "dpo_long", "judge", "rl")]
    wh.write("models", pl.DataFrame(rows))
    # the judge stage finished last before RL, but it is not of the policy's lineage
    assert resolve_rollout(rollout, str(wh.home)).model == "/models/dpo_long"
    # a stage's name is that stage's newest model: what `model: judge` names in a profile
    assert resolve_rollout(RolloutConfig(backend="local", model="judge"), str(wh.home)).model == "/models/judge"
    with pytest.raises(LookupError, match="no model of stage 'sft_short'"):
        resolve_rollout(RolloutConfig(backend="local", model="sft_short"), str(wh.home))
    other = RolloutConfig(backend="local", model="/some/path")
    assert resolve_rollout(other, str(wh.home)) is other


def test_the_judge_stage_trains_a_small_model_that_answers_in_the_verdict_format(wh):
    """The judge stage on the real DeepSpeed SFT path, a small hybrid model from its base on
    judge_data only: >= 90% of its verdicts parse."""
    from transformers import AutoTokenizer

    from data_specs import get_spec
    from tasks.genrm.config import JudgeConfig
    from tasks.genrm.judge import GenRMJudge
    from tasks.genrm.validation import judge_accuracy, synthetic_benchmark_items
    from tasks.rollout.config import LocalConfig
    from tasks.rollout.local import LocalBackend
    from tasks.train.base_model import prepare_base_model
    from tasks.train.data import write_training_tables
    from tasks.train.runner import StageJob, execute_stage

    torch.set_num_threads(1)
    rows = synthetic_rows(60)  # ~30 SFT-side instances per task
    wh.write("synthetic_tasks", pl.DataFrame(rows))
    small = {"tokenizer_vocab_size": 512, "hybrid": {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "softmax_attention_every": 2, "max_position_embeddings": 1024,
        "lightning_chunk_size": 32, "num_experts": 0}}
    cfg = TrainConfig(base_model={"kind": "hybrid", "name": "judge-base", "tokenizer_texts": 400},
                      optimizer={"lr": 6e-3, "warmup_steps": 2},
                      engine={"zero_stage": 2, "precision": "fp32", "micro_batch_size": 8},
                      data={"judge_examples_per_task": 20, "judge_pairwise_share": 0.5,
                            "rl_requires_difficulty": False},
                      judge={"steps": 150, "checkpoint_every": 150, "max_tokens": 1024})
    base = prepare_base_model(wh, cfg.base_model, small)
    refs, _ = write_training_tables(wh, cfg, AutoTokenizer.from_pretrained(base))
    judge_data = wh.read("judge_data")
    assert judge_data.height == 20 * len(TASKS) and set(judge_data["stage"]) == {"judge"}
    assert not wh.read("sft_data").filter(pl.col("domain") == JUDGE_DOMAIN).height
    job = StageJob(stage="judge", home=str(wh.home), run_name="judge", profile="test", init_model=str(base),
                   data_ref=refs["judge_data"], config=cfg.model_dump(), fingerprint="judge")
    result = execute_stage(job)
    spec = get_spec("judge_benchmark")
    items = synthetic_benchmark_items(TASKS, 4, [0], 0, {r["id"] for r in rows}, kinds=("pairwise", "grade"))
    bench = spec.conform(pl.DataFrame(items, schema=spec.schema))
    judge_cfg = JudgeConfig(rollout={"backend": "local", "model": result["path"], "temperature": 0.7,
                                     "max_tokens": 24, "repetition_window": None},
                            max_response_chars=1000, consistency={"blind_samples": 1})
    backend = LocalBackend.from_path(result["path"], LocalConfig(batch_size=32, threads=1))
    result = judge_accuracy(GenRMJudge(backend, judge_cfg), bench, None)
    metrics = result.metrics
    assert metrics["synthetic_samples"] == 2 * 4 * len(TASKS)           # both orders of every pair judged
    print("judge metrics", metrics)
    assert metrics["synthetic_parseable"] >= 0.9, [j["raw_text"] for j in result.judgments]
    assert metrics["synthetic_grade_unreadable"] <= 0.1, [j["raw_text"] for j in result.judgments]


class _GradeOnlyBackend:
    """Test fake of a rollout backend (a model cannot be scripted): it grades by exact match of
    the response's <answer> with the ground truth, or always gives ``constant`` when set."""

    name = "grade-fake"

    def __init__(self, constant: str | None = None):
        self.constant = constant

    def format_chat(self, messages):
        return messages[-1]["content"]

    def generate(self, prompts, params):
        from tasks.rollout.base import Completion

        out = []
        for p in prompts:
            truth = p.split("[Ground-truth answer]\n")[1].split("\n\n[Response]")[0]
            response = p.split("[Response]\n")[1].split("\n\nJudge only")[0]
            text = self.constant or ("[[5]]" if response == answer_text(truth) else "[[1]]")
            out.append([Completion(text) for _ in range(params.n)])
        return out


def test_grade_accuracy_per_family_and_its_distance_from_chance():
    from data_specs import get_spec
    from tasks.genrm.config import JudgeConfig
    from tasks.genrm.judge import GenRMJudge
    from tasks.genrm.validation import judge_accuracy, p_above_chance, synthetic_benchmark_items

    items = synthetic_benchmark_items(TASKS, 12, [0], seed=0, kinds=("grade",))
    spec = get_spec("judge_benchmark")
    bench = spec.conform(pl.DataFrame(items, schema=spec.schema))
    cfg = JudgeConfig(consistency={"blind_samples": 1})
    exact = judge_accuracy(GenRMJudge(_GradeOnlyBackend(), cfg), bench, None).metrics
    assert exact["grade_accuracy"] == exact["synthetic_grade_accuracy"] == 1.0
    assert exact["synthetic_grade_items"] == 36 and exact["synthetic_web_of_lies_grade_items"] == 12
    assert exact["synthetic_grade_p_vs_chance"] == pytest.approx(0.5 ** 36)
    constant = judge_accuracy(GenRMJudge(_GradeOnlyBackend("[[5]]"), cfg), bench, None).metrics
    for name in TASKS:  # balanced labels: always "consistent" is exactly chance, and not significant
        assert constant[f"synthetic_{name}_grade_accuracy"] == 0.5
    assert constant["synthetic_grade_p_vs_chance"] > 0.5
    assert p_above_chance(0, 10) == pytest.approx(1.0) and p_above_chance(10, 10) == pytest.approx(2 ** -10)


def test_instances_too_long_for_the_judge_prompt_give_no_examples():
    """A question the judge's prompt would cut is skipped: every example shows its whole instance
    (what the audit checks), found in a default run where 600 characters cut some questions."""
    sft = side(synthetic_rows())
    lengths = sorted(len(r["prompt"]) for r in sft.values())
    limit = lengths[len(lengths) // 2]                      # about half the questions are longer
    examples = judge_sft_rows(sft, per_task=8, seed=0, pairwise_share=0.5, max_chars=limit)
    assert examples
    for ex in examples:
        row = sft[ex["source_id"]]
        assert len(row["prompt"]) <= limit and row["prompt"] in ex["prompt"]
