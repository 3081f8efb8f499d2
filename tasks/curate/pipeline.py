"""``run_curate``: prompts -> filter -> exact -> MinHash -> semantic -> keep -> decontaminate -> split.

Incremental by construction: a prompt is new when it is in neither pool nor removed by an
earlier curate run (``decisions``). Only new rows are filtered, hashed and encoded; they
are deduplicated against every row kept before (whose signatures and embeddings come from
the warehouse) and decontaminated against every benchmark item. Pool rows are re-checked
only against benchmark items added since they were last checked.

The pools record the settings that made them (``settings_key``, in the snapshot note). A
run with different settings (or pools whose settings are unknown) recomputes every prompt
from scratch: new pool snapshots and decisions, the old ones kept for comparison, cached
signatures and embeddings reused where their parameters match.

The blocks (``tasks.curate.blocks``) each do one job and return what they decided;
``CurationState`` is the one place run state changes: it applies each block's result,
checks its counts against its decisions, and at the end checks that every row is
accounted for (kept in a pool, or removed once with a reason).
"""
from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import polars as pl

from data_specs import get_spec
from data_specs.curation import POOL_TABLES
from tasks.curate.accounting import DecisionLog, StageCount
from tasks.curate.block import Block, BlockResult, CurationView, candidate_rows, node_space
from tasks.curate.blocks import (
    DecontamBlock,
    DecontamResult,
    ExactBlock,
    FilterBlock,
    FilterResult,
    KeepBlock,
    MinHashBlock,
    SemanticBlock,
    SplitBlock,
    SplitResult,
)
from tasks.curate.config import CurateConfig
from tasks.curate.model_repair import ModelRepair
from tasks.curate.parallel import LocalMapper
from tasks.curate.stores import EmbeddingStore, SignatureStore
from tasks.rollout.base import RolloutBackend
from warehouse import TableRef, Warehouse

T = TypeVar("T")


@dataclass
class CurateResult:
    run_id: str
    stages: dict[str, StageCount]
    refs: dict[str, TableRef]
    counters: dict[str, float]
    similarities: dict[str, np.ndarray] = field(default_factory=dict)


# -- loading -------------------------------------------------------------------------------
SETTINGS_NOTE = "settings "


def settings_key(cfg: CurateConfig) -> str:
    """What decides the pools (filters, dedup, decontamination, split, source priority, model repair
    when enabled); not ``chunk_rows``, which only sizes the work. Model repair switched off leaves
    the key it had before the setting existed, so pools made then are not curated again."""
    import hashlib
    import json

    exclude = {"chunk_rows"} | (set() if cfg.model_repair.enabled else {"model_repair"})
    return hashlib.sha256(json.dumps(cfg.model_dump(exclude=exclude), sort_keys=True,
                                     default=str).encode()).hexdigest()[:16]


def pool_settings(wh: Warehouse) -> str | None:
    """The settings key the current pools were made with (None: no pools, or made before it was recorded)."""
    name = POOL_TABLES["sft"]
    if not wh.exists(name):
        return None
    note = wh.history(name)["note"][0] or ""   # newest first
    return note.split(SETTINGS_NOTE, 1)[1].split()[0] if SETTINGS_NOTE in note else None


def _old_pools(wh: Warehouse) -> pl.DataFrame:
    frames = [wh.read(t) for t in POOL_TABLES.values() if wh.exists(t)]
    spec = get_spec("sft_pool")
    return pl.concat([spec.conform(f) for f in frames]) if frames else spec.empty()


def _processed_ids(wh: Warehouse, old: pl.DataFrame) -> pl.Series:
    ids = [old["id"]]
    if wh.exists("decisions"):
        ids.append(wh.sql("SELECT DISTINCT row_id AS id FROM decisions WHERE decision = 'removed' "
                          "AND stage LIKE 'curate.%'")["id"])
    return pl.concat(ids).unique()


