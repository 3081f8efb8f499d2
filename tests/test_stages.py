"""The stage registry reaches every consumer; the pipeline keys its cache on what stages read."""
from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from data_specs import get_spec
from data_specs.stages import (
    STAGE_NAMES,
    TRAIN_STAGES,
    TRAINING_TABLES,
    earlier_stages,
    stages_reading,
)


def test_each_registered_stage_reaches_config_specs_runner_and_pipeline():
    from flows.pipeline import STAGES
    from tasks.train.config import STAGE_CONFIG, TrainConfig
    from tasks.train.runner import RECIPES

    cfg = TrainConfig()
    for ts in TRAIN_STAGES:
        assert isinstance(cfg.stage(ts.name), STAGE_CONFIG[ts.recipe])   # a profile block per stage
        assert ts.recipe in RECIPES
        assert ts.name in STAGES and (ts.follows is None or ts.follows in STAGES[ts.name].after)
    # the stage columns of the training tables accept exactly the stages that read them
    for table in ("sft_data", "dpo_pairs"):
        column = next(c for c in get_spec(table).columns if c.name == "stage")
        assert tuple(column.allowed) == stages_reading(table)
    assert earlier_stages("rl") == ("dpo_long", "dpo_short", "sft_long", "sft_short")
    # the first stage to run builds the base model, whose tokenizer is trained on the texts of
    # TEXT_TABLES as they stand: every first stage waits for the stages writing them (a judge
    # started after synthesize alone built it before curate had written sft_pool, and the
    # default run's every outcome moved). rollouts come later and only a cached model sees them.
    from flows.pipeline import upstream_stages
    from tasks.train.base_model import TEXT_TABLES

    writers = {"sft_pool": "curate", "prompts": "ingest", "synthetic_tasks": "synthesize"}
    for ts in TRAIN_STAGES:
        if ts.follows is None:
            assert {writers[t] for t, _ in TEXT_TABLES if t in writers} <= upstream_stages(ts.name), ts.name
    # the pipeline runs every stage after all it depends on
    order = list(STAGES)
    assert all(order.index(dep) < order.index(name) for name, st in STAGES.items() for dep in st.after)
    assert [s for s in order if s in STAGE_NAMES] == list(STAGE_NAMES)


def test_dependency_order_refuses_cycles_and_unknown_stages():
    from flows.pipeline import Stage, dependency_order

    def run(profile, home):
        return {}

    a, b = Stage("a", run, after=("b",)), Stage("b", run, after=("a",))
    with pytest.raises(ValueError, match="cycle"):
        dependency_order([a, b])
    with pytest.raises(ValueError, match="undeclared"):
        dependency_order([Stage("c", run, after=("nowhere",))])
    first, second = Stage("x", run, after=("y",)), Stage("y", run)
    assert [s.name for s in dependency_order([first, second])] == ["y", "x"]


class _Tokenizer:
    name_or_path = "test-tokenizer"

    def __len__(self) -> int:
        return 100


def _synthetic(wh, per_task: int = 6):
    from tasks.synthesize import generate_task_instances

    rows = generate_task_instances("web_of_lies", [0], per_task, 0, 3, "configured")["rows"]
    return wh.write("synthetic_tasks", pl.DataFrame(rows))


def test_training_table_is_built_once_until_a_source_changes(wh):
    from tasks.train.config import TrainConfig
    from tasks.train.data import build_table

    _synthetic(wh)
    cfg = TrainConfig(data={"rl_requires_difficulty": False})
    first, report = build_table(wh, "rl_prompts", cfg, _Tokenizer())
    assert report is not None and first is not None and first.rows == report.kept > 0
    again, report = build_table(wh, "rl_prompts", cfg, _Tokenizer())
    assert report is None and again == first                    # up to date: not rebuilt
    _synthetic(wh, per_task=8)                                  # a source changed
    third, report = build_table(wh, "rl_prompts", cfg, _Tokenizer())
    assert report is not None and third.snapshot != first.snapshot


