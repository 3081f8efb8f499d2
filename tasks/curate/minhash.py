"""MinHash near-duplicate detection: vectorized numpy signatures, LSH banding, connected components (scipy).

Signatures: each shingle's 64-bit hash is cut to 32 bits and pushed through ``num_perm``
multiply-shift hash functions ((a*x + b) mod 2**64) >> 32 with random odd 64-bit a and
random b (Dietzfelbinger's universal family: three wrapping uint64 operations, no
division, several times cheaper than datasketch's (a*x + b) mod (2**61 - 1)); the
per-document minimum of each is the signature, computed for all shingles of a block of
documents in one array operation.

Banding: ``bands`` x ``rows_per_band`` is either given or derived from the Jaccard
threshold by datasketch's rule (minimise the weighted false-positive and false-negative
areas under the LSH S-curve). Documents sharing any band are candidates; candidates are
confirmed by the Jaccard estimated from their full signatures (fraction of equal
minima) so chance band collisions do not merge unrelated rows.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
from scipy.integrate import quad
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from tasks.curate.config import MinHashConfig
from tasks.curate.normalize import ngram_hashes, tokenize

EMPTY_SLOT = np.uint32(0xFFFFFFFF)
SHINGLES_PER_BLOCK = 1 << 14   # (shingles x num_perm) working array of ~15 MB stays cache-friendly
ALL_PAIRS_MAX_BUCKET = 16      # larger LSH buckets contribute star edges only


@dataclass(frozen=True)
class Banding:
    bands: int
    rows: int

    def collision_probability(self, jaccard: float) -> float:
        return 1.0 - (1.0 - jaccard ** self.rows) ** self.bands


def optimal_banding(threshold: float, num_perm: int, fp_weight: float = 0.5,
                    fn_weight: float = 0.5) -> Banding:
    """The (bands, rows) minimising fp_weight*FP + fn_weight*FN, as datasketch chooses them.

    FP is the probability mass of pairs below the threshold that still collide, FN of pairs
    above it that never do (uniform prior on Jaccard).
    """
    best, best_err = Banding(1, num_perm), float("inf")
    for b in range(1, num_perm + 1):
        for r in range(1, num_perm // b + 1):
            fp = quad(lambda s, r=r, b=b: 1 - (1 - s ** r) ** b, 0.0, threshold)[0]
            fn = quad(lambda s, r=r, b=b: (1 - s ** r) ** b, threshold, 1.0)[0]
            err = fp_weight * fp + fn_weight * fn
            if err < best_err:
                best, best_err = Banding(b, r), err
    return best


def banding_for(cfg: MinHashConfig) -> Banding:
    if cfg.bands is not None:
        return Banding(cfg.bands, cfg.rows_per_band)
    return optimal_banding(cfg.threshold, cfg.num_perm, cfg.false_positive_weight, cfg.false_negative_weight)


def signature_params_key(cfg: MinHashConfig) -> str:
    """Identifies signatures computed with these settings (stored signatures with another key are stale)."""
    return f"ms:{cfg.shingle}:{cfg.ngram}:{cfg.num_perm}:{cfg.seed}"


def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.integers(1, 2**63, size=num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)   # odd
    b = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64)
    return a, b


def shingle_hashes(normalized: list[str], cfg: MinHashConfig) -> tuple[np.ndarray, np.ndarray]:
    """(32-bit shingle hashes as uint64, owning doc) sorted by doc. Short docs are one shingle."""
    tokens = tokenize(normalized, cfg.shingle)
    grams, owner = ngram_hashes(tokens, cfg.ngram, short_docs="whole")
    return grams >> np.uint64(32), owner


def minhash_signatures(normalized: list[str], cfg: MinHashConfig) -> np.ndarray:
    """(docs x num_perm) uint32 signatures; a doc without shingles gets all EMPTY_SLOT."""
    a, b = permutations(cfg.num_perm, cfg.seed)
    shingles, owner = shingle_hashes(normalized, cfg)
    sig = np.full((len(normalized), cfg.num_perm), EMPTY_SLOT, dtype=np.uint32)
    for lo in range(0, len(shingles), SHINGLES_PER_BLOCK):
        block = shingles[lo:lo + SHINGLES_PER_BLOCK]
        docs = owner[lo:lo + SHINGLES_PER_BLOCK]
        hashed = block[:, None] * a[None, :]   # wraps mod 2**64 by design
        hashed += b[None, :]
        hashed >>= np.uint64(32)
        seg_starts = np.flatnonzero(np.r_[True, docs[1:] != docs[:-1]])
        seg_docs = docs[seg_starts]
        seg_min = np.minimum.reduceat(hashed, seg_starts, axis=0).astype(np.uint32)
        # a doc appears once per block (shingles are sorted by doc), so fancy assignment is exact
        sig[seg_docs] = np.minimum(sig[seg_docs], seg_min)
    return sig


def band_keys(sig: np.ndarray, banding: Banding) -> np.ndarray:
    """(docs x bands) uint64 hash of each band's rows."""
    mult = (np.random.default_rng(7).integers(1, 2**63, size=banding.rows, dtype=np.uint64) | np.uint64(1))
    keys = np.zeros((sig.shape[0], banding.bands), dtype=np.uint64)
    for band in range(banding.bands):
        cols = sig[:, band * banding.rows:(band + 1) * banding.rows].astype(np.uint64)
        acc = np.zeros(sig.shape[0], dtype=np.uint64)
        for j in range(banding.rows):
            acc += (cols[:, j] + np.uint64(1)) * mult[j]
        keys[:, band] = acc
    return keys


