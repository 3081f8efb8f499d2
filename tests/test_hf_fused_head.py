"""Pretrained (Hugging Face) models score tokens through the fused FP32 head (issue #13, item 2).

``model.loading`` adopts a transformers causal LM's ``lm_head`` as the fused head when the
model's logits are exactly its final hidden states times that weight; ``token_logprobs`` then
scores from the decoder's hidden states and the weight in FP32, never by upcasting the
model's own (bf16) logits. Checked on the tiny random Llama: same values and gradients as
the logits path in fp32, FP32-accurate in bf16 where upcast bf16 logits are not, the prefix-
shared path on the fused head, and a soft-capped model (Gemma-2) left on its logits.
"""
import copy

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

from model.hybrid import FusedLogprobHead
from model.loading import adopt_fused_head, load_causal_lm
from model.logprobs import logprobs_from_logits, prefix_shared_logprobs, token_logprobs
from tasks.rollout.tiny_model import tiny_llama_path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return tiny_llama_path(home=tmp_path_factory.mktemp("home"))


def batch(vocab: int, rows: int = 3, width: int = 12):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (rows, width), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0                      # a right-padded row
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :4] = -100                  # a prompt of 4 tokens, unscored
    return ids, mask, labels


def logits_path(model, ids, mask, labels):
    """What scoring did before: the model's own logits, upcast to FP32."""
    targets = labels[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return logprobs_from_logits(model(input_ids=ids, attention_mask=mask).logits[:, :-1], targets)


def test_loading_adopts_the_fused_head_keeping_the_tied_parameter(llama_dir):
    model, _ = load_causal_lm(llama_dir)
    head = model.get_output_embeddings()
    assert isinstance(head, FusedLogprobHead)
    assert head.weight is model.get_input_embeddings().weight          # still tied
    assert adopt_fused_head(model) is None                              # idempotent


def test_fused_scores_and_gradients_equal_the_logits_path_in_fp32(llama_dir):
    fused, _ = load_causal_lm(llama_dir)
    plain = copy.deepcopy(fused)
    plain.set_output_embeddings(torch.nn.Linear(64, plain.config.vocab_size, bias=False))
    plain.get_output_embeddings().weight = plain.get_input_embeddings().weight
    fused.train(), plain.train()
    ids, mask, labels = batch(fused.config.vocab_size)
    logp, entropy, _ = token_logprobs(fused, ids, mask, labels)
    ref_logp, ref_entropy = logits_path(plain, ids, mask, labels)
    scored = labels[:, 1:] != -100
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy[scored], ref_entropy[scored], rtol=1e-5, atol=1e-5)
    (logp.sum() + entropy[scored].sum()).backward()
    (ref_logp.sum() + ref_entropy[scored].sum()).backward()
    for (name, p), (_, q) in zip(fused.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_bf16_model_is_scored_in_fp32_not_from_bf16_logits(llama_dir):
    model, _ = load_causal_lm(llama_dir, dtype="bfloat16")
    with torch.no_grad():   # logits of a trained model's size (random init gives |logit| < 0.1)
        model.get_input_embeddings().weight.mul_(300)
    bf16_head = copy.deepcopy(model)                    # the same model scoring from its bf16 logits
    bf16_head.set_output_embeddings(torch.nn.Linear(64, model.config.vocab_size, bias=False, dtype=torch.bfloat16))
    bf16_head.get_output_embeddings().weight = bf16_head.get_input_embeddings().weight
    ids, mask, labels = batch(model.config.vocab_size)
    with torch.no_grad():
        logp, _, _ = token_logprobs(model, ids, mask, labels)
        upcast, _ = logits_path(bf16_head, ids, mask, labels)
        assert bf16_head(input_ids=ids).logits.dtype == torch.bfloat16
        hidden = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
        exact = torch.log_softmax(hidden.double() @ model.get_output_embeddings().weight.double().T, -1)
    targets = labels[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    truth = exact.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1).masked_fill(targets == -100, 0)
    fused_error = (logp.double() - truth).abs().max().item()
    upcast_error = (upcast.double() - truth).abs().max().item()
    assert logp.dtype == torch.float32
    assert fused_error <= 1e-4, fused_error
    assert upcast_error > 1e-2, upcast_error          # bf16 logits lose ~3 significant digits


def test_prefix_shared_scoring_runs_on_the_fused_head(llama_dir):
    model, _ = load_causal_lm(llama_dir)
    vocab = model.config.vocab_size
    prompt = torch.randint(1, vocab, (5,), generator=torch.Generator().manual_seed(3))
    rows = [torch.cat([prompt, torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(n))])
            for n in (4, 6, 3)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = r, 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :5] = -100
    shared = prefix_shared_logprobs(model, ids, mask, labels)
    assert shared.tokens_saved > 0
    reencoded, _, _ = token_logprobs(model, ids, mask, labels)
    torch.testing.assert_close(shared.logp, reencoded, rtol=1e-5, atol=1e-5)


def test_soft_capped_logits_stay_on_the_model_logits():
    config = Gemma2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                          final_logit_softcapping=2.0)
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config)
    reason = adopt_fused_head(model)
    assert reason is not None and "soft-capped" in reason
    assert not isinstance(model.get_output_embeddings(), FusedLogprobHead)
    ids, mask, labels = batch(97)
    logp, _, _ = token_logprobs(model, ids, mask, labels)        # the logits path, soft cap applied
    torch.testing.assert_close(logp, logits_path(model, ids, mask, labels)[0])