def test_a_builder_reads_only_its_declared_sources_at_pinned_snapshots(wh, monkeypatch):
    from tasks.train import data
    from tasks.train.config import TrainConfig

    pinned = _synthetic(wh)
    _synthetic(wh, per_task=8)                    # newer, not the pinned one
    cfg = TrainConfig(data={"rl_requires_difficulty": False})
    ref, _ = data.build_table(wh, "rl_prompts", cfg, _Tokenizer(), sources={"synthetic_tasks": pinned})
    parents = {e["parent"] for e in wh.lineage("rl_prompts") if e["child"] == str(ref)}
    assert parents == {str(pinned)}               # built from the pinned snapshot, not the newest

    def reads_prompts_too(src, cfg, tokenizer):
        src.read("prompts")
        return data.build_rl_prompts(src, cfg)

    monkeypatch.setitem(data.BUILDERS, "rl_prompts", reads_prompts_too)
    with pytest.raises(KeyError, match="read 'prompts', which data_specs/stages.py does not declare"):
        data.build_table(wh, "rl_prompts", cfg, _Tokenizer())
    with pytest.raises(ValueError, match=r"not \['prompts'\]"):
        data.Sources(wh, "rl_prompts", {"prompts": None})
    assert "prompts" not in TRAINING_TABLES["rl_prompts"].sources


def test_recording_tables_sees_reads_and_writes_of_prefect_tasks(wh):
    from prefect import flow, task

    from warehouse import recording_tables

    wh.write("notes", pl.DataFrame({"x": [1]}))   # tables without a spec: any columns

    @task
    def copy():
        return wh.write("copied", wh.read("notes"))

    @flow
    def two_tasks():
        return copy.submit().result()

    with recording_tables() as use:
        ref = two_tasks()
    assert use.read == {"notes"} and use.written == [ref]
    assert use.snapshots == {"notes": wh.history("notes")["snapshot"][0]}   # the snapshot it read


def _stage_run(wh, stage: str, inputs: list[str], outputs: dict[str, list[str]]) -> None:
    wh.append("stage_runs", pl.DataFrame([{
        "stage": stage, "cache_key": "k", "inputs": json.dumps(inputs), "outputs": json.dumps(outputs),
        "config_hash": "c", "mlflow_run_id": None, "summary": "{}", "seconds": 0.0}]))


def test_a_read_table_counts_as_changed_only_when_an_earlier_stage_or_new_data_rewrote_it(wh):
    from flows.pipeline import changed_reads, last_stage_run

    pool = wh.write("pool", pl.DataFrame({"x": [1]}))
    _stage_run(wh, "dpo_short", ["pool@" + pool.snapshot, "samples@none"], {"models": ["models@m1"]})
    previous = last_stage_run(wh, "dpo_short")
    assert changed_reads(wh, "dpo_short", previous) == []
    # difficulty runs after DPO: the samples it appends (as its rollouts) do not make DPO run again
    later = wh.write("samples", pl.DataFrame({"x": [1]}))
    _stage_run(wh, "difficulty", [], {"samples": [str(later)]})
    assert changed_reads(wh, "dpo_short", previous) == []
    # samples written outside the pipeline are new data for DPO's builder
    wh.append("samples", pl.DataFrame({"x": [2]}))
    assert changed_reads(wh, "dpo_short", previous) == ["samples"]
    # and so is a pool a re-run of curate (an earlier stage) rewrote
    _stage_run(wh, "difficulty", [], {"samples": [str(wh.latest("samples"))]})
    assert changed_reads(wh, "dpo_short", previous) == []
    # the judge stage runs beside the policy stages: its model row does not make sft_short run again
    models = wh.write("models_seen", pl.DataFrame({"x": [1]}))
    _stage_run(wh, "sft_short", ["models_seen@" + models.snapshot], {})
    _stage_run(wh, "judge", [], {"models_seen": [str(wh.append("models_seen", pl.DataFrame({"x": [2]})))]})
    assert changed_reads(wh, "sft_short", last_stage_run(wh, "sft_short")) == []
    newer_pool = wh.write("pool", pl.DataFrame({"x": [3]}))
    _stage_run(wh, "curate", [], {"pool": [str(newer_pool)]})
    assert changed_reads(wh, "dpo_short", previous) == ["pool"]


