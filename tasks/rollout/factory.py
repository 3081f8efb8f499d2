"""Backend chosen by configuration: ``make_backend(cfg)`` for the profile's rollout section."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.rollout.base import RolloutBackend
from tasks.rollout.smol import SMOL_NAME, gguf_dir, smollm2_path
from tasks.rollout.tiny_model import TINY_LLAMA_NAME, tiny_llama_path

if TYPE_CHECKING:   # annotations only: config.py validates backend names against BACKENDS here
    from tasks.rollout.config import RolloutConfig

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


@dataclass(frozen=True)
class BackendKind:
    """A rollout backend, registered once in ``BACKENDS``; every place that treats backends
    differently reads these fields instead of testing names.

    ``settings`` names ``RolloutConfig``'s field of the backend's own settings (its engine part:
    two rollouts with equal ``engine_key`` can share one loaded engine). ``loads_model``: the
    backend loads ``RolloutConfig.model`` itself (an alias or a path, resolved against the home
    first); False where a server names its model. ``device``: the accelerator it holds while it
    runs, counted by the pipeline's per-device stage limit (None: it holds none of its own)."""
    name: str
    load: Callable[[RolloutConfig], RolloutBackend]
    settings: str
    loads_model: bool
    device: str | None = None


def _local(cfg: RolloutConfig) -> RolloutBackend:
    from tasks.rollout.local import LocalBackend

    return LocalBackend.from_path(resolve_model(cfg.model), cfg.local)


def _openai(cfg: RolloutConfig) -> RolloutBackend:
    from tasks.rollout.openai_client import OpenAIBackend

    return OpenAIBackend(cfg.openai)


def _vllm(cfg: RolloutConfig) -> RolloutBackend:
    from tasks.rollout.vllm_backend import VLLMBackend

    return VLLMBackend(str(resolve_model(cfg.model)), cfg.vllm)


# a new backend: its module (a RolloutBackend), its settings field in RolloutConfig, one entry here
BACKENDS: dict[str, BackendKind] = {k.name: k for k in (
    BackendKind("local", _local, "local", loads_model=True),
    BackendKind("openai", _openai, "openai", loads_model=False),
    BackendKind("vllm", _vllm, "vllm", loads_model=True, device="cuda"),
)}


def backend_kind(name: str) -> BackendKind:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown rollout backend {name!r}; expected one of {sorted(BACKENDS)}") from None


def engine_key(cfg: RolloutConfig) -> str:
    """What a loaded engine of ``cfg`` is: the backend, its model and its own settings (sampling
    settings are per call, so rollouts differing only there share one engine)."""
    kind = backend_kind(cfg.backend)
    return json.dumps(cfg.model_dump(include={"backend", "model", kind.settings}), sort_keys=True)


def make_backend(cfg: RolloutConfig) -> RolloutBackend:
    return backend_kind(cfg.backend).load(cfg)
