"""Prefix-shared group updates (issue #14, item 4): each distinct prompt encoded once for the
responses that share it must give the log-probs, losses and gradients of re-encoding the
prompt with every response. The same holds for distinct prompts that open alike (SFT examples
under one set of instructions, such as the judge's), grouped to encode the fewest tokens.

A small hybrid policy (lightning layers with a chunk size the prompts cross, softmax layers,
dense or MoE feed-forward) scores one batch both ways: prompts of 1 to 23 tokens, responses
of 0 to 10, right padding, groups of 3, and a slice of rows that cuts two groups. A real
DeepSpeed engine then runs the RL stage's behaviour pass and one update both ways.
"""
import itertools
import logging
import random

import pytest
import torch

from model.config import IGNORE_INDEX, HybridConfig
from model.hybrid import HybridForCausalLM
from model.logprobs import (
    prefix_layout,
    prefix_shared_logprobs,
    response_starts,
    shared_prefix_groups,
    token_logprobs,
)
from model.losses import group_advantages, policy_loss
from tasks.train.config import EngineConfig, OptimizerConfig, RLStageConfig
from tasks.train.encoding import pad_batch
from tasks.train.engine import create_engine
from tasks.train.rl import _behaviour_logprobs, _micro_batches, _minibatch_step

VOCAB, GROUP_SIZE = 61, 3
PROMPT_LENGTHS = (6, 1, 23, 13)
REWARDS = [1, 0, 0, 0, 1, 1, 1, 0, 1, 0, 0, 1]


def tiny_policy(num_experts: int = 0) -> HybridForCausalLM:
    config = HybridConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                          num_attention_heads=2, num_key_value_heads=1, softmax_attention_every=2,
                          lightning_chunk_size=4, num_experts=num_experts, num_experts_per_tok=2,
                          pad_token_id=0)
    torch.manual_seed(0)
    return HybridForCausalLM(config).train()


def group_batch() -> tuple[dict, list[int]]:
    """4 prompts x 3 responses laid out group by group, as the RL stage pads them."""
    gen = torch.Generator().manual_seed(1)
    seqs, prompt_lengths = [], []
    for n_prompt in PROMPT_LENGTHS:
        prompt = torch.randint(1, VOCAB, (n_prompt,), generator=gen).tolist()
        for _ in range(GROUP_SIZE):
            length = int(torch.randint(0, 11, (1,), generator=gen))
            seqs.append(prompt + torch.randint(1, VOCAB, (length,), generator=gen).tolist())
            prompt_lengths.append(n_prompt)
    tensors = pad_batch(seqs, prompt_lengths, pad_id=0)
    tensors["mask"] = (tensors["labels"][:, 1:] != IGNORE_INDEX).float()
    tensors["sampler_logp"] = torch.zeros_like(tensors["mask"])
    return tensors, prompt_lengths


def both_ways(policy, tensors: dict, rows: list[int]):
    idx = torch.tensor(rows)
    batch = (tensors["input_ids"][idx], tensors["attention_mask"][idx], tensors["labels"][idx])
    return token_logprobs(policy, *batch), prefix_shared_logprobs(policy, *batch)


