"""CISPO's off-policy updates under DeepSpeed gradient accumulation (issue #12, item 5).

A real DeepSpeed engine on CPU (accumulation 2) runs the RL stage's update on a small hybrid
policy: 6 groups of 4 responses, 2 updates per batch, so each micro-batch holds a group and
a half (the cut group must keep its own token normalizer, and the mean over groups must
stay the minibatch's). Each update must be one optimizer step whose gradient is the whole
minibatch's, so the second update sees moved weights: its importance ratio leaves 1 and
CISPO's clip acts. The truth is recomputed outside the code
under test: a spy on ``engine.step`` keeps the weights (and, at ZeRO-0, the gradient) of
every real optimizer step, and a plain copy of the policy computes each minibatch's loss
and gradient with one backward.
"""
import copy

import pytest
import torch

from model.config import HybridConfig
from model.hybrid import HybridForCausalLM
from model.logprobs import token_logprobs
from model.losses import group_advantages, policy_loss
from tasks.train.config import TrainConfig
from tasks.train.encoding import pad_batch
from tasks.train.harness import StageHarness, StageJob
from tasks.train.rl import _minibatches, _update
from warehouse import TableRef

VOCAB, GROUPS, GROUP_SIZE, UPDATES, ACCUMULATION = 61, 6, 4, 2, 2
EPS_HIGH = 0.02                         # small, so one step of lr 1e-2 moves ratios past it
MINIBATCHES = [list(range(12)), list(range(12, 24))]       # groups 0-2, then groups 3-5
REWARDS = [1, 0, 0, 1, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 0, 1, 0]


def tiny_policy() -> HybridForCausalLM:
    config = HybridConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, softmax_attention_every=2,
                          lightning_chunk_size=8, num_experts=0, pad_token_id=0)
    torch.manual_seed(0)
    return HybridForCausalLM(config).train()


def rollout_tensors() -> tuple[dict, torch.Tensor]:
    """The RL stage's training tensors for 6 groups (one prompt each, responses of 2-8 tokens)."""
    gen = torch.Generator().manual_seed(1)
    seqs, prompt_lengths = [], []
    for _ in range(GROUPS):
        prompt = torch.randint(1, VOCAB, (int(torch.randint(3, 6, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(GROUP_SIZE):
            response = torch.randint(1, VOCAB, (int(torch.randint(2, 9, (1,), generator=gen)),), generator=gen)
            seqs.append(prompt + response.tolist())
            prompt_lengths.append(len(prompt))
    tensors = pad_batch(seqs, prompt_lengths, pad_id=0)
    tensors["mask"] = (tensors["labels"][:, 1:] != -100).float()
    tensors["sampler_logp"] = torch.zeros_like(tensors["mask"])
    return tensors, group_advantages(torch.tensor(REWARDS, dtype=torch.float32), GROUP_SIZE)


def rl_harness(home, zero_stage: int, group_size: int = GROUP_SIZE, updates: int = UPDATES,
               epochs: int = 1, accumulation: int = ACCUMULATION) -> StageHarness:
    cfg = TrainConfig(optimizer={"lr": 1e-2},
                      engine={"zero_stage": zero_stage, "precision": "fp32", "micro_batch_size": 6,
                              "gradient_accumulation_steps": accumulation},
                      rl={"steps": 1, "prompts_per_step": GROUPS, "group_size": group_size,
                          "updates_per_batch": updates, "epochs_per_batch": epochs, "loss": "cispo"})
    return StageHarness(StageJob(stage="rl", home=str(home), run_name="accumulation", profile="test",
                                 # the update runs on tensors built here: no model path, no table read
                                 init_model="(in memory)", data_ref=TableRef("rl_prompts", "unused"),
                                 config=cfg.model_dump(),
                                 fingerprint="accumulation"))


def spy_on_real_steps(engine) -> list[dict]:
    """Before each optimizer step DeepSpeed really takes: the weights it starts from and the
    gradient in ``p.grad`` (ZeRO-0 keeps it there; ZeRO-2 holds it in its own buffers)."""
    seen, step = [], engine.step

    def spy(*args, **kwargs):
        if engine.is_gradient_accumulation_boundary():
            params = list(engine.module.named_parameters())
            seen.append({"weights": {n: p.detach().clone() for n, p in params},
                         "grads": {n: p.grad.detach().clone() for n, p in params if p.grad is not None}})
        return step(*args, **kwargs)

    engine.step = spy
    return seen


def minibatch_loss_and_gradient(policy, weights: dict, rows: list[int], tensors: dict, old_logp: torch.Tensor,
                                advantages: torch.Tensor, group_size: int) -> tuple[dict, dict, float]:
    """The minibatch's CISPO statistics, its gradient (one backward over all its rows) and that gradient's norm."""
    with torch.no_grad():
        for name, p in policy.named_parameters():
            p.copy_(weights[name])
    policy.zero_grad()
    idx = torch.tensor(rows)
    logp, _, _ = token_logprobs(policy, tensors["input_ids"][idx], tensors["attention_mask"][idx],
                                tensors["labels"][idx])
    loss, stats = policy_loss("cispo", logp, old_logp[idx], advantages[idx], tensors["mask"][idx],
                              1.0, EPS_HIGH, group_size=group_size)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in policy.named_parameters()}
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])))
    return stats, grads, norm