# -- run state ------------------------------------------------------------------------------
class CurationState:
    """Which rows are removed, the duplicate links, the decisions and counts of one run."""

    def __init__(self, run_id: str, incoming: pl.DataFrame, old: pl.DataFrame, cfg: CurateConfig):
        self.cfg, self.incoming, self.old = cfg, incoming, old
        self.log = DecisionLog(run_id)
        self.stages: dict[str, StageCount] = {}
        self.counters: Counter = Counter()
        self.similarities: dict[str, np.ndarray] = {}
        self.removed_ids: Counter = Counter()
        self._nodes(candidate_rows(incoming.clear(), cfg.source_priority))

    def _nodes(self, new: pl.DataFrame) -> None:
        """Pool rows kept before, then this run's rows past the filter (none removed yet)."""
        self.new = new
        self.node_ids, self.prompts, self.clusters, self.links = node_space(self.old, new)
        self.node_of = {row_id: node for node, row_id in enumerate(self.node_ids)}
        self.removed = np.zeros(len(self.node_ids), bool)

    def view(self) -> CurationView:
        removed = self.removed.copy()
        removed.flags.writeable = False
        return CurationView(self.incoming, self.old, self.new, self.node_ids, self.prompts, removed,
                            self.clusters, self.links)

    def apply(self, result: BlockResult) -> BlockResult:
        self._check_counts(result)
        for d in result.decisions:
            self.log.add(d.row_id, d.stage, d.reason, d.reference_id, d.score, d.rewritten)
            if d.rewritten:
                continue
            self.removed_ids[d.row_id] += 1
            if self.removed_ids[d.row_id] > 1:
                raise RuntimeError(f"{d.stage}: row {d.row_id} removed a second time")
            if d.row_id in self.node_of:
                self.removed[self.node_of[d.row_id]] = True
        for links in result.links:
            self.links.add(links.pairs[:, 0], links.pairs[:, 1])
            self.clusters.add(links.kind, links.pairs, links.scores)
        self.counters.update(result.counters)
        self.similarities.update(result.similarities)
        if isinstance(result, FilterResult):   # its survivors are the rows every later block sees
            self._nodes(candidate_rows(result.kept, self.cfg.source_priority))
        return result

    def _check_counts(self, result: BlockResult) -> None:
        """Each stage's counts balance and match the decisions the block returned for it."""
        stages = {c.stage for c in result.counts}
        stray = {d.stage for d in result.decisions} - stages
        if stray:
            raise RuntimeError(f"decisions for {sorted(stray)} come without that stage's counts")
        for count in result.counts:
            count.check()
            mine = [d for d in result.decisions if d.stage == count.stage]
            removed = Counter(d.reason for d in mine if not d.rewritten)
            if removed != count.removed or sum(d.rewritten for d in mine) != count.rewritten:
                raise RuntimeError(f"{count.stage}: counts {dict(count.removed)} disagree with decisions "
                                   f"{dict(removed)}")
            self.stages[count.stage] = count

    def check_every_row(self, pool: list[str | None]) -> None:
        """Rows in = rows kept + rows removed: each incoming row and each old pool row is either
        in a pool or removed (once, with a reason), never both."""
        for node, side in enumerate(pool):
            if (side is None) != bool(self.removed[node]):
                state = "removed and pooled" if side else "neither pooled nor removed"
                raise RuntimeError(f"curate: row {self.node_ids[node]} is {state}")
        filtered_out = sum(1 for i in self.incoming["id"].to_list() if self.removed_ids[i] and i not in self.node_of)
        if self.incoming.height != filtered_out + self.new.height:
            raise RuntimeError(f"curate: {self.incoming.height} rows in != {filtered_out} filtered out + "
                               f"{self.new.height} past the filter")

    def pool_frames(self, pool: list[str | None], cluster: list[str | None], run_id: str) -> dict[str, pl.DataFrame]:
        spec, n_old, kept = get_spec("sft_pool"), self.old.height, ~self.removed
        old = self.old.with_columns(pl.Series("pool", pool[:n_old], dtype=pl.Utf8),
                                    pl.Series("cluster_id", cluster[:n_old], dtype=pl.Utf8))
        old = old.filter(pl.Series(kept[:n_old]))
        new = self.new.with_columns(pl.Series("pool", pool[n_old:], dtype=pl.Utf8),
                                    pl.Series("cluster_id", cluster[n_old:], dtype=pl.Utf8),
                                    pl.lit(run_id).alias("curate_run"))
        new = spec.conform(new.filter(pl.Series(kept[n_old:])))
        rows = pl.concat([spec.conform(old), new])
        return {name: rows.filter(pl.col("pool") == p) for p, name in POOL_TABLES.items()}


# -- the run --------------------------------------------------------------------------------
def curate_blocks(wh: Warehouse, cfg: CurateConfig, mapper, benchmarks: pl.DataFrame,
                  checked: pl.DataFrame, repair_backend: RolloutBackend | None = None) -> tuple[list[Block], list]:
    """(the blocks in run order, the stores to flush at the end); ``repair_backend``: the model
    ``curate.model_repair`` asks, needed when it is enabled."""
    signatures = SignatureStore(wh, cfg.minhash, mapper, cfg.chunk_rows)
    embeddings = EmbeddingStore(wh, cfg.semantic, mapper, cfg.chunk_rows)
    repair = None
    if cfg.model_repair.enabled:
        if repair_backend is None:
            raise ValueError("curate.model_repair is enabled but no backend was given: pass repair_backend (the "
                             "curate flow builds it from curate.model_repair.rollout), or disable model_repair")
        repair = ModelRepair(cfg.model_repair, repair_backend, mapper, cfg.chunk_rows)
    blocks: list[Block] = [FilterBlock(cfg.filters, mapper, cfg.chunk_rows, repair), ExactBlock(),
                           MinHashBlock(cfg.minhash, signatures)]
    if cfg.semantic.enabled:
        blocks.append(SemanticBlock(cfg.semantic, embeddings))
    blocks += [KeepBlock(), DecontamBlock(cfg.decontam, benchmarks, checked, embeddings, mapper, cfg.chunk_rows),
               SplitBlock(cfg.split)]
    return blocks, [signatures, embeddings]


def _run_directly(name: str, fn: Callable[[], T]) -> T:
    return fn()


