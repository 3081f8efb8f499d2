"""The training-data audit, and the data links it guards (issue: the pipeline proves it works).

A warehouse is built by the real stages (ingest -> curate -> synthesize -> training data
builders). The one stand-in is the ``difficulty`` table, written here as a difficulty run
would write it (the real stage needs a model that can solve the prompts; tests of the
stage itself are in test_difficulty.py).
"""
from __future__ import annotations

import json

import polars as pl
import pytest
from test_train_engine import SMALL_MODEL

from data_specs import get_spec
from tasks.audit import AuditFailed, run_audit
from tasks.curate.config import CurateConfig, SemanticConfig
from tasks.curate.pipeline import run_curate
from tasks.ingest import store_records
from tasks.records import RawRecord
from tasks.synth.config import SyntheticSplitConfig
from tasks.synthesize import generate_task_instances
from tasks.train.config import TrainConfig
from tasks.train.data import (
    Sources,
    build_dpo_pairs,
    build_rl_prompts,
    build_sft_data,
    write_training_tables,
)
from warehouse import TableRef

TASKS = ["object_counting", "boolean_expressions", "operation"]
MC = "Which number is the largest? (A) 2 (B) 9 (C) 4"
PROMPTS = (
    [{"prompt": f"A shelf holds {n} red books and {m} blue books. How many books are on the shelf in total?",
      "answer": str(n + m), "domain": "math"} for n, m in [(3, 4), (5, 6), (7, 8), (9, 2), (4, 4), (6, 1)]]
    + [{"prompt": MC, "answer": "B", "domain": "math"},
       {"prompt": "How many positive divisors does the number 3600 have?", "answer": "45", "domain": "math"},
       {"prompt": "Write a short poem about the sea and its colours.", "solution": "Waves of blue.",
        "domain": "general"},
       {"prompt": "Describe a quiet morning in a small harbour town.", "answer": "Gulls and grey water.",
        "domain": "general"},
       {"prompt": "Write a friendly note thanking a neighbour for watering the plants.",
        "answer": "Thank you, the plants look happier than ever.", "domain": "general"}]
)
BENCH = {"item_id": "b1", "prompt": "How many positive divisors does the number 3600 have?", "answer": "45",
         "domain": "math"}


def train_config(**data) -> TrainConfig:
    return TrainConfig(base_model={"kind": "hybrid", "name": "audit-base", "tokenizer_texts": 300},
                       data={"synthetic_per_task": 20, "judge_examples_per_task": 4, "judge_open_pairs": 4, **data},
                       sft_short={"max_tokens": 400}, sft_long={"min_tokens": 401, "max_tokens": 2048},
                       dpo_short={"max_tokens": 400}, dpo_long={"min_tokens": 401, "max_tokens": 2048},
                       judge={"max_tokens": 2048})


def write_difficulty(wh, decisions: dict[str, str], run_id: str) -> None:
    """The rows a difficulty run writes (stand-in for sampling a model)."""
    rows = [{"prompt_id": pid, "source_table": "x", "domain": "logic", "n": 4, "correct": 2, "decision": d,
             "model": "stand-in", "run_id": run_id} for pid, d in decisions.items()]
    wh.append("difficulty", get_spec("difficulty").conform(pl.DataFrame(rows)))


def seed_curated(wh, per_task: int) -> list[dict]:
    """Ingest ``PROMPTS`` and the benchmark item, curate them (the item is decontaminated away) and
    write ``per_task`` synthetic instances of each of ``TASKS``; the synthetic rows."""
    store_records(wh, [RawRecord("t.jsonl", i + 1, data=r) for i, r in enumerate(PROMPTS)], "unit")
    store_records(wh, [RawRecord("b.jsonl", 1, data=BENCH)], "tinybench", kind="benchmarks")
    run_curate(wh, CurateConfig(semantic=SemanticConfig(enabled=False),
                                decontam={"embedding": False}, split={"rl_fraction": 0.5}))
    rows = []
    for name in TASKS:
        rows += generate_task_instances(name, [0], per_task, 0, 3, "configured", SyntheticSplitConfig())["rows"]
    wh.write("synthetic_tasks", pl.DataFrame(rows))
    return rows


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from transformers import AutoTokenizer

    from tasks.train.base_model import prepare_base_model
    from warehouse import Warehouse

    wh = Warehouse(tmp_path_factory.mktemp("audit"))
    rows = seed_curated(wh, per_task=16)
    cfg = train_config()
    tokenizer = AutoTokenizer.from_pretrained(prepare_base_model(wh, cfg.base_model, SMALL_MODEL))
    rl_side = wh.read("rl_pool")["id"].to_list() + [r["id"] for r in rows if r["split"] == "rl"]
    # the first difficulty run keeps every RL-side prompt; a later run rejects two of them
    write_difficulty(wh, dict.fromkeys(rl_side, "keep"), "run-1")
    write_difficulty(wh, {rl_side[-1]: "too_easy", rl_side[-2]: "unsolved"}, "run-2")
    write_training_tables(wh, cfg, tokenizer)
    return wh, cfg, tokenizer, rl_side


