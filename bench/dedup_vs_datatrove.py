"""posttrain's MinHash near-dup step vs datatrove's MinHash pipeline, file to kept ids on both sides.

Corpus: original documents of random words plus planted copies whose tail is rewritten so
their 5-word-shingle Jaccard to the original spans 0.4..1.0, written once (untimed) to one
JSONL or Parquet file with opaque ids. Ground truth: a planted pair is a duplicate when its
exact Jaccard >= --threshold; a method should remove one document of each such pair and
nothing else. Both methods use 5-word shingles and 14 bands x 8 rows; posttrain additionally
confirms LSH candidates by their signature-estimated Jaccard.

Both clocks run from that file on disk to the set of kept ids in memory, I/O included:
posttrain reads the file (polars), normalizes, signs, bands, confirms and keeps one
document per cluster; datatrove runs its three stages as documented (signatures,
buckets on 2 workers, clusters, each stage's files on local disk) and its removal indexes
become kept ids through the file's id column (read inside its clock too).

    .venv/bin/python bench/dedup_vs_datatrove.py --docs 50000 [--format parquet]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

# bench/ is this script's directory, first on sys.path
from sides import print_peers


def make_corpus(n_docs: int, dup_fraction: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    # letters only: datatrove's normalizer folds digits, which would merge "w12" and "w34"
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = np.unique(["".join(w) for w in letters[rng.integers(0, 26, size=(24000, 7))]])[:20000]
    n_dups = int(n_docs * dup_fraction)
    n_orig = n_docs - n_dups
    docs = [list(vocab[rng.integers(0, len(vocab), size=int(rng.integers(80, 200)))]) for _ in range(n_orig)]
    pairs = []
    for orig in rng.choice(n_orig, size=n_dups, replace=False):
        words = docs[orig]
        target = rng.uniform(0.4, 1.0)
        shingles = len(words) - 4
        changed = round(shingles * (1 - target) / (1 + target))
        k = max(0, changed - 4) if changed else 0
        copy = words[:len(words) - k] + list(vocab[rng.integers(0, len(vocab), size=k)]) if k else list(words)
        if k == 0 and changed:   # tiny change: swap one word in the middle
            copy = list(words)
            copy[len(copy) // 2] = "zzz"
        pairs.append((int(orig), len(docs)))
        docs.append(copy)
    texts = [" ".join(d) for d in docs]
    order = rng.permutation(len(texts))           # copies are not all at the end
    position = np.empty_like(order)
    position[order] = np.arange(len(order))
    texts = [texts[i] for i in order]
    pairs = [(int(position[a]), int(position[b])) for a, b in pairs]
    return texts, pairs


def exact_jaccard(a: str, b: str, n: int = 5) -> float:
    wa, wb = a.split(), b.split()
    sa = {" ".join(wa[i:i + n]) for i in range(len(wa) - n + 1)}
    sb = {" ".join(wb[i:i + n]) for i in range(len(wb) - n + 1)}
    return len(sa & sb) / len(sa | sb)


def score(removed: set[str], truth: list[tuple[str, str]]) -> tuple[float, float, float]:
    tp = sum(1 for a, b in truth if a in removed or b in removed)
    precision = tp / len(removed) if removed else 1.0
    recall = tp / len(truth) if truth else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return precision, recall, f1


def write_corpus(texts: list[str], folder: Path, fmt: str) -> tuple[Path, list[str]]:
    """The corpus as one file (untimed), with opaque ids; returns (file, ids in file order)."""
    import polars as pl
    ids = [hashlib.blake2b(str(i).encode(), digest_size=6).hexdigest() for i in range(len(texts))]
    folder.mkdir(parents=True)
    path = folder / f"docs.{fmt}"
    if fmt == "parquet":
        pl.DataFrame({"id": ids, "text": texts}).write_parquet(path)
    else:
        with open(path, "w") as fh:
            fh.writelines(json.dumps({"text": t, "id": i}) + "\n" for i, t in zip(ids, texts))
    return path, ids


def read_corpus(path: Path, columns: list[str]):
    import polars as pl
    if path.suffix == ".parquet":
        return pl.read_parquet(path, columns=columns)
    return pl.read_ndjson(path, schema={c: pl.Utf8 for c in columns})


def run_posttrain(path: Path, threshold: float, confirm: float) -> tuple[set[str], float]:
    from tasks.curate.config import MinHashConfig
    from tasks.curate.minhash import components, minhash_signatures, near_duplicate_edges
    from tasks.text import normalize_series
    cfg = MinHashConfig(ngram=5, num_perm=112, bands=14, rows_per_band=8, threshold=threshold,
                        confirm_threshold=confirm)
    t0 = time.perf_counter()
    docs = read_corpus(path, ["id", "text"])
    sig = minhash_signatures(normalize_series(docs["text"]).to_list(), cfg)
    edges = near_duplicate_edges(sig, cfg)
    labels = components(docs.height, edges.pairs)
    # keep the first document of each cluster, remove the rest
    first = np.full(labels.max() + 1, docs.height)
    np.minimum.at(first, labels, np.arange(docs.height))
    kept = set(docs["id"].gather(np.flatnonzero(first[labels] == np.arange(docs.height))).to_list())
    return kept, time.perf_counter() - t0


def run_datatrove(path: Path, workdir: Path) -> tuple[set[str], float]:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.readers import JsonlReader, ParquetReader
    from datatrove.utils.hashing import HashConfig
    cfg = MinhashConfig(hash_config=HashConfig(precision=64), num_buckets=14, hashes_per_bucket=8, n_grams=5)
    reader = (ParquetReader if path.suffix == ".parquet" else JsonlReader)(str(path.parent))
    t0 = time.perf_counter()
    LocalPipelineExecutor(pipeline=[reader, MinhashDedupSignature(output_folder=str(workdir / "sigs"), config=cfg)],
                          tasks=1, workers=1, logging_dir=str(workdir / "logs1")).run()
    LocalPipelineExecutor(pipeline=[MinhashDedupBuckets(input_folder=str(workdir / "sigs"),
                                                        output_folder=str(workdir / "buckets"), config=cfg)],
                          tasks=cfg.num_buckets, workers=2, logging_dir=str(workdir / "logs2")).run()
    LocalPipelineExecutor(pipeline=[MinhashDedupCluster(input_folder=str(workdir / "buckets"),
                                                        output_folder=str(workdir / "remove"), config=cfg)],
                          tasks=1, workers=1, logging_dir=str(workdir / "logs3")).run()
    removed: set[int] = set()
    for f in (workdir / "remove").glob("*.remove"):   # one task read the one file: indexes are file rows
        raw = f.read_bytes()
        removed.update(struct.unpack(f"<{len(raw) // 4}I", raw))
    ids = read_corpus(path, ["id"])["id"].to_list()
    kept = {doc_id for i, doc_id in enumerate(ids) if i not in removed}
    return kept, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=50_000)
    ap.add_argument("--dup-fraction", type=float, default=0.2)
    ap.add_argument("--threshold", type=float, default=0.8, help="ground-truth (and confirmation) Jaccard")
    ap.add_argument("--confirm", type=float, nargs="+", default=[0.7, 0.75, 0.8],
                    help="posttrain's confirmation cutoffs on the estimated Jaccard (each is reported)")
    ap.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    args = ap.parse_args()
    print_peers("datatrove", "spacy")
    texts, planted = make_corpus(args.docs, args.dup_fraction)
    jac = [exact_jaccard(texts[a], texts[b]) for a, b in planted]
    with tempfile.TemporaryDirectory() as tmp:
        path, ids = write_corpus(texts, Path(tmp) / "data", args.format)
        truth = [(ids[a], ids[b]) for (a, b), j in zip(planted, jac) if j >= args.threshold]
        print(f"docs={len(texts)} planted pairs={len(planted)} (Jaccard {min(jac):.2f}..{max(jac):.2f}), "
              f"true duplicates (J >= {args.threshold}) = {len(truth)}; both read {path.name} "
              f"({path.stat().st_size / 2**20:.0f} MiB)")
        ours = {c: run_posttrain(path, args.threshold, c) for c in args.confirm}
        theirs, t_theirs = run_datatrove(path, Path(tmp) / "datatrove")
    rows = [(f"posttrain@{c}", *ours[c]) for c in args.confirm] + [("datatrove", theirs, t_theirs)]
    for name, kept, t in rows:
        removed = set(ids) - kept
        p, r, f1 = score(removed, truth)
        print(f"{name:15s} {len(texts) / t:9.0f} docs/s  ({t:6.1f}s)  removed={len(removed):6d}  "
              f"precision={p:.4f} recall={r:.4f} F1={f1:.4f}")
    for c in args.confirm:
        print(f"throughput ratio posttrain@{c}/datatrove = {t_theirs / ours[c][1]:.1f}x  (target >= 10x)")


if __name__ == "__main__":
    main()