def run_curate(wh: Warehouse, cfg: CurateConfig | None = None, *, run_id: str | None = None,
               mapper=None, step: Callable[[str, Callable[[], T]], T] | None = None,
               sources: dict[str, TableRef] | None = None,
               repair_backend: RolloutBackend | None = None) -> CurateResult:
    """Curate the prompts no earlier run has seen; write pools, decisions and reusable state.

    ``sources``: the ``prompts`` and ``benchmarks`` snapshots to curate against (the pipeline
    hands over what ingest wrote); one not given is read at its newest.

    ``repair_backend``: the rollout backend ``curate.model_repair`` asks to extract answers and
    write tests (``tasks.curate.model_repair``); required when that is enabled.

    ``step(name, fn)`` runs each block (``filter``, ``exact``, ``minhash``, ``semantic``,
    ``keep``, ``decontaminate``, ``split``); the curate flow passes one that makes each a
    Prefect task, so the blocks show in the run's graph. Default: call ``fn``.
    """
    step = step or _run_directly
    cfg = cfg or CurateConfig()
    run_id = run_id or uuid.uuid4().hex
    mapper = mapper or LocalMapper()
    settings = settings_key(cfg)
    # pools made with other (or unknown) settings: every prompt is curated again under these
    from_scratch = any(wh.exists(t) for t in POOL_TABLES.values()) and pool_settings(wh) != settings
    old = get_spec("sft_pool").empty() if from_scratch else _old_pools(wh)
    inputs = {name: wh.pinned(name, sources) for name in CURATED_INPUTS}
    prompts = _read_input(wh, inputs, "prompts")
    new = prompts if from_scratch else prompts.filter(~pl.col("id").is_in(_processed_ids(wh, old).implode()))
    new = new.unique("id", keep="first", maintain_order=True)
    checked = wh.read("decontam_benchmarks", default_empty=True).select("benchmark", "item_id", "text_hash")
    blocks, stores = curate_blocks(wh, cfg, mapper, _read_input(wh, inputs, "benchmarks"), checked, repair_backend)
    state = CurationState(run_id, new, old, cfg)

    def run_block(block: Block) -> Callable[[], BlockResult]:
        return lambda: state.apply(block.run(state.view()))

    results = {b.name: step(b.name, run_block(b)) for b in blocks}
    split: SplitResult = results["split"]
    decontam: DecontamResult = results["decontaminate"]
    state.check_every_row(split.pool)
    refs = _write(wh, state, stores, split, decontam.checked_items, from_scratch, settings,
                  [r for r in inputs.values() if r is not None])
    counters = {
        "rows_new": new.height, "rows_old_pool": old.height, "from_scratch": float(from_scratch),
        "hashed": state.counters["hashed"], "encoded": state.counters["encoded"],
        "encoded_benchmarks": state.counters["encoded_benchmarks"],
        "benchmark_items_new": decontam.checked_items.height,
        "sft_pool": refs["sft_pool"].rows, "rl_pool": refs["rl_pool"].rows,
        "removed": sum(s.removed_total for s in state.stages.values()),
    }
    counters |= {k: v for k, v in sorted(state.counters.items()) if k not in counters}
    return CurateResult(run_id, state.stages, refs, counters, state.similarities)


CURATED_INPUTS = ("prompts", "benchmarks")   # the tables curate reads that other stages write


def _read_input(wh: Warehouse, inputs: dict[str, TableRef | None], name: str) -> pl.DataFrame:
    ref = inputs[name]
    return get_spec(name).empty() if ref is None else wh.read(name, ref.snapshot)


def _write(wh: Warehouse, state: CurationState, stores: list, split: SplitResult, checked_items: pl.DataFrame,
           from_scratch: bool, settings: str, parents: list[TableRef]) -> dict[str, TableRef]:
    """Stored signatures and embeddings, the pools (when anything changed), decisions, checked items;
    ``parents``: the prompts and benchmarks snapshots curated."""
    run_id = state.log.run_id
    refs: dict[str, TableRef] = {}
    for store in stores:
        ref = store.flush(wh, parents)
        if ref is not None:
            refs[ref.name] = ref
    changed = (from_scratch or state.incoming.height > 0 or checked_items.height > 0
               or any(not wh.exists(t) for t in POOL_TABLES.values()))
    if changed:   # pools before decisions: a crash in between only makes the next run redo removals
        for name, frame in state.pool_frames(split.pool, split.cluster, run_id).items():
            refs[name] = wh.write(name, frame, parents=parents,
                                  note=f"curate {run_id} {SETTINGS_NOTE}{settings}")
    else:
        refs.update({name: wh.latest(name) for name in POOL_TABLES.values()})
    if len(state.log):
        refs["decisions"] = wh.append("decisions", state.log.frame(), parents=parents, note=f"curate {run_id}")
    if checked_items.height:
        refs["decontam_benchmarks"] = wh.append(
            "decontam_benchmarks", checked_items.select("benchmark", "item_id", "text_hash").with_columns(
                pl.lit(run_id).alias("run_id")), parents=parents, note=f"curate {run_id}")
    return refs
