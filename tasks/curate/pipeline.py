"""``run_curate``: prompts -> filter -> exact -> MinHash -> semantic -> decontaminate -> split.

Incremental by construction: a prompt is new when it is in neither pool nor removed by an
earlier curate run (``decisions``). Only new rows are filtered, hashed and encoded; they
are deduplicated against every row kept before (whose signatures and embeddings come from
the warehouse) and decontaminated against every benchmark item. Pool rows are re-checked
only against benchmark items added since they were last checked.

The pools record the settings that made them (``settings_key``, in the snapshot note). A
run with different settings (or pools whose settings are unknown) recomputes every prompt
from scratch: new pool snapshots and decisions, the old ones kept for comparison, cached
signatures and embeddings reused where their parameters match.

Node numbering for the duplicate-link graph: old pool rows first (0..n_old-1), then this
run's candidate rows. Which member of a duplicate cluster stays is decided per cluster by
``tasks.curate.keep_rule`` (earlier-kept, checkable answer, source priority, medoid).
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
from tasks.curate import dedup as dd
from tasks.curate import keep_rule as kr
from tasks.curate import minhash as mh
from tasks.curate.accounting import DecisionLog, StageCount
from tasks.curate.config import CurateConfig, FilterConfig, MinHashConfig, SemanticConfig
from tasks.curate.decontaminate import (
    BenchmarkGrams,
    Contamination,
    benchmark_grams,
    embedding_contamination,
    ngram_contamination,
    ngram_overlaps,
)
from tasks.curate.filters import FilterOutcome, Row, answer_parses, apply_filters
from tasks.curate.normalize import normalize_series, text_hash
from tasks.curate.parallel import LocalMapper, chunked
from tasks.curate.semantic import encode, neighbours_above, vectors_from_bytes, vectors_to_bytes
from tasks.curate.split import POOL_TABLES, LinkGraph, assign_pools, cross_pool_edges
from warehouse import TableRef, Warehouse

STAGES = ("curate.filter", "curate.exact", "curate.minhash", "curate.semantic", "curate.decontam", "curate.split")
T = TypeVar("T")
DEFAULT_SOURCE_PRIORITY = 100


@dataclass
class CurateResult:
    run_id: str
    stages: dict[str, StageCount]
    refs: dict[str, TableRef]
    counters: dict[str, float]
    similarities: dict[str, np.ndarray] = field(default_factory=dict)


# -- map steps (module level so Dask can ship them) ---------------------------------------
def filter_chunk(records: list[dict], cfg: FilterConfig) -> list[FilterOutcome]:
    rows = [Row(r["id"], r["domain"], r["prompt"] or "", r["answer"], r["tests"]) for r in records]
    return apply_filters(rows, cfg)


def signature_chunk(normalized: list[str], cfg: MinHashConfig) -> np.ndarray:
    return mh.minhash_signatures(normalized, cfg)


def encode_chunk(texts: list[str], cfg: SemanticConfig) -> np.ndarray:
    return encode(texts, cfg)


def overlap_chunk(piece: tuple[int, list[str]], bench: BenchmarkGrams) -> pl.DataFrame:
    offset, texts = piece
    return ngram_overlaps(texts, bench).with_columns(pl.col("row") + offset)


# -- stored state: signatures and embeddings computed once per text -----------------------
class EmbeddingStore:
    """Embeddings by (key, text): read from the warehouse when present, else encoded and queued."""

    def __init__(self, wh: Warehouse, cfg: SemanticConfig, mapper, chunk_rows: int):
        self.wh, self.cfg, self.mapper, self.chunk_rows = wh, cfg, mapper, chunk_rows
        self.encoded: Counter = Counter()
        self.pending: list[pl.DataFrame] = []

    def _stored(self) -> list[pl.LazyFrame]:
        sources = [p.lazy() for p in self.pending]   # encoded earlier in this run, not yet written
        if self.wh.exists("embeddings"):
            sources.append(self.wh.scan("embeddings").filter(pl.col("model") == self.cfg.model))
        return sources

    def vectors(self, keys: list[str], texts: list[str], kind: str) -> np.ndarray:
        hashes = [text_hash(t) for t in texts]
        want = pl.DataFrame({"key": keys, "text_hash": hashes}).with_row_index("i")
        found = pl.DataFrame(schema={"i": pl.UInt32, "dim": pl.Int32, "vector": pl.Binary})
        stored = self._stored()
        if stored and keys:
            found = (pl.concat(stored).join(want.lazy(), on=["key", "text_hash"]).select("i", "dim", "vector")
                     .unique("i", keep="first", maintain_order=True).collect())
        missing = np.setdiff1d(np.arange(len(keys)), found["i"].to_numpy())
        fresh = self._encode([texts[i] for i in missing])
        dim = fresh.shape[1] if len(missing) else (int(found["dim"][0]) if found.height else 0)
        out = np.zeros((len(keys), dim), dtype=np.float32)
        if found.height:
            out[found["i"].to_numpy()] = vectors_from_bytes(found["vector"].to_list(), dim)
        if len(missing):
            out[missing] = fresh
            self.encoded[kind] += len(missing)
            self.pending.append(pl.DataFrame({
                "key": [keys[i] for i in missing], "kind": kind, "model": self.cfg.model,
                "text_hash": [hashes[i] for i in missing], "dim": dim, "vector": vectors_to_bytes(fresh)},
                schema=get_spec("embeddings").schema))
        return out

    def _encode(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, 0), np.float32)
        return np.concatenate(self.mapper.map(encode_chunk, chunked(texts, self.chunk_rows), cfg=self.cfg))

    def flush(self, wh: Warehouse, parents) -> TableRef | None:
        if not self.pending:
            return None
        ref = wh.append("embeddings", pl.concat(self.pending), parents=parents, note="curate")
        self.pending = []
        return ref


class SignatureStore:
    def __init__(self, wh: Warehouse, cfg: MinHashConfig, mapper, chunk_rows: int):
        self.wh, self.cfg, self.mapper, self.chunk_rows = wh, cfg, mapper, chunk_rows
        self.params = mh.signature_params_key(cfg)
        self.hashed = 0
        self.pending: list[pl.DataFrame] = []

    def signatures(self, ids: list[str], normalized: list[str], hashes: list[str]) -> np.ndarray:
        want = pl.DataFrame({"row_id": ids, "text_hash": hashes}).with_row_index("i")
        found = pl.DataFrame(schema={"i": pl.UInt32, "signature": pl.Binary})
        if self.wh.exists("minhash_signatures") and ids:
            found = (self.wh.scan("minhash_signatures").filter(pl.col("params") == self.params)
                     .join(want.lazy(), on=["row_id", "text_hash"]).select("i", "signature")
                     .unique("i", keep="first").collect())
        sig = np.zeros((len(ids), self.cfg.num_perm), dtype=np.uint32)
        if found.height:
            sig[found["i"].to_numpy()] = mh.signatures_from_bytes(found["signature"].to_list(), self.cfg.num_perm)
        missing = np.setdiff1d(np.arange(len(ids)), found["i"].to_numpy())
        if len(missing):
            parts = self.mapper.map(signature_chunk, chunked([normalized[i] for i in missing], self.chunk_rows),
                                    cfg=self.cfg)
            sig[missing] = np.concatenate(parts)
            self.hashed += len(missing)
            self.pending.append(pl.DataFrame({
                "row_id": [ids[i] for i in missing], "params": self.params,
                "text_hash": [hashes[i] for i in missing],
                "signature": mh.signatures_to_bytes(sig[missing])}, schema=get_spec("minhash_signatures").schema))
        return sig

    def flush(self, wh: Warehouse, parents) -> TableRef | None:
        if not self.pending:
            return None
        ref = wh.append("minhash_signatures", pl.concat(self.pending), parents=parents, note="curate")
        self.pending = []
        return ref


# -- loading -------------------------------------------------------------------------------
SETTINGS_NOTE = "settings "


def settings_key(cfg: CurateConfig) -> str:
    """What decides the pools (filters, dedup, decontamination, split, source priority); not
    ``chunk_rows``, which only sizes the work."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(cfg.model_dump(exclude={"chunk_rows"}), sort_keys=True,
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