def test_what_a_killed_stage_wrote_is_its_own_and_does_not_rerun_the_stages_before_it(wh):
    """A stage killed after it wrote a table but before the pipeline recorded its run (sft_long
    registered its model, then kill -9) still owns that snapshot: the catalog names its writer,
    so the rerun does not take it for new data and redo sft_short."""
    from flows.pipeline import changed_reads, last_stage_run, standing_outputs
    from warehouse import recording_writer

    models = wh.write("models_seen", pl.DataFrame({"x": [1]}))
    _stage_run(wh, "sft_short", ["models_seen@" + models.snapshot], {"models_seen": [str(models)]})
    with recording_writer("sft_long"):                     # no stage_runs row follows: killed
        wh.append("models_seen", pl.DataFrame({"x": [2]}))
    previous = last_stage_run(wh, "sft_short")
    assert changed_reads(wh, "sft_short", previous) == []
    assert standing_outputs(wh, previous)["models_seen"].snapshot == models.snapshot   # not data from outside
    wh.append("models_seen", pl.DataFrame({"x": [3]}))       # written by hand: new data
    assert changed_reads(wh, "sft_short", previous) == ["models_seen"]


def test_a_stage_run_records_what_it_read_and_wrote_in_one_form_and_old_rows_still_read(wh):
    """``inputs`` and ``outputs`` both hold table references (a TableRef's fields), so a reader
    never tells two encodings apart; rows written with ``name@snapshot`` text still read."""
    from flows.pipeline import STAGES, changed_reads, last_stage_run, record_stage_run
    from warehouse import TableRef, recording_tables

    pool = wh.write("pool", pl.DataFrame({"x": [1]}))
    with recording_tables() as use:
        wh.read("pool")
        wh.exists("absent")
        out = wh.write("notes", pl.DataFrame({"y": [1, 2]}))
    record_stage_run(wh, STAGES["dpo_short"], "k", use, "c", {}, 1.0)
    row = last_stage_run(wh, "dpo_short")
    inputs, outputs = json.loads(row["inputs"]), json.loads(row["outputs"])
    assert [TableRef(**r) for r in inputs] == [TableRef("absent", "none"), TableRef("pool", pool.snapshot)]
    assert [TableRef(**r) for r in outputs["notes"]] == [out] and outputs["notes"][0]["rows"] == 2
    assert changed_reads(wh, "dpo_short", row) == []
    wh.append("pool", pl.DataFrame({"x": [2]}))          # new data outside the pipeline
    assert changed_reads(wh, "dpo_short", row) == ["pool"]
    _stage_run(wh, "dpo_long", [str(pool), "absent@none"], {"notes": [str(out)]})   # the old text form
    assert changed_reads(wh, "dpo_long", last_stage_run(wh, "dpo_long")) == ["pool"]


def test_independent_stages_run_side_by_side_and_a_failure_stops_only_what_depends_on_it():
    import threading

    from prefect import flow, task

    from flows.pipeline import Stage, run_graph

    both_running = threading.Barrier(2, timeout=60)   # passes only if a and b run at the same time
    ran = []

    @task(task_run_name="{name}")
    def stage(name: str) -> str:
        ran.append(name)
        if name in ("a", "b"):
            both_running.wait()
        if name == "c":
            raise ValueError("boom")
        return name

    graph = {n: Stage(n, lambda profile, home, refs: {}, after=deps)
             for n, deps in [("a", ()), ("b", ()), ("c", ("a",)), ("d", ("c",)), ("e", ("b",))]}

    @flow
    def graph_flow():
        return run_graph(graph, list(graph), lambda name, _needed, upstream, _results: stage.submit(
            name, wait_for=upstream))

    results, problems = graph_flow()
    assert results == {"a": "a", "b": "b", "e": "e"}
    assert problems["c"].startswith("failed: ValueError") and problems["d"] == "not run: c did not finish"
    assert "d" not in ran