@pytest.fixture(scope="module", params=[0, 2], ids=["zero0", "zero2"])
def run(request, tmp_path_factory):
    """One RL batch through ``_update`` at ZeRO-0 or ZeRO-2, and the truth beside it."""
    h = rl_harness(tmp_path_factory.mktemp("home"), request.param)
    policy = tiny_policy()
    reference = copy.deepcopy(policy)
    engine = h.create_engine(policy)
    real_steps = spy_on_real_steps(engine)
    tensors, advantages = rollout_tensors()
    steps_before = engine.global_steps
    logged = _update(h, engine, tensors, advantages, EPS_HIGH)
    with torch.no_grad():
        old_logp = token_logprobs(reference, tensors["input_ids"], tensors["attention_mask"], tensors["labels"])[0]
    truth = [minibatch_loss_and_gradient(reference, s["weights"], rows, tensors, old_logp, advantages, GROUP_SIZE)
             for s, rows in zip(real_steps, MINIBATCHES)]
    for k, (stats, _, norm) in enumerate(truth, 1):
        print(f"ZeRO-{request.param} update {k}: ratio_mean {stats['ratio_mean']:.6f} "
              f"clip_fraction {stats['clip_fraction']:.4f} grad_norm {norm:.6f}")
    print(f"ZeRO-{request.param} logged: " + ", ".join(f"{k} {v:.6f}" for k, v in sorted(logged.items())))
    return {"h": h, "engine": engine, "zero_stage": request.param, "logged": logged, "real_steps": real_steps,
            "optimizer_steps": engine.global_steps - steps_before, "truth": truth}


