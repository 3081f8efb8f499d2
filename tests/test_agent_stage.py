"""The agent stage end to end on a real DeepSpeed engine (CPU): agent SFT on expert solutions, then
CISPO over multi-turn trajectories in two environments; its ``trajectories`` rows are token-exact,
and a SIGKILLed stage resumes to the trajectories and losses of an uninterrupted run."""
from __future__ import annotations

import json

import polars as pl
from test_train_resume import sigkill_stage_when
from transformers import AutoTokenizer

from tasks.ingest import store_records
from tasks.records import RawRecord
from tasks.rollout.tiny_model import tiny_llama_path
from tasks.train import checkpoint
from tasks.train.config import TrainConfig
from tasks.train.data import write_training_tables
from tasks.train.runner import StageJob, execute_stage


def agent_config(steps: int = 6, **agent) -> TrainConfig:
    return TrainConfig(
        base_model={"kind": "pretrained", "name": "tiny-llama", "pretrained_path": "tiny-llama"},
        optimizer={"lr": agent.pop("lr", 1e-3)},
        engine={"zero_stage": 2, "precision": "fp32", "micro_batch_size": 1},
        agent={"steps": steps, "checkpoint_every": 2, "expert_steps": 2, "expert_batch": 4,
               "environments": [{"name": "tool_arithmetic", "train_seeds": 4}, {"name": "feedback", "train_seeds": 4}],
               "group_size": 2, "tasks_per_step": 2, "window": 3, "max_live_rounds": 1, "max_turn_tokens": 24,
               "max_tokens": 1024, "process_reward": 0.5, "time_cost": 0.05, **agent})


def agent_job(wh, cfg: TrainConfig, run_name: str) -> StageJob:
    base = str(tiny_llama_path())
    refs, _ = write_training_tables(wh, cfg, AutoTokenizer.from_pretrained(base), ["agent_tasks"])
    return StageJob(stage="agent", home=str(wh.home), run_name=run_name, profile="test", init_model=base,
                    data_ref=str(refs["agent_tasks"]), config=cfg.model_dump(), fingerprint=run_name)


def _records(path):
    return checkpoint.StepLog(path, enabled=False).records()


def _trajectories(wh, run_name: str) -> list[tuple]:
    df = wh.read("trajectories").filter(pl.col("train_run") == run_name).sort("step", "trajectory_id")
    return [(r["step"], r["kind"], r["trajectory_id"].split(":", 2)[-1], r["token_ids"], r["loss_mask"], r["reward"])
            for r in df.iter_rows(named=True)]