@pytest.mark.parametrize("judged", [False, True], ids=["no-judged-prompts", "judged-prompts"])
def test_a_stage_waits_for_its_after_if_stages_only_when_its_inputs_need_them(judged):
    """RL's shape: it follows `prep` always and `judge` only when asked, once `prep` is done, says
    its prompts need the judge. Not needed: it runs while the judge is still running (the judge
    waits for RL to start); needed: only after the judge finished. Either way `needs` is asked
    once, with prep's result, and `needed` reaches the submitted stage (its cache key). A stage
    starts as soon as what it follows has finished, while other stages still run."""
    import threading

    from prefect import flow, task

    from flows.pipeline import Stage, run_graph

    rl_started, judge_done, asked, order = threading.Event(), threading.Event(), [], []

    @task(task_run_name="{name}")
    def stage(name: str, needed: bool) -> str:
        if name == "judge" and not judged:
            # within 30 s: a scheduler that looked again only when every running stage had finished
            # (or each minute) would start rl after the judge, or a minute late
            assert rl_started.wait(30), "rl waited for the judge though its prompts did not need it"
        if name == "rl":
            rl_started.set()
            assert judge_done.is_set() == judged
        if name == "judge":
            judge_done.set()
        order.append(name)
        return f"{name}:{needed}"

    def run(profile, home, refs):
        return {}

    graph = {"prep": Stage("prep", run), "judge": Stage("judge", run),
             "rl": Stage("rl", run, after=("prep",), after_if=("judge",)),
             "audit": Stage("audit", run, after=("rl", "judge"))}

    def needs(name: str, upstream_results: list) -> bool:
        asked.append((name, upstream_results))
        return judged

    @flow
    def graph_flow():
        return run_graph(graph, list(graph), lambda name, needed, upstream, _results: stage.submit(
            name, needed, wait_for=upstream), needs)

    results, problems = graph_flow()
    assert problems == {} and asked == [("rl", ["prep:False"])]
    assert results["rl"] == f"rl:{judged}" and order[-1] == "audit"
    assert order.index("judge") < order.index("rl") if judged else order.index("rl") < order.index("judge")


def test_the_pipeline_runs_rl_beside_the_judge_unless_its_prompts_are_judged(wh):
    """What the pipeline asks before RL waits for the judge and the references: whether the
    rl_prompts it will build from the tables handed over hold prompts in the GenRM's domains."""
    from flows.pipeline import STAGES, _judges_prompts
    from tasks.profile import load_profile
    from tasks.train.config import TrainConfig
    from tasks.train.data import rl_genrm_prompts

    rl = STAGES["rl"]
    assert rl.after_if == ("judge", "references") and "judge" not in rl.after
    assert "references" not in STAGES["dpo_short"].after
    assert set(STAGES["audit"].after) == set(STAGES) - {"audit"}     # last, after the judge too
    cfg = load_profile("tiny").section("train", TrainConfig)
    cfg.data.rl_requires_difficulty = False
    logic = _synthetic(wh)
    assert rl_genrm_prompts(wh, cfg, {"synthetic_tasks": logic}) == 0
    pool = wh.write("rl_pool", pl.DataFrame([
        {"id": "g1", "source": "mine", "domain": "general", "prompt": "Write a haiku about rain.", "answer": None,
         "tests": None, "metadata": "{}", "content_hash": "h", "text_hash": "t", "cluster_id": "c1", "pool": "rl",
         "verifiable": False}]))
    assert rl_genrm_prompts(wh, cfg, {"synthetic_tasks": logic, "rl_pool": pool}) == 1
    assert rl_genrm_prompts(wh, cfg, {"synthetic_tasks": logic}) == 1        # rl_pool not handed over: newest
    cfg.rl.genrm.enabled = False
    assert rl_genrm_prompts(wh, cfg, {"synthetic_tasks": logic, "rl_pool": pool}) == 0
    # the profile's own rl.rl_requires_difficulty holds: undecided prompts do not train, so nothing to judge
    assert not _judges_prompts("tiny", str(wh.home), {"synthetic_tasks": logic, "rl_pool": pool})