def test_synthetic_instances_split_by_cluster_with_both_sides_per_task(built):
    wh, *_ = built
    synth = wh.read("synthetic_tasks")
    assert set(synth["split"]) == {"sft", "rl"}
    assert synth.group_by("cluster_id").agg(pl.col("split").n_unique())["split"].max() == 1
    per_task = synth.group_by("task").agg(pl.col("split").n_unique().alias("sides"))
    assert per_task["sides"].min() == 2
    # seeded: the same seed gives the same sides, another seed moves some clusters
    again = generate_task_instances(TASKS[0], [0], 16, 0, 3, "configured", SyntheticSplitConfig())["rows"]
    other = generate_task_instances(TASKS[0], [0], 16, 0, 3, "configured", SyntheticSplitConfig(seed=7))["rows"]
    mine = dict(zip(synth["id"], synth["split"]))
    assert all(mine[r["id"]] == r["split"] for r in again)
    assert any(mine[r["id"]] != r["split"] for r in other)


def test_training_tables_use_the_curated_text_of_their_own_side(built):
    wh, *_ = built
    sft_pool, rl_pool = wh.read("sft_pool"), wh.read("rl_pool")
    synth = wh.read("synthetic_tasks")
    sft_side = set(sft_pool["id"]) | set(synth.filter(pl.col("split") == "sft")["id"])
    rl_ids = set(rl_pool["id"]) | set(synth.filter(pl.col("split") == "rl")["id"])
    sft, dpo, rl = wh.read("sft_data"), wh.read("dpo_pairs"), wh.read("rl_prompts")
    assert set(sft["source_id"]) <= sft_side and set(dpo["prompt_id"]) <= sft_side
    assert set(rl["prompt_id"]) <= rl_ids and sft.height and dpo.height and rl.height
    # curated text reaches training: the multiple-choice prompt was rewritten by curate
    curated = {r["id"]: r["prompt"] for r in pl.concat([sft_pool, rl_pool]).iter_rows(named=True)}
    raw = {r["id"]: r["prompt"] for r in wh.read("prompts").iter_rows(named=True)}
    mc_id = next(i for i, p in raw.items() if p == MC)
    assert curated.get(mc_id, MC) != MC, "curate should rewrite the multiple-choice prompt"
    for table, col in ((sft, "source_id"), (dpo, "prompt_id"), (rl, "prompt_id")):
        for r in table.filter(pl.col("source_table") != "synthetic_tasks").iter_rows(named=True):
            assert r["prompt"] == curated[r[col]]
    # and the verifier checks RL samples against the curated answer (a rewrite changes both)
    curated_answers = {r["id"]: r["answer"] for r in pl.concat([sft_pool, rl_pool]).iter_rows(named=True)}
    for r in rl.filter(pl.col("source_table") != "synthetic_tasks").iter_rows(named=True):
        assert r["answer"] == curated_answers[r["prompt_id"]]


def test_the_latest_difficulty_decision_wins(built):
    wh, cfg, _, rl_side = built
    rl = set(wh.read("rl_prompts")["prompt_id"])
    assert rl_side[-1] not in rl and rl_side[-2] not in rl      # kept in run-1, rejected in run-2
    assert set(rl_side[:-2]) <= rl
    _, _, report = build_rl_prompts(Sources(wh, "rl_prompts"), cfg)
    assert report.dropped == {"difficulty_too_easy": 1, "difficulty_unsolved": 1}
    assert report.seen == report.kept + sum(report.dropped.values())