def test_agent_stage_trains_on_token_exact_trajectories(wh):
    cfg = agent_config()
    result = execute_stage(agent_job(wh, cfg, "once"))
    assert result["steps"] == 6 and result["expert_demonstrations"] > 0
    curve = _records(checkpoint.stage_dir(wh.checkpoints_dir, "once", "agent"))
    assert [r["step"] for r in curve] == list(range(6))
    assert all(r.get("expert_sft") == 1.0 for r in curve[:2])
    rl = curve[2:]
    for r in rl:
        assert 0.0 <= r["success_rate"] <= 1.0 and r["turns_mean"] >= 1.0
        assert 0.0 < r["masked_token_share"] < 1.0
    assert sum(r["fifo_pauses"] for r in rl) > 0
    df = wh.read("trajectories").filter(pl.col("train_run") == "once")
    policy = df.filter(pl.col("kind") == "policy")
    # 4 RL steps x 2 groups (the last step, drained, returns every group it finished) x 2 samples,
    # none lost or stored twice
    assert policy.height >= 4 * 2 * 2
    assert policy["trajectory_id"].n_unique() == policy.height
    assert policy.group_by("group_id").len()["len"].to_list() == [2] * (policy.height // 2)
    for r in df.iter_rows(named=True):
        spans = json.loads(r["turn_spans"])
        trained = {i for start, end, _, _ in spans for i in range(start, end)}
        assert {i for i, m in enumerate(r["loss_mask"]) if m} == trained
        assert r["trained_tokens"] == len(trained) and r["num_tokens"] == len(r["token_ids"])
        assert r["ended"] in ("answered", "max_turns", "max_tokens", "tool_error")
        assert len(r["reward_to_go"]) == r["num_turns"]
    _the_audit_checks_the_agent_tables(wh, df)


def _the_audit_checks_the_agent_tables(wh, trajectories: pl.DataFrame) -> None:
    """The audit passes on what the stage wrote, and fails on a trajectory whose mask gives loss to
    a tool-output token, on a training seed in the held-out range, and on an episode opening with
    a benchmark item."""
    from tasks.audit import run_audit

    report = run_audit(wh)
    checks = {c.name: c for c in report.checks}
    assert all(checks[n].checked > 0 and not checks[n].offending
               for n in ("agent_no_benchmark_item", "agent_heldout_seeds", "trajectory_loss_mask")), report.describe()
    # a trajectory with one environment token (right after its first turn) given loss
    row = trajectories.filter(pl.col("num_turns") > 1).row(0, named=True)
    end = json.loads(row["turn_spans"])[0][1]
    mask = list(row["loss_mask"])
    assert mask[end] == 0
    mask[end] = 1
    bad = trajectories.filter(pl.col("trajectory_id") == row["trajectory_id"]).with_columns(
        pl.Series("loss_mask", [mask], dtype=pl.List(pl.Int8)), pl.lit(row["trajectory_id"] + "-bad").alias("trajectory_id"))
    wh.append("trajectories", bad)
    offending = next(c.offending for c in run_audit(wh).checks if c.name == "trajectory_loss_mask")
    assert any(row["trajectory_id"] + "-bad" in o for o in offending)
    # a held-out seed and a benchmark item among the training episodes
    tasks = wh.read("agent_tasks")
    store_records(wh, [RawRecord("b.jsonl", 1, data={"item_id": "b1", "prompt": tasks["prompt"][1], "answer": "1",
                                                     "domain": "math"})], "tinybench", kind="benchmarks")
    wh.write("agent_tasks", tasks.with_columns(pl.when(pl.int_range(pl.len()) == 0).then(10**9 + 3)
                                               .otherwise(pl.col("seed")).alias("seed")))
    report = run_audit(wh)
    checks = {c.name: c for c in report.checks}
    assert not report.passed
    assert any(tasks["task_id"][0] in o and "held-out" in o for o in checks["agent_heldout_seeds"].offending)
    assert any(tasks["task_id"][1] in o and "b1" in o for o in checks["agent_no_benchmark_item"].offending)


def test_a_sigkilled_agent_stage_resumes_to_an_uninterrupted_runs_trajectories(wh):
    # the random-init model learns the feedback format from 20 expert steps, so its RL groups
    # disagree (and train) on most steps: the resumed run must reproduce real updates
    expert = 20
    cfg = agent_config(steps=expert + 8, expert_steps=expert, expert_batch=8, lr=1e-3, expert_lr=5e-3,
                       environments=[{"name": "feedback", "train_seeds": 8}])
    straight = agent_job(wh, cfg, "straight")
    execute_stage(straight)

    job = agent_job(wh, cfg, "killed")
    stage = job.stage_path
    # past the checkpoint after RL step 2, then kill hard
    sigkill_stage_when(cfg.engine, job, lambda step, records: step is not None and step >= expert + 2
                       and records >= step + 1)
    execute_stage(job)
    a = _records(straight.stage_path)
    b = _records(stage)
    assert [r["step"] for r in b] == list(range(expert + 8))
    # the expert steps ran at expert_lr, RL at the stage's lr (the schedule survives the resume)
    assert abs(b[expert - 2]["lr"] - 5e-3) < 1e-9 and max(r["lr"] for r in b[expert:]) <= 1e-3 + 1e-12
    assert sum("loss" in r for r in a[expert:]) >= 4, "the RL steps trained too rarely for the comparison to mean much"
    for ra, rb in zip(a, b):
        # a step whose groups all agree trains nothing (dynamic sampling) and records no loss
        assert ("loss" in ra) == ("loss" in rb), ra["step"]
        assert abs(ra.get("loss", 0.0) - rb.get("loss", 0.0)) < 1e-4, (ra["step"], ra.get("loss"), rb.get("loss"))
        assert ra.get("success_rate") == rb.get("success_rate")
    assert _trajectories(wh, "straight") == _trajectories(wh, "killed")


def _seed_rl_samples(wh, run_name: str) -> list[tuple[str, list[int]]]:
    """rl_prompts and rl_rollouts as an RL stage of ``run_name`` leaves them: two verified samples
    (one of them stored twice), a wrong one, and a verified one of another run. Returns the
    (prompt, completion ids) the agent stage should rehearse."""
    from data_specs import get_spec

    prompts = [("p1", "What is 2 + 3?"), ("p2", "Count the vowels in 'banana'.")]
    wh.write("rl_prompts", get_spec("rl_prompts").conform(pl.DataFrame(
        [{"prompt_id": p, "source_table": "synthetic_tasks", "domain": "logic", "prompt": t, "answer": "5",
          "selected_by": "synthetic_tasks"} for p, t in prompts])))
    rows = []
    for i, (pid, run, reward, ids) in enumerate([("p1", run_name, 1.0, [7, 8, 9, 2]), ("p1", run_name, 1.0, [7, 8, 9, 2]),
                                                 ("p2", run_name, 1.0, [11, 12, 2]), ("p2", run_name, 0.0, [13, 2]),
                                                 ("p1", "another-run", 1.0, [14, 2])]):
        rows.append({"rollout_id": f"{pid}:{i}:{run}", "prompt_id": pid, "source_table": "rl_prompts",
                     "domain": "logic", "sample_index": i, "text": " ".join(map(str, ids)), "token_ids": ids,
                     "num_tokens": len(ids), "finish_reason": "stop", "truncated": False, "reward": reward,
                     "backend": "local", "model": "m", "train_run": run, "step": 0, "policy_version": 0,
                     "staleness": 0})
    wh.write("rl_rollouts", get_spec("rl_rollouts").conform(pl.DataFrame(rows)))
    return [("What is 2 + 3?", [7, 8, 9, 2]), ("Count the vowels in 'banana'.", [11, 12, 2])]


def test_the_agent_stage_rehearses_the_runs_verified_rl_samples(wh):
    """replay_batch: each training step also fits sequences of the RL stage's own verified samples
    of this run (the forgetting fix measured on smol): the pool is exactly those, once each, and
    the first step's replay loss is their token-mean NLL under the starting weights, recomputed
    here with a plain forward of the model."""
    import torch
    from transformers import AutoModelForCausalLM

    from tasks.train.encoding import encode_prompt

    expected = _seed_rl_samples(wh, "rehearsed")
    cfg = agent_config(steps=3, replay_batch=3, replay_weight=0.5)
    job = agent_job(wh, cfg, "rehearsed")
    result = execute_stage(job)
    assert result["replay_pool"] == 2
    curve = _records(checkpoint.stage_dir(wh.checkpoints_dir, "rehearsed", "agent"))
    assert all(r["replay_sequences"] == 3.0 for r in curve if "loss" in r)

    tokenizer = AutoTokenizer.from_pretrained(job.init_model)
    pool = sorted(expected, key=lambda pc: pc[0] != "What is 2 + 3?")   # the pool's order: by rollout_id
    g = torch.Generator().manual_seed(cfg.seed * 37 + 0)
    picked = [pool[i] for i in torch.randint(len(pool), (3,), generator=g).tolist()]
    model = AutoModelForCausalLM.from_pretrained(job.init_model, torch_dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for prompt, completion in picked:
            ids = encode_prompt(tokenizer, prompt, "logic") + completion
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
            tok = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
            total -= float(tok[-len(completion):].sum())
            count += len(completion)
    assert abs(curve[0]["replay_loss"] - total / count) < 1e-3


def test_replay_without_verified_rl_samples_is_refused_with_the_run_named(wh):
    import pytest

    cfg = agent_config(steps=3, replay_batch=2)
    with pytest.raises(ValueError, match="no rl_rollouts / rl_prompts .* train the rl stage of run 'bare'"):
        execute_stage(agent_job(wh, cfg, "bare"))