def _with_rank(cand: pl.DataFrame, cfg: CurateConfig) -> pl.DataFrame:
    """Source priority per row (read by the keep rule); rows in a deterministic order."""
    priority = cand["source"].replace_strict(cfg.source_priority, default=DEFAULT_SOURCE_PRIORITY,
                                             return_dtype=pl.Int64) if cand.height else pl.Series([], dtype=pl.Int64)
    return (cand.with_columns(priority.alias("_priority"))
            .sort(["verifiable", "_priority", "id"], descending=[True, False, False]))


def _verifiable(domain: str, answer: str | None, tests: str | None) -> bool:
    if domain == "code":
        return bool((tests or "").strip())
    if domain == "math":
        return answer_parses((answer or "").strip())
    return domain == "logic" and bool((answer or "").strip())


class Curation:
    """One curate run's state; each stage method removes rows and adds duplicate links."""

    def __init__(self, wh: Warehouse, cfg: CurateConfig, run_id: str, mapper, from_scratch: bool = False):
        self.wh, self.cfg, self.run_id, self.mapper = wh, cfg, run_id, mapper
        self.log = DecisionLog(run_id)
        self.stages: dict[str, StageCount] = {}
        self.sims: dict[str, np.ndarray] = {}
        self.old = get_spec("sft_pool").empty() if from_scratch else _old_pools(wh)
        self.n_old = self.old.height
        self.signatures = SignatureStore(wh, cfg.minhash, mapper, cfg.chunk_rows)
        self.embeddings = EmbeddingStore(wh, cfg.semantic, mapper, cfg.chunk_rows)
        self.cand = pl.DataFrame()
        self.alive = np.ones(0, bool)       # per node
        self.graph = LinkGraph(0)
        self.node_ids: list[str] = []
        self.dups = dd.DuplicateClusters(0, 0, self._standing, self._word_ids)
        self._words: dict[int, np.ndarray] = {}
        self._vocab: dict[str, int] = {}

    # nodes
    def _remove(self, stage: str, node: int, reason: str, ref: str | None, score: float | None) -> None:
        self.alive[node] = False
        self.log.removed(stage, self.node_ids[node], reason, ref, score)
        self.stages[stage].removed[reason] += 1

    # duplicate clusters (tasks.curate.dedup): stages add links, settle_duplicates decides
    def _word_ids(self, node: int) -> np.ndarray:
        """Words as written (case and punctuation kept) as vocabulary ids, for the keep rule's edit distances."""
        if node not in self._words:
            words = (self._prompt(node) or "").split()
            self._words[node] = np.array([self._vocab.setdefault(w, len(self._vocab)) for w in words], dtype=np.int64)
        return self._words[node]

    def _standing(self, node: int) -> kr.Standing:
        i = node - self.n_old
        return kr.Standing(bool(self.cand["verifiable"][i]), int(self.cand["_priority"][i]),
                           self.cand["rewritten"][i] is not None, len(self._word_ids(node)), self.node_ids[node])

    def settle_duplicates(self) -> None:
        """One keep decision per duplicate cluster; each removed row names the kept row it links to."""
        new_nodes = np.arange(self.n_old, len(self.node_ids))
        removed = self.dups.settle(new_nodes.tolist())
        self.alive[new_nodes] = True
        for r in sorted(removed.values(), key=lambda r: r.row):
            self.alive[r.row] = False
            self.log.removed(dd.STAGES[r.stage], self.node_ids[r.row], dd.REASONS[r.stage],
                             self.node_ids[r.kept], r.score)
        self.stages.update({sc.stage: sc for sc in dd.stage_counts(len(new_nodes), removed.values())})

    def _alive_new(self) -> np.ndarray:
        return np.flatnonzero(self.alive[self.n_old:]) + self.n_old

    def _begin(self, stage: str, nodes: np.ndarray) -> StageCount:
        self.stages[stage] = StageCount(stage, rows_in=len(nodes))
        return self.stages[stage]

    def _end(self, stage: str, nodes: np.ndarray) -> None:
        sc = self.stages[stage]
        sc.kept = int(self.alive[nodes].sum())
        sc.check()

    # stages
    def filter(self, new: pl.DataFrame) -> None:
        sc = self._begin("curate.filter", np.arange(new.height))
        records = new.select("id", "domain", "prompt", "answer", "tests").to_dicts()
        outcomes = [o for part in self.mapper.map(filter_chunk, chunked(records, self.cfg.chunk_rows),
                                                  cfg=self.cfg.filters) for o in part]
        kept = []
        for o in outcomes:
            if o.removed_reason:
                self.log.removed("curate.filter", o.id, o.removed_reason)
                sc.removed[o.removed_reason] += 1
                continue
            if o.rewritten_reason:
                self.log.rewritten("curate.filter", o.id, o.rewritten_reason)
                sc.rewritten += 1
            kept.append({"id": o.id, "_prompt": o.prompt, "_answer": o.answer, "rewritten": o.rewritten_reason})
        sc.kept = len(kept)
        sc.check()
        changed = pl.DataFrame(kept, schema={"id": pl.Utf8, "_prompt": pl.Utf8, "_answer": pl.Utf8,
                                             "rewritten": pl.Utf8})
        cand = (new.join(changed, on="id", how="inner")
                .with_columns(pl.col("_prompt").alias("prompt"), pl.col("_answer").alias("answer"))
                .drop("_prompt", "_answer"))
        cand = cand.with_columns(normalize_series(cand["prompt"]).alias("_norm"))
        cand = cand.with_columns(
            pl.Series("text_hash", [text_hash(t) for t in cand["_norm"].to_list()], dtype=pl.Utf8),
            pl.Series("verifiable", [_verifiable(d, a, t) for d, a, t in
                                     zip(cand["domain"], cand["answer"], cand["tests"])], dtype=pl.Boolean))
        self.cand = _with_rank(cand, self.cfg)
        self.node_ids = self.old["id"].to_list() + self.cand["id"].to_list()
        self.alive = np.ones(len(self.node_ids), bool)
        self.graph = LinkGraph(len(self.node_ids))
        self.dups = dd.DuplicateClusters(len(self.node_ids), self.n_old, self._standing, self._word_ids)

    def exact(self) -> None:
        """Rows with the same normalized text become one unit (a pool row's, when one has that text)."""
        old_first = {h: i for i, h in reversed(list(enumerate(self.old["text_hash"].to_list())))}
        groups: dict[str, list[int]] = {}
        for node, h, norm in zip(self._alive_new().tolist(), self.cand["text_hash"].to_list(),
                                 self.cand["_norm"].to_list()):
            if norm:   # nothing left after normalization: no key to compare
                groups.setdefault(h, []).append(node)
        for h, members in groups.items():
            unit = old_first[h] if h in old_first else self.dups.rank_rows(members, members)[0]
            self.dups.join(unit, members)
            others = np.array([m for m in members if m != unit], dtype=np.int64)
            self.alive[others] = False      # later stages look at one row per unit
            self.graph.add(others, np.full(len(others), unit))

    def minhash(self) -> None:
        new_nodes = self._alive_new()
        old_norm = normalize_series(self.old["prompt"]).to_list()
        sig_old = self.signatures.signatures(self.old["id"].to_list(), old_norm, self.old["text_hash"].to_list())
        local_new = new_nodes - self.n_old
        sig_new = self.signatures.signatures([self.node_ids[n] for n in new_nodes],
                                             [self.cand["_norm"][int(i)] for i in local_new],
                                             [self.cand["text_hash"][int(i)] for i in local_new])
        sig = np.vstack([sig_old, sig_new])
        node_of = np.r_[np.arange(self.n_old), new_nodes]          # signature row -> node
        found = mh.near_duplicate_edges(sig, self.cfg.minhash)
        self.sims["minhash_candidate_jaccard"] = found.candidate_jaccard
        new_link = (found.pairs >= self.n_old).any(axis=1)   # old-old links were settled before
        pairs = node_of[found.pairs[new_link]]
        self.graph.add(pairs[:, 0], pairs[:, 1])
        self.dups.add_links(dd.MINHASH, pairs, found.jaccard[new_link])
        # the semantic stage encodes one unit per MinHash cluster (the others join in if it links that one)
        self.alive[np.array(self.dups.provisional_removals(), dtype=np.int64)] = False

    def semantic(self) -> None:
        new_nodes = self._alive_new()
        t, block = self.cfg.semantic.threshold, self.cfg.semantic.block_rows
        emb_new = self._embed(new_nodes)
        emb_old = self._embed(np.arange(self.n_old))
        vs_old = neighbours_above(emb_new, emb_old, t, block)
        self.graph.add(new_nodes[vs_old.query], vs_old.target)
        within = neighbours_above(emb_new, emb_new, t, block, earlier_only=True)
        self.graph.add(new_nodes[within.query], new_nodes[within.target])
        self.sims["semantic_nearest_cosine"] = np.maximum(vs_old.best, within.best)
        pairs = np.concatenate([np.stack([new_nodes[vs_old.query], vs_old.target], axis=1),
                                np.stack([new_nodes[within.query], new_nodes[within.target]], axis=1)])
        self.dups.add_links(dd.SEMANTIC, pairs, np.concatenate([vs_old.score, within.score]))
        vectors = dict(enumerate(emb_old)) | dict(zip(new_nodes.tolist(), emb_new))
        self._link_set_aside(vectors)

    def _link_set_aside(self, vectors: dict[int, np.ndarray]) -> None:
        """Encodes the units MinHash set aside in clusters the semantic stage linked, and links them.

        The keep decision then sees every member of those clusters (the original may be among them).
        """
        touched = [m for m in self.dups.clusters() if self.dups.linked_by(m, dd.SEMANTIC)]
        aside = sorted({u for m in touched for u in m if u not in vectors})
        if not aside:
            return
        vectors |= dict(zip(aside, self._embed(np.array(aside, dtype=np.int64))))
        aside_set = set(aside)
        for members in touched:
            mine = [u for u in members if u in aside_set]
            if not mine:
                continue
            sims = np.stack([vectors[u] for u in mine]) @ np.stack([vectors[u] for u in members]).T
            rows, cols = np.nonzero(sims >= self.cfg.semantic.threshold)
            pairs = np.array([[mine[r], members[c]] for r, c in zip(rows, cols)], dtype=np.int64).reshape(-1, 2)
            keep = pairs[:, 0] != pairs[:, 1]
            pairs, rows, cols = pairs[keep], rows[keep], cols[keep]
            self.graph.add(pairs[:, 0], pairs[:, 1])
            self.dups.add_links(dd.SEMANTIC, pairs, sims[rows, cols])

    def _embed(self, nodes: np.ndarray) -> np.ndarray:
        texts = [self._prompt(int(n)) for n in nodes]
        return self.embeddings.vectors([self.node_ids[int(n)] for n in nodes], texts, "prompt")

    def _prompt(self, node: int) -> str:
        return self.old["prompt"][node] if node < self.n_old else self.cand["prompt"][node - self.n_old]

    def decontaminate(self, bench: pl.DataFrame, checked: pl.DataFrame) -> pl.DataFrame:
        """Returns the benchmark items checked for the first time (to record)."""
        cfg = self.cfg.decontam
        bench = bench.with_columns(pl.Series("text_hash", [text_hash(t) for t in bench["text"].to_list()],
                                             dtype=pl.Utf8))
        fresh_items = bench.join(checked, on=["benchmark", "item_id", "text_hash"], how="anti")
        is_fresh = np.isin(np.arange(bench.height), bench.with_row_index("i").join(
            fresh_items.select("benchmark", "item_id", "text_hash"), on=["benchmark", "item_id", "text_hash"]
        )["i"].to_numpy())
        old_nodes = np.flatnonzero(self.alive[:self.n_old]) if is_fresh.any() else np.zeros(0, np.int64)
        nodes = np.r_[self._alive_new(), old_nodes].astype(np.int64)
        self._begin("curate.decontam", nodes)
        if bench.height == 0 or len(nodes) == 0:
            self._end("curate.decontam", nodes)
            return fresh_items
        keys = [f"{b}:{i}" for b, i in zip(bench["benchmark"], bench["item_id"])]
        is_old_row = nodes < self.n_old
        texts = [self._prompt(int(n)) for n in nodes]
        norm = normalize_series(pl.Series(texts, dtype=pl.Utf8)).to_list()
        grams = benchmark_grams(keys, normalize_series(bench["text"]).to_list(), cfg.ngram)
        pieces = [(lo, norm[lo:lo + self.cfg.chunk_rows]) for lo in range(0, len(norm), self.cfg.chunk_rows)]
        overlaps = pl.concat([pl.DataFrame(schema={"row": pl.Int64, "item": pl.Int64, "shared": pl.UInt32,
                                                   "coverage": pl.Float64})]
                             + self.mapper.map(overlap_chunk, pieces, bench=grams))
        # pool rows were checked against the old items already
        allowed = ~is_old_row[overlaps["row"].to_numpy()] | is_fresh[overlaps["item"].to_numpy()]
        overlaps = overlaps.filter(pl.Series(allowed))
        best_cov = overlaps.group_by("row").agg(pl.col("coverage").max())
        self.sims["decontam_ngram_coverage"] = best_cov["coverage"].to_numpy()
        self.stages["curate.decontam"].removed.update({})
        found = [ngram_contamination(overlaps, grams, cfg)]
        if cfg.embedding:
            bench_vecs = self.embeddings.vectors(keys, bench["text"].to_list(), "benchmark")
            row_vecs = self._embed(nodes)
            best_item = np.full(len(nodes), -1, np.int64)
            best = np.full(len(nodes), -np.inf, np.float32)
            for rows, items in ((~is_old_row, np.ones(bench.height, bool)), (is_old_row, is_fresh)):
                if rows.any() and items.any():
                    sims = row_vecs[rows] @ bench_vecs[items].T
                    best_item[rows] = np.flatnonzero(items)[sims.argmax(axis=1)]
                    best[rows] = sims.max(axis=1)
            self.sims["decontam_embedding_cosine"] = best[np.isfinite(best)]
            found.append(embedding_contamination(best_item, best, keys, cfg))
        self._record_contamination(nodes, found)
        self._end("curate.decontam", nodes)
        return fresh_items

    def _record_contamination(self, nodes: np.ndarray, found: list[Contamination]) -> None:
        counters = Counter()
        for hit in found:     # n-gram first: its evidence is the stronger one
            for r, ref, score, reason in zip(hit.row, hit.reference, hit.score, hit.reason):
                counters[reason] += 1
                if self.alive[nodes[r]]:
                    self._remove("curate.decontam", int(nodes[r]), reason, ref, float(score))
        self.detected = counters

    def split(self) -> tuple[list[str | None], list[str | None]]:
        new_nodes = self._alive_new()
        self._begin("curate.split", new_nodes)
        verifiable = np.r_[self.old["verifiable"].to_numpy().astype(bool),
                           self.cand["verifiable"].to_numpy().astype(bool)] if self.node_ids else np.zeros(0, bool)
        is_old = np.arange(len(self.node_ids)) < self.n_old
        pool, cluster, straddling = assign_pools(
            self.graph.labels(), self.alive.copy(), is_old, self.old["pool"].to_list() + [None] * self.cand.height,
            self.old["cluster_id"].to_list() + [None] * self.cand.height, self.node_ids, verifiable, self.cfg.split)
        for node, ref in straddling.items():
            self._remove("curate.split", int(node), "cluster_straddles_pools", ref, None)
            pool[node] = None
        self._end("curate.split", new_nodes)
        leaks = cross_pool_edges(self.graph.edges(), [p if self.alive[i] else None for i, p in enumerate(pool)])
        if leaks:
            raise RuntimeError(f"curate.split: {leaks} duplicate link(s) between the SFT and RL pools")
        return pool, cluster

    def pool_frames(self, pool: list[str | None], cluster: list[str | None]) -> dict[str, pl.DataFrame]:
        spec = get_spec("sft_pool")
        old = self.old.with_columns(pl.Series("pool", pool[:self.n_old], dtype=pl.Utf8),
                                    pl.Series("cluster_id", cluster[:self.n_old], dtype=pl.Utf8))
        old = old.filter(pl.Series(self.alive[:self.n_old]))
        new = self.cand.with_columns(pl.Series("pool", pool[self.n_old:], dtype=pl.Utf8),
                                     pl.Series("cluster_id", cluster[self.n_old:], dtype=pl.Utf8),
                                     pl.lit(self.run_id).alias("curate_run"))
        new = spec.conform(new.filter(pl.Series(self.alive[self.n_old:])))
        rows = pl.concat([spec.conform(old), new])
        return {name: rows.filter(pl.col("pool") == p) for p, name in POOL_TABLES.items()}


