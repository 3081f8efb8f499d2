"""The hybrid model under a real DeepSpeed ZeRO-3 engine (one CPU rank in this process, gloo).

ZeRO-3 keeps every parameter partitioned and gathers it only around its module's call, so
these tests prove the fused FP32 log-prob head reads ``lm_head.weight`` inside such a call:
ZeRO-3 training follows ZeRO-0 step for step from the same init and data, and ZeRO-3
log-probs equal the plain model's.
"""
import copy
import json

import pytest
import torch

from model.config import HybridConfig
from model.hybrid import HybridForCausalLM
from model.logprobs import token_logprobs
from model.losses import sft_loss
from model.optim import build_adamw
from tasks.train.config import EngineConfig
from tasks.train.ds_config import deepspeed_config
from tasks.train.engine import backward_and_step, init_single_rank, prepare_environment

VOCAB, STEPS, LR = 97, 3, 1e-2


def tiny_hybrid() -> HybridForCausalLM:
    """One lightning and one softmax layer with a 4-expert MoE feed-forward."""
    config = HybridConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, softmax_attention_every=2,
                          lightning_chunk_size=8, num_experts=4, num_experts_per_tok=2, pad_token_id=0)
    torch.manual_seed(0)
    return HybridForCausalLM(config).train()


def fixed_batches() -> list[dict[str, torch.Tensor]]:
    """STEPS left-padded batches whose labels mask the padding and a 3-token prompt."""
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(1, VOCAB, (2, 12), generator=gen)
        mask = torch.ones_like(ids)
        mask[0, :4] = 0
        ids = ids.masked_fill(mask == 0, 0)
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :7] = -100
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return batches


def deepspeed_engine(model: HybridForCausalLM, zero_stage: int):
    engine_cfg = EngineConfig(zero_stage=zero_stage, precision="fp32", micro_batch_size=2)
    prepare_environment(engine_cfg)
    init_single_rank()
    import deepspeed

    ds_config = deepspeed_config(engine_cfg)
    if zero_stage == 3:
        # by default parameters under 1e5 elements stay gathered for good, i.e. this whole
        # model: release every one after use so the head really has to be gathered
        ds_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config,
                                           optimizer=build_adamw(model.parameters(), lr=LR))
    return engine


def sft_steps(engine, batches) -> list[tuple[float, float]]:
    """The SFT stage's step on each batch: (loss, gradient norm before clipping)."""
    history = []
    for batch in batches:
        logp, _, aux = token_logprobs(engine.module, batch["input_ids"], batch["attention_mask"], batch["labels"])
        loss = sft_loss(logp, batch["labels"][:, 1:] != -100) + aux
        history.append((loss.item(), backward_and_step(engine, loss)))
    return history


@pytest.fixture(scope="module")
def runs():
    init = tiny_hybrid()
    plain = copy.deepcopy(init).eval()
    zero0 = deepspeed_engine(copy.deepcopy(init), 0)
    zero3 = deepspeed_engine(copy.deepcopy(init), 3)
    probe = fixed_batches()[0]
    with torch.no_grad():
        before = {
            "plain": plain.fused_token_logprobs(probe["input_ids"], probe["attention_mask"], probe["labels"]),
            "zero3": zero3.module.fused_token_logprobs(probe["input_ids"], probe["attention_mask"], probe["labels"]),
            "plain_logits": plain(probe["input_ids"], attention_mask=probe["attention_mask"]).logits,
            "zero3_logits": zero3.module(probe["input_ids"], attention_mask=probe["attention_mask"]).logits,
        }
    batches = fixed_batches()
    return {"before": before, "zero0": (zero0, sft_steps(zero0, batches)),
            "zero3": (zero3, sft_steps(zero3, batches))}


def test_zero3_partitions_the_head_and_scores_like_the_plain_model(runs):
    zero3, _ = runs["zero3"]
    head = zero3.module.lm_head.weight
    assert head.numel() == 0 and head.ds_numel == VOCAB * 32      # only a partition lives outside calls
    before = runs["before"]
    for got, want in zip(before["zero3"], before["plain"]):         # log-probs, entropies
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert (before["plain"][0] != 0).sum() == 10                  # labels 7..11 of both rows were scored
    torch.testing.assert_close(before["zero3_logits"], before["plain_logits"], rtol=0, atol=1e-6)


def test_zero3_training_matches_zero0_step_for_step(runs):
    import deepspeed

    (zero0, history0), (zero3, history3) = runs["zero0"], runs["zero3"]
    losses0, losses3 = [h[0] for h in history0], [h[0] for h in history3]
    assert losses3 == pytest.approx(losses0, rel=0, abs=1e-5)
    assert [h[1] for h in history3] == pytest.approx([h[1] for h in history0], rel=1e-5)
    assert len(set(losses0)) == STEPS                              # the weights moved between steps
    params3 = dict(zero3.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params3.values())):
        for name, param in zero0.module.named_parameters():
            torch.testing.assert_close(params3[name].detach(), param.detach(), rtol=0, atol=1e-5, msg=name)


def test_sft_stage_runs_under_zero3_and_saves_full_weights(wh):
    """The stage plumbing at ZeRO-3: no refusal, ZeRO-3 checkpoint at step 2, gathered HF save.
    (Its model is under the default persistence threshold; the tests above cover partitioning.)"""
    from test_train_engine import seeded_sft_job, small_config
    from transformers import AutoModelForCausalLM

    from tasks.train.runner import execute_stage

    job = seeded_sft_job(wh, small_config(zero_stage=3), stage_steps=3)
    result = execute_stage(job)
    assert json.loads((job.stage_path / "ds_config.json").read_text())["zero_optimization"]["stage"] == 3
    steps = [json.loads(line) for line in (job.stage_path / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2] and all(s["grad_norm"] > 0 for s in steps)
    reloaded = AutoModelForCausalLM.from_pretrained(result["path"])      # gathered, not partitions
    base = AutoModelForCausalLM.from_pretrained(job.init_model)
    assert reloaded.lm_head.weight.shape == base.lm_head.weight.shape
    assert not torch.equal(reloaded.lm_head.weight, base.lm_head.weight)   # the head was trained