def test_stages_hand_over_what_they_wrote_and_a_reused_stage_what_it_wrote_then(wh, monkeypatch):
    """A stage runs on the refs its upstream stages handed over and passes them on with its own
    writes; a reused stage hands over its recorded outputs, unless new data came from outside."""
    from flows import pipeline
    from flows.pipeline import Stage, handed_over, stage_task

    pool = wh.write("pool", pl.DataFrame({"x": [1]}))
    seen = {}

    def run(profile, home, refs):
        seen["refs"] = refs
        return {"mlflow_run_id": None, "out": str(wh.write("made", wh.read("pool", refs["pool"].snapshot)))}

    monkeypatch.setitem(pipeline.STAGES, "curate", Stage("curate", run))
    first = stage_task.fn("curate", "tiny", str(wh.home), False, {"pool": pool})
    made = wh.latest("made")
    assert seen["refs"] == {"pool": pool} and first["table_refs"] == {"pool": pool, "made": made}
    # unchanged: skipped, and it hands over the snapshot it wrote, not the table's newest
    later = wh.write("made", pl.DataFrame({"x": [9]}))
    pipeline.record_stage_run(wh, Stage("difficulty", run), "k", pipeline.TableUse(written=[later]), "c", {}, 0.0)
    again = stage_task.fn("curate", "tiny", str(wh.home), False, {"pool": pool})
    assert again["skipped"] and again["table_refs"]["made"] == made
    # a snapshot written outside the pipeline since is new data: the next stages get it
    outside = wh.append("made", pl.DataFrame({"x": [5]}))
    assert stage_task.fn("curate", "tiny", str(wh.home), False, {"pool": pool})["table_refs"]["made"] == outside
    # two branches holding different snapshots of one table: the one committed last is handed on
    assert handed_over(wh, [{"made": made, "pool": pool}, {"made": later}]) == {"made": later, "pool": pool}
    assert handed_over(wh, [{"made": outside}, {"made": made}])["made"] == outside


def test_training_tables_are_built_from_the_snapshots_handed_over(wh):
    """What the train flow does with the refs the pipeline hands over: each table is built from
    those of its sources (a snapshot written after the hand-over is not read)."""
    from tasks.train.config import TrainConfig
    from tasks.train.data import write_training_tables

    handed = _synthetic(wh)
    _synthetic(wh, per_task=8)                    # newer, written after the hand-over
    cfg = TrainConfig(data={"rl_requires_difficulty": False})
    refs, _ = write_training_tables(wh, cfg, _Tokenizer(), ["rl_prompts"], sources={"synthetic_tasks": handed})
    parents = {e["parent"] for e in wh.lineage("rl_prompts") if e["child"] == str(refs["rl_prompts"])}
    assert parents == {str(handed)}


def test_the_base_model_tokenizer_reads_the_text_snapshots_handed_over(wh):
    """The texts a base model's tokenizer is trained on come from the snapshots handed over (a
    snapshot written after the hand-over is not read); without a hand-over, the newest."""
    from tasks.train.base_model import warehouse_texts

    handed = _synthetic(wh)
    newer = _synthetic(wh, per_task=8)             # written after the hand-over
    texts = [t for col in ("prompt", "answer") for t in wh.read_ref(handed)[col].to_list()]
    assert warehouse_texts(wh, 10_000, {"synthetic_tasks": handed}) == texts
    assert warehouse_texts(wh, 10_000) == [t for col in ("prompt", "answer") for t in wh.read_ref(newer)[col].to_list()]
    assert texts != warehouse_texts(wh, 10_000)


