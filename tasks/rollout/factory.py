"""Backend chosen by configuration: ``make_backend(cfg)`` for the profile's rollout section."""
from __future__ import annotations

from pathlib import Path

from tasks.rollout.base import RolloutBackend
from tasks.rollout.config import RolloutConfig
from tasks.rollout.smol import SMOL_NAME, gguf_dir, smollm2_path
from tasks.rollout.tiny_model import TINY_LLAMA_NAME, tiny_llama_path

MODEL_ALIASES = {"smol": smollm2_path, SMOL_NAME: smollm2_path, TINY_LLAMA_NAME: tiny_llama_path}


def resolve_model(spec: str, what: str = "rollout model") -> Path:
    """A model alias ("smol", "tiny-llama") or a path to a model dir / .gguf file."""
    if spec in MODEL_ALIASES:
        return MODEL_ALIASES[spec]()
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"{what} {spec!r} is neither an alias ({sorted(MODEL_ALIASES)}) nor an existing path"
        )
    return path


def resolve_model_dir(spec: str, what: str = "model") -> Path:
    """Like ``resolve_model``, always a Hugging Face directory: a .gguf file is dequantized once
    into a cached directory (training saves checkpoints beside a directory and reloads its
    tokenizer from one)."""
    path = resolve_model(spec, what)
    if path.is_file() and path.suffix == ".gguf":
        return gguf_dir(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{what} {spec!r}: {path} is neither a .gguf file nor a directory with config.json")
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
