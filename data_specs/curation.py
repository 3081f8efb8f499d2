"""Tables written by the curate flow: the SFT / RL pools and the reusable dedup state."""
from __future__ import annotations

import polars as pl

from data_specs.base import Column, TableSpec, register
from data_specs.core import PROMPTS

POOLS = ("sft", "rl")

_POOL_EXTRA = [
    Column("text_hash", pl.Utf8, required=True, description="sha of the normalized prompt (exact-dedup key)"),
    Column("cluster_id", pl.Utf8, required=True,
           description="leakage cluster: rows linked by any duplicate edge share it and a pool"),
    Column("pool", pl.Utf8, required=True, allowed=POOLS),
    Column("verifiable", pl.Boolean, required=True, description="has a rule-checkable answer or tests"),
    Column("rewritten", pl.Utf8, description="rule that rewrote the prompt/answer (e.g. multiple choice)"),
    Column("curate_run", pl.Utf8, description="run that admitted the row"),
]


def _pool_spec(name: str, pool: str) -> TableSpec:
    columns = [c for c in PROMPTS.columns] + [
        c if c.name != "pool" else Column("pool", pl.Utf8, required=True, allowed=(pool,)) for c in _POOL_EXTRA]
    return TableSpec(name, version=1, key=("id",), columns=columns,
                     description=f"Curated {pool.upper()} prompts: filtered, deduplicated, decontaminated.")


SFT_POOL = register(_pool_spec("sft_pool", "sft"))
RL_POOL = register(_pool_spec("rl_pool", "rl"))
POOL_TABLES = {"sft": SFT_POOL.name, "rl": RL_POOL.name}   # side -> the curated pool table

EMBEDDINGS = register(TableSpec(
    "embeddings", version=1, key=("key", "model", "text_hash"),
    description="Unit-norm sentence embeddings, stored so no text is ever encoded twice.",
    columns=[
        Column("key", pl.Utf8, required=True, description="prompt id, or benchmark:item_id"),
        Column("kind", pl.Utf8, required=True, allowed=("prompt", "benchmark")),
        Column("model", pl.Utf8, required=True),
        Column("text_hash", pl.Utf8, required=True, description="sha of the exact text encoded"),
        Column("dim", pl.Int32, required=True),
        Column("vector", pl.Binary, required=True, description="float32 little-endian, dim values"),
    ],
))

MINHASH_SIGNATURES = register(TableSpec(
    "minhash_signatures", version=1, key=("row_id", "params", "text_hash"),
    description="MinHash signatures of curated rows, reused by incremental runs.",
    columns=[
        Column("row_id", pl.Utf8, required=True),
        Column("params", pl.Utf8, required=True, description="hash family:shingle:ngram:num_perm:seed"),
        Column("text_hash", pl.Utf8, required=True),
        Column("signature", pl.Binary, required=True, description="uint32 little-endian, num_perm values"),
    ],
))

DECONTAM_BENCHMARKS = register(TableSpec(
    "decontam_benchmarks", version=1, key=("benchmark", "item_id", "text_hash"),
    description="Benchmark items the pools have been decontaminated against (new ones trigger a re-check).",
    columns=[
        Column("benchmark", pl.Utf8, required=True),
        Column("item_id", pl.Utf8, required=True),
        Column("text_hash", pl.Utf8, required=True),
        Column("run_id", pl.Utf8),
    ],
))
