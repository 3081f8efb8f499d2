"""End to end: train_flow runs every stage on the tiny profile (CPU, DeepSpeed in process): the
judge, then the five policy stages, RL's GenRM judging with the judge stage's model."""
import json

import polars as pl
from mlflow.tracking import MlflowClient

from tasks.synthesize import generate_task_instances

SHORT_TASKS = ["object_counting", "boolean_expressions", "web_of_lies", "operation", "word_sorting"]
LONG_TASKS = ["skyscraper", "campsite", "calcudoko"]


SHORT_SCHEDULE = {
    "POSTTRAIN__TRAIN__SFT_SHORT__STEPS": "12", "POSTTRAIN__TRAIN__SFT_SHORT__CHECKPOINT_EVERY": "6",
    "POSTTRAIN__TRAIN__SFT_LONG__STEPS": "8", "POSTTRAIN__TRAIN__SFT_LONG__CHECKPOINT_EVERY": "4",
    "POSTTRAIN__TRAIN__DPO_SHORT__STEPS": "6", "POSTTRAIN__TRAIN__RL__STEPS": "6",
    "POSTTRAIN__TRAIN__RL__CHECKPOINT_EVERY": "3", "POSTTRAIN__TRAIN__JUDGE__STEPS": "6",
    "POSTTRAIN__TRAIN__JUDGE__CHECKPOINT_EVERY": "3",
}


def seed_synthetic_tasks(wh, per_task: int = 24):
    rows = []
    for name in SHORT_TASKS + LONG_TASKS:
        rows += generate_task_instances(name, [0, 1], per_task, 0, 3, "configured")["rows"]
    return wh.write("synthetic_tasks", pl.DataFrame(rows))


def test_train_flow_runs_every_stage_with_child_runs_and_lineage(home, wh, monkeypatch):
    from flows.train import train_flow

    # no difficulty stage here: the RL side trains undecided prompts (the pipeline test bands them)
    monkeypatch.setenv("POSTTRAIN__TRAIN__DATA__RL_REQUIRES_DIFFICULTY", "false")
    # the wiring, not the learning (test_pipeline_e2e runs the full tiny schedule)
    for key, value in SHORT_SCHEDULE.items():
        monkeypatch.setenv(key, value)
    synth = seed_synthetic_tasks(wh)
    res = train_flow(profile="tiny", home=str(home))
    stages = ["judge", "sft_short", "sft_long", "dpo_short", "dpo_long", "rl"]
    # the agent stage is optional: this profile names no environment, so it trains nothing
    assert list(res["stages"]) == [*stages, "agent"] and res["stages"]["agent"] == {
        "steps": 0, "no_data": True, "reason": "no agent_tasks rows: the profile asks for none"}

    client = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    parent = client.get_run(res["mlflow_run_id"])
    # both UIs name the run by what it trains, not "train" / a random Prefect name
    assert parent.info.run_name == "train all stages" and parent.data.tags["posttrain.stage"] == "train"
    from prefect.client.orchestration import get_client
    with get_client(sync_client=True) as prefect:
        assert prefect.read_flow_run(parent.data.tags["prefect.flow_run_id"]).name == "train all stages"
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    by_stage = {c.data.tags["posttrain.stage"]: c for c in children}
    assert set(stages) <= set(by_stage)
    for stage in stages:
        run = by_stage[stage]
        assert run.info.status == "FINISHED"
        history = client.get_metric_history(run.info.run_id, f"{stage}.loss" if stage != "rl" else "rl.reward_mean")
        assert len(history) >= 2                       # a curve, not a point
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"plots", "model", stage} <= artifacts  # curves, weights, ds_config
        assert any(d.dataset.name.startswith(("judge_data@", "sft_data@", "dpo_pairs@", "rl_prompts@"))
                   for d in run.inputs.dataset_inputs)
    rl_metrics = by_stage["rl"].data.metrics
    assert {"rl.window", "rl.generation_perplexity", "rl.response_length_p99", "rl.groups_sampled",
            "rl.level_mean"} <= set(rl_metrics)   # the level mix of the synthetic prompts drawn
    if rl_metrics["rl.groups_kept"] > 0:
        assert "rl.clip_fraction" in rl_metrics and "rl.entropy" in rl_metrics

    models = wh.read("models")
    assert models["stage"].to_list() == stages
    lineage = {e["parent"].split("@")[0] for e in wh.lineage("models")}
    assert {"judge_data", "sft_data", "dpo_pairs", "rl_prompts", "synthetic_tasks"} <= lineage
    assert json.loads(models["data_snapshots"][1])[0].startswith("sft_data@")
    # the judge starts from the base model, and no policy stage starts from the judge
    assert models["init_model"][0] == res["base_model"] and models["path"][0] not in models["init_model"].to_list()
    # the RL stage's rollouts landed in its own table, each with the policy version that sampled it
    rollouts = wh.read("rl_rollouts")
    assert rollouts.height > 0 and set(rollouts["source_table"]) == {"rl_prompts"}
    versions = rollouts.group_by("step").agg(pl.col("policy_version").first()).sort("step")["policy_version"]
    assert versions[0] == 0 and versions.is_sorted() and versions[-1] > 0
    assert not wh.exists("rollouts")   # nothing else sampled here
    assert synth.rows > 0

    # a second run retrains only from the first stage whose data changed; everything before
    # it is reused as is (the RL stage's own rollouts are not DPO data, so here: nothing)
    again = train_flow(profile="tiny", home=str(home))
    unchanged_so_far = True
    for s in stages:
        unchanged_so_far = unchanged_so_far and again["stages"][s]["data"] == res["stages"][s]["data"]
        assert again["stages"][s]["skipped"] == unchanged_so_far, s
    assert again["stages"]["sft_short"]["skipped"] and again["stages"]["sft_long"]["skipped"]

    # a stage none of whose rows fall in its length range passes its model on, and says so
    monkeypatch.setenv("POSTTRAIN__TRAIN__SFT_LONG__MIN_TOKENS", "100000")
    monkeypatch.setenv("POSTTRAIN__TRAIN__SFT_LONG__MAX_TOKENS", "200000")
    empty = train_flow(profile="tiny", home=str(home), stages=["sft_long"])
    passed = empty["stages"]["sft_long"]
    assert passed["passed_through"] and passed["steps"] == 0 and passed["path"] == empty["base_model"]
    row = wh.read("models").filter(pl.col("model_id") == f"{empty['run_name']}/sft_long")
    assert row["path"].to_list() == [empty["base_model"]] and row["steps"].to_list() == [0]
    assert client.get_run(passed["mlflow_run_id"]).data.tags["posttrain.passed_through"] == "True"


