"""The model the first stage starts from.

``hybrid``: the in-house lightning-attention model sized by the profile's ``model.yaml``,
with a byte-level BPE tokenizer trained on warehouse text; built once and cached under
``$POSTTRAIN_HOME/models/<name>/`` (later runs reuse it). ``pretrained``: a local
Hugging Face directory, used as is.
"""
from __future__ import annotations

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
        path = Path(cfg.pretrained_path).expanduser()
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"base_model.pretrained_path {path} has no config.json")
        return path

    def build(out: Path) -> None:
        from model import ModelSection, build_tiny_model, train_tokenizer

        section = ModelSection(**model_section)
        texts = warehouse_texts(wh, cfg.tokenizer_texts, sources)
        if len(texts) < 10:
            raise ValueError(f"only {len(texts)} warehouse texts to train the tokenizer on: "
                             "ingest or synthesize data before training")
        tokenizer = train_tokenizer(texts, section.tokenizer_vocab_size, out)
        build_tiny_model(tokenizer, section, seed=seed).save_pretrained(out)

    return build_once(wh.models_dir, cfg.name, build)
