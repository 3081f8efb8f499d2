"""Rollouts: one interface (base.py), three backends (local, openai, vllm), chosen by config.

    from tasks.rollout import make_backend, RolloutConfig, SamplingParams
    backend = make_backend(profile.section("rollout", RolloutConfig))
    completions = backend.generate(prompts, SamplingParams(n=16, max_tokens=512))
"""
from tasks.rollout.base import Completion, RolloutBackend, SamplingParams
from tasks.rollout.config import RolloutConfig
from tasks.rollout.factory import make_backend, resolve_model
from tasks.rollout.server import ServerProcess, serve_model

__all__ = [
           "Completion",
           "RolloutBackend",
           "RolloutConfig",
           "SamplingParams",
           "ServerProcess",
           "make_backend",
           "resolve_model",
           "serve_model",
]
