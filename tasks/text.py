"""Text normalization and stable text hashing: one definition for every stage that compares texts.

Curate's exact dedup keys, synthesize's instance clusters and the audit's overlap checks all
hash the same normal form, so a prompt is "the same text" in each of them by one rule.
``hash_fraction`` turns a key into a seeded, reproducible draw in [0, 1) (which side a cluster
lands on). Every value here is stable across processes, machines and library versions, because
the hashes are stored in the warehouse and reused by later runs.
"""
from __future__ import annotations

import hashlib
import unicodedata

import polars as pl

# Punctuation and symbols become spaces: "x^2+1" and "x^2 + 1" normalize alike.
_PUNCT = r"[\p{P}\p{S}]+"
_SPACE = r"\s+"


def normalize_series(texts: pl.Series) -> pl.Series:
    """Unicode NFKC, lower case, punctuation dropped, whitespace collapsed."""
    return (texts.fill_null("").str.normalize("NFKC").str.to_lowercase()
            .str.replace_all(_PUNCT, " ").str.replace_all(_SPACE, " ").str.strip_chars())


def normalize_texts(texts: list[str] | pl.Series) -> list[str]:
    series = texts if isinstance(texts, pl.Series) else pl.Series("text", texts, dtype=pl.Utf8)
    return normalize_series(series).to_list()


def text_hash(normalized: str) -> str:
    """The exact-duplicate key of an already normalized text."""
    return hashlib.sha256(normalized.encode("utf-8")).hexdigest()[:32]


def hash_fraction(key: str, seed: int) -> float:
    """Deterministic value in [0, 1) from a key: the same cluster always lands the same way."""
    digest = hashlib.sha256(f"{seed}\x1f{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def collapse_text(text: str) -> str:
    """Unicode NFKC with whitespace runs collapsed to one space (case and punctuation kept): the
    form ingest keys rows on, so a re-ingested file with other line breaks dedups to its rows."""
    return " ".join(unicodedata.normalize("NFKC", text).split())


def stable_id(*parts: str | None) -> str:
    """A row id stable across runs and machines: sha256 of the parts (None as empty), 20 hex."""
    h = hashlib.sha256()
    for p in parts:
        h.update((p or "").encode("utf-8"))
        h.update(b"\x1f")
    return h.hexdigest()[:20]
