"""Hybrid model: config, tokenizer, a few CPU training steps, save/reload through the Auto
classes, generation with the recurrent cache, and the FP32 log-prob numerics."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import model
from kernels import head_logprobs
from model import HybridCache, HybridConfig, build_tiny_model, lightning_slopes, train_tokenizer

TEXTS = [
    f"Question {i}: what is {i} plus {i + 3}? <think>{i} + {i + 3} = {2 * i + 3}</think>"
    f"<answer>{2 * i + 3}</answer> The quick brown fox jumps over the lazy dog."
    for i in range(200)
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(TEXTS, vocab_size=384, out_dir=tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def trained(tokenizer, tmp_path_factory):
    """Tiny hybrid model after a few AdamW steps, saved with its tokenizer."""
    net = build_tiny_model(tokenizer)
    batch = tokenizer(TEXTS[:8], return_tensors="pt", padding=True)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        out = net(**batch, labels=batch.input_ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    save_dir = tmp_path_factory.mktemp("ckpt")
    net.save_pretrained(save_dir)
    tokenizer.save_pretrained(save_dir)
    return net.eval(), losses, save_dir


def test_config_layer_pattern_and_slopes():
    cfg = HybridConfig(vocab_size=50, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=16, softmax_attention_every=8)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [7, 15]
    assert cfg.rotary_dim == 4  # half of head_dim 8
    first, last = lightning_slopes(8, 0, 16), lightning_slopes(8, 15, 16)
    # s_h = 2^(-8h/H) times (1 - l/(L-1) + 1e-5): ~1 in the first layer, ~1e-5 in the last
    assert first[0] == pytest.approx(2 ** -1, rel=1e-4) and first[-1] == pytest.approx(2 ** -8, rel=1e-4)
    assert last[0] == pytest.approx(2 ** -1 * (1 - 15 / (15 + 1e-5) + 1e-5), rel=1e-6)
    assert last[0] < 1e-5
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        HybridConfig(num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(ValueError, match="layer_types has 3 entries"):
        HybridConfig(num_hidden_layers=2, layer_types=["linear_attention"] * 3)


def test_tokenizer_specials_and_chat_template(tokenizer, tmp_path):
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        assert len(tokenizer(tag, add_special_tokens=False).input_ids) == 1
    text = tokenizer.decode(tokenizer("<answer>7</answer>").input_ids, skip_special_tokens=True)
    assert text == "<answer>7</answer>"  # reasoning tags survive decoding, specials do not
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|bos|><|system|>\nBe brief.<|eos|>\n<|user|>\n1+1?<|eos|>\n<|assistant|>\n"
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == prompt
    with pytest.raises(Exception, match="chat role must be"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_training_reduces_loss_and_reloads_through_auto_classes(trained):
    net, losses, save_dir = trained
    assert losses[-1] < losses[0] - 0.3, losses
    assert isinstance(AutoConfig.from_pretrained(save_dir), HybridConfig)
    reloaded = AutoModelForCausalLM.from_pretrained(save_dir).eval()
    assert isinstance(reloaded, model.HybridForCausalLM)
    ids = torch.tensor([[5, 9, 30, 31, 70]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, net(ids).logits)


def test_generate_with_recurrent_cache_matches_uncached(trained):
    _, _, save_dir = trained
    net = AutoModelForCausalLM.from_pretrained(save_dir).eval()
    tok = AutoTokenizer.from_pretrained(save_dir)
    prompts = ["Question 3: what is", "The quick brown fox jumps over"]
    batch = tok(prompts, return_tensors="pt", padding=True)
    result = net.generate(**batch, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id,
                          return_dict_in_generate=True)
    cached = result.sequences
    assert isinstance(result.cache, HybridCache)  # generate ran on our recurrent cache
    assert result.cache.get_seq_length() == cached.shape[1] - 1  # the last token is never fed
    uncached = net.generate(**batch, max_new_tokens=10, do_sample=False, use_cache=False,
                            pad_token_id=tok.pad_token_id)
    assert torch.equal(cached, uncached)
    # left padding must not change a prompt's continuation
    alone = tok(prompts[:1], return_tensors="pt")
    single = net.generate(**alone, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id)
    assert torch.equal(single[0, -10:], cached[0, -10:])


def test_lightning_state_stays_constant_size_while_kv_grows(trained):
    net, _, _ = trained
    cache = HybridCache(net.config)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    sizes = []
    with torch.no_grad():
        out = net(ids, cache=cache, use_cache=True)
        for _ in range(5):
            sizes.append(cache.state_bytes())
            next_id = out.logits[:, -1].argmax(-1, keepdim=True)
            out = net(next_id, cache=cache, use_cache=True)
    assert len({s["lightning"] for s in sizes}) == 1 and sizes[0]["lightning"] > 0
    assert sizes[-1]["softmax_kv"] > sizes[0]["softmax_kv"]
    assert cache.get_seq_length() == 11


def test_training_logprobs_match_step_by_step_decoding(trained):
    """Log-probs of the training path (chunked kernel + fused FP32 head) vs the decoding path
    (prefill one token, then one token at a time through the recurrent cache)."""
    net, _, _ = trained
    ids = torch.tensor([[1, 40, 41, 42, 100, 120, 7, 9, 200, 201, 202, 55, 66, 77, 88, 99, 11, 12]])
    with torch.no_grad():
        logp_train, entropy = net.fused_token_logprobs(ids)
        cache = HybridCache(net.config)
        decoded = []
        for t in range(ids.shape[1] - 1):
            logits = net(ids[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1]
            decoded.append(torch.log_softmax(logits, -1)[0, ids[0, t + 1]])
    logp_decode = torch.stack(decoded)
    corr = torch.corrcoef(torch.stack([logp_train[0], logp_decode]))[0, 1].item()
    max_diff = (logp_train[0] - logp_decode).abs().max().item()
    print(f"train vs decode log-prob correlation {corr:.6f}, max |diff| {max_diff:.2e}")
    assert corr > 0.9999 and max_diff < 1e-4
    assert entropy.shape == logp_train.shape and (entropy > 0).all()


def test_token_logprobs_agree_with_loss_and_backprop(trained, tokenizer):
    net, _, _ = trained
    batch = tokenizer(TEXTS[20:23], return_tensors="pt", padding=True)
    logp, _, aux = net.fused_token_logprobs(batch.input_ids, batch.attention_mask, with_aux=True)
    out = net(**batch, labels=batch.input_ids)
    n_valid = batch.attention_mask[:, 1:].sum()
    expected = -logp.sum() / n_valid + net.config.router_aux_loss_coef * aux
    torch.testing.assert_close(out.loss, expected)
    assert (logp[batch.attention_mask[:, 1:] == 0] == 0).all()
    assert 0.9 < aux.item() < 4.0  # balance loss is 1 when routing is uniform
    (-logp.sum()).backward()
    assert net.lm_head.weight.grad is not None and net.model.layers[0].attn.qkv_proj.weight.grad is not None
    net.zero_grad()


def test_fp32_head_beats_bf16_on_rare_tokens():
    """Against a float64 reference, the FP32 fused head is far closer than a BF16 head on the
    rarest tokens, the ones whose log-probs broke RL in MiniMax-M1."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 128, generator=gen)
    weight = torch.randn(4096, 128, generator=gen) * 0.3
    ref = torch.log_softmax(hidden.double() @ weight.double().T, -1)
    rare = ref.argmin(-1)  # least likely token per position
    ref_rare = ref.gather(-1, rare[:, None])[:, 0]
    fp32_logp, _ = head_logprobs(hidden, weight, rare)
    bf16_logits = hidden.bfloat16() @ weight.bfloat16().T
    bf16_logp = torch.log_softmax(bf16_logits, -1).gather(-1, rare[:, None])[:, 0]
    fp32_err = (fp32_logp.double() - ref_rare).abs().mean().item()
    bf16_err = (bf16_logp.double() - ref_rare).abs().mean().item()
    print(f"rare-token |log-prob error| vs float64: fp32 {fp32_err:.2e}, bf16 {bf16_err:.2e}")
    assert fp32_err < 1e-3 < bf16_err
    assert fp32_err * 100 < bf16_err


