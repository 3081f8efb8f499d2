"""The model the first stage starts from.

``hybrid``: the in-house lightning-attention model sized by the profile's ``model.yaml``,
with a byte-level BPE tokenizer trained on warehouse text; built once and cached under
``$POSTTRAIN_HOME/models/<name>-<digest>/``, the digest of the settings that build it (the
model section, the tokenizer's text count, the seed): later runs with the same settings reuse
it, and a changed ``model.yaml`` builds a model of its own shape instead of reusing the old
one. ``pretrained``: the same names a rollout model takes: an alias (``smol``: SmolLM2-135M-Instruct
from its package), a local Hugging Face directory (used as is) or a ``.gguf`` file (dequantized
once into a cached directory).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tasks.model_cache import build_once
from tasks.train.config import BaseModelConfig
from warehouse import TableRef, Warehouse

TEXT_TABLES = (("sft_pool", ("prompt", "solution", "answer")), ("prompts", ("prompt", "solution", "answer")),
               ("synthetic_tasks", ("prompt", "answer")), ("rollouts", ("text",)))


def warehouse_texts(wh: Warehouse, limit: int, sources: dict[str, TableRef] | None = None) -> list[str]:
    """Up to ``limit`` texts from the tables the stages will train on, in a stable order: each at
    the snapshot in ``sources`` (what the pipeline's earlier stages handed over), else its newest."""
    texts: list[str] = []
    sources = sources or {}
    for table, columns in TEXT_TABLES:
        ref = sources.get(table)
        if ref is None and not wh.exists(table):
            continue
        df = wh.read(table, ref.snapshot if ref is not None else None)
        for col in columns:
            if col in df.columns:
                texts.extend(t for t in df[col].to_list() if isinstance(t, str) and t.strip())
        if len(texts) >= limit:
            break
    return texts[:limit]


def prepare_base_model(wh: Warehouse, cfg: BaseModelConfig, model_section: dict, seed: int = 0,
                       sources: dict[str, TableRef] | None = None) -> Path:
    """Directory of the initial model (built and cached for ``hybrid``, its tokenizer trained on
    the texts of ``sources``, the snapshots handed over, where they hold a text table)."""
    if cfg.kind == "pretrained":
        from tasks.rollout.factory import resolve_model_dir

        return resolve_model_dir(cfg.pretrained_path, "base_model.pretrained_path")

    def build(out: Path) -> None:
        from model import ModelSection, build_tiny_model, train_tokenizer

        section = ModelSection(**model_section)
        texts = warehouse_texts(wh, cfg.tokenizer_texts, sources)
        if len(texts) < 10:
            raise ValueError(f"only {len(texts)} warehouse texts to train the tokenizer on: "
                             "ingest or synthesize data before training")
        tokenizer = train_tokenizer(texts, section.tokenizer_vocab_size, out)
        from model.loading import MODEL_LOAD_LOCK

        with MODEL_LOAD_LOCK:   # its random init must not run under another thread's load patches
            model = build_tiny_model(tokenizer, section, seed=seed)
        model.save_pretrained(out)

    return build_once(wh.models_dir, f"{cfg.name}-{build_digest(model_section, cfg.tokenizer_texts, seed)}", build)


def build_digest(model_section: dict, tokenizer_texts: int, seed: int) -> str:
    """Short digest of what a hybrid base model is built from (its cache directory's suffix)."""
    from model import ModelSection

    settings = {"model": ModelSection(**model_section).model_dump(), "tokenizer_texts": tokenizer_texts, "seed": seed}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