def gradients(policy, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    params = dict(policy.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {n: g for n, g in zip(params, grads) if g is not None}


def assert_same_gradients(policy, loss_a: torch.Tensor, loss_b: torch.Tensor) -> None:
    grads_a, grads_b = gradients(policy, loss_a), gradients(policy, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, atol=1e-5, rtol=1e-5, msg=name)


def test_layout_encodes_each_distinct_prompt_once():
    tensors, prompt_lengths = group_batch()
    layout = prefix_layout(tensors["input_ids"], tensors["attention_mask"], tensors["labels"])
    assert layout.prompt_of_row.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    # prefixes hold all but each prompt's last token, left-padded
    assert layout.prefix_mask.sum(1).tolist() == [n - 1 for n in PROMPT_LENGTHS]
    assert layout.prefix_ids.shape[1] == max(PROMPT_LENGTHS) - 1
    # each chunk is the prompt's last token, then the response
    for row, n_prompt in enumerate(prompt_lengths):
        length = int(tensors["attention_mask"][row].sum())
        chunk = layout.chunk_ids[row, :length - n_prompt + 1]
        assert chunk.tolist() == tensors["input_ids"][row, n_prompt - 1:length].tolist()
        assert int(layout.chunk_mask[row].sum()) == length - n_prompt + 1


@pytest.mark.parametrize("num_experts", [0, 4], ids=["dense", "moe"])
def test_logprobs_loss_and_gradients_match_reencoding(num_experts):
    policy = tiny_policy(num_experts)
    tensors, prompt_lengths = group_batch()
    rows = list(range(len(prompt_lengths)))
    (logp, entropy, aux), shared = both_ways(policy, tensors, rows)
    mask = tensors["mask"]
    torch.testing.assert_close(shared.logp, logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(shared.entropy * mask, entropy * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(shared.aux, aux, atol=1e-6, rtol=1e-6)
    if num_experts:
        assert aux.item() > 0  # the balance loss counts the shared prompt once per response
    # prompt tokens not re-run: every row's prompt, less each prompt once (its last token is re-run per row)
    assert shared.tokens_saved == sum(prompt_lengths) - sum(n - 1 for n in PROMPT_LENGTHS) - len(rows)

    # an off-policy CISPO step: behaviour log-probs nudged so ratios leave 1 and the clip acts
    old = (logp.detach() + 0.05 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(2))) * mask
    advantages = group_advantages(torch.tensor(REWARDS, dtype=torch.float32), GROUP_SIZE)
    loss_a, stats_a = policy_loss("cispo", logp, old, advantages, mask, 1.0, 0.02, group_size=GROUP_SIZE)
    loss_b, stats_b = policy_loss("cispo", shared.logp, old, advantages, mask, 1.0, 0.02, group_size=GROUP_SIZE)
    assert stats_a["clip_fraction"] > 0
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-6)
    assert stats_b == pytest.approx(stats_a, abs=1e-6)
    assert_same_gradients(policy, loss_a + aux, loss_b + shared.aux)


def test_rows_that_cut_groups_share_within_their_slice():
    policy = tiny_policy()
    tensors, _ = group_batch()
    rows = [1, 2, 3, 4, 5, 6]   # the last two responses of group 0, group 1, the first of group 2
    (logp, _, _), shared = both_ways(policy, tensors, rows)
    torch.testing.assert_close(shared.logp, logp, atol=1e-5, rtol=0)
    # group 0's prompt (6 tokens) shared by 2 rows: 5 tokens saved; group 1's one-token prompt: nothing
    assert shared.tokens_saved == 5
    weights = torch.rand(logp.shape, generator=torch.Generator().manual_seed(3))
    assert_same_gradients(policy, (logp * weights).sum(), (shared.logp * weights).sum())


def test_hf_llama_shares_through_its_dynamic_cache():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    policy = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          pad_token_id=0)).train()
    tensors, prompt_lengths = group_batch()
    (logp, _, _), shared = both_ways(policy, tensors, list(range(len(prompt_lengths))))
    assert shared.tokens_saved > 0
    torch.testing.assert_close(shared.logp, logp, atol=1e-5, rtol=0)
    assert_same_gradients(policy, logp.sum(), shared.logp.sum())


def test_sliding_window_model_reencodes_and_says_why_once(caplog):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    policy = MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              pad_token_id=0, sliding_window=4)).train()
    tensors, prompt_lengths = group_batch()
    rows = list(range(len(prompt_lengths)))
    with caplog.at_level(logging.WARNING, logger="posttrain.logprobs"):
        for _ in range(2):
            (logp, _, _), shared = both_ways(policy, tensors, rows)
            assert shared.tokens_saved == 0
            torch.testing.assert_close(shared.logp, logp, atol=0, rtol=0)
    warnings = [r.getMessage() for r in caplog.records if "prefix-shared" in r.getMessage()]
    assert len(warnings) == 1 and "DynamicSlidingWindowLayer" in warnings[0], warnings


