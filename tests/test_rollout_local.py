from dataclasses import replace

import pytest
import torch

from tasks.rollout.base import Completion, RolloutBackend, SamplingParams
from tasks.rollout.config import LocalConfig, RolloutConfig
from tasks.rollout.factory import make_backend
from tasks.rollout.local import LocalBackend, sample_next_token
from tasks.rollout.repetition import repetition_cut, truncate_on_repetition
from tasks.rollout.tiny_model import tiny_llama_path

PROMPTS = ["What is 3 + 4?", "def f(x):\n    return", "the of and to in is that for it as with was on be by"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return tiny_llama_path(home=tmp_path_factory.getbasetemp() / "shared-models-home")


@pytest.fixture(scope="module")
def backend(tiny_path):
    torch.set_num_threads(1)
    return LocalBackend.from_path(tiny_path, LocalConfig(batch_size=4))


def teacher_forced_logprobs(backend, prompt: str, token_ids: list[int], temperature: float) -> list[float]:
    """Log-probs of ``token_ids`` from one unpadded, uncached forward pass."""
    prompt_ids = backend.tokenizer(prompt)["input_ids"]
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = backend.model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(token_ids)[:, None]).squeeze(-1).tolist()


def test_backend_follows_the_interface_and_returns_n_completions_each(backend):
    assert isinstance(backend, RolloutBackend)
    out = backend.generate(PROMPTS, SamplingParams(n=3, max_tokens=12, seed=0))
    assert [len(per_prompt) for per_prompt in out] == [3, 3, 3]
    for completion in (c for per_prompt in out for c in per_prompt):
        assert isinstance(completion, Completion)
        assert 1 <= len(completion.token_ids) <= 12
        assert len(completion.logprobs) == len(completion.token_ids)
        assert all(lp <= 0 for lp in completion.logprobs)
        assert completion.finish_reason in ("stop", "length")
        assert completion.text == backend.tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_seeded_sampling_is_reproducible_and_seed_sensitive(backend):
    params = SamplingParams(n=2, max_tokens=10, seed=7, top_p=0.9)
    first = backend.generate(PROMPTS, params)
    again = backend.generate(PROMPTS, params)
    other = backend.generate(PROMPTS, SamplingParams(n=2, max_tokens=10, seed=8, top_p=0.9))
    ids = lambda out: [c.token_ids for per_prompt in out for c in per_prompt]
    assert ids(first) == ids(again)
    assert ids(first) != ids(other)


def test_left_padded_cached_logprobs_match_an_unpadded_full_forward(backend):
    # Prompts of different lengths share a batch: padding, positions and the KV cache
    # must leave every sequence's distribution exactly as if it were alone.
    out = backend.generate(PROMPTS, SamplingParams(n=2, max_tokens=16, seed=1, temperature=0.7))
    for prompt, per_prompt in zip(PROMPTS, out):
        for completion in per_prompt:
            expected = teacher_forced_logprobs(backend, prompt, completion.token_ids, 0.7)
            assert completion.logprobs == pytest.approx(expected, abs=2e-4)


def test_greedy_matches_transformers_generate(backend):
    for prompt in PROMPTS:
        ids = backend.tokenizer(prompt, return_tensors="pt")
        reference = backend.model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=backend.pad_id)
        ours = backend.generate([prompt], SamplingParams(n=1, max_tokens=8, temperature=0))[0][0]
        expected = reference[0, ids["input_ids"].shape[1]:].tolist()
        assert ours.token_ids == expected[: len(ours.token_ids)]


def test_tiny_top_p_is_greedy():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50)
    tokens, logprobs = sample_next_token(logits, 1.0, 1e-6, generator)
    assert tokens.tolist() == logits.argmax(-1).tolist()
    assert logprobs.tolist() == pytest.approx(torch.log_softmax(logits, -1).max(-1).values.tolist())


