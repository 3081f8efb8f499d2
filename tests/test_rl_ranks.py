"""RL on two DeepSpeed ranks (torchrun, gloo) beside a ``serve-model`` rollout engine: the same
curve as one process, policy versions in every rollout, and a SIGKILLed rank recovered by
resuming from the last checkpoint with the engine restarted on those weights."""
import re
import signal
import time
from pathlib import Path

import polars as pl
import psutil
from test_rollout_engine import engine_config
from test_train_engine import seeded_sft_job

from tasks.profile import load_profile
from tasks.rollout.config import RolloutConfig
from tasks.train import checkpoint
from tasks.train.config import TrainConfig
from tasks.train.engine import run_launcher
from tasks.train.harness import StageJob
from tasks.train.rl import _minibatches
from tasks.train.runner import execute_stage

STEPS = 5


def rl_job(wh, sft_job, name: str, ranks: int) -> StageJob:
    cfg = engine_config()
    cfg.rl.steps, cfg.rl.checkpoint_every = STEPS, 2
    cfg.rl.rollout_engine.restarts = 0
    # the same micro-batches either way: 2 ranks x 1, or 1 rank accumulating 2
    cfg.engine.micro_batch_size = 4
    if ranks == 1:
        cfg.engine.gradient_accumulation_steps = 2
    else:
        cfg.engine.num_ranks, cfg.engine.launcher = ranks, "torchrun"
    return StageJob(stage="rl", home=str(wh.home), run_name=name, profile="test", init_model=sft_job.init_model,
                    data_ref=str(wh.latest("rl_prompts")), config=cfg.model_dump(), fingerprint=name)


def _rank_process(launcher: psutil.Process, rank: str) -> psutil.Process | None:
    for child in launcher.children(recursive=True):
        try:
            if "launcher_entry" in " ".join(child.cmdline()) and child.environ().get("RANK") == rank:
                return child
        except psutil.Error:
            continue
    return None


def _kill_rank_after_checkpoint(job: StageJob) -> int:
    """Start the ranks, SIGKILL rank 1 once a checkpoint and a step past it exist; the step reached."""
    stage = job.stage_path
    stage.mkdir(parents=True, exist_ok=True)
    job.save(stage / "job.json")
    proc = run_launcher(job.train_config.engine, stage / "job.json", stage / "launcher.log")
    deadline = time.time() + 600
    try:
        while time.time() < deadline:
            done = checkpoint.latest_step(stage)
            if done is not None and len(checkpoint.StepLog(stage, enabled=False).records()) > done:
                break
            assert proc.poll() is None, (stage / "launcher.log").read_text()[-3000:]
            time.sleep(0.1)
        _rank_process(psutil.Process(proc.pid), "1").send_signal(signal.SIGKILL)
        assert proc.wait(timeout=120) != 0     # torchrun ends the stage when a rank dies
    finally:
        if proc.poll() is None:
            proc.kill()
    return checkpoint.latest_step(stage)


def _engine_processes() -> set[int]:
    out = set()
    for p in psutil.process_iter(["cmdline"]):
        if "tasks.rollout.server" in " ".join(p.info["cmdline"] or []):
            out.add(p.pid)
    return out


def test_two_rank_rl_with_an_engine_matches_one_process_and_survives_a_killed_rank(wh):
    engines_before = _engine_processes()
    sft_job = seeded_sft_job(wh, engine_config())
    single = rl_job(wh, sft_job, "one-rank", 1)
    execute_stage(single)
    reference = checkpoint.StepLog(single.stage_path, enabled=False).records()

    job = rl_job(wh, sft_job, "two-ranks", 2)
    resumed_from = _kill_rank_after_checkpoint(job)
    assert resumed_from is not None and resumed_from < STEPS and not checkpoint.is_done(job.stage_path)
    result = execute_stage(job, timeout_s=600)        # resumed: engine restarted with the checkpoint's weights
    assert result["world_size"] == 2
    curve = checkpoint.StepLog(job.stage_path, enabled=False).records()
    assert [r["step"] for r in curve] == list(range(STEPS))
    for mine, theirs in zip(curve, reference):
        assert mine["reward_mean"] == theirs["reward_mean"], (mine, theirs)
        assert abs(mine["loss"] - theirs["loss"]) < 1e-4, (mine["step"], mine["loss"], theirs["loss"])
        assert mine["policy_staleness"] == 0.0

    rollouts = wh.read("rl_rollouts").filter(pl.col("train_run") == "two-ranks")
    versions = rollouts.group_by("step").agg(pl.col("policy_version").unique()).sort("step")
    assert versions["step"].to_list() == list(range(STEPS))          # each step stored once, by rank 0
    assert versions["policy_version"].to_list() == [[2 * s] for s in range(STEPS)]
    assert rollouts.height == STEPS * 16 and set(rollouts["staleness"]) == {0}
    assert set(rollouts["backend"]) == {"serve-model"}
    # no engine outlives its stage, not even the one whose rank 0 torchrun tore down
    deadline = time.time() + 10
    while _engine_processes() - engines_before and time.time() < deadline:
        time.sleep(0.2)
    assert not _engine_processes() - engines_before


