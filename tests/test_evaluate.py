"""The evaluate stage: held-out pass@k into eval_results, with the tiny local model."""
from __future__ import annotations

import json

import polars as pl
import pytest
import torch
from mlflow.tracking import MlflowClient

from tasks import sources, tracking
from tasks.evaluate import (
    SYNTHETIC_BENCHMARK,
    UNTRAINED_BENCHMARK,
    EvaluateConfig,
    ModelChoice,
    SyntheticHeldout,
    benchmark_items,
    choose_model,
    evaluate_items,
    heldout_synthetic_items,
    summarize,
    training_instance_ids,
)
from tasks.ingest import store_records
from tasks.records import RawRecord
from tasks.rollout.base import Completion, SamplingParams
from tasks.rollout.tiny_model import tiny_llama_path
from tasks.synth.base import heldout_seed
from tasks.synth.registry import get_task
from warehouse import Warehouse

BENCHMARKS = ["aime2024", "aime2025", "math500", "humaneval"]


def ingest_benchmarks(wh: Warehouse) -> None:
    """The bundled benchmark rows, through the real ingest code (no Prefect needed)."""
    for bench, records in sources.mmath_records().items():
        store_records(wh, records, bench, kind="benchmarks")
    store_records(wh, sources.humaneval_records(), "humaneval", kind="benchmarks")


@pytest.fixture(scope="module")
def eval_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("eval_home")
    ingest_benchmarks(Warehouse(home))
    return home


@pytest.fixture(scope="module")
def tiny_model(eval_home):
    return tiny_llama_path(home=eval_home)


@pytest.fixture(scope="module")
def flow_result(eval_home, tiny_model):
    """One real evaluate flow run on the tiny profile, one item per benchmark."""
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POSTTRAIN_HOME", str(eval_home))
        mp.setenv("POSTTRAIN__EVALUATE__N", "4")
        mp.setenv("POSTTRAIN__EVALUATE__SYNTHETIC__PER_TASK", "2")
        from flows.evaluate import evaluate_flow
        return evaluate_flow(profile="tiny", home=str(eval_home), model=str(tiny_model), max_items=1)


FAMILIES = [f"{SYNTHETIC_BENCHMARK}/{t}" for t in ("web_of_lies", "object_properties", "object_counting")]
UNTRAINED = [f"{UNTRAINED_BENCHMARK}/rg:gcd"]   # the tiny profile's family no stage trains on


def test_flow_writes_pass_at_k_per_benchmark_and_k(flow_result, eval_home, tiny_model):
    cfg_k = [1, 4]   # configs/profiles/tiny/evaluate.yaml
    results = Warehouse(eval_home).read("eval_results")
    expected = sorted(BENCHMARKS + [SYNTHETIC_BENCHMARK, UNTRAINED_BENCHMARK] + FAMILIES + UNTRAINED)
    assert sorted(results.get_column("benchmark").unique().to_list()) == expected
    assert results.height == len(expected) * len(cfg_k)
    assert results.get_column("stage").null_count() == results.height   # a named model, not a stage
    assert set(results.get_column("k").to_list()) == set(cfg_k)
    assert results.get_column("n").unique().to_list() == [4]
    assert results.get_column("temperature").unique().to_list() == [1.0]
    assert results.get_column("top_p").unique().to_list() == [0.95]
    assert results.get_column("model").unique().to_list() == [str(tiny_model)]
    assert results.get_column("pass_at_k").is_between(0, 1).all()
    items = dict(results.filter(pl.col("k") == 1).select("benchmark", "items").iter_rows())
    assert items == {**{b: 1 for b in BENCHMARKS}, SYNTHETIC_BENCHMARK: 6, **{f: 2 for f in FAMILIES},
                     UNTRAINED_BENCHMARK: 32, UNTRAINED[0]: 32}   # per_task_untrained: 32
    # pass@k never decreases with k, item by item and so on average
    wide = results.pivot(on="k", index="benchmark", values="pass_at_k")
    assert (wide.get_column("4") >= wide.get_column("1")).all()
    assert flow_result["items"] == 42 and flow_result["synthetic_items"] == 38


