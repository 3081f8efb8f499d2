"""A learning check: CISPO on the tiny model raises a trivially learnable reward."""
import polars as pl
import pytest
from test_train_engine import seeded_sft_job

from tasks.train.config import TrainConfig
from tasks.train.harness import StageHarness, StageJob
from tasks.train.rl import train_rl


def first_token_reward(row, text, token_ids):
    """1 when the response starts with a token id divisible by 4 (a quarter of the vocabulary)."""
    return 1.0 if token_ids and token_ids[0] % 4 == 0 else 0.0


def test_cispo_raises_mean_reward_on_an_easy_reward(wh):
    cfg = TrainConfig(
        seed=0,
        base_model={"kind": "hybrid", "name": "test-base", "tokenizer_texts": 200},
        optimizer={"lr": 1e-2},
        engine={"zero_stage": 2, "precision": "fp32", "micro_batch_size": 2},
        rl={"steps": 14, "checkpoint_every": 100, "prompts_per_step": 4, "group_size": 8, "updates_per_batch": 2,
            "windows": [{"max_tokens": 2, "eps_high": 0.2, "gradient_clipping": 1.0},
                        {"max_tokens": 3, "eps_high": 0.18, "gradient_clipping": 0.8}],
            "gates": {"ppl_patience": 2, "ppl_tolerance": 10.0, "p99_fraction": 0.5, "min_steps_per_window": 4},
            "curriculum": [{"start_step": 0, "domains": {"logic": 1.0}}],
            "window_refresh": {"enabled": True, "min_samples": 8},
            "adaptive_levels": {"enabled": True, "every_steps": 5, "min_samples": 4},
            "repetition_window": None, "max_sampling_rounds": 2})
    sft_job = seeded_sft_job(wh, cfg)
    refs = {r["name"]: f"{r['name']}@{r['snapshot']}" for r in wh.tables().iter_rows(named=True)}
    job = StageJob(stage="rl", home=str(wh.home), run_name="learn", profile="test", init_model=sft_job.init_model,
                   data_ref=refs["rl_prompts"], config=cfg.model_dump(), fingerprint="learn")
    result = train_rl(StageHarness(job), reward_fn=first_token_reward)

    curve = StageHarness(job).steps.records()
    rewards = [r["reward_mean"] for r in curve]
    assert len(rewards) == 14
    start, end = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert end > start + 0.2, rewards
    # every step with kept groups trained; with 2 updates per batch the second minibatch is
    # scored by weights the first optimizer step moved, so the ratio statistics see a policy change
    trained = [r for r in curve if "loss" in r]
    assert len(trained) == sum(r["groups_kept"] > 0 for r in curve) > 0
    # (measured: 6e-4 to 3e-2 per step; updates that left the weights alone would give ~0)
    assert all(r["approx_kl"] > 1e-4 for r in trained), [r["approx_kl"] for r in trained]
    # and some of those ratios left the clip range [1 - eps_low, 1 + eps_high]
    assert all(0.0 <= r["clip_fraction"] <= 1.0 for r in trained) and any(r["clip_fraction"] > 0 for r in trained)
    # the schedule stepped up once its gates passed, lowering the clip threshold
    assert curve[-1]["window"] == 3 and curve[-1]["gradient_clipping"] == 0.8
    assert result["final_window"] == 3
    # the per-window refresh ran once, at the advance: the tiny model solves no logic prompt at
    # every sample (the verifiers', not the custom reward's, correctness), so none is dropped
    advanced = [r for r in curve if "refresh_dropped" in r]
    assert len(advanced) == 1 and advanced[0]["refresh_dropped"] == 0
    assert advanced[0]["refresh_pool"] == result["prompts"] and advanced[0]["refresh_domain_share/logic"] == 1.0
    # the adaptive levels measured every 5 steps; one level per task in this pool: nothing to move
    measured = [r["step"] for r in curve if "adaptive_moves" in r]
    assert measured == [4, 9] and all(r["adaptive_moves"] == 0 for r in curve if "adaptive_moves" in r)
    rollouts = wh.read("rl_rollouts")
    assert rollouts.height == sum(int(r["groups_sampled"]) for r in curve) * 8
    assert set(rollouts["source_table"]) == {"rl_prompts"}
    # the curve reports what was sampled: each stored response carries the reward of its own
    # tokens, and a step's reward_mean is the mean over the responses it sampled
    assert all(r["reward"] == first_token_reward(None, r["text"], r["token_ids"])
               for r in rollouts.iter_rows(named=True))
    per_step = rollouts.group_by("step").agg(pl.col("reward").mean()).sort("step")
    assert per_step["step"].to_list() == [r["step"] for r in curve]
    assert per_step["reward"].to_list() == pytest.approx(rewards)