def test_without_a_curated_pool_nothing_trains_from_raw_prompts(tmp_path):
    from warehouse import Warehouse

    wh = Warehouse(tmp_path)
    store_records(wh, [RawRecord("t.jsonl", i + 1, data=r) for i, r in enumerate(PROMPTS)], "unit")
    cfg = train_config()
    assert build_sft_data(Sources(wh, "sft_data"), cfg, None)[0].is_empty()
    assert build_dpo_pairs(Sources(wh, "dpo_pairs"), cfg, None)[0].is_empty()
    assert build_rl_prompts(Sources(wh, "rl_prompts"), train_config(rl_requires_difficulty=False))[0].is_empty()


def test_audit_passes_on_what_the_builders_wrote(built):
    wh, *_ = built
    report = run_audit(wh)
    assert report.passed, report.describe()
    names = {c.name: c.checked for c in report.checks}
    assert set(names) == {"training_snapshots", "sft_side", "dpo_side", "rl_side", "judge_side", "no_prompt_on_both_sides",
                          "no_cluster_on_both_sides", "no_benchmark_item", "rl_latest_difficulty_keep",
                          "sampled_targets_verified", "agent_no_benchmark_item", "agent_heldout_seeds",
                          "trajectory_loss_mask"}
    # this warehouse's SFT targets are gold and its DPO rejected sides perturbations: nothing sampled;
    # no agent stage ran (its checks are in test_agent_stage.py)
    assert names.pop("sampled_targets_verified") == 0
    assert [names.pop(n) for n in ("agent_no_benchmark_item", "agent_heldout_seeds", "trajectory_loss_mask")] == [0] * 3
    assert all(v > 0 for v in names.values()), names
    # the judge's open pairs (an SFT-pool prompt quoted in its judge prompt) are among the rows checked
    assert (wh.read("judge_data")["source_table"] == "sft_pool").sum() > 0


def _planted(wh, name: str, frame: pl.DataFrame):
    """Replace ``name`` with ``frame`` for one audit, then restore the previous snapshot's content."""
    before = wh.read(name)
    wh.write(name, frame)
    try:
        return run_audit(wh)
    finally:
        wh.write(name, before)


def _failed(report, check: str) -> list[str]:
    return next(c.offending for c in report.checks if c.name == check)


def test_audit_fails_on_a_planted_cross_side_row(built):
    wh, *_ = built
    sft_synth = wh.read("synthetic_tasks").filter(pl.col("split") == "sft").row(0, named=True)
    rl = wh.read("rl_prompts")
    planted = rl.head(1).with_columns(pl.lit(sft_synth["id"]).alias("prompt_id"),
                                      pl.lit(sft_synth["prompt"]).alias("prompt"),
                                      pl.lit("synthetic_tasks").alias("source_table"))
    report = _planted(wh, "rl_prompts", pl.concat([rl, planted]))
    assert not report.passed
    assert any(sft_synth["id"] in o and "sft side" in o for o in _failed(report, "rl_side"))
    assert any(sft_synth["id"] in o for o in _failed(report, "no_prompt_on_both_sides"))
    assert any(sft_synth["id"] in o for o in _failed(report, "rl_latest_difficulty_keep"))


def test_audit_fails_on_a_judge_example_built_on_an_rl_side_instance(built):
    """The judge trains on SFT-side instances only: one quoting an RL-side instance is flagged."""
    wh, *_ = built
    rl_synth = wh.read("synthetic_tasks").filter(pl.col("split") == "rl").row(0, named=True)
    judge = wh.read("judge_data")
    planted = judge.head(1).with_columns(pl.lit("planted").alias("example_id"), pl.lit(rl_synth["id"]).alias("source_id"),
                                         pl.lit(f"[Problem]\n{rl_synth['prompt']}").alias("prompt"))
    report = _planted(wh, "judge_data", pl.concat([judge, planted]))
    assert any(rl_synth["id"] in o and "rl side" in o for o in _failed(report, "judge_side"))


def test_audit_fails_on_a_planted_contaminated_row(built):
    wh, *_ = built
    sft = wh.read("sft_data")
    planted = sft.head(1).with_columns(pl.lit("contaminated").alias("example_id"),
                                       pl.lit(BENCH["prompt"]).alias("prompt"))
    report = _planted(wh, "sft_data", pl.concat([sft, planted]))
    offending = _failed(report, "no_benchmark_item")
    assert any("tinybench:b1" in o for o in offending), offending
    # the decontaminated pool row itself, slipped into sft_data under its own id
    removed = wh.read("decisions").filter(pl.col("stage") == "curate.decontam")["row_id"].to_list()
    assert removed
    sneaky = sft.head(1).with_columns(pl.lit("sneaky").alias("example_id"), pl.lit(removed[0]).alias("source_id"),
                                      pl.lit("a rephrased text").alias("prompt"))
    report = _planted(wh, "sft_data", pl.concat([sft, sneaky]))
    assert any(removed[0] in o and "decontamination" in o for o in _failed(report, "no_benchmark_item"))


