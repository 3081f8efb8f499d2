"""Signatures and embeddings computed once per text: read from the warehouse when stored
there with the same parameters, else computed (on the mapper) and queued for one write at
the end of the run."""
from __future__ import annotations

import numpy as np
import polars as pl

from data_specs import get_spec
from tasks.curate import minhash as mh
from tasks.curate.config import MinHashConfig, SemanticConfig
from tasks.curate.parallel import chunked
from tasks.curate.semantic import encode, vectors_from_bytes, vectors_to_bytes
from tasks.text import text_hash
from warehouse import TableRef, Warehouse


# map steps (module level so Dask can ship them)
def signature_chunk(normalized: list[str], cfg: MinHashConfig) -> np.ndarray:
    return mh.minhash_signatures(normalized, cfg)


def encode_chunk(texts: list[str], cfg: SemanticConfig) -> np.ndarray:
    return encode(texts, cfg)


class _PendingRows:
    """Rows computed in this run, appended to ``table`` in one snapshot when the run writes."""
    table: str

    def __init__(self) -> None:
        self.pending: list[pl.DataFrame] = []

    def flush(self, wh: Warehouse, parents) -> TableRef | None:
        if not self.pending:
            return None
        ref = wh.append(self.table, pl.concat(self.pending), parents=parents, note="curate")
        self.pending = []
        return ref


class EmbeddingStore(_PendingRows):
    """Embeddings by (key, text hash) for one model."""

    table = "embeddings"

    def __init__(self, wh: Warehouse, cfg: SemanticConfig, mapper, chunk_rows: int):
        super().__init__()
        self.wh, self.cfg, self.mapper, self.chunk_rows = wh, cfg, mapper, chunk_rows

    def _stored(self) -> list[pl.LazyFrame]:
        sources = [p.lazy() for p in self.pending]   # encoded earlier in this run, not yet written
        if self.wh.exists("embeddings"):
            sources.append(self.wh.scan("embeddings").filter(pl.col("model") == self.cfg.model))
        return sources

    def vectors(self, keys: list[str], texts: list[str], kind: str) -> tuple[np.ndarray, int]:
        """(len(keys) x dim unit vectors, how many of them were encoded now)."""
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
            self.pending.append(pl.DataFrame({
                "key": [keys[i] for i in missing], "kind": kind, "model": self.cfg.model,
                "text_hash": [hashes[i] for i in missing], "dim": dim, "vector": vectors_to_bytes(fresh)},
                schema=get_spec("embeddings").schema))
        return out, len(missing)

    def _encode(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, 0), np.float32)
        return np.concatenate(self.mapper.map(encode_chunk, chunked(texts, self.chunk_rows), cfg=self.cfg))



class SignatureStore(_PendingRows):
    """MinHash signatures by (row id, text hash) for one set of MinHash parameters."""

    table = "minhash_signatures"

    def __init__(self, wh: Warehouse, cfg: MinHashConfig, mapper, chunk_rows: int):
        super().__init__()
        self.wh, self.cfg, self.mapper, self.chunk_rows = wh, cfg, mapper, chunk_rows
        self.params = mh.signature_params_key(cfg)

    def signatures(self, ids: list[str], normalized: list[str], hashes: list[str]) -> tuple[np.ndarray, int]:
        """(len(ids) x num_perm signatures, how many of them were computed now)."""
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
            self.pending.append(pl.DataFrame({
                "row_id": [ids[i] for i in missing], "params": self.params,
                "text_hash": [hashes[i] for i in missing],
                "signature": mh.signatures_to_bytes(sig[missing])}, schema=get_spec("minhash_signatures").schema))
        return sig, len(missing)

