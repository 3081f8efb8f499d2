"""vLLM backend: the offline ``vllm.LLM`` engine (the ``gpu`` extra), imported lazily.

vLLM reports the log-prob of each sampled token when asked for ``logprobs=0``; the M1
repetition rule is then applied to finished completions, as for the OpenAI backend.
"""
from __future__ import annotations

from tasks.rollout.base import Completion, SamplingParams
from tasks.rollout.chat import render_with_tokenizer
from tasks.rollout.config import VLLMConfig
from tasks.rollout.repetition import truncate_on_repetition


def vllm_available() -> bool:
    """True when vLLM imports and a CUDA device is visible."""
    try:
        import torch
        import vllm  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


class VLLMBackend:
    name = "vllm"

    def __init__(self, model_path: str, config: VLLMConfig | None = None):
        try:
            from vllm import LLM
        except ImportError as e:
            raise ImportError("the vllm backend needs the gpu extra: pip install 'posttrain[gpu]'") from e
        self.config = config or VLLMConfig()
        self.model_name = model_path
        kwargs = {"model": model_path, "dtype": self.config.dtype,
                      "gpu_memory_utilization": self.config.gpu_memory_utilization,
                      "tensor_parallel_size": self.config.tensor_parallel_size,
                      "enforce_eager": self.config.enforce_eager}
        if self.config.max_model_len:
            kwargs["max_model_len"] = self.config.max_model_len
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()

    def format_chat(self, messages: list[dict[str, str]]) -> str:
        return render_with_tokenizer(self.tokenizer, messages)

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        from vllm import SamplingParams as VLLMSamplingParams

        want_logprobs = params.logprobs or params.repetition_window is not None
        sampling = VLLMSamplingParams(
            n=params.n, temperature=params.temperature, top_p=params.top_p,
            max_tokens=params.max_tokens, stop=list(params.stop) or None, seed=params.seed,
            logprobs=0 if want_logprobs else None,
        )
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        return [[self._completion(o, params) for o in request.outputs] for request in outputs]

    def _completion(self, output, params: SamplingParams) -> Completion:
        token_ids = list(output.token_ids)
        logprobs = None
        if output.logprobs is not None:
            logprobs = [step[token].logprob for step, token in zip(output.logprobs, token_ids)]
        completion = Completion(
            text=output.text, token_ids=token_ids, logprobs=logprobs,
            finish_reason="length" if output.finish_reason == "length" else "stop",
        )
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)
        completion = truncate_on_repetition(completion, params.repetition_window, params.repetition_prob, decode=decode)
        if not params.logprobs:
            completion.logprobs = None
        return completion
