"""Prefix-trie forwards (``model.trie``): multi-turn trajectories merged into a trie and run as
one packed row with tree attention must give the log-probs, entropies and parameter gradients
of running every sequence on its own.

The sequences have an agent group's shape: one shared prompt; a trajectory of three turns
(policy tokens, then a tool result) and its per-turn training samples (each a strict prefix of
the next); a trajectory forked from it after two shared turns; one sharing only the prompt; a
duplicate; a single-token sequence. Real tiny models (random-init Llama and Qwen2, sdpa and
eager attention, the plain and the fused FP32 head), no mocks. The reference is each sequence
alone through the model's own forward, no padding. Models that cannot take a tree mask (the
in-house hybrid, a sliding window) fall back to separate forwards and say why once.
"""
import logging

import pytest
import torch

from model.config import HybridConfig
from model.hybrid import HybridForCausalLM
from model.logprobs import token_logprobs
from model.trie import PrefixTrie, separate_logprobs, tree_inputs, trie_logprobs

VOCAB = 97


def tiny_llama(attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attention_dropout=0.0, pad_token_id=0)
    return LlamaForCausalLM._from_config(config, attn_implementation=attn).eval()


def tiny_qwen2(attn: str = "sdpa", sliding_window: int | None = None):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attention_dropout=0.0, pad_token_id=0, use_sliding_window=sliding_window is not None,
                         sliding_window=sliding_window, max_window_layers=0)
    return Qwen2ForCausalLM._from_config(config, attn_implementation=attn).eval()


def tiny_hybrid():
    config = HybridConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                          num_attention_heads=2, num_key_value_heads=1, softmax_attention_every=2,
                          lightning_chunk_size=4, pad_token_id=0)
    torch.manual_seed(0)
    return HybridForCausalLM(config).eval()


def multiturn_sequences() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)

    def toks(n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=gen).tolist()

    prompt = toks(12)
    turns_a = [(toks(5), toks(3)) for _ in range(3)]                 # (policy, tool result)
    turns_b = turns_a[:2] + [(toks(4), toks(3))]                     # forked after 2 shared turns
    turns_c = [(toks(6), toks(2))]                                   # shares only the prompt

    def history(turns, k):  # sample of turn k: everything before it, then its policy tokens
        return prompt + [t for policy, tool in turns[:k - 1] for t in policy + tool] + turns[k - 1][0]

    samples_a = [history(turns_a, k) for k in (1, 2, 3)]            # each a strict prefix of the next
    return samples_a + [history(turns_b, 3), history(turns_c, 1), samples_a[1], prompt[:1]]


def reference(model, sequences):
    """Each sequence alone through the model's own forward: FP32 log-softmax of its logits."""
    logp, entropy = [], []
    for seq in sequences:
        logits = model(input_ids=torch.tensor([seq])).logits[0, :-1].float()
        log_probs = torch.log_softmax(logits, -1)
        logp.append(log_probs.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0])
        entropy.append(-(log_probs.exp() * log_probs).sum(-1))
    return logp, entropy