def m1_scaled_down(sft_job) -> TrainConfig:
    """The ``m1`` profile's RL stage in its shape (ZeRO-3 ranks through a launcher, a serve-model
    engine fed every update, CISPO, staged windows, the GenRM on open prompts) at CPU scale:
    2 ranks instead of 8, fp32 on CPU, the tiny model and judge, token windows / 4096."""
    m1 = load_profile("m1").section("train", TrainConfig)
    rl = m1.rl.model_copy(deep=True)
    rl.steps, rl.checkpoint_every, rl.prompts_per_step, rl.group_size, rl.updates_per_batch = 3, 2, 4, 4, 2
    rl.windows = [w.model_copy(update={"max_tokens": max(2, w.max_tokens // 4096 - 8)}) for w in rl.windows]
    rl.gates = rl.gates.model_copy(update={"ppl_patience": 2, "min_steps_per_window": 1})
    rl.curriculum = [rl.curriculum[0]]                     # its first phase (math, logic, code)
    rl.genrm.judge.rollout = RolloutConfig(backend="local", model="tiny-llama", n=1, max_tokens=4,
                                           repetition_window=None)
    # dynamic sampling on (M1's), one round: a dropped group is a shortfall the update must absorb
    rl.repetition_window, rl.dynamic_sampling, rl.max_sampling_rounds = None, True, 1
    rl.rollout_engine = rl.rollout_engine.model_copy(update={"device": "cpu", "dtype": "float32", "threads": 1,
                                                              "batch_size": 64, "startup_timeout_s": 180})
    # M1's proportions: its 16 x 8 micro-batches take 8 groups of 16 per update, these 4 x 2 take 2 of
    # 4, so an update left with one group (dynamic sampling's shortfall) has slices with no response
    engine = m1.engine.model_copy(update={"num_ranks": 2, "launcher": "torchrun", "accelerator": "cpu",
                                          "precision": "fp32", "micro_batch_size": 1,
                                          "gradient_accumulation_steps": 4, "threads_per_rank": 1})
    assert engine.zero_stage == 3 and rl.loss == "cispo" and rl.rollout_engine.kind == "serve-model"
    return TrainConfig(seed=0, base_model=sft_job.train_config.base_model, engine=engine, rl=rl,
                       optimizer=m1.optimizer.model_copy(update={"lr": 1e-3}))


def test_the_m1_rl_stage_runs_in_its_shape_scaled_down(wh):
    """With dynamic sampling on, an update that keeps fewer groups than its micro-batches divide
    (issue #32, item 4: m1 crashed there) is still one optimizer step, and the step metrics say
    how it was split."""
    sft_job = seeded_sft_job(wh, engine_config())
    cfg = m1_scaled_down(sft_job)
    job = StageJob(stage="rl", home=str(wh.home), run_name="m1-shape", profile="m1", init_model=sft_job.init_model,
                   data_ref=str(wh.latest("rl_prompts")), config=cfg.model_dump(), fingerprint="m1-shape",
                   # the ranks are other processes: the reward that makes groups drop is named, not passed
                   extra={"reward_fn": f"{Path(__file__).parent / 'rl_shortfall_reward.py'}:parity_except_web_of_lies"})
    result = execute_stage(job, timeout_s=600)
    assert result["world_size"] == 2 and checkpoint.is_done(job.stage_path)
    curve = checkpoint.StepLog(job.stage_path, enabled=False).records()
    assert [r["step"] for r in curve] == [0, 1, 2] and all(r["policy_staleness"] == 0.0 for r in curve)
    short = [r for r in curve if r["groups_shortfall"] > 0 and r["groups_kept"] > 0]
    assert short, [(r["groups_kept"], r["groups_shortfall"]) for r in curve]
    parts, versions, updates_so_far = 4 * 2, {}, 0
    for r in curve:
        kept = int(r["groups_kept"])
        assert kept + r["groups_shortfall"] == cfg.rl.prompts_per_step
        versions[r["step"]] = updates_so_far
        minibatches = _minibatches(kept, cfg.rl.group_size, cfg.rl.updates_per_batch) if kept else []
        updates_so_far += len(minibatches)
        if kept:   # what the split had to do, from the responses each update held
            assert r["uneven_updates"] == sum(len(m) % parts != 0 for m in minibatches)
            assert r["zero_weight_micro_batches"] == sum(max(0, parts - len(m)) for m in minibatches)
    assert any(r["zero_weight_micro_batches"] > 0 or r["uneven_updates"] > 0 for r in short)
    rollouts = wh.read("rl_rollouts").filter(pl.col("train_run") == "m1-shape")
    # every update was one optimizer step: the engine's weights are that many steps on at each step
    by_step = rollouts.group_by("step").agg(pl.col("policy_version").unique()).sort("step")
    assert dict(zip(by_step["step"], by_step["policy_version"].to_list())) == {s: [v] for s, v in versions.items()}
    assert set(rollouts["backend"]) == {"serve-model"}
    # each rollout names the weights that sampled it, as the models table names the stage's model
    # (issue #32, item 8: every row said the stage's initial model)
    labels = rollouts.select("model", "policy_version").unique()
    assert labels.height == len(set(versions.values())) > 1
    assert all(model == f"m1-shape/rl@update{v}" for model, v in labels.iter_rows())


def _two_rank_profile(tmp_path) -> str:
    """The tiny profile with its RL stage on 2 torchrun ranks (ZeRO-2) beside a serve-model
    engine, scaled to a few steps; the GenRM is off (this home trains no judge)."""
    import shutil

    import yaml

    from tasks.profile import configs_dir

    profile = tmp_path / "two-rank-rl"
    shutil.copytree(configs_dir() / "profiles" / "tiny", profile)
    train = yaml.safe_load((profile / "train.yaml").read_text())
    train["base_model"]["tokenizer_texts"] = 200
    train["data"]["rl_requires_difficulty"] = False        # this home has no difficulty run
    train["engine"].update({"num_ranks": 2, "launcher": "torchrun", "micro_batch_size": 4})
    # every step's metrics in MLflow (the test reads each step's staleness and engine syncs)
    train["rl"].update({"steps": 3, "checkpoint_every": 2, "log_every": 1, "prompts_per_step": 4, "group_size": 4,
                        "dynamic_sampling": False, "max_sampling_rounds": 1,
                        "windows": [{"max_tokens": 4, "eps_high": 0.2, "gradient_clipping": 1.0}],
                        "curriculum": [{"start_step": 0, "domains": {"logic": 1.0}}],
                        "genrm": {"enabled": False},
                        "rollout_engine": {"kind": "serve-model", "max_staleness": 0, "threads": 1}})
    (profile / "train.yaml").write_text(yaml.safe_dump(train))
    return str(profile)


def test_posttrain_train_runs_rl_on_two_ranks_beside_an_engine(wh, tmp_path):
    """The CLI a user runs: ``posttrain train --stage rl`` on 2 ranks with a separate engine,
    policy versions and staleness in ``rl_rollouts`` and in the stage's MLflow run."""
    import mlflow
    from test_cli import cli

    from tasks.synthesize import generate_task_instances

    rows = []
    for name in ("object_counting", "web_of_lies"):
        rows += generate_task_instances(name, [0], 12, 0, 3, "configured")["rows"]
    wh.write("synthetic_tasks", pl.DataFrame(rows))
    out = cli("train", "--stage", "rl", "--profile", _two_rank_profile(tmp_path), home=wh.home, timeout=900).stdout
    # the stage table's rl row: 3 steps
    assert re.search(r"│ rl\s*│ 3\s*│", out) and "final model" in out, out

    rollouts = wh.read("rl_rollouts")
    assert set(rollouts["backend"]) == {"serve-model"} and set(rollouts["staleness"]) == {0}
    versions = rollouts.group_by("step").agg(pl.col("policy_version").unique()).sort("step")
    assert versions["step"].to_list() == [0, 1, 2]
    # the rl block's 2 updates a batch: the engine gets the weights of every second optimizer step
    assert versions["policy_version"].to_list() == [[0], [2], [4]]

    run = wh.read("models").filter(pl.col("stage") == "rl").row(-1, named=True)
    assert checkpoint.read_done(Path(run["path"]).parent)["world_size"] == 2
    mlflow.set_tracking_uri(f"sqlite:///{wh.home / 'mlflow.db'}")
    client = mlflow.MlflowClient()
    metric = {name: [m.value for m in client.get_metric_history(run["mlflow_run_id"], f"rl.{name}")]
              for name in ("policy_staleness", "engine_syncs")}
    # one push before each sampling round after the first (max_staleness 0)
    assert metric == {"policy_staleness": [0.0, 0.0, 0.0], "engine_syncs": [0.0, 1.0, 2.0]}, metric
    params = client.get_run(run["mlflow_run_id"]).data.params
    assert (params["engine.num_ranks"], params["stage_config.rollout_engine.kind"]) == ("2", "serve-model")