def test_minibatches_give_one_update_each_of_whole_groups():
    assert _minibatches(GROUPS, GROUP_SIZE, UPDATES) == MINIBATCHES
    # dynamic sampling kept 5 groups for 4 updates: still 4 steps, groups split 2-1-1-1
    five = _minibatches(5, 2, 4)
    assert [len(rows) // 2 for rows in five] == [2, 1, 1, 1]
    assert sorted(r for rows in five for r in rows) == list(range(10))


def test_each_minibatch_is_exactly_one_optimizer_step(run):
    assert run["optimizer_steps"] == UPDATES
    assert len(run["real_steps"]) == UPDATES
    assert run["engine"].micro_steps == UPDATES * ACCUMULATION   # no micro-batch left over for the next batch


def test_second_update_is_off_policy_and_clip_acts(run):
    logged, truth = run["logged"], run["truth"]
    # the averaged step metrics: update 1 is on-policy (ratio 1, no clip), update 2 is not
    assert logged["clip_fraction"] > 0 and logged["approx_kl"] > 1e-4, logged
    assert logged["ratio_mean"] != pytest.approx(1.0, abs=1e-4), logged
    assert len(truth) == UPDATES
    (first, _, _), (second, _, _) = truth
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and first["clip_fraction"] == 0.0
    # ratios move both ways, so their mean moves less than each ratio: KL shows the spread
    assert abs(second["ratio_mean"] - 1) > 1e-3 and second["approx_kl"] > 1e-3, second
    assert second["clip_fraction"] > 0.05, second
    # what the stage logs is the mean of the two updates' true statistics
    for key in ("ratio_mean", "clip_fraction", "approx_kl"):
        assert logged[key] == pytest.approx((first[key] + second[key]) / 2, abs=1e-5), key


def test_grad_norm_of_every_real_step_is_logged(run):
    norms = [norm for _, _, norm in run["truth"]]
    assert run["logged"]["grad_norm"] == pytest.approx(sum(norms) / UPDATES, rel=1e-5)
    assert len(norms) == UPDATES and all(n > 0 for n in norms)


# ZeRO-0 only: ZeRO-2 keeps gradients in its own buffers (its logged norm is checked above)
@pytest.mark.parametrize("run", [0], ids=["zero0"], indirect=True)
def test_accumulated_gradient_equals_the_full_minibatch_gradient(run):
    assert len(run["real_steps"]) == UPDATES
    for k, (step, (_, full, _)) in enumerate(zip(run["real_steps"], run["truth"]), 1):
        assert step["grads"].keys() == full.keys()
        for name, grad in full.items():
            torch.testing.assert_close(step["grads"][name], grad, rtol=1e-5, atol=1e-5,
                                       msg=lambda m, k=k, name=name: f"update {k}, {name}: {m}")


# dynamic sampling kept fewer groups than the shape divides (issue #32, item 4): M1's group 16 over
# 16 accumulation x 8 ranks needs whole multiples of 8 groups per update. Here: 3 groups of 3 in one
# update over 2 micro-batches (9 responses: slices of 5 and 4), and 2 groups of 3 in two updates over
# 4 micro-batches (3 responses each: the fourth slice has none and runs a stand-in at weight zero).
@pytest.mark.parametrize(("groups", "group_size", "updates", "accumulation", "uneven", "zero_weight"),
                         [(3, 3, 1, 2, 1, 0), (2, 3, 2, 4, 2, 2)], ids=["uneven-slices", "empty-slice"])
def test_an_update_that_does_not_divide_is_one_exact_optimizer_step(tmp_path, groups, group_size, updates,
                                                                     accumulation, uneven, zero_weight):
    rows = groups * group_size
    h = rl_harness(tmp_path, 0, group_size=group_size, updates=updates, accumulation=accumulation)
    policy = tiny_policy()
    reference = copy.deepcopy(policy)
    engine = h.create_engine(policy)
    real_steps = spy_on_real_steps(engine)
    tensors, _ = rollout_tensors()
    tensors = {k: v[:rows] for k, v in tensors.items()}
    advantages = group_advantages(torch.tensor(REWARDS[:rows], dtype=torch.float32), group_size)
    assert advantages.abs().sum() > 0
    logged = _update(h, engine, tensors, advantages, EPS_HIGH)

    assert engine.global_steps == updates and engine.micro_steps == updates * accumulation
    assert (logged["uneven_updates"], logged["zero_weight_micro_batches"]) == (uneven, zero_weight)
    with torch.no_grad():
        old_logp = token_logprobs(reference, tensors["input_ids"], tensors["attention_mask"], tensors["labels"])[0]
    minibatches = _minibatches(groups, group_size, updates)
    assert len(real_steps) == updates and sorted(r for m in minibatches for r in m) == list(range(rows))
    norms = []
    for step, minibatch in zip(real_steps, minibatches):
        _, full, norm = minibatch_loss_and_gradient(reference, step["weights"], minibatch, tensors, old_logp,
                                                    advantages, group_size)
        norms.append(norm)
        assert norm > 0
        for name, grad in full.items():   # the stand-in row adds nothing; the cut slices lose nothing
            torch.testing.assert_close(step["grads"][name], grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")
    assert logged["grad_norm"] == pytest.approx(sum(norms) / updates, rel=1e-5)


def test_every_pass_over_the_batch_trains_against_the_sampling_policy(tmp_path):
    """``epochs_per_batch`` 2 with one update per pass: two optimizer steps on the same rows, the
    second one's behaviour log-probs still those of sampling time (not re-scored), so its ratio
    leaves 1 on the very tokens the first pass trained and the clip acts there."""
    h = rl_harness(tmp_path, 0, updates=1, epochs=2)
    policy = tiny_policy()
    reference = copy.deepcopy(policy)
    engine = h.create_engine(policy)
    real_steps = spy_on_real_steps(engine)
    tensors, advantages = rollout_tensors()
    logged = _update(h, engine, tensors, advantages, EPS_HIGH)
    assert engine.global_steps == 2 and engine.micro_steps == 2 * ACCUMULATION
    with torch.no_grad():
        old_logp = token_logprobs(reference, tensors["input_ids"], tensors["attention_mask"], tensors["labels"])[0]
    every_row = list(range(GROUPS * GROUP_SIZE))
    (first, first_grad, _), (second, second_grad, _) = [
        minibatch_loss_and_gradient(reference, s["weights"], every_row, tensors, old_logp, advantages, GROUP_SIZE)
        for s in real_steps]
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and first["clip_fraction"] == 0.0
    assert second["approx_kl"] > 1e-3 and second["clip_fraction"] > 0.05, second
    assert logged["last_epoch_clip_fraction"] == pytest.approx(second["clip_fraction"], abs=1e-6)
    assert logged["clip_fraction"] == pytest.approx((first["clip_fraction"] + second["clip_fraction"]) / 2, abs=1e-6)
    for step, truth in zip(real_steps, (first_grad, second_grad)):
        for name, grad in truth.items():
            torch.testing.assert_close(step["grads"][name], grad, rtol=1e-5, atol=1e-5)


def test_stale_rollouts_with_unknown_sampler_logprobs_keep_the_trainers_there(tmp_path):
    """Rollouts from weights some updates behind train against the sampler's log-probs; a token
    whose log-prob the sampler left out (an OpenAI server's null, issue #32 item 8) takes the
    trainer's instead of 0 (probability 1), and the train/inference gap counts known tokens only.
    The known ones here are the trainer's own, so the one update is exactly on-policy."""
    h = rl_harness(tmp_path, 0, updates=1)
    policy = tiny_policy()
    reference = copy.deepcopy(policy)
    engine = h.create_engine(policy)
    tensors, advantages = rollout_tensors()
    with torch.no_grad():
        old_logp = token_logprobs(reference, tensors["input_ids"], tensors["attention_mask"], tensors["labels"])[0]
    mask = tensors["mask"]
    unknown = torch.zeros_like(mask)
    unknown.view(-1)[::3] = 1.0
    known = mask * (1 - unknown)
    assert 0 < known.sum() < mask.sum()
    tensors["sampler_logp"] = old_logp * known          # an unknown token's slot holds 0, as the stage fills it
    tensors["sampler_logp_known"] = known
    logged = _update(h, engine, tensors, advantages, EPS_HIGH, stale=True)
    assert logged["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and logged["clip_fraction"] == 0.0, logged
    assert logged["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert logged["train_infer_logprob_gap"] == pytest.approx(0.0, abs=1e-5)


def test_truncated_importance_sampling_weights_each_token_by_the_capped_ratio(tmp_path):
    """``rl.tis_cap``: where the sampler's log-probs differ from the trainer's on the same weights,
    each token's advantage is weighted by min(pi_train / pi_sampler, cap). The update's gradient is
    the one of per-token advantages so weighted; ``rl.max_logprob_gap`` flags the step."""
    h = rl_harness(tmp_path, 0, updates=1)
    h.stage_cfg = h.stage_cfg.model_copy(update={"tis_cap": 2.0, "max_logprob_gap": 0.1})
    policy = tiny_policy()
    reference = copy.deepcopy(policy)
    engine = h.create_engine(policy)
    real_steps = spy_on_real_steps(engine)
    tensors, advantages = rollout_tensors()
    with torch.no_grad():
        old_logp = token_logprobs(reference, tensors["input_ids"], tensors["attention_mask"], tensors["labels"])[0]
    mask = tensors["mask"]
    # the sampler saw a third of the tokens 0.5 nats likelier (ratio e^-0.5) and a third 1.0 nats
    # less likely (ratio e^1.0 = 2.72, over the cap 2)
    shift = torch.zeros_like(mask)
    shift.view(-1)[0::3], shift.view(-1)[1::3] = 0.5, -1.0
    tensors["sampler_logp"] = (old_logp + shift) * mask
    logged = _update(h, engine, tensors, advantages, EPS_HIGH)

    weights = torch.exp(-shift).clamp(max=2.0)
    assert logged["tis_weight_mean"] == pytest.approx(float((weights * mask).sum() / mask.sum()), rel=1e-5)
    capped = float(((shift == -1.0) * mask).sum() / mask.sum())
    assert logged["tis_truncated_fraction"] == pytest.approx(capped, rel=1e-5) and capped > 0.2
    assert logged["logprob_gap_exceeded"] == 1.0 and logged["train_infer_logprob_gap"] > 0.1
    _, truth, _ = minibatch_loss_and_gradient(reference, real_steps[0]["weights"], list(range(len(advantages))),
                                              tensors, old_logp, advantages[:, None] * weights, GROUP_SIZE)
    _, untouched, _ = minibatch_loss_and_gradient(reference, real_steps[0]["weights"], list(range(len(advantages))),
                                                  tensors, old_logp, advantages, GROUP_SIZE)
    for name, grad in truth.items():
        torch.testing.assert_close(real_steps[0]["grads"][name], grad, rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(truth[n], untouched[n], atol=1e-6) for n in truth)


def test_without_tis_the_update_ignores_the_samplers_logprobs_and_no_flag_is_raised(tmp_path):
    h = rl_harness(tmp_path, 0, updates=1)
    h.stage_cfg = h.stage_cfg.model_copy(update={"max_logprob_gap": 10.0})
    engine = h.create_engine(tiny_policy())
    tensors, advantages = rollout_tensors()
    tensors["sampler_logp"] = tensors["sampler_logp"] - 0.3 * tensors["mask"]
    logged = _update(h, engine, tensors, advantages, EPS_HIGH)
    assert logged["logprob_gap_exceeded"] == 0.0 and "tis_weight_mean" not in logged
    assert logged["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