def test_the_audit_reads_the_snapshots_handed_over_not_the_newest(built):
    """The pipeline hands the audit what its stages wrote (#34 item 3): a training table written
    after (a later run, a hand edit) is not what this run trained on, so it neither fails nor
    passes this run's audit; without a hand-over the newest is audited."""
    wh, *_ = built
    clean = wh.latest("sft_data")
    sft = wh.read("sft_data")
    planted = sft.head(1).with_columns(pl.lit("contaminated").alias("example_id"), pl.lit(BENCH["prompt"]).alias("prompt"))
    wh.write("sft_data", pl.concat([sft, planted]))
    try:
        handed = {"sft_data": clean, "benchmarks": wh.latest("benchmarks")}
        report = run_audit(wh, sources=handed)
        assert report.passed, report.describe()
        assert report.snapshots["sft_data"] == str(clean)
        assert not run_audit(wh).passed
    finally:
        wh.write("sft_data", sft)


def test_audit_flow_fails_the_run_and_the_cli_prints_offending_ids(built, monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from flows.audit import audit_flow
    from flows.cli import app

    wh, *_ = built
    assert audit_flow(home=str(wh.home))["passed"]
    rl = wh.read("rl_prompts")
    wh.write("rl_prompts", pl.concat([rl, rl.head(1).with_columns(pl.lit("ghost").alias("prompt_id"))]))
    try:
        with pytest.raises(AuditFailed, match="violation"):
            audit_flow(home=str(wh.home))
        out = CliRunner().invoke(app, ["audit", "--home", str(wh.home)], catch_exceptions=False)
        assert out.exit_code == 1 and "ghost" in out.output and "FAILED" in out.output
    finally:
        wh.write("rl_prompts", rl)


def test_the_per_task_cap_applies_to_the_prompts_difficulty_kept(built, tmp_path):
    """A task's kept prompts past its first ``synthetic_per_task`` ids still train: the cap
    counts kept prompts (capping first dropped kept prompts for ones difficulty rejected)."""
    import shutil

    from warehouse import Warehouse

    shared, *_ = built
    wh = Warehouse(shutil.copytree(shared.home, tmp_path / "home"))   # its own difficulty run, on a copy
    synth = wh.read("synthetic_tasks").filter(pl.col("split") == "rl").sort("id")
    task = synth["task"][0]
    ids = synth.filter(pl.col("task") == task)["id"].to_list()
    assert len(ids) >= 4
    # the task's first two ids rejected, the rest kept; a cap of 2 then takes ids[2:4]
    write_difficulty(wh, {**dict.fromkeys(ids[:2], "unsolved"), **dict.fromkeys(ids[2:], "keep")}, "run-cap")
    rows, _, report = build_rl_prompts(Sources(wh, "rl_prompts"), train_config(synthetic_per_task=2))
    mine = rows.filter(pl.col("task") == task)["prompt_id"].to_list()
    assert mine == ids[2:4]
    assert report.dropped["over_synthetic_per_task"] >= len(ids) - 4
    assert report.seen == report.kept + sum(report.dropped.values())


def test_judge_open_pairs_come_from_open_sft_pool_prompts_balanced(built):
    """Open pairs: an SFT-pool open prompt's own reference against another prompt's, both
    slots, the bare verdict naming the prompt's own answer; distinct pairs on one prompt
    are distinct examples."""
    from tasks.genrm.parse import parse_pairwise
    from tasks.train.data import _sft_frame, judge_rows
    from tasks.train.judge_data import open_pair_rows

    wh, _, tokenizer, _ = built
    rows = [{"id": f"p{i}", "_table": "sft_pool", "prompt": f"Request {i}", "gold": f"answer {i}"} for i in range(3)]
    pairs = open_pair_rows(rows, 12, seed=0)
    assert len(pairs) == 12 and {p["source_table"] for p in pairs} == {"sft_pool"}
    labels = [parse_pairwise(p["response"]).value for p in pairs]
    assert labels.count(-1) == labels.count(1) == 6
    for p, label in zip(pairs, labels):
        i = p["source_id"][1:]
        own_slot = "[Answer 1]" if label == -1 else "[Answer 2]"
        assert p["prompt"].split(own_slot)[1].lstrip().startswith(f"answer {i}")
        assert p["prompt"].count(f"answer {i}") == 1 and f"Request {i}" in p["prompt"]
    assert open_pair_rows(rows[:1], 4, seed=0) == []
    # every distinct pair is its own judge_data example (one prompt, one verdict, other answers)
    frame, _, report = _sft_frame(pairs, [], "judge_data", train_config(), tokenizer)
    assert frame.height == len({(p["prompt"], p["response"]) for p in pairs}) > 3 and not report.dropped
    # through the builder: pairs only on the pool's open prompts
    open_ids = set(wh.read("sft_pool").filter(pl.col("domain").is_in(["general", "instruction"]))["id"])
    built_rows = [r for r in judge_rows(Sources(wh, "judge_data"), train_config(judge_open_pairs=6), [])
                  if r["source_table"] == "sft_pool"]
    assert len(open_ids) > 1 and len(built_rows) == 6 and {r["source_id"] for r in built_rows} <= open_ids


# -- what each model trained on (issue #32, item 2) -------------------------------------------

def _register(wh, stage: str, snapshots: list[str]) -> None:
    row = {"model_id": f"audit-run/{stage}", "run_name": "audit-run", "stage": stage, "path": "/nowhere",
           "init_model": "base", "profile": "test", "steps": 1, "final_loss": 0.1,
           "data_snapshots": json.dumps(snapshots), "config_hash": "c", "mlflow_run_id": None,
           "num_parameters": 1}
    wh.append("models", get_spec("models").conform(pl.DataFrame([row])))


def test_a_later_difficulty_run_does_not_fail_the_model_that_trained_before_it(built):
    """The RL model trained on rl_prompts built from the difficulty decisions of its day; a
    difficulty run after it rejects one of those prompts. The model's training was correct:
    the audit checks its snapshot against the decisions it was built from (the old audit read
    the newest decisions and failed it)."""
    wh, *_ = built
    # the snapshot the builder wrote (earlier tests plant and restore rows without lineage), newest again
    history = wh.history("rl_prompts").filter(pl.col("parents").str.contains("difficulty@"))
    as_built = TableRef("rl_prompts", history["snapshot"][-1])
    rl = wh.write("rl_prompts", wh.read_ref(as_built), parents=_parent_names(wh, as_built))
    _register(wh, "rl", [str(rl)])
    difficulty = wh.read("difficulty")
    kept_prompt = wh.read("rl_prompts")["prompt_id"][0]
    write_difficulty(wh, {kept_prompt: "too_easy"}, "run-3")
    try:
        report = run_audit(wh)
        assert report.passed, report.describe()
        assert report.snapshots["rl_prompts"] == str(rl)
        assert report.snapshots["difficulty"] != str(wh.latest("difficulty"))   # the decisions of its build
        # an rl_prompts table built now, from the newest decisions, would be checked against them
        planted = wh.write("rl_prompts", wh.read_ref(rl), parents=[wh.latest("difficulty")])
        report = run_audit(wh)
        assert any(kept_prompt in o and str(planted) in o for o in _failed(report, "rl_latest_difficulty_keep"))
        wh.write("rl_prompts", wh.read_ref(rl), parents=_parent_names(wh, rl))   # as built, for the tests after
    finally:
        wh.write("difficulty", difficulty)


def _parent_names(wh, ref) -> list[str]:
    return [str(p) for p in wh.parents(ref.name, ref.snapshot)]


def test_a_training_snapshot_a_model_names_must_exist(built):
    wh, *_ = built
    _register(wh, "sft_short", ["sft_data@20990101T000000-deadbeef"])
    report = run_audit(wh)
    assert any("audit-run/sft_short" in o and "no longer holds" in o for o in _failed(report, "training_snapshots"))
    _register(wh, "sft_short", [str(wh.latest("sft_data"))])     # the stage's newest model again
    assert run_audit(wh).passed


def test_a_home_with_no_training_table_fails_the_audit(tmp_path):
    from warehouse import Warehouse

    report = run_audit(Warehouse(tmp_path))
    assert not report.passed
    assert any("nothing trained to audit" in o for o in _failed(report, "training_snapshots"))
