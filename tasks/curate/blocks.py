"""The curate blocks, in run order: filter -> exact -> MinHash -> semantic -> keep -> decontaminate -> split.

Each reads a ``CurationView`` and returns a ``BlockResult`` (``tasks.curate.block``): its
decisions, its duplicate links, its stage counts and counters. None of them writes run
state; ``tasks.curate.pipeline`` applies their results.

The dedup blocks only link rows; ``KeepBlock`` decides once per duplicate cluster which row
stays (``tasks.curate.dedup``). To save work they look at fewer rows than they link:
MinHash hashes one row per exact unit, and the semantic block encodes one unit per MinHash
cluster, then encodes the units it skipped in clusters it linked so the keep rule sees them.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from tasks.curate import dedup as dd
from tasks.curate.accounting import StageCount
from tasks.curate.block import BlockResult, CurationView, Decision, Links
from tasks.curate.config import (
    DecontamConfig,
    FilterConfig,
    MinHashConfig,
    SemanticConfig,
    SplitConfig,
)
from tasks.curate.decontaminate import (
    BenchmarkGrams,
    Contamination,
    benchmark_grams,
    embedding_contamination,
    ngram_contamination,
    ngram_overlaps,
)
from tasks.curate.filters import FilterOutcome, Row, apply_filters
from tasks.curate.minhash import near_duplicate_edges
from tasks.curate.model_repair import ModelRepair, RepairResult
from tasks.curate.parallel import chunked
from tasks.curate.semantic import neighbours_above
from tasks.curate.split import assign_pools, cross_pool_edges
from tasks.curate.stores import EmbeddingStore, SignatureStore
from tasks.genrm.config import OPEN_DOMAINS
from tasks.text import normalize_series, text_hash

OVERLAP_SCHEMA = {"row": pl.Int64, "item": pl.Int64, "shared": pl.UInt32, "coverage": pl.Float64}


# -- map steps (module level so Dask can ship them) ---------------------------------------
def filter_chunk(records: list[dict], cfg: FilterConfig) -> list[FilterOutcome]:
    rows = [Row(r["id"], r["domain"], r["prompt"] or "", r["answer"], r["tests"]) for r in records]
    return apply_filters(rows, cfg)


def overlap_chunk(piece: tuple[int, list[str]], bench: BenchmarkGrams) -> pl.DataFrame:
    offset, texts = piece
    return ngram_overlaps(texts, bench).with_columns(pl.col("row") + offset)


# -- filter -------------------------------------------------------------------------------
@dataclass
class FilterResult(BlockResult):
    kept: pl.DataFrame = field(default_factory=pl.DataFrame)   # rows past the rules, as rewritten


class FilterBlock:
    """The M1 quality rules on this run's incoming rows: remove with a reason, or rewrite; with
    ``repair``, a model first repairs what two rules would remove (``tasks.curate.model_repair``)."""
    name, stage = "filter", "curate.filter"

    def __init__(self, cfg: FilterConfig, mapper, chunk_rows: int, repair: ModelRepair | None = None):
        self.cfg, self.mapper, self.chunk_rows, self.repair = cfg, mapper, chunk_rows, repair

    def run(self, rows: CurationView) -> FilterResult:
        incoming = rows.incoming
        count = StageCount(self.stage, rows_in=incoming.height)
        records = incoming.select("id", "domain", "prompt", "answer", "tests").to_dicts()
        outcomes = [o for part in self.mapper.map(filter_chunk, chunked(records, self.chunk_rows), cfg=self.cfg)
                    for o in part]
        repaired = self.repair.run(outcomes, incoming, self.cfg) if self.repair is not None else RepairResult(outcomes)
        decisions, kept = [], []
        for o in repaired.outcomes:
            if o.removed_reason:
                decisions.append(Decision(o.id, self.stage, o.removed_reason))
                count.removed[o.removed_reason] += 1
                continue
            if o.rewritten_reason:
                decisions.append(Decision(o.id, self.stage, o.rewritten_reason, score=repaired.scores.get(o.id),
                                          rewritten=True))
                count.rewritten += 1
            kept.append({"id": o.id, "_prompt": o.prompt, "_answer": o.answer, "_tests": o.tests,
                         "_metadata": repaired.metadata.get(o.id), "rewritten": o.rewritten_reason})
        count.kept = len(kept)
        changed = pl.DataFrame(kept, schema={"id": pl.Utf8, "_prompt": pl.Utf8, "_answer": pl.Utf8, "_tests": pl.Utf8,
                                             "_metadata": pl.Utf8, "rewritten": pl.Utf8})
        survivors = (incoming.join(changed, on="id", how="inner", maintain_order="left")   # ingestion order
                     .with_columns(pl.col("_prompt").alias("prompt"), pl.col("_answer").alias("answer"),
                                   pl.col("_tests").alias("tests"),
                                   pl.coalesce("_metadata", "metadata").alias("metadata"))
                     .drop("_prompt", "_answer", "_tests", "_metadata"))
        return FilterResult([count], decisions, kept=survivors, counters=dict(repaired.counters))


# -- exact --------------------------------------------------------------------------------
class ExactBlock:
    """Rows with the same normalized text become one unit: a pool row's when one has that
    text, else the unit of the row the keep rule ranks first."""
    name = "exact"

    def run(self, rows: CurationView) -> BlockResult:
        old_first = {h: i for i, h in reversed(list(enumerate(rows.old["text_hash"].to_list())))}
        hashes, norms = rows.new["text_hash"].to_list(), rows.new["_norm"].to_list()
        groups: dict[str, list[int]] = {}
        for node in rows.live_new().tolist():
            if norms[node - rows.n_old]:   # nothing left after normalization: no key to compare
                groups.setdefault(hashes[node - rows.n_old], []).append(node)
        members_of, units = [], []
        for h, members in groups.items():
            unit = old_first[h] if h in old_first else rows.clusters.ranking.rank_rows(members, members)[0]
            others = [m for m in members if m != unit]
            members_of += others
            units += [unit] * len(others)
        return BlockResult(links=[Links.between(dd.EXACT, members_of, units, np.ones(len(units)))],
                           counters={"exact.rows_joined": len(units)})


# -- MinHash ------------------------------------------------------------------------------
class MinHashBlock:
    """LSH near-duplicate links between one row per unit and every pool row (signatures stored)."""
    name = "minhash"

    def __init__(self, cfg: MinHashConfig, signatures: SignatureStore):
        self.cfg, self.signatures = cfg, signatures

    def run(self, rows: CurationView) -> BlockResult:
        heads = rows.unit_heads()
        local = (heads - rows.n_old).tolist()
        norms, hashes = rows.new["_norm"].to_list(), rows.new["text_hash"].to_list()
        sig_old, hashed_old = self.signatures.signatures(
            rows.old["id"].to_list(), normalize_series(rows.old["prompt"]).to_list(), rows.old["text_hash"].to_list())
        sig_new, hashed_new = self.signatures.signatures(
            [rows.node_ids[n] for n in heads], [norms[i] for i in local], [hashes[i] for i in local])
        node_of = np.r_[np.arange(rows.n_old), heads].astype(np.int64)          # signature row -> node
        found = near_duplicate_edges(np.vstack([sig_old, sig_new]), self.cfg)
        new_link = (found.pairs >= rows.n_old).any(axis=1)   # old-old links were settled before
        links = Links(dd.MINHASH, node_of[found.pairs[new_link]].reshape(-1, 2), found.jaccard[new_link])
        return BlockResult(links=[links], similarities={"minhash_candidate_jaccard": found.candidate_jaccard},
                           counters={"hashed": hashed_old + hashed_new, "minhash.candidate_pairs": found.candidates,
                                     "minhash.links": len(links.pairs)})


# -- semantic -----------------------------------------------------------------------------
class SemanticBlock:
    """MiniLM cosine links: one unit per MinHash cluster against each other and every pool row."""
    name = "semantic"

    def __init__(self, cfg: SemanticConfig, embeddings: EmbeddingStore):
        self.cfg, self.embeddings = cfg, embeddings

    def run(self, rows: CurationView) -> BlockResult:
        set_aside = set(rows.clusters.provisional_removals())
        nodes = np.array([n for n in rows.unit_heads().tolist() if n not in set_aside], dtype=np.int64)
        t, block = self.cfg.threshold, self.cfg.block_rows
        emb_new, encoded_new = self._embed(rows, nodes)
        emb_old, encoded_old = self._embed(rows, np.arange(rows.n_old))
        vs_old = neighbours_above(emb_new, emb_old, t, block)
        within = neighbours_above(emb_new, emb_new, t, block, earlier_only=True)
        found = [Links.between(dd.SEMANTIC, nodes[vs_old.query], vs_old.target, vs_old.score),
                 Links.between(dd.SEMANTIC, nodes[within.query], nodes[within.target], within.score)]
        vectors = dict(enumerate(emb_old)) | dict(zip(nodes.tolist(), emb_new))
        aside, encoded_aside = self._link_set_aside(rows, found, vectors)
        links = found + aside
        return BlockResult(links=links, similarities={"semantic_nearest_cosine": np.maximum(vs_old.best, within.best)},
                           counters={"encoded": encoded_new + encoded_old + encoded_aside,
                                     "semantic.links": sum(len(x.pairs) for x in links)})

    def _link_set_aside(self, rows: CurationView, found: list[Links],
                        vectors: dict[int, np.ndarray]) -> tuple[list[Links], int]:
        """Links the units MinHash set aside in clusters this block linked, encoding them first.

        The keep decision then sees every member of those clusters (the original may be among them).
        """
        preview = rows.clusters.with_links(dd.SEMANTIC, np.concatenate([x.pairs for x in found]),
                                           np.concatenate([x.scores for x in found]))
        touched = [m for m in preview.clusters() if preview.linked_by(m, dd.SEMANTIC)]
        aside = sorted({u for m in touched for u in m if u not in vectors})
        if not aside:
            return [], 0
        aside_vectors, encoded = self._embed(rows, np.array(aside, dtype=np.int64))
        vectors |= dict(zip(aside, aside_vectors))
        aside_set, out = set(aside), []
        for members in touched:
            mine = [u for u in members if u in aside_set]
            if not mine:
                continue
            sims = np.stack([vectors[u] for u in mine]) @ np.stack([vectors[u] for u in members]).T
            r, c = np.nonzero(sims >= self.cfg.threshold)
            pairs = np.array([[mine[i], members[j]] for i, j in zip(r, c)], dtype=np.int64).reshape(-1, 2)
            keep = pairs[:, 0] != pairs[:, 1]
            out.append(Links(dd.SEMANTIC, pairs[keep], sims[r[keep], c[keep]]))
        return out, encoded

    def _embed(self, rows: CurationView, nodes: np.ndarray) -> tuple[np.ndarray, int]:
        return self.embeddings.vectors([rows.node_ids[n] for n in nodes], [rows.prompts[n] for n in nodes], "prompt")


# -- keep ---------------------------------------------------------------------------------
class KeepBlock:
    """One keep decision per duplicate cluster, once every dedup block has linked; each removed
    row names the kept row it links to and counts for the stage of that link."""
    name = "keep"

    def run(self, rows: CurationView) -> BlockResult:
        new_nodes = rows.live_new()
        removed = rows.clusters.settle(new_nodes.tolist())
        decisions = [Decision(rows.node_ids[r.row], dd.STAGES[r.stage], dd.REASONS[r.stage], rows.node_ids[r.kept],
                              r.score) for r in sorted(removed.values(), key=lambda r: r.row)]
        return BlockResult(dd.stage_counts(len(new_nodes), removed.values()), decisions,
                           counters={"keep.links_answers_differ": len(rows.clusters.answer_conflicts)})


# -- decontaminate ------------------------------------------------------------------------
@dataclass
class DecontamResult(BlockResult):
    checked_items: pl.DataFrame = field(default_factory=pl.DataFrame)   # benchmark items checked the first time


class DecontamBlock:
    """Removes rows sharing an n-gram with (or embedded close to) a benchmark item.

    This run's rows are checked against every item; pool rows only against items no earlier
    run checked them against.
    """
    name, stage = "decontaminate", "curate.decontam"

    def __init__(self, cfg: DecontamConfig, benchmarks: pl.DataFrame, checked: pl.DataFrame,
                 embeddings: EmbeddingStore, mapper, chunk_rows: int):
        self.cfg, self.embeddings, self.mapper, self.chunk_rows = cfg, embeddings, mapper, chunk_rows
        self.bench = benchmarks.with_columns(
            pl.Series("text_hash", [text_hash(t) for t in benchmarks["text"].to_list()], dtype=pl.Utf8))
        key = ["benchmark", "item_id", "text_hash"]
        self.fresh_items = self.bench.join(checked, on=key, how="anti")
        self.is_fresh = np.isin(np.arange(self.bench.height), self.bench.with_row_index("i").join(
            self.fresh_items.select(key), on=key)["i"].to_numpy())

    def run(self, rows: CurationView) -> DecontamResult:
        old_nodes = np.flatnonzero(~rows.removed[:rows.n_old]) if self.is_fresh.any() else np.zeros(0, np.int64)
        nodes = np.r_[rows.live_new(), old_nodes].astype(np.int64)
        count = StageCount(self.stage, rows_in=len(nodes), kept=len(nodes))
        out = DecontamResult([count], checked_items=self.fresh_items,
                             counters={"decontam.detected_ngram": 0, "decontam.detected_embedding": 0})
        if self.bench.height == 0 or len(nodes) == 0:
            return out
        keys = [f"{b}:{i}" for b, i in zip(self.bench["benchmark"], self.bench["item_id"])]
        is_old_row = nodes < rows.n_old
        found = [self._ngram_hits(rows, nodes, is_old_row, keys, out)]
        if self.cfg.embedding:
            found.append(self._embedding_hits(rows, nodes, is_old_row, keys, out))
        out.decisions = self._decisions(rows, nodes, found, out)
        count.removed.update(d.reason for d in out.decisions)
        count.kept = len(nodes) - len(out.decisions)
        return out

    def _ngram_hits(self, rows: CurationView, nodes: np.ndarray, is_old_row: np.ndarray, keys: list[str],
                    out: DecontamResult) -> Contamination:
        norm = normalize_series(pl.Series([rows.prompts[n] for n in nodes], dtype=pl.Utf8)).to_list()
        grams = benchmark_grams(keys, normalize_series(self.bench["text"]).to_list(), self.cfg.ngram)
        pieces = [(lo, norm[lo:lo + self.chunk_rows]) for lo in range(0, len(norm), self.chunk_rows)]
        overlaps = pl.concat([pl.DataFrame(schema=OVERLAP_SCHEMA)] + self.mapper.map(overlap_chunk, pieces, bench=grams))
        # pool rows were checked against the old items already
        allowed = ~is_old_row[overlaps["row"].to_numpy()] | self.is_fresh[overlaps["item"].to_numpy()]
        overlaps = overlaps.filter(pl.Series(allowed))
        best_cov = overlaps.group_by("row", maintain_order=True).agg(pl.col("coverage").max())
        out.similarities["decontam_ngram_coverage"] = best_cov["coverage"].to_numpy()
        return ngram_contamination(overlaps, grams, self.cfg)

    def _embedding_hits(self, rows: CurationView, nodes: np.ndarray, is_old_row: np.ndarray, keys: list[str],
                        out: DecontamResult) -> Contamination:
        bench_vecs, encoded_bench = self.embeddings.vectors(keys, self.bench["text"].to_list(), "benchmark")
        row_vecs, encoded_rows = self.embeddings.vectors([rows.node_ids[n] for n in nodes],
                                                         [rows.prompts[n] for n in nodes], "prompt")
        best_item = np.full(len(nodes), -1, np.int64)
        best = np.full(len(nodes), -np.inf, np.float32)
        for sel, items in ((~is_old_row, np.ones(self.bench.height, bool)), (is_old_row, self.is_fresh)):
            if sel.any() and items.any():
                sims = row_vecs[sel] @ bench_vecs[items].T
                best_item[sel] = np.flatnonzero(items)[sims.argmax(axis=1)]
                best[sel] = sims.max(axis=1)
        out.similarities["decontam_embedding_cosine"] = best[np.isfinite(best)]
        out.counters.update({"encoded": encoded_rows, "encoded_benchmarks": encoded_bench})
        return embedding_contamination(best_item, best, keys, self.cfg)

    def _decisions(self, rows: CurationView, nodes: np.ndarray, found: list[Contamination],
                   out: DecontamResult) -> list[Decision]:
        detected, decisions, removed = Counter(), [], set()
        for hit in found:     # n-gram first: its evidence is the stronger one
            for r, ref, score, reason in zip(hit.row.tolist(), hit.reference, hit.score.tolist(), hit.reason):
                detected[reason] += 1
                if r not in removed:
                    removed.add(r)
                    decisions.append(Decision(rows.node_ids[nodes[r]], self.stage, reason, ref, float(score)))
        out.counters["decontam.detected_ngram"] = sum(v for k, v in detected.items() if k.startswith("ngram"))
        out.counters["decontam.detected_embedding"] = detected["embedding_similarity"]
        return decisions


# -- split --------------------------------------------------------------------------------
@dataclass
class SplitResult(BlockResult):
    pool: list[str | None] = field(default_factory=list)      # per node: "sft", "rl", or None (removed)
    cluster: list[str | None] = field(default_factory=list)   # per node: leakage cluster id


class SplitBlock:
    """Whole leakage clusters to SFT or RL; a new row whose cluster already spans both pools goes."""
    name, stage = "split", "curate.split"

    def __init__(self, cfg: SplitConfig):
        self.cfg = cfg

    def run(self, rows: CurationView) -> SplitResult:
        new_nodes = rows.live_new()
        count = StageCount(self.stage, rows_in=len(new_nodes))
        n, n_new = len(rows.node_ids), rows.new.height
        verifiable = np.r_[rows.old["verifiable"].to_numpy().astype(bool),
                           rows.new["verifiable"].to_numpy().astype(bool)] if n else np.zeros(0, bool)
        open_domain = np.r_[rows.old["domain"].is_in(list(OPEN_DOMAINS)).to_numpy().astype(bool),
                            rows.new["domain"].is_in(list(OPEN_DOMAINS)).to_numpy().astype(bool)] if n else np.zeros(0, bool)
        kept = ~rows.removed
        pool, cluster, straddling = assign_pools(
            rows.links.labels(), kept.copy(), np.arange(n) < rows.n_old, rows.old["pool"].to_list() + [None] * n_new,
            rows.old["cluster_id"].to_list() + [None] * n_new, rows.node_ids, verifiable, self.cfg, open_domain)
        decisions = []
        for node, ref in straddling.items():
            decisions.append(Decision(rows.node_ids[node], self.stage, "cluster_straddles_pools", ref))
            count.removed["cluster_straddles_pools"] += 1
            kept[node], pool[node] = False, None
        count.kept = int(kept[new_nodes].sum())
        leaks = cross_pool_edges(rows.links.edges(), [p if kept[i] else None for i, p in enumerate(pool)])
        if leaks:
            raise RuntimeError(f"curate.split: {leaks} duplicate link(s) between the SFT and RL pools")
        return SplitResult([count], decisions, pool=pool, cluster=cluster)
