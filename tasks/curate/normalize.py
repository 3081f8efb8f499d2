"""Stable token / n-gram hashing shared by dedup and decontamination (texts are normalized by
``tasks.text`` first).

Every hash here is deterministic across processes, machines and library versions
(blake2b per distinct token, then a fixed polynomial over token hashes), because MinHash
signatures are stored in the warehouse and reused by later runs.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import polars as pl

# Odd 64-bit multipliers for the position-weighted n-gram hash (fixed so hashes are stable).
_POSITION_MULTIPLIERS = (np.random.default_rng(20250613).integers(1, 2**63, size=256, dtype=np.uint64)
                         | np.uint64(1))


def token_hash(token: str) -> int:
    return int.from_bytes(hashlib.blake2b(token.encode("utf-8"), digest_size=8).digest(), "little")


@dataclass
class TokenArrays:
    """All documents' token hashes, flattened: doc d owns hashes[starts[d]:starts[d]+lengths[d]]."""
    hashes: np.ndarray   # uint64
    starts: np.ndarray   # int64
    lengths: np.ndarray  # int64

    @property
    def docs(self) -> int:
        return len(self.lengths)


def tokenize(normalized: list[str], unit: str = "word") -> TokenArrays:
    """Word (split on spaces) or character tokens of already-normalized texts, hashed."""
    series = pl.Series("t", normalized, dtype=pl.Utf8)
    pieces = series.str.split(" ") if unit == "word" else series.str.split("")
    # "" splits into [""]: a document with no tokens
    pieces = pieces.list.eval(pl.element().filter(pl.element().str.len_bytes() > 0))
    lengths = pieces.list.len().cast(pl.Int64).to_numpy()
    flat = pieces.explode().drop_nulls()
    if flat.len() == 0:
        return TokenArrays(np.zeros(0, np.uint64), np.zeros(len(lengths), np.int64), lengths)
    distinct = flat.unique()
    hashed = pl.Series([token_hash(t) for t in distinct.to_list()], dtype=pl.UInt64)
    hashes = flat.replace_strict(distinct, hashed, return_dtype=pl.UInt64).to_numpy()
    starts = np.zeros(len(lengths), np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return TokenArrays(hashes.astype(np.uint64, copy=False), starts, lengths)


def ngram_hashes(tokens: TokenArrays, n: int, short_docs: str = "whole") -> tuple[np.ndarray, np.ndarray]:
    """(gram hashes uint64, owning doc index) for every window of ``n`` tokens in every doc.

    A doc shorter than ``n`` contributes one gram made of all its tokens when
    ``short_docs == "whole"`` and nothing when ``"skip"``. The hash of a window is
    sum(token_hash[i] * M[i]) mod 2**64, so equal token sequences hash equally anywhere.
    """
    if n > len(_POSITION_MULTIPLIERS):
        raise ValueError(f"n-gram size {n} exceeds {len(_POSITION_MULTIPLIERS)}")
    h, starts, lengths = tokens.hashes, tokens.starts, tokens.lengths
    total = len(h)
    doc_of_token = np.repeat(np.arange(tokens.docs, dtype=np.int64), lengths)
    grams = [np.zeros(0, np.uint64)]
    owners = [np.zeros(0, np.int64)]
    if total >= n:
        width = total - n + 1
        acc = np.zeros(width, np.uint64)
        for i in range(n):
            acc += h[i:i + width] * _POSITION_MULTIPLIERS[i]
        pos_in_doc = np.arange(width, dtype=np.int64) - starts[doc_of_token[:width]]
        valid = pos_in_doc <= lengths[doc_of_token[:width]] - n
        grams.append(acc[valid])
        owners.append(doc_of_token[:width][valid])
    if short_docs == "whole":
        short = np.flatnonzero((lengths > 0) & (lengths < n))
        if len(short):
            g, o = whole_doc_hashes(tokens, short)
            grams.append(g)
            owners.append(o)
    gram = np.concatenate(grams)
    owner = np.concatenate(owners)
    order = np.argsort(owner, kind="stable")
    return gram[order], owner[order]


def whole_doc_hashes(tokens: TokenArrays, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One gram per listed doc covering all its tokens (same formula as ngram_hashes)."""
    lens = tokens.lengths[docs]
    if lens.max(initial=0) > len(_POSITION_MULTIPLIERS):
        raise ValueError("whole-document grams are limited to 256 tokens")
    idx = np.repeat(tokens.starts[docs], lens) + _ranges(lens)
    prods = tokens.hashes[idx] * _POSITION_MULTIPLIERS[_ranges(lens)]
    seg_starts = np.zeros(len(docs), np.int64)
    np.cumsum(lens[:-1], out=seg_starts[1:])
    return np.add.reduceat(prods, seg_starts).astype(np.uint64), docs.astype(np.int64)


def _ranges(lengths: np.ndarray) -> np.ndarray:
    """Concatenated aranges: [0..l0), [0..l1), ..."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(total, dtype=np.int64) - starts