def rl_step(prefix_shared: bool, tensors: dict, advantages: torch.Tensor) -> tuple[torch.Tensor, dict, int]:
    """The RL stage's behaviour pass and one update, in 3 micro-batches of 4 rows (groups 1 and 2 are cut)."""
    cfg = RLStageConfig(group_size=GROUP_SIZE, prefix_shared=prefix_shared)
    engine, _ = create_engine(tiny_policy(), EngineConfig(zero_stage=0, precision="fp32", micro_batch_size=4,
                                                          gradient_accumulation_steps=3),
                              OptimizerConfig(lr=1e-2), lr=1e-2, total_steps=10)
    micro_batches = _micro_batches(list(range(advantages.numel())), 3)
    old_logp, saved = _behaviour_logprobs(engine.module, tensors, micro_batches, prefix_shared)
    old_logp = old_logp + 0.05 * torch.randn(old_logp.shape, generator=torch.Generator().manual_seed(2))
    stats = _minibatch_step(engine, cfg, tensors, list(range(advantages.numel())), micro_batches,
                            old_logp * tensors["mask"], advantages, 0.02)
    return old_logp, stats, saved


def test_rl_update_is_the_same_with_and_without_prefix_sharing():
    tensors, _ = group_batch()
    advantages = group_advantages(torch.tensor(REWARDS, dtype=torch.float32), GROUP_SIZE)
    old_a, stats_a, saved_a = rl_step(False, tensors, advantages)
    old_b, stats_b, saved_b = rl_step(True, tensors, advantages)
    torch.testing.assert_close(old_b, old_a, atol=1e-5, rtol=0)
    assert saved_a == 0 and stats_a.pop("prefix_shared_tokens_saved") == 0
    # what each slice shares: group 0 in rows 0-2 (2 x 5 tokens), group 2 in rows 6-7 (22), group 3 in
    # rows 9-11 (2 x 12); the one-token prompt and group 2's row 8, alone in its slice, share nothing
    assert saved_b == 10 + 22 + 24 and stats_b.pop("prefix_shared_tokens_saved") == saved_b
    assert stats_a["clip_fraction"] > 0 and stats_a["grad_norm"] > 0
    assert stats_b == pytest.approx(stats_a, rel=1e-5, abs=1e-6)


def _encoded_tokens(prompts, groups) -> int:
    """Prompt tokens a grouping runs: each group's shared part once, every row's rest."""
    return sum(shared + sum(len(prompts[r]) - shared for r in rows) for rows, shared in groups)


def _set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _set_partitions(rest):
        yield [[first], *partition]
        for i in range(len(partition)):
            yield [*partition[:i], [first, *partition[i]], *partition[i + 1:]]


def _common(prompts, rows) -> int:
    """The most a group may share: the common start of its prompts, each less its last token."""
    shared = min(len(prompts[r]) - 1 for r in rows)
    for a, b in itertools.combinations(rows, 2):
        shared = min(shared, next((i for i, (x, y) in enumerate(zip(prompts[a], prompts[b])) if x != y), shared))
    return max(shared, 0)


def test_shared_prefix_groups_encode_the_fewest_tokens_of_any_grouping():
    rng = random.Random(0)
    for trial in range(40):
        stems = [[rng.randrange(3) for _ in range(rng.randrange(0, 6))] for _ in range(2)]
        prompts = [tuple(rng.choice(stems) + [rng.randrange(3) for _ in range(rng.randrange(1, 5))])
                   for _ in range(rng.randrange(1, 7))]
        prompts += [prompts[0]] * rng.randrange(0, 2)          # sometimes an identical prompt
        groups = shared_prefix_groups(prompts)
        assert sorted(r for rows, _ in groups for r in rows) == list(range(len(prompts)))
        for rows, shared in groups:
            assert shared == _common(prompts, rows) if len(rows) > 1 else shared == len(prompts[rows[0]]) - 1
        best = min(_encoded_tokens(prompts, [(rows, _common(prompts, rows)) for rows in partition])
                   for partition in _set_partitions(list(range(len(prompts)))))
        assert _encoded_tokens(prompts, groups) == best, (trial, prompts, groups)