def weighted_loss(logp: list[torch.Tensor]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return sum((torch.randn(lp.shape, generator=gen) * lp).sum() for lp in logp)


def gradients(model, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {n: g for n, g in zip(params, grads) if g is not None}


def assert_same(model, out, ref_logp, ref_entropy) -> None:
    assert [lp.shape for lp in out.logp] == [lp.shape for lp in ref_logp]
    for got, want in zip(out.logp, ref_logp):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for got, want in zip(out.entropy, ref_entropy):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    grads, ref_grads = gradients(model, weighted_loss(out.logp)), gradients(model, weighted_loss(ref_logp))
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)


def test_trie_statistics_hand_made():
    seqs = [[1, 2, 3], [1, 2, 4], [1, 2, 3], [1, 2], [5], [1, 2, 3, 6]]
    trie = PrefixTrie.build(seqs)
    # nodes in DFS preorder: 1, 1-2, 1-2-3, 1-2-3-6, 1-2-4, 5
    assert trie.token == [1, 2, 3, 6, 4, 5]
    assert trie.parent == [-1, 0, 1, 2, 1, -1]
    assert trie.depth == [0, 1, 2, 3, 2, 0]
    assert trie.size == [5, 4, 2, 1, 1, 1]
    assert trie.paths == [[0, 1, 2], [0, 1, 4], [0, 1, 2], [0, 1], [5], [0, 1, 2, 3]]
    assert (trie.num_tokens, trie.num_nodes) == (16, 6)
    assert trie.bound == pytest.approx(16 / 6)
    assert trie.rows() == [[0, 1, 2, 3, 4, 5]]
    # a cap of 4 splits the first root subtree below 1-2 and repeats 1, 1-2 in the second row
    assert trie.rows(4) == [[0, 1, 2, 3], [0, 1, 4, 5]]
    with pytest.raises(ValueError, match="longest sequence"):
        trie.rows(3)
    with pytest.raises(ValueError, match="empty"):
        PrefixTrie.build([[1], []])
    # the tree mask: each token attends to its ancestors and itself only
    mask = tree_inputs(trie, trie.rows(), torch.float32, "cpu")["attention_mask"][0, 0] == 0
    want = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                         [1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask, want)


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_equals_separate_forwards(build, attn):
    model = build(attn)
    seqs = multiturn_sequences()
    out = trie_logprobs(model, seqs)
    trie = PrefixTrie.build(seqs)
    assert (out.method, out.reason, out.rows) == ("tree", None, 1)
    assert (out.tokens, out.trie_tokens) == (trie.num_tokens, trie.num_nodes)
    assert trie.bound > 2
    assert out.logp[-1].shape == (0,)          # the single-token sequence has nothing to score
    assert_same(model, out, *reference(model, seqs))


def test_multi_row_packing_equals_one_row():
    model = tiny_llama()
    seqs = multiturn_sequences()
    cap = max(len(s) for s in seqs)            # the tightest cap: every row holds a longest sequence
    out = trie_logprobs(model, seqs, max_tokens_per_row=cap)
    trie = PrefixTrie.build(seqs)
    assert out.method == "tree" and out.rows > 1
    assert trie.num_nodes < out.trie_tokens < trie.num_tokens   # ancestors repeated across rows
    assert_same(model, out, *reference(model, seqs))


def test_fused_head_model_goes_through_it():
    from model.hybrid import FusedLogprobHead
    from model.loading import adopt_fused_head

    model = tiny_llama()
    seqs = multiturn_sequences()
    ref = reference(model, seqs)
    assert adopt_fused_head(model) is None
    assert isinstance(model.get_output_embeddings(), FusedLogprobHead)
    out = trie_logprobs(model, seqs, max_tokens_per_row=40)
    assert out.method == "tree"
    assert_same(model, out, *ref)


def test_without_the_tree_mask_a_packed_row_is_wrong():
    """The negative control: the packed row under a plain causal mask lets a branch see its
    siblings, so the 4D mask (not something transformers substitutes) is what makes it exact."""
    model = tiny_llama()
    seqs = multiturn_sequences()
    trie = PrefixTrie.build(seqs)
    inputs = tree_inputs(trie, trie.rows(), torch.float32, "cpu")
    with torch.no_grad():
        tree = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"],
                     attention_mask=inputs["attention_mask"]).logits
        causal = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"]).logits
        fork = trie.paths[3][-1]                 # the last token of the forked trajectory
        alone = model(input_ids=torch.tensor([seqs[3]])).logits[0, -1]
    torch.testing.assert_close(tree[0, fork], alone, atol=1e-5, rtol=0)
    assert float((causal[0, fork] - alone).abs().max()) > 1e-3


@pytest.mark.parametrize("build", [tiny_hybrid, lambda: tiny_qwen2(sliding_window=4)], ids=["hybrid", "sliding"])
def test_models_without_an_exact_tree_mask_fall_back_and_say_why_once(build, caplog):
    model = build()
    seqs = multiturn_sequences()
    with caplog.at_level(logging.WARNING, logger="posttrain.trie"):
        out = trie_logprobs(model, seqs)
        again = trie_logprobs(model, seqs, max_tokens_per_row=64)
    warnings = [r.getMessage() for r in caplog.records if "tree-attention" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert out.method == again.method == "separate"
    assert ("lightning" if build is tiny_hybrid else "sliding") in out.reason
    assert out.rows == 1 and again.rows > 1 and out.trie_tokens == out.tokens
    empty = torch.zeros(0)
    alone = [token_logprobs(model, torch.tensor([s]))[:2] if len(s) > 1 else (empty[None], empty[None])
             for s in seqs]
    assert_same(model, again, [lp[0] for lp, _ in alone], [ent[0] for _, ent in alone])


def test_separate_logprobs_batches_under_a_token_budget():
    model = tiny_llama()
    seqs = multiturn_sequences()
    one, split = separate_logprobs(model, seqs), separate_logprobs(model, seqs, max_tokens_per_batch=64)
    assert one.rows == 1 and split.rows > 1
    for a, b in zip(one.logp, split.logp):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    forced = trie_logprobs(model, seqs, tree=False)
    assert (forced.method, forced.reason) == ("separate", None)
