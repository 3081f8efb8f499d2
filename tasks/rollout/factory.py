"""Backend chosen by configuration: ``make_backend(cfg)`` for the profile's rollout section."""
from __future__ import annotations

from pathlib import Path

from tasks.rollout.base import RolloutBackend
from tasks.rollout.config import RolloutConfig
from tasks.rollout.smol import SMOL_NAME, smollm2_path
from tasks.rollout.tiny_model import TINY_LLAMA_NAME, tiny_llama_path

MODEL_ALIASES = {"smol": smollm2_path, SMOL_NAME: smollm2_path, TINY_LLAMA_NAME: tiny_llama_path}


def resolve_model(spec: str) -> Path:
    """A model alias ("smol", "tiny-llama") or a path to a model dir / .gguf file."""
    if spec in MODEL_ALIASES:
        return MODEL_ALIASES[spec]()
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"rollout model {spec!r} is neither an alias ({sorted(MODEL_ALIASES)}) nor an existing path"
        )
    return path


def make_backend(cfg: RolloutConfig) -> RolloutBackend:
    if cfg.backend == "local":
        from tasks.rollout.local import LocalBackend

        return LocalBackend.from_path(resolve_model(cfg.model), cfg.local)
    if cfg.backend == "openai":
        from tasks.rollout.openai_client import OpenAIBackend

        return OpenAIBackend(cfg.openai)
    if cfg.backend == "vllm":
        from tasks.rollout.vllm_backend import VLLMBackend

        return VLLMBackend(str(resolve_model(cfg.model)), cfg.vllm)
    raise ValueError(f"unknown rollout backend {cfg.backend!r}")