def test_head_scores_only_labelled_positions_with_the_full_heads_values_and_gradients():
    """An SFT row scores its response only: the head goes through the vocabulary at those
    positions alone, with the log-probs, entropies and gradients of scoring every position
    (0 log-prob and entropy where the label is ignored)."""
    from model.config import IGNORE_INDEX
    from model.hybrid import FusedLogprobHead

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 20, 32, generator=gen)
    labels = torch.randint(0, 300, (3, 20), generator=gen)
    labels[:, :14] = IGNORE_INDEX          # a prompt, then the scored response
    labels[2, 17:] = IGNORE_INDEX          # a shorter row's padding
    head = FusedLogprobHead(32, 300)
    torch.nn.init.normal_(head.weight, std=0.2, generator=gen)
    h_part = hidden.clone().requires_grad_()
    logp, entropy = head(h_part, labels)
    h_full = hidden.clone().requires_grad_()
    w_full = head.weight.detach().clone().requires_grad_()
    full_logp, full_entropy = head_logprobs(h_full, w_full, labels)   # every position through the vocabulary
    scored = labels != IGNORE_INDEX
    torch.testing.assert_close(logp[scored], full_logp[scored], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy[scored], full_entropy[scored], rtol=1e-6, atol=1e-6)
    assert (logp[~scored] == 0).all() and (entropy[~scored] == 0).all()
    assert (full_entropy[~scored] > 0).all()                            # the full head computed them
    (logp.sum() + (entropy * scored).sum()).backward()
    (full_logp.sum() + (full_entropy * scored).sum()).backward()
    torch.testing.assert_close(h_part.grad, h_full.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.weight.grad, w_full.grad, rtol=1e-5, atol=1e-6)
    assert (h_part.grad[~scored] == 0).all()