def _run_directly(name: str, fn: Callable[[], T]) -> T:
    return fn()


def run_curate(wh: Warehouse, cfg: CurateConfig | None = None, *, run_id: str | None = None,
               mapper=None, step: Callable[[str, Callable[[], T]], T] | None = None) -> CurateResult:
    """Curate the prompts no earlier run has seen; write pools, decisions and reusable state.

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
    cur = Curation(wh, cfg, run_id, mapper, from_scratch=from_scratch)
    prompts = wh.read("prompts", default_empty=True)
    new = prompts if from_scratch else prompts.filter(~pl.col("id").is_in(_processed_ids(wh, cur.old).implode()))
    new = new.unique("id", keep="first", maintain_order=True)
    bench = wh.read("benchmarks", default_empty=True)
    checked = wh.read("decontam_benchmarks", default_empty=True).select("benchmark", "item_id", "text_hash")

    step("filter", lambda: cur.filter(new))
    step("exact", cur.exact)
    step("minhash", cur.minhash)
    if cfg.semantic.enabled:
        step("semantic", cur.semantic)
    step("keep", cur.settle_duplicates)
    fresh_items = step("decontaminate", lambda: cur.decontaminate(bench, checked))
    pool, cluster = step("split", cur.split)

    parents = [r for r in (wh.latest("prompts"), wh.latest("benchmarks")) if r is not None]
    refs: dict[str, TableRef] = {}
    for store in (cur.signatures, cur.embeddings):
        ref = store.flush(wh, parents)
        if ref is not None:
            refs[ref.name] = ref
    changed = (from_scratch or new.height > 0 or fresh_items.height > 0
               or any(not wh.exists(t) for t in POOL_TABLES.values()))
    if changed:   # pools before decisions: a crash in between only makes the next run redo removals
        for name, frame in cur.pool_frames(pool, cluster).items():
            refs[name] = wh.write(name, frame, mode="replace", parents=parents,
                                  note=f"curate {run_id} {SETTINGS_NOTE}{settings}")
    else:
        refs.update({name: wh.latest(name) for name in POOL_TABLES.values()})
    if len(cur.log):
        refs["decisions"] = wh.append("decisions", cur.log.frame(), parents=parents, note=f"curate {run_id}")
    if fresh_items.height:
        refs["decontam_benchmarks"] = wh.append(
            "decontam_benchmarks", fresh_items.select("benchmark", "item_id", "text_hash").with_columns(
                pl.lit(run_id).alias("run_id")), parents=parents, note=f"curate {run_id}")

    counters = {
        "rows_new": new.height, "rows_old_pool": cur.n_old, "from_scratch": float(from_scratch),
        "hashed": cur.signatures.hashed, "encoded": cur.embeddings.encoded["prompt"],
        "encoded_benchmarks": cur.embeddings.encoded["benchmark"],
        "benchmark_items_new": fresh_items.height,
        "sft_pool": refs["sft_pool"].rows, "rl_pool": refs["rl_pool"].rows,
        "removed": sum(s.removed_total for s in cur.stages.values()),
        "decontam.detected_ngram": sum(v for k, v in getattr(cur, "detected", {}).items() if k.startswith("ngram")),
        "decontam.detected_embedding": getattr(cur, "detected", Counter())["embedding_similarity"],
    }
    return CurateResult(run_id, cur.stages, refs, counters, cur.sims)
