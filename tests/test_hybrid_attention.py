"""The hybrid model's softmax layers without a dense T x T mask: causal SDPA when nothing is
padded (or the batch is right-padded), end-aligned causal attention over a cache, each row on
its real tokens otherwise; against the dense boolean mask the model used to build, on the
same weights: outputs at real positions, the loss, every parameter's gradient, cached
decoding and a padded prefix in the cache.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias

from model import hybrid
from model.config import HybridConfig
from model.hybrid import HybridCache, HybridForCausalLM

VOCAB = 53


def tiny_model() -> HybridForCausalLM:
    config = HybridConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, softmax_attention_every=2,
                          lightning_chunk_size=4, pad_token_id=0)
    torch.manual_seed(0)
    return HybridForCausalLM(config)


def dense_mask_attention(q, k, v, padding):
    """The previous implementation: a [B, 1, T, past+T] boolean mask, causal, padded keys hidden,
    the diagonal always visible."""
    seq_len, kv_len = q.shape[2], k.shape[2]
    past = kv_len - seq_len
    query_pos = torch.arange(past, kv_len)[:, None]
    key_pos = torch.arange(kv_len)[None, :]
    mask = (key_pos <= query_pos)[None, None].expand(q.shape[0], 1, -1, -1)
    if padding.key_mask is not None:
        mask = (mask & padding.key_mask[:, None, None, :]) | (key_pos == query_pos)[None, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.fixture
def dense_reference(monkeypatch):
    """Runs a callable once with the model's attention and once with the dense mask."""
    def both(run):
        ours = run()
        with monkeypatch.context() as patch:
            patch.setattr(hybrid, "softmax_attention", dense_mask_attention)
            reference = run()
        return ours, reference
    return both


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Every F.scaled_dot_product_attention call: (attn_mask, is_causal, query length, key length)."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append((attn_mask, is_causal, q.shape[-2], k.shape[-2]))
        # a CausalBias dispatches itself only when it sees the real function under this name
        F.scaled_dot_product_attention = real
        try:
            return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)
        finally:
            F.scaled_dot_product_attention = spy

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def padded_batch(left: bool):
    gen = torch.Generator().manual_seed(2)
    lengths = [13, 7, 10]
    ids = torch.zeros(3, 13, dtype=torch.long)
    mask = torch.zeros(3, 13, dtype=torch.long)
    for row, n in enumerate(lengths):
        span = slice(13 - n, 13) if left else slice(0, n)
        ids[row, span] = torch.randint(1, VOCAB, (n,), generator=gen)
        mask[row, span] = 1
    return ids, mask


def loss_logits_and_grads(net, ids, mask):
    net.zero_grad()
    out = net(ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    logits = net(ids, attention_mask=mask).logits.detach()
    grads = {name: p.grad.clone() for name, p in net.named_parameters() if p.grad is not None}
    return out.loss.detach(), logits, grads


# ----------------------------------------------------------------- no T x T mask


def test_unpadded_and_right_padded_batches_use_maskless_causal_attention(sdpa_calls):
    net = tiny_model()
    ids = torch.randint(1, VOCAB, (2, 64))
    net(ids, labels=ids).loss.backward()
    right_ids, right_mask = padded_batch(left=False)
    net(right_ids, attention_mask=right_mask, labels=right_ids)
    net(ids, attention_mask=torch.ones_like(ids))
    assert len(sdpa_calls) == 3 * 2  # two softmax layers per forward
    assert all(mask is None and causal for mask, causal, _, _ in sdpa_calls)


def test_cached_continuation_aligns_causal_at_the_end_without_a_mask(sdpa_calls):
    """Queries after a cache: several at once get an end-aligned causal bias (flash on a GPU,
    no tensor), a single one sees every key; neither builds a mask tensor."""
    net = tiny_model().eval()
    ids = torch.randint(1, VOCAB, (2, 12))
    with torch.no_grad():
        cache = HybridCache(net.config)
        net(ids[:, :5], cache=cache, use_cache=True)
        net(ids[:, 5:11], cache=cache, use_cache=True)
        net(ids[:, 11:], cache=cache, use_cache=True)
    prefill, continuation, decode = sdpa_calls[0:2], sdpa_calls[2:4], sdpa_calls[4:6]
    assert all(mask is None and causal for mask, causal, _, _ in prefill)
    assert all(isinstance(mask, CausalBias) and (q, k) == (6, 11) for mask, _, q, k in continuation)
    assert all(mask is None and not causal and (q, k) == (1, 12) for mask, causal, q, k in decode)


def test_cached_continuation_matches_one_forward():
    net = tiny_model().eval()
    ids = torch.randint(1, VOCAB, (2, 12))
    with torch.no_grad():
        full = net(ids).logits
        cache = HybridCache(net.config)
        first = net(ids[:, :5], cache=cache, use_cache=True).logits
        rest = net(ids[:, 5:], cache=cache, use_cache=True).logits
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------- padding vs the dense mask


@pytest.mark.parametrize("left", [True, False])
def test_padded_batches_match_the_dense_mask(dense_reference, left):
    """Loss, logits at real positions and every gradient, to 1e-5 in fp32."""
    net = tiny_model()
    ids, mask = padded_batch(left)
    (loss, logits, grads), (ref_loss, ref_logits, ref_grads) = dense_reference(
        lambda: loss_logits_and_grads(net, ids, mask))
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    real = mask.bool()
    torch.testing.assert_close(logits[real], ref_logits[real], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(logits).all()
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-5, msg=name)


def test_left_padded_generation_matches_the_dense_mask(dense_reference):
    """Cached greedy decoding of left-padded prompts: the same tokens and step logits."""
    net = tiny_model().eval()
    ids, mask = padded_batch(left=True)

    def generate():
        with torch.no_grad():
            out = net.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                               output_logits=True, return_dict_in_generate=True)
        return out.sequences, torch.stack(out.logits)

    (tokens, logits), (ref_tokens, ref_logits) = dense_reference(generate)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)


def test_padded_prefix_in_the_cache_matches_the_dense_mask(dense_reference):
    """The prefix-shared RL layout: left-padded prefixes run with a cache, then right-padded
    chunks on top, with gradients through both."""
    net = tiny_model()
    prefix_ids, prefix_mask = padded_batch(left=True)
    chunk_ids, chunk_mask = padded_batch(left=False)
    chunk_ids, chunk_mask = chunk_ids[:, :6], chunk_mask[:, :6]
    chunk_mask[1, 4:] = 0
    full_mask = torch.cat([prefix_mask, chunk_mask], dim=1)

    def run():
        net.zero_grad()
        cache = HybridCache(net.config)
        net(prefix_ids, attention_mask=prefix_mask, cache=cache, use_cache=True)
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0)[:, -6:]
        out = net(chunk_ids, attention_mask=full_mask, position_ids=positions, cache=cache, labels=chunk_ids)
        out.loss.backward()
        return out.token_logprobs.detach(), {n: p.grad.clone() for n, p in net.named_parameters()
                                             if p.grad is not None}

    (logp, grads), (ref_logp, ref_grads) = dense_reference(run)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-5, msg=name)