def test_rl_is_handed_the_judge_of_the_models_snapshot_it_was_given(home, wh):
    """RL's GenRM judge is a model of this home (``model: judge``): the train flow resolves it from
    the ``models`` snapshot the pipeline handed over, so a judge registered since (a later run)
    is not the one this run trains against; it enters the stage's fingerprint (#34 item 3)."""
    from flows.train import judge_model, stage_fingerprint
    from tasks.model_registry import stage_model
    from tasks.profile import load_profile
    from tasks.train.config import TrainConfig

    conf = load_profile("tiny").section("train", TrainConfig)
    assert conf.rl.genrm.enabled and conf.rl.genrm.judge.rollout.model == "judge"
    assert judge_model(wh, conf, "rl", None) is None          # no judge trained yet: resolved when asked
    row = {"run_name": "r1", "stage": "judge", "init_model": "base", "profile": "tiny", "steps": 2,
           "data_snapshots": "[]", "config_hash": "x"}
    first = wh.append("models", pl.DataFrame([{**row, "model_id": "r1/judge", "path": str(home / "judge-1")}]))
    newer = wh.append("models", pl.DataFrame([{**row, "model_id": "r2/judge", "run_name": "r2",
                                               "path": str(home / "judge-2")}]))
    assert judge_model(wh, conf, "rl", {"models": first}) == str(home / "judge-1")
    assert judge_model(wh, conf, "rl", None) == stage_model(wh, "judge") == str(home / "judge-2")
    assert stage_model(wh, "judge", sources={"models": first}) == str(home / "judge-1")
    assert judge_model(wh, conf, "sft_short", {"models": newer}) is None   # only RL has a GenRM judge
    data = first   # any snapshot: the fingerprint's other parts are held equal
    assert stage_fingerprint(wh, "c", "rl", data, "base", {}, str(home / "judge-1")) != \
        stage_fingerprint(wh, "c", "rl", data, "base", {}, str(home / "judge-2"))