def test_flows_a_pipeline_stage_runs_report_under_that_stage_s_progress_bar(wh, monkeypatch):
    """Under the pipeline, the train flow of the sft_short stage reported "train" and
    "train.sft_short" beside the stage's own bar, and the judge branch's train flow shared that
    "train" bar, marking it done while the other branch still trained. Inside a stage only the
    stage reports; the same flow run on its own (``posttrain train``) keeps its bars."""
    from prefect import flow

    from flows import pipeline
    from flows.common import report_progress, set_progress_hook
    from flows.pipeline import Stage, stage_task

    @flow
    def train_like(stage: str) -> None:
        report_progress("train", "start")
        report_progress(f"train.{stage}", "start")
        report_progress(f"train.{stage}", "done")
        report_progress("train", "done")

    def run(stage):
        def body(profile, home, refs):
            train_like(stage)
            return {"mlflow_run_id": None}
        return body

    for name in ("sft_short", "judge"):
        monkeypatch.setitem(pipeline.STAGES, name, Stage(name, run(name)))
    events = []
    set_progress_hook(lambda stage, event: events.append((stage, event)))
    try:
        @flow
        def two_branches():
            futures = [stage_task.submit(n, "tiny", str(wh.home), True) for n in ("sft_short", "judge")]
            return [f.result() for f in futures]

        two_branches()
        assert sorted(events) == [("judge", "done"), ("judge", "start"), ("sft_short", "done"), ("sft_short", "start")]
        events.clear()
        train_like("sft_long")
        assert events == [("train", "start"), ("train.sft_long", "start"), ("train.sft_long", "done"),
                          ("train", "done")]
    finally:
        set_progress_hook(None)


def test_stages_holding_one_gpu_take_turns_and_cpu_stages_run_beside_them():
    """Issue #32 item 11: the gpu profile ran references (a vLLM judge at 0.85 of the memory)
    beside dpo_short on one GPU. Stages that hold a device wait for it; others do not."""
    import threading
    import time

    from prefect import flow, task

    from flows.pipeline import Stage, run_graph

    running: set[str] = set()
    overlaps, waits = [], []
    lock = threading.Lock()
    cpu_beside_gpu = threading.Barrier(2, timeout=60)   # passes only if `cpu` runs beside a GPU stage

    @task(task_run_name="{name}")
    def stage(name: str) -> str:
        with lock:
            running.add(name)
            overlaps.append(set(running))
        if name in ("cpu", "dpo"):
            cpu_beside_gpu.wait()
        time.sleep(0.3)
        with lock:
            running.discard(name)
        return name

    def run(profile, home, refs):
        return {}

    graph = {n: Stage(n, run) for n in ("references", "dpo", "cpu")}
    devices = {"references": {"cuda:0"}, "dpo": {"cuda:0"}, "cpu": set()}

    @flow
    def graph_flow(per_device: int):
        return run_graph(graph, list(graph), lambda name, _n, upstream, _r: stage.submit(name, wait_for=upstream),
                         devices=devices.__getitem__, per_device=per_device,
                         on_device_wait=lambda name, device, holders: waits.append((name, device, holders)))

    results, problems = graph_flow(1)
    assert problems == {} and set(results) == set(graph)
    assert not any({"references", "dpo"} <= seen for seen in overlaps), overlaps
    assert waits == [("dpo", "cuda:0", ["references"])]      # told once, naming the holder

    # two stages a device: they may share it
    overlaps.clear()
    waits.clear()
    cpu_beside_gpu.reset()
    results, problems = graph_flow(2)
    assert problems == {} and waits == []


def test_the_gpu_profile_puts_its_stages_on_the_gpu_and_tiny_on_none():
    from flows.pipeline import STAGES, accelerators_in, stage_devices
    from tasks.profile import CoreSettings, load_profile

    gpu = load_profile("gpu")
    on_gpu = {n for n, s in STAGES.items() if stage_devices(s, gpu)}
    assert {"references", "dpo_short", "judge", "rl", "difficulty", "evaluate"} <= on_gpu
    assert "audit" not in on_gpu and "ingest" not in on_gpu
    tiny = load_profile("tiny")
    assert not any(stage_devices(s, tiny) for s in STAGES.values())
    assert accelerators_in({"engine": {"accelerator": "cpu"}, "judge": {"rollout": {"backend": "local",
                                                                                    "local": {"device": "cuda:1"}}}}) \
        == {"cuda:1"}
    assert gpu.section("profile", CoreSettings).stages_per_device == 1