def test_stop_strings_end_the_sequence_and_are_cut_from_the_text(backend):
    free = backend.generate([PROMPTS[0]], SamplingParams(n=1, max_tokens=24, temperature=0))[0][0]
    stop = free.text[len(free.text) // 2: len(free.text) // 2 + 2]
    assert stop.strip(), "greedy output too short to pick a stop string from"
    stopped = backend.generate([PROMPTS[0]], SamplingParams(n=1, max_tokens=24, temperature=0, stop=(stop,)))[0][0]
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text
    assert free.text.startswith(stopped.text)
    assert len(stopped.token_ids) < len(free.token_ids)


def test_repetition_truncation_while_generating(backend):
    # Near-zero temperature makes every sampled token near-certain: the M1 rule fires.
    params = SamplingParams(n=2, max_tokens=40, temperature=0.02, seed=0, repetition_window=6, repetition_prob=0.99)
    out = backend.generate(PROMPTS, params)
    assert sum(c.truncated for per_prompt in out for c in per_prompt) >= 3
    for completion in (c for per_prompt in out for c in per_prompt):
        if completion.finish_reason == "stop":
            continue
        assert completion.finish_reason == "repetition" and completion.truncated
        assert len(completion.token_ids) >= 6
        assert repetition_cut(completion.logprobs, 6, 0.99) == len(completion.token_ids)
    unlimited = backend.generate(PROMPTS, SamplingParams(n=1, max_tokens=40, temperature=1.0, seed=0))
    assert all(c.finish_reason != "repetition" for per_prompt in unlimited for c in per_prompt)


def test_post_hoc_truncation_matches_the_streaming_rule():
    logprobs = [-2.0, -0.001, -0.001, -0.5, -0.001, -0.001, -0.001, -0.001, -3.0]
    assert repetition_cut(logprobs, 3, 0.99) == 7
    assert repetition_cut(logprobs, 5, 0.99) is None
    completion = Completion(text="abcdefghi", token_ids=list(range(9)), logprobs=logprobs, finish_reason="length")
    cut = truncate_on_repetition(completion, 3, 0.99, token_texts=list("abcdefghi"))
    assert (cut.text, cut.token_ids, cut.finish_reason) == ("abcdefg", list(range(7)), "repetition")
    assert truncate_on_repetition(completion, None, 0.99) is completion
    with pytest.raises(ValueError, match="decode"):
        truncate_on_repetition(Completion("x", [], logprobs, "length"), 3, 0.99)


def test_factory_builds_the_configured_backend(tiny_path):
    cfg = RolloutConfig(backend="local", model=str(tiny_path), max_tokens=8, repetition_window=4,
                        local=LocalConfig(batch_size=2))
    backend = make_backend(cfg)
    assert backend.name == "local"
    out = backend.generate(["hi"], cfg.sampling_params(n=2))
    assert len(out[0]) == 2
    with pytest.raises(FileNotFoundError, match="neither an alias"):
        make_backend(RolloutConfig(model="/no/such/model", max_tokens=8, repetition_window=4))
    with pytest.raises(ValueError, match="exceeds max_tokens"):
        RolloutConfig(max_tokens=8, repetition_window=100)


def test_inhouse_hybrid_model_samples_through_the_same_backend(tmp_path, tiny_path):
    hybrid = pytest.importorskip("model.hybrid")
    from transformers import AutoTokenizer

    from model.config import HybridConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    torch.manual_seed(0)
    config = HybridConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, softmax_attention_every=2,
                          pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id)
    hybrid.HybridForCausalLM(config).save_pretrained(tmp_path / "hybrid")
    tokenizer.save_pretrained(tmp_path / "hybrid")
    backend = LocalBackend.from_path(tmp_path / "hybrid", LocalConfig(batch_size=4))
    out = backend.generate(PROMPTS, SamplingParams(n=2, max_tokens=8, seed=0, temperature=0.8))
    for prompt, per_prompt in zip(PROMPTS, out):
        for completion in per_prompt:
            expected = teacher_forced_logprobs(backend, prompt, completion.token_ids, 0.8)
            assert completion.logprobs == pytest.approx(expected, abs=2e-4)


SHARED_PREFIX = ["def f(x):\n    return x", "def f(x):\n    return", "def f(x):\n    return x * 3 + 1\n\ndef g(y):",
                 "def f(x):\n    return x"]


def test_shared_prefix_prefill_keeps_logprobs_and_greedy_tokens_exact(backend):
    """Prompts sharing a token prefix (and a duplicate) run the prefix once and copy its
    cache: every sequence must still see exactly its own unpadded distribution."""
    from tasks.rollout.local import _shared_prefix_length
    ids = backend._encode_prompts(SHARED_PREFIX)
    assert _shared_prefix_length(list(map(list, {tuple(i): 0 for i in ids}))) >= 4
    sampled = backend.generate(SHARED_PREFIX, SamplingParams(n=2, max_tokens=12, seed=3, temperature=0.7))
    assert backend._prefix_cache_ok  # the shared-prefix path ran (no fallback)
    for prompt, per_prompt in zip(SHARED_PREFIX, sampled):
        for completion in per_prompt:
            expected = teacher_forced_logprobs(backend, prompt, completion.token_ids, 0.7)
            assert completion.logprobs == pytest.approx(expected, abs=2e-4)
    greedy = backend.generate(SHARED_PREFIX, SamplingParams(n=2, max_tokens=10, temperature=0))
    for prompt, per_prompt in zip(SHARED_PREFIX, greedy):
        ids = backend.tokenizer(prompt, return_tensors="pt")
        reference = backend.model.generate(**ids, max_new_tokens=10, do_sample=False, pad_token_id=backend.pad_id)
        expected = reference[0, ids["input_ids"].shape[1]:].tolist()
        for completion in per_prompt:
            assert completion.token_ids == expected[: len(completion.token_ids)]


def test_a_sequence_with_its_own_stream_samples_the_same_whatever_shares_its_batch(tiny_path, backend):
    """seed_per_sequence: a prompt's samples do not depend on the batch size, on the other
    prompts of the call, or on other rows stopping early; the sampled tokens follow each row's
    own distribution (log-probs as a full forward gives them)."""
    params = SamplingParams(n=3, max_tokens=12, seed=5, top_p=0.9, seed_per_sequence=True)
    ids = lambda out: [[c.token_ids for c in per_prompt] for per_prompt in out]
    together = ids(backend.generate(PROMPTS, params))
    single = LocalBackend(backend.model, backend.tokenizer, LocalConfig(batch_size=1))
    assert ids(single.generate(PROMPTS, params)) == together
    assert ids(backend.generate(PROMPTS[1:2], params)) == together[1:2]
    # a stop string ends some rows early; the others' tokens are the same as without it
    stopped = backend.generate(PROMPTS, replace(params, stop=(" ",)))
    for per_prompt, full in zip(stopped, together):
        for c, tokens in zip(per_prompt, full):
            assert tokens[:len(c.token_ids)] == c.token_ids
    # other seeds differ, and the shared-stream sampler is still the default
    assert ids(backend.generate(PROMPTS, replace(params, seed=6))) != together
    assert ids(backend.generate(PROMPTS, replace(params, seed_per_sequence=False))) \
        != together
    c = backend.generate(PROMPTS[:1], params)[0][0]
    expected = teacher_forced_logprobs(backend, PROMPTS[0], c.token_ids, 1.0)
    assert c.logprobs == pytest.approx(expected, abs=1e-4)
