"""vLLM backend on a GPU machine; skipped cleanly where CUDA or vllm is missing."""
import pytest

from tasks.rollout.base import SamplingParams
from tasks.rollout.vllm_backend import vllm_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not vllm_available(), reason="needs CUDA and the vllm package (gpu extra)")]


def test_vllm_backend_generates_with_logprobs_and_repetition_rule(tmp_path):
    from tasks.rollout.config import VLLMConfig
    from tasks.rollout.tiny_model import tiny_llama_path
    from tasks.rollout.vllm_backend import VLLMBackend

    path = tiny_llama_path(home=tmp_path)
    backend = VLLMBackend(str(path), VLLMConfig(gpu_memory_utilization=0.3, max_model_len=512, enforce_eager=True))
    out = backend.generate(["What is 3 + 4?", "hello"], SamplingParams(n=3, max_tokens=16, seed=0))
    assert [len(per_prompt) for per_prompt in out] == [3, 3]
    for completion in (c for per_prompt in out for c in per_prompt):
        assert len(completion.logprobs) == len(completion.token_ids) > 0
    cold = backend.generate(["hello"], SamplingParams(n=2, max_tokens=32, temperature=0.02,
                                                     repetition_window=5, repetition_prob=0.99))
    assert all(c.truncated or c.finish_reason == "stop" for c in cold[0])
