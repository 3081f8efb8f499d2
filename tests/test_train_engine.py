"""DeepSpeed stage runner on CPU: one rank in process, two ranks through the launcher (gloo)."""
import json

import polars as pl
import pytest
import torch

from tasks.synthesize import generate_task_instances
from tasks.train.config import TrainConfig
from tasks.train.data import write_training_tables
from tasks.train.ds_config import deepspeed_config
from tasks.train.encoding import batch_indices
from tasks.train.runner import StageJob, execute_stage

TASKS = ["object_counting", "boolean_expressions", "web_of_lies", "operation"]
SMALL_MODEL = {"tokenizer_vocab_size": 320, "hybrid": {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "softmax_attention_every": 2, "max_position_embeddings": 512,
    "lightning_chunk_size": 32, "num_experts": 0}}


def small_config(**engine) -> TrainConfig:
    return TrainConfig(
        base_model={"kind": "hybrid", "name": "test-base", "tokenizer_texts": 200},
        optimizer={"lr": 3e-3},
        engine={"zero_stage": 2, "precision": "fp32", "micro_batch_size": 2, **engine},
        sft_short={"steps": 4, "checkpoint_every": 2, "max_tokens": 256},
        sft_long={"steps": 2, "checkpoint_every": 2, "min_tokens": 257, "max_tokens": 1024})


def seeded_sft_job(wh, cfg: TrainConfig, stage_steps: int | None = None, run_name: str = "test",
                   stage: str = "sft_short"):
    """A warehouse with synthetic tasks, a cached small base model and the training tables; the
    job of ``stage`` (by default sft_short) on its table."""
    from transformers import AutoTokenizer

    from data_specs.stages import train_stage
    from tasks.train.base_model import prepare_base_model

    rows = []
    for name in TASKS:
        rows += generate_task_instances(name, [0], 12, 0, 3, "configured")["rows"]
    wh.write("synthetic_tasks", pl.DataFrame(rows))
    # these tests exercise the training loops, not the selection: RL may train undecided prompts
    cfg.data.rl_requires_difficulty = False
    base = prepare_base_model(wh, cfg.base_model, SMALL_MODEL)
    refs, _ = write_training_tables(wh, cfg, AutoTokenizer.from_pretrained(base))
    if stage_steps is not None:
        getattr(cfg, stage).steps = stage_steps
    return StageJob(stage=stage, home=str(wh.home), run_name=run_name, profile="test", init_model=str(base),
                    data_ref=str(refs[train_stage(stage).table]), config=cfg.model_dump(), fingerprint="test")


def test_a_changed_model_section_builds_a_base_model_of_its_own_shape(wh):
    """The cached base model is keyed on what builds it: the same settings reuse it, a changed
    model.yaml (here 4 heads instead of 2) gets a model of its own shape, never the stale one."""
    from transformers import AutoConfig

    from tasks.train.base_model import prepare_base_model

    rows = generate_task_instances("object_counting", [0], 12, 0, 3, "configured")["rows"]
    wh.write("synthetic_tasks", pl.DataFrame(rows))
    cfg = small_config()
    first = prepare_base_model(wh, cfg.base_model, SMALL_MODEL)
    assert prepare_base_model(wh, cfg.base_model, SMALL_MODEL) == first
    wider = {**SMALL_MODEL, "hybrid": {**SMALL_MODEL["hybrid"], "num_attention_heads": 4, "num_key_value_heads": 2}}
    second = prepare_base_model(wh, cfg.base_model, wider)
    assert second != first and second.name.startswith("test-base-")
    assert AutoConfig.from_pretrained(first).num_attention_heads == 2
    assert AutoConfig.from_pretrained(second).num_attention_heads == 4
    assert prepare_base_model(wh, cfg.base_model, SMALL_MODEL, seed=1) not in (first, second)


def test_ds_config_follows_the_profile():
    cfg = small_config(zero_stage=1, gradient_accumulation_steps=3, offload_optimizer=True, precision="bf16")
    ds = deepspeed_config(cfg.engine)
    assert ds["zero_optimization"]["stage"] == 1 and ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["gradient_accumulation_steps"] == 3 and ds["bf16"] == {"enabled": True}
    assert ds["zero_allow_untested_optimizer"] is True and ds["train_batch_size"] == 6
    with pytest.raises(ValueError, match="launcher"):
        TrainConfig(engine={"num_ranks": 2, "launcher": "inprocess"})
    # a stage's own launcher, for its one rank; the rest keep the engine's
    cfg = TrainConfig(judge={"launcher": "process"})
    assert cfg.engine_for("judge").launcher == "process" and cfg.engine_for("sft_short") == cfg.engine
    # several ranks already run in processes of their own, under the engine's launcher
    ranks = TrainConfig(judge={"launcher": "process"}, engine={"num_ranks": 2, "launcher": "torchrun"})
    assert ranks.engine_for("judge") == ranks.engine
    with pytest.raises(ValueError, match="judge.launcher 'inprocess' runs one rank"):
        TrainConfig(judge={"launcher": "inprocess"}, engine={"num_ranks": 2, "launcher": "torchrun"})