def test_the_final_policy_stage_is_the_end_of_the_chain_not_the_last_name(monkeypatch):
    """Evaluate follows the policy's final stage and RL starts from the stages before RL, both read
    from the registry's chain: a stage appended after RL is not mistaken for RL (it used to be
    ``STAGE_NAMES[-1]``)."""
    import dataclasses

    from data_specs import stages

    assert stages.final_policy_stage() == "agent" and stages.last_of("sft") == "sft_long"
    assert stages.last_of("rl") == "rl"   # the agent stage follows RL: a phase of its own
    extra = dataclasses.replace(stages.train_stage("rl"), name="rl_long", follows="agent")
    monkeypatch.setattr(stages, "TRAIN_STAGES", (*stages.TRAIN_STAGES, extra))
    assert stages.final_policy_stage() == "rl_long"
    assert stages.stages_of("rl") == ("rl", "rl_long") and stages.last_of("rl") == "rl"
    broken = dataclasses.replace(stages.train_stage("dpo_long"), name="dpo_side", follows="sft_long")
    monkeypatch.setattr(stages, "TRAIN_STAGES", (*stages.TRAIN_STAGES, broken))
    with pytest.raises(ValueError, match="one chain"):
        stages.final_policy_stage()


_ONE_FILE_PROBE = r"""
import json, sys, types
from pathlib import Path
root, extra = Path(sys.argv[1]), sys.argv[2]
sys.path.insert(0, str(root))
import data_specs
src = (root / "data_specs/stages.py").read_text()
if extra != "none":   # the one edit a new stage takes: a TrainStage line in the registry
    table = {"sft": "sft_data", "dpo": "dpo_pairs", "rl": "rl_prompts"}[extra]
    line = f'    TrainStage("{extra}_final", "{extra}", "{table}", "agent", ("models",), "a stage after the agent"),'
    anchor = "\n)\n\nSTAGE_NAMES"
    assert anchor in src
    src = src.replace(anchor, "\n" + line + anchor, 1)
module = types.ModuleType("data_specs.stages")
module.__file__ = str(root / "data_specs/stages.py")
sys.modules["data_specs.stages"] = data_specs.stages = module
exec(compile(src, module.__file__, "exec"), module.__dict__)
from flows.pipeline import STAGES
from tasks.evaluate import LADDER

from tasks.profile import load_profile
from tasks.train.config import TrainConfig
load_profile("tiny").section("train", TrainConfig)
print(json.dumps({"after": {n: sorted(s.after) for n, s in STAGES.items()}, "ladder": list(LADDER)}))
"""


@pytest.mark.parametrize("recipe", ["sft", "dpo", "rl"])
def test_a_stage_appended_after_rl_touches_one_file(recipe):
    """Adding a training stage with an existing recipe at the end of the chain (after the agent
    stage, which follows RL) is one ``TrainStage`` line in data_specs/stages.py: the pipeline still
    forms (no cycle), every other stage waits on what it waited on before, evaluate follows the new
    end of the chain, and the evaluate ladder gains a rung for the new phase."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]

    def probe(extra: str) -> dict:
        out = subprocess.run([sys.executable, "-c", _ONE_FILE_PROBE, str(root), extra], cwd=root,
                             capture_output=True, text=True, check=False)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    before, after = probe("none"), probe(recipe)
    new = f"{recipe}_final"
    assert after["after"].pop(new) == ["agent"]
    assert after["after"].pop("evaluate") == [new] and before["after"].pop("evaluate") == ["agent"]
    assert after["after"].pop("audit") == sorted([*before["after"].pop("audit"), new])   # audit waits on all
    assert after["after"] == before["after"]
    assert before["ladder"] == ["base", "sft_long", "dpo_long", "rl", "agent"]
    # after the agent stage (a recipe of its own) every recipe's stage starts a new phase: a new rung
    assert after["ladder"] == ["base", "sft_long", "dpo_long", "rl", "agent", new]