def test_flow_records_items_and_mlflow_metrics(flow_result, eval_home):
    wh = Warehouse(eval_home)
    per_item = wh.read("eval_items")
    assert per_item.height == 42 and per_item.get_column("n").unique().to_list() == [4]
    assert (per_item.get_column("correct") <= per_item.get_column("n")).all()
    tracking.configure(home=eval_home)   # artifact listing resolves runs through the global tracking URI
    client = MlflowClient()
    run = client.get_run(flow_result["mlflow_run_id"])
    for bench in BENCHMARKS + [SYNTHETIC_BENCHMARK, UNTRAINED_BENCHMARK] + FAMILIES + UNTRAINED:
        assert f"eval.{bench}.pass_at_1" in run.data.metrics
        assert run.data.metrics[f"eval.{bench}.items"] >= 1
    assert run.data.tags["posttrain.model_source"] == "argument"
    # where the time went: the model's items (a named model is labelled "model"), measured
    assert 0 < run.data.metrics["eval.seconds.model.items"] <= run.data.metrics["eval.seconds.model"]
    assert "plots/eval_pass_at_k.png" in [a.path for a in client.list_artifacts(run.info.run_id, "plots")]
    inputs = {d.dataset.name.split("@")[0] for d in run.inputs.dataset_inputs}
    assert {"benchmarks", "eval_results", "eval_items"} <= inputs
    # results point back at the benchmark snapshot they were computed from
    parents = json.loads(wh.history("eval_results").get_column("parents")[0])
    assert any(p.startswith("benchmarks@") for p in parents)


def test_newest_models_row_is_the_default_model(tmp_path, tiny_model):
    wh = Warehouse(tmp_path)
    row = {"model_id": "run1/sft_short", "run_name": "run1", "stage": "sft_short", "path": str(tiny_model),
           "init_model": str(tiny_model), "profile": "tiny", "steps": 2, "data_snapshots": "[]", "config_hash": "x"}
    wh.append("models", pl.DataFrame([row]))
    wh.append("models", pl.DataFrame([{**row, "model_id": "run1/rl", "stage": "rl"}]))
    chosen = choose_model(wh)
    assert chosen == ModelChoice("run1/rl", str(tiny_model), "models table")
    assert choose_model(wh, str(tiny_model)).source == "argument"


def test_no_model_fails_with_a_clear_message(tmp_path):
    with pytest.raises(LookupError, match="no model to evaluate.*--model"):
        choose_model(Warehouse(tmp_path))
    with pytest.raises(FileNotFoundError, match="neither an alias"):
        choose_model(Warehouse(tmp_path), str(tmp_path / "missing-model"))


def test_heldout_synthetic_seeds_are_disjoint_from_training(tmp_path):
    from tasks.synth.config import SynthesizeConfig
    from tasks.synthesize import run_synthesis

    wh = Warehouse(tmp_path)
    tasks = ["game_of_24", "word_sorting"]
    training = run_synthesis(wh, SynthesizeConfig(per_task=6, tasks=tasks, default_levels=[0], use_calibration=False))
    train_df = wh.read_ref(training)
    assert (train_df.get_column("seed") >= 0).all()   # the training seed range
    spec = SyntheticHeldout(tasks=tasks, per_task=5, levels=[0])
    draw = heldout_synthetic_items(spec, set(train_df.get_column("id").to_list()))
    assert len(draw.items) == 10
    assert all(it.row["seed"] < 0 for it in draw.items)
    assert not {it.row["id"] for it in draw.items} & set(train_df.get_column("id").to_list())
    # an instance already in training is skipped and counted, even from a held-out seed
    first = get_task("game_of_24").generate(heldout_seed(0), 0)
    redraw = heldout_synthetic_items(SyntheticHeldout(tasks=["game_of_24"], per_task=2, levels=[0]), {first.id})
    assert redraw.skipped_seen_in_training == 1
    assert first.id not in {it.row["id"] for it in redraw.items} and len(redraw.items) == 2
    # so is one whose question an ingested prompt already asks (same text, another generator path)
    store_records(wh, [RawRecord("mine.jsonl", 1, {"prompt": "  " + first.question.upper() + " ",
                                                     "answer": first.answer, "domain": "logic"})], "mine")
    same_text = heldout_synthetic_items(SyntheticHeldout(tasks=["game_of_24"], per_task=2, levels=[0]),
                                        training_instance_ids(wh))
    assert same_text.skipped_seen_in_training == 1
    assert first.question not in {it.row["question"] for it in same_text.items}


class GoldAnswerBackend:
    """A test double of the RolloutBackend protocol that answers from the gold answer.

    The tiny model's outputs are noise, so it never solves anything; this double checks
    that correct answers are scored as correct and counted into pass@k. Sample ``i`` of
    every prompt is right when ``i < right``.
    """

    name = "gold-answer-double"

    def __init__(self, answers: dict[str, str], right: int):
        self.answers, self.right = answers, right

    def format_chat(self, messages):
        return messages[-1]["content"]

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        out = []
        for p in prompts:
            gold = next(a for q, a in self.answers.items() if p.startswith(q))
            out.append([Completion(text=gold if i < self.right else "no idea", token_ids=[1, 2])
                        for i in range(params.n)])
        return out