@pytest.mark.parametrize("profile", ["tiny", "gpu", "m1"])
def test_every_profile_has_a_valid_train_section(profile):
    from tasks.profile import load_profile

    cfg = load_profile(profile).section("train", TrainConfig)
    assert cfg.optimizer.betas == (0.9, 0.95) and cfg.optimizer.eps == 1e-15
    assert [w.max_tokens for w in cfg.rl.windows] == sorted(w.max_tokens for w in cfg.rl.windows)
    if profile == "m1":
        assert cfg.rl.windows[0].max_tokens == 40960 and cfg.rl.windows[-1].max_tokens == 81920
        assert cfg.engine.zero_stage == 3


def test_batch_order_is_a_pure_function_of_step():
    first_epoch = [i for s in range(5) for i in batch_indices(s, 10, 2, seed=1)]
    assert sorted(first_epoch) == list(range(10))            # each example once per epoch
    assert batch_indices(7, 10, 3, seed=1) == batch_indices(7, 10, 3, seed=1)
    assert batch_indices(0, 10, 4, seed=1) != batch_indices(0, 10, 4, seed=2)


def test_sft_in_process_lowers_loss_and_saves_hf(wh):
    from transformers import AutoModelForCausalLM

    import model  # noqa: F401  registers the hybrid architecture

    job = seeded_sft_job(wh, small_config(), stage_steps=6)
    result = execute_stage(job)
    steps = [json.loads(l) for l in (job.stage_path / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(6))
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert all(s["grad_norm"] > 0 for s in steps)
    reloaded = AutoModelForCausalLM.from_pretrained(result["path"])
    assert reloaded.config.model_type == "posttrain_hybrid"
    assert (job.stage_path / "DONE").exists() and result["world_size"] == 1


def test_two_rank_sft_through_the_launcher(wh):
    cfg = small_config(num_ranks=2, launcher="torchrun")
    job = seeded_sft_job(wh, cfg, run_name="two-ranks")
    result = execute_stage(job, timeout_s=400)
    assert result["world_size"] == 2 and result["steps"] == 4
    steps = [json.loads(l) for l in (job.stage_path / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]           # written once, by rank 0
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in steps)
    assert json.loads((job.stage_path / "ds_config.json").read_text())["train_batch_size"] == 4


def _stage_steps(wh, cfg: TrainConfig, run_name: str) -> list[dict]:
    job = seeded_sft_job(wh, cfg, stage_steps=3, run_name=run_name)
    execute_stage(job)
    return [json.loads(l) for l in (job.stage_path / "steps.jsonl").read_text().splitlines()]


def test_a_prompt_loss_adds_the_prompt_tokens_to_the_sft_objective(wh):
    """``prompt_loss_weight``: the response's loss is logged on its own and matches a run without
    the prompt term before the first update; the prompt term adds to the loss and changes the
    updates (with prefix sharing on, as the tiny judge trains)."""
    plain = _stage_steps(wh, small_config(), "plain")
    cfg = small_config()
    cfg.sft_short.prompt_loss_weight, cfg.sft_short.prefix_shared = 0.5, True
    weighted = _stage_steps(wh, cfg, "prompt-loss")
    assert "response_loss" not in plain[0]
    assert weighted[0]["response_loss"] == pytest.approx(plain[0]["loss"], abs=1e-5)
    assert all(s["loss"] > s["response_loss"] + 0.1 for s in weighted)   # the prompt's NLL, weighted 0.5
    assert weighted[1]["response_loss"] != pytest.approx(plain[1]["loss"], abs=1e-5)


def test_a_stage_with_its_own_process_trains_there_and_reports_back(wh):
    """``launcher: process`` on one stage (the tiny judge's, which runs beside the policy): the
    stage trains in a Python process of its own, whose output is the stage's launcher.log, and
    returns the same summary as in process."""
    cfg = small_config()
    cfg.sft_short.launcher = "process"
    job = seeded_sft_job(wh, cfg, stage_steps=3, run_name="own-process")
    result = execute_stage(job)
    assert result["world_size"] == 1 and result["steps"] == 3
    assert (job.stage_path / "launcher.log").exists() and (job.stage_path / "DONE").exists()
    steps = [json.loads(l) for l in (job.stage_path / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2] and steps[-1]["loss"] < steps[0]["loss"]


def test_stop_launcher_ends_the_launcher_and_the_ranks_it_started(tmp_path):
    """An interrupted stage leaves no rank behind: ranks run in the launcher's own session, so
    they would outlive the pipeline that started them."""
    import os
    import subprocess
    import time

    from tasks.train.engine import stop_launcher

    pid_file = tmp_path / "child.pid"
    proc = subprocess.Popen(["sh", "-c", f"sleep 120 & echo $! > {pid_file}; wait"], start_new_session=True)
    for _ in range(100):
        if pid_file.exists() and pid_file.read_text().strip():
            break
        time.sleep(0.05)
    child = int(pid_file.read_text())
    stop_launcher(proc, grace_s=5)
    assert proc.poll() is not None
    for _ in range(100):   # the orphaned child is reaped by init once killed
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"rank {child} outlived its launcher")