def test_identical_prompts_always_share_and_a_short_common_start_does_not_split_them():
    a, b = (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 9, 9, 9, 9, 9, 9)
    # two groups of 3 sharing 7 tokens each beat one group of 6 sharing the 2-token start
    assert shared_prefix_groups([a, a, a, b, b, b]) == [([0, 1, 2], 7), ([3, 4, 5], 7)]
    # distinct prompts under one 6-token instruction share it
    head = (4, 4, 4, 4, 4, 4)
    assert shared_prefix_groups([head + (1,), head + (2, 2), head + (3,)]) == [([0, 1, 2], 6)]


def instruction_batch() -> dict:
    """SFT rows: one 14-token instruction opening every prompt, then each its own question and answer."""
    gen = torch.Generator().manual_seed(5)
    instruction = torch.randint(1, VOCAB, (14,), generator=gen).tolist()
    seqs, prompt_lengths = [], []
    for _ in range(6):
        prompt = instruction + torch.randint(1, VOCAB, (int(torch.randint(1, 9, (1,), generator=gen)),),
                                             generator=gen).tolist()
        seqs.append(prompt + torch.randint(1, VOCAB, (int(torch.randint(1, 5, (1,), generator=gen)),),
                                           generator=gen).tolist())
        prompt_lengths.append(len(prompt))
    return pad_batch(seqs, prompt_lengths, pad_id=0)


def test_prompts_under_one_instruction_share_it_with_the_same_loss_and_gradients():
    policy = tiny_policy()
    batch = instruction_batch()
    layout = prefix_layout(batch["input_ids"], batch["attention_mask"], batch["labels"])
    assert layout.prompt_of_row.tolist() == [0] * 6 and layout.prefix_mask.sum().item() == 14
    (logp, _, _), shared = both_ways(policy, batch, list(range(6)))
    assert shared.tokens_saved == 5 * 14
    torch.testing.assert_close(shared.logp, logp, atol=1e-5, rtol=0)
    mask = batch["labels"][:, 1:] != IGNORE_INDEX
    assert_same_gradients(policy, logp[mask].mean(), shared.logp[mask].mean())


def test_a_prompt_loss_scores_every_token_after_the_shared_instruction_as_re_encoding_does():
    """SFT with a prompt loss (``prompt_loss_weight``): labels score the prompt too, and the prompt
    lengths say where each prompt ends, so the rows still share their instruction. Every token
    after it is scored with re-encoding's log-prob; the shared instruction, the same for every
    row, is not scored (``scored`` says so), and the loss over what was scored has re-encoding's
    gradient."""
    policy = tiny_policy()
    batch = instruction_batch()
    prompt_lengths = response_starts(batch["attention_mask"], batch["labels"])
    every_token = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
    logp, _, _ = token_logprobs(policy, batch["input_ids"], batch["attention_mask"], every_token)
    shared = prefix_shared_logprobs(policy, batch["input_ids"], batch["attention_mask"], every_token,
                                    prompt_lengths=prompt_lengths)
    assert shared.tokens_saved == 5 * 14
    # re-encoding scores every real next token; sharing all but those the 14-token instruction predicts
    real = batch["attention_mask"][:, 1:] != 0
    columns = torch.arange(real.shape[1])[None]
    assert torch.equal(shared.scored, real & (columns >= 14))
    torch.testing.assert_close(shared.logp[shared.scored], logp[shared.scored], atol=1e-5, rtol=0)
    assert (shared.logp[~shared.scored] == 0).all()
    # without prompt lengths the first scored label would be taken for the prompt's end: nothing shared
    assert prefix_shared_logprobs(policy, batch["input_ids"], batch["attention_mask"], every_token).tokens_saved == 0
    assert_same_gradients(policy, logp[shared.scored].mean(), shared.logp[shared.scored].mean())
    # the response tokens are scored in both, and a re-encoded batch says it scored exactly its labels
    response = batch["labels"][:, 1:] != IGNORE_INDEX
    assert (shared.scored & response).sum() == response.sum()
    assert torch.equal(prefix_shared_logprobs(policy, batch["input_ids"], batch["attention_mask"],
                                              batch["labels"]).scored, response)