def test_correct_answers_are_counted_into_unbiased_pass_at_k(eval_home):
    wh = Warehouse(eval_home)
    cfg = EvaluateConfig(benchmarks=["math500", "humaneval"], max_items=2, n=4, k=[1, 2, 4], synthetic=None,
                         use_chat_template=False)
    items = benchmark_items(wh, cfg)
    answers = {}
    for it in items:
        if it.domain == "math":
            answers[it.row["prompt"]] = f"The answer is \\boxed{{{it.row['answer']}}}."
        else:   # HumanEval's canonical solution (stored as the answer), fenced with its signature
            answers[it.row["prompt"]] = f"```python\n{it.row['prompt']}{it.row['answer']}```"
    results = evaluate_items(items, GoldAnswerBackend(answers, right=1), cfg)
    assert [r.correct for r in results] == [1] * 4, [(r.item.item_id, r.first_error) for r in results]
    summary = summarize(results, cfg, ModelChoice("gold", "-", "argument"), "double", None)
    got = {(r["benchmark"], r["k"]): r["pass_at_k"] for r in summary.iter_rows(named=True)}
    # one correct sample in four: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1/2, pass@4 = 1
    for bench_name in ("math500", "humaneval"):
        assert got[(bench_name, 1)] == pytest.approx(0.25)
        assert got[(bench_name, 2)] == pytest.approx(0.5)
        assert got[(bench_name, 4)] == pytest.approx(1.0)


def test_config_errors_name_the_problem(eval_home):
    with pytest.raises(ValueError, match="every k must be in 1..n=4"):
        EvaluateConfig(n=4, k=[1, 8])
    with pytest.raises(LookupError, match="'gsm8k' has no rows.*available"):
        benchmark_items(Warehouse(eval_home), EvaluateConfig(benchmarks=["gsm8k"]))
    with pytest.raises(ValueError, match="levels \\[99\\] not usable for task 'game_of_24'"):
        heldout_synthetic_items(SyntheticHeldout(tasks=["game_of_24"], levels=[99]), set())


def test_stage_ladder_is_the_newest_runs_models_from_base_to_rl(tmp_path, tiny_model):
    from tasks.evaluate import ladder_table, stage_ladder

    wh = Warehouse(tmp_path)
    base = tmp_path / "base-model"
    base.mkdir()
    row = {"run_name": "old", "path": str(tiny_model), "init_model": str(base), "profile": "tiny", "steps": 2,
           "data_snapshots": "[]", "config_hash": "x"}
    handed = {}
    for run in ("old", "new"):
        for stage in ("sft_short", "sft_long", "dpo_short", "dpo_long", "rl"):
            wh.append("models", pl.DataFrame([{**row, "run_name": run, "model_id": f"{run}/{stage}", "stage": stage}]))
        handed[run] = {"models": wh.latest("models")}
    # the pipeline hands evaluate the models snapshot its own run wrote: a run that registered
    # models since (here "new", as if started beside it) is not what this run evaluates
    assert [c.model_id for c in stage_ladder(wh, ["base", "rl"], sources=handed["old"])] == ["old/base", "old/rl"]
    ladder = stage_ladder(wh, ["base", "sft_long", "dpo_long", "rl"])
    assert [(c.stage, c.model_id) for c in ladder] == [
        ("base", "new/base"), ("sft_long", "new/sft_long"), ("dpo_long", "new/dpo_long"), ("rl", "new/rl")]
    assert ladder[0].path == str(base)
    summary = pl.DataFrame([{"benchmark": "b", "k": 1, "stage": c.stage, "pass_at_k": i / 10}
                            for i, c in enumerate(ladder)])
    assert ladder_table(summary) == {"b": {"base": 0.0, "sft_long": 0.1, "dpo_long": 0.2, "rl": 0.3}}