def test_a_model_registered_once_is_not_registered_again_by_a_rerun_of_its_stage(home, wh):
    """A stage killed after it registered its model and before the pipeline recorded the stage
    runs again on the rerun, finds its finished checkpoint and registers: the same model (same
    row but for the MLflow run) is not added twice; a different one is."""
    from tasks.train.models import register_model

    path = home / "checkpoints" / "r" / "sft_short" / "final"
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    data = wh.write("sft_data_seen", pl.DataFrame({"x": [1]}))
    kwargs = {"run_name": "r", "stage": "sft_short", "init_model": "base", "profile": "tiny", "parents": [data],
                "config_hash": "c", "mlflow_run_id": None, "log_weights_max_mb": 0.0, "audit_violations": 0}
    first = register_model(wh, result={"path": str(path), "steps": 4, "final_loss": 1.5}, **kwargs)
    again = register_model(wh, result={"path": str(path), "steps": 4, "final_loss": 1.5}, **kwargs)
    assert again == first and wh.read("models").height == 1
    longer = register_model(wh, result={"path": str(path), "steps": 8, "final_loss": 1.2}, **kwargs)
    assert longer != first and wh.read("models")["steps"].to_list() == [4, 8]


def test_a_rerun_stage_that_finds_its_model_registered_hands_that_model_to_the_next_stage(home, wh, monkeypatch):
    """The stage after it starts from that model. A dpo_short killed after registering its model
    and before the pipeline recorded it ran again, wrote nothing (its model stood) and handed
    over the ``models`` snapshot from before it: dpo_long then started from sft_short's model
    (test_pipeline_interrupted failed in CI on it: every table from dpo_long on differed)."""
    from flows import pipeline
    from flows.pipeline import Stage, stage_task
    from flows.train import _previous_model
    from tasks.train.models import register_model

    def model(stage: str):
        path = home / "checkpoints" / "r" / stage / "final"
        path.mkdir(parents=True, exist_ok=True)
        return path

    data = wh.write("pairs_seen", pl.DataFrame({"x": [1]}))
    kwargs = {"run_name": "r", "init_model": str(model("sft_short")), "profile": "tiny", "parents": [data],
              "config_hash": "c", "mlflow_run_id": None, "log_weights_max_mb": 0.0, "audit_violations": 0}
    before = register_model(wh, stage="sft_short", result={"path": str(model("sft_short")), "steps": 2}, **kwargs)

    def dpo_short(profile, home_, refs):
        ref = register_model(wh, stage="dpo_short", result={"path": str(model("dpo_short")), "steps": 4}, **kwargs)
        return {"mlflow_run_id": None, "models": str(ref)}

    monkeypatch.setitem(pipeline.STAGES, "dpo_short", Stage("dpo_short", dpo_short))
    dpo_short("tiny", str(home), {})   # the killed run: registered, never recorded by the pipeline
    rerun = stage_task.fn("dpo_short", "tiny", str(home), False, {"models": before})
    assert wh.read("models")["stage"].to_list() == ["sft_short", "dpo_short"]   # not registered twice
    handed = rerun["table_refs"]["models"]
    assert handed == wh.latest("models") != before
    assert _previous_model(wh, "r", "dpo_long", "base", sources={"models": handed}) == str(model("dpo_short"))


def test_a_stage_the_profile_leaves_out_of_train_stages_is_named_not_trained(home, wh, monkeypatch):
    """smol goes from SFT straight to RL (train.stages without DPO): the pipeline still calls the
    DPO stages; each says why it trained nothing, and the on-policy samples that only make DPO
    pairs are not drawn."""
    from flows.samples import samples_flow
    from flows.train import train_flow

    monkeypatch.setenv("POSTTRAIN__TRAIN__STAGES", "[judge, sft_short, sft_long, rl, agent]")
    res = train_flow(profile="tiny", home=str(home), stages=["dpo_short", "dpo_long"])
    reason = "not in train.stages of profile tiny (judge, sft_short, sft_long, rl, agent)"
    assert res["stages"] == {"dpo_short": {"steps": 0, "not_in_profile": True, "reason": reason},
                             "dpo_long": {"steps": 0, "not_in_profile": True, "reason": reason}}
    assert res["final_model"] is None and not wh.exists("dpo_pairs") and not wh.exists("models")

    monkeypatch.setenv("POSTTRAIN__SAMPLES__ON_POLICY__ENABLED", "true")
    out = samples_flow("on_policy", profile="tiny", home=str(home))
    assert out["enabled"] is False and out["tables"] == {}
    assert out["idle"].startswith("no DPO stage in train.stages (judge, sft_short, sft_long, rl, agent)")

    from flows.pipeline import idle_stages
    assert idle_stages({"on_policy": out, "dpo_short": res}) == [
        {"stage": "on_policy", "reason": out["idle"]}, {"stage": "dpo_short", "reason": reason},
        {"stage": "dpo_long", "reason": reason}]