def candidate_pairs(sig: np.ndarray, banding: Banding, active: np.ndarray | None = None) -> np.ndarray:
    """(pairs x 2) int64 index pairs (lo < hi) that share at least one band bucket."""
    n = sig.shape[0]
    idx = np.arange(n) if active is None else np.flatnonzero(active)
    if len(idx) < 2:
        return np.zeros((0, 2), np.int64)
    keys = band_keys(sig[idx], banding)
    edges = []
    for band in range(banding.bands):
        col = keys[:, band]
        order = np.argsort(col, kind="stable")
        sorted_keys = col[order]
        run_start = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
        run_len = np.diff(np.r_[run_start, len(order)])
        multi = run_len >= 2
        if not multi.any():
            continue
        # star edges: every bucket member to the bucket's first member
        starts, lens = run_start[multi], run_len[multi]
        firsts = np.repeat(order[starts], lens - 1)
        members = order[np.repeat(starts, lens - 1) + _offsets_from_one(lens)]
        edges.append(np.stack([firsts, members], axis=1))
        # small buckets: all pairs, so confirmation does not depend on who came first
        for s, k in zip(starts[lens > 2], lens[lens > 2]):
            if k <= ALL_PAIRS_MAX_BUCKET:
                edges.append(np.array(list(itertools.combinations(order[s:s + k], 2)), dtype=np.int64))
    if not edges:
        return np.zeros((0, 2), np.int64)
    pairs = idx[np.concatenate(edges)]
    pairs = np.sort(pairs, axis=1)
    pairs = np.unique(pairs[:, 0] * n + pairs[:, 1])
    return np.stack([pairs // n, pairs % n], axis=1)


def _offsets_from_one(lens: np.ndarray) -> np.ndarray:
    """For bucket lengths [3, 2]: [1, 2, 1] (member offsets after each bucket's first)."""
    total = int((lens - 1).sum())
    starts = np.repeat(np.cumsum(lens - 1) - (lens - 1), lens - 1)
    return np.arange(total, dtype=np.int64) - starts + 1


def estimated_jaccard(sig: np.ndarray, pairs: np.ndarray, chunk: int = 200_000) -> np.ndarray:
    out = np.empty(len(pairs), dtype=np.float64)
    for lo in range(0, len(pairs), chunk):
        p = pairs[lo:lo + chunk]
        out[lo:lo + chunk] = (sig[p[:, 0]] == sig[p[:, 1]]).mean(axis=1)
    return out


def components(n: int, pairs: np.ndarray) -> np.ndarray:
    """Connected-component label per node (scipy's connected_components over the edges)."""
    if len(pairs) == 0:
        return np.arange(n)
    graph = coo_matrix((np.ones(len(pairs), np.int8), (pairs[:, 0], pairs[:, 1])), shape=(n, n))
    return connected_components(graph, directed=False)[1]


@dataclass
class NearDupEdges:
    pairs: np.ndarray        # (k x 2) confirmed near-duplicate pairs
    jaccard: np.ndarray      # estimated Jaccard of each pair
    candidates: int          # pairs LSH proposed before confirmation
    candidate_jaccard: np.ndarray


def near_duplicate_edges(sig: np.ndarray, cfg: MinHashConfig, active: np.ndarray | None = None) -> NearDupEdges:
    if active is None:
        active = ~(sig == EMPTY_SLOT).all(axis=1)
    banding = banding_for(cfg)
    cand = candidate_pairs(sig, banding, active)
    jac = estimated_jaccard(sig, cand)
    cutoff = cfg.threshold if cfg.confirm_threshold is None else cfg.confirm_threshold
    keep = jac >= cutoff if cfg.verify_candidates else np.ones(len(cand), bool)
    return NearDupEdges(cand[keep], jac[keep], len(cand), jac)


def signatures_to_bytes(sig: np.ndarray) -> list[bytes]:
    return [row.tobytes() for row in np.ascontiguousarray(sig, dtype=np.uint32)]


def signatures_from_bytes(blobs: list[bytes], num_perm: int) -> np.ndarray:
    if not blobs:
        return np.zeros((0, num_perm), dtype=np.uint32)
    return np.frombuffer(b"".join(blobs), dtype=np.uint32).reshape(len(blobs), num_perm).copy()