def test_benchmark_stages_scores_public_benchmarks_only_there_and_held_out_families_everywhere():
    from tasks.evaluate import SYNTHETIC_BENCHMARK, UNTRAINED_BENCHMARK, EvalItem, EvaluateConfig

    cfg = EvaluateConfig(stages=["base", "sft_long", "rl"], benchmark_stages=["base", "rl"], n=2)
    public = EvalItem("math500", "m1", "math", {})
    trained = EvalItem(f"{SYNTHETIC_BENCHMARK}/rg:chain_sum", "s1", "math", {})
    never = EvalItem(f"{UNTRAINED_BENCHMARK}/rg:gcd", "u1", "math", {})
    assert [cfg.scores_at(public, st) for st in ("base", "sft_long", "rl")] == [True, False, True]
    assert all(cfg.scores_at(it, st) for it in (trained, never) for st in ("base", "sft_long", "rl"))
    assert cfg.scores_at(public, None)   # a model named by hand: every item
    assert all(EvaluateConfig(n=2).scores_at(public, st) for st in ("base", "sft_long"))   # default: everywhere
    with pytest.raises(ValueError, match=r"benchmark_stages \['dpo_long'\] are not among"):
        EvaluateConfig(stages=["base", "rl"], benchmark_stages=["dpo_long"], n=2)


def test_untrained_stages_score_the_never_trained_families_only_there_and_the_verdict_checks_first_vs_last():
    from tasks.evaluate import (
        SYNTHETIC_BENCHMARK,
        UNTRAINED_BENCHMARK,
        EvalItem,
        EvaluateConfig,
        ItemResult,
        ladder_intervals,
        ladder_verdict,
        untrained_falls,
    )

    stages = ["base", "sft_long", "rl", "agent"]
    cfg = EvaluateConfig(stages=stages, untrained_stages=["base", "rl", "agent"], benchmark_stages=["base", "agent"],
                         n=2)
    public = EvalItem("math500", "m1", "math", {})
    trained = [EvalItem(f"{SYNTHETIC_BENCHMARK}/rg:chain_sum", f"s{i}", "logic", {}) for i in range(20)]
    never = [EvalItem(f"{UNTRAINED_BENCHMARK}/rg:gcd", f"u{i}", "logic", {}) for i in range(20)]
    assert [cfg.scores_at(never[0], st) for st in stages] == [True, False, True, True]
    assert [cfg.scores_at(trained[0], st) for st in stages] == [True] * 4
    assert [cfg.scores_at(public, st) for st in stages] == [True, False, False, True]   # its own setting
    assert cfg.scores_at(never[0], None)   # a model named by hand: every item
    with pytest.raises(ValueError, match=r"untrained_stages \['dpo_long'\] are not among"):
        EvaluateConfig(stages=["base", "rl"], untrained_stages=["dpo_long"], n=2)

    # trained items rise at every stage; the never-trained ones (scored at base, rl, agent only) fall
    # from 2/2 at base to 0/2 at agent on every item: the first-vs-last check sees it
    def results(stage: str) -> list[ItemResult]:
        rise = stages.index(stage)
        out = [ItemResult(it, 2, min(2, rise), 10.0, 0, None) for it in trained]
        if cfg.scores_at(never[0], stage):
            out += [ItemResult(it, 2, {"base": 2, "rl": 1, "agent": 0}[stage], 10.0, 0, None) for it in never]
        return out

    by_stage = {st: results(st) for st in stages}
    intervals = ladder_intervals(by_stage)
    untrained_pairs = {(iv.a, iv.b) for iv in intervals if iv.benchmark == UNTRAINED_BENCHMARK}
    assert ("base", "agent") in untrained_pairs and ("rl", "agent") in untrained_pairs
    assert not {p for p in untrained_pairs if "sft_long" in p}   # never scored there: no interval
    ladder = {f"{SYNTHETIC_BENCHMARK}/rg:chain_sum": {"base": 0.0, "sft_long": 0.5, "rl": 1.0, "agent": 1.0},
              f"{UNTRAINED_BENCHMARK}/rg:gcd": {"base": 1.0, "rl": 0.5, "agent": 0.0}}
    falls = untrained_falls(ladder, intervals)
    assert {(iv.benchmark, iv.a, iv.b) for iv in falls} == {(f"{UNTRAINED_BENCHMARK}/rg:gcd", "base", "agent"),
                                                             (UNTRAINED_BENCHMARK, "base", "agent")}
    assert "never-trained families FELL: rg:gcd -1.00" in ladder_verdict(ladder, intervals=intervals)


def test_agent_stages_name_the_ladder_stages_that_play_the_held_out_episodes():
    from tasks.evaluate import EvaluateConfig

    agent = {"environments": [{"name": "tool_arithmetic"}], "stages": ["rl", "agent"]}
    cfg = EvaluateConfig(stages=["base", "sft_long", "rl", "agent"], agent=agent, n=2)
    assert [cfg.agent.plays_at(st) for st in ("base", "sft_long", "rl", "agent", None)] == [False, False, True,
                                                                                           True, True]
    with pytest.raises(ValueError, match=r"agent.stages \['agent'\] are not among"):
        EvaluateConfig(stages=["base", "rl"], agent=agent, n=2)
