"""Semantic dedup overhead: the curate semantic stage over N rows / bare MiniLM encode of those rows.

The stage does the warehouse lookup of stored embeddings, the encode, the blocked
neighbour search (new vs kept rows and within new rows) and the keep rule; the peer is
``SentenceTransformer.encode`` on exactly the texts that entered the stage, same batch
size. Target <= 1.15.

    .venv/bin/python bench/semantic_dedup.py --rows 3000
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

from data_specs import get_spec
from tasks.curate.config import CurateConfig, DecontamConfig, SemanticConfig
from tasks.curate.parallel import LocalMapper
from tasks.curate.pipeline import CurationState, curate_blocks
from tasks.curate.semantic import encode, load_model
from tasks.ingest import store_records
from tasks.records import RawRecord
from warehouse import Warehouse

SUBJECTS = ["train", "farmer", "river", "library", "robot", "garden", "bakery", "comet", "violin", "harbor"]
VERBS = ["travels", "collects", "measures", "paints", "counts", "repairs", "orders", "observes"]


def corpus(rows: int, seed: int = 0) -> list[str]:
    """Distinct questions plus ~10% light rewordings (the semantic duplicates to find)."""
    rng = np.random.default_rng(seed)
    texts = []
    for i in range(rows):
        if texts and rng.random() < 0.1:
            source = texts[int(rng.integers(len(texts)))]
            texts.append(source.replace("How many items does", "What count of items does"))
        else:
            s, v = rng.choice(SUBJECTS), rng.choice(VERBS)
            texts.append(f"How many items does the {s} number {i} that {v} {int(rng.integers(2, 999))} things "
                         f"per day handle after {int(rng.integers(2, 60))} days?")
    return texts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=3000)
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()
    texts = corpus(args.rows)
    sem = SemanticConfig(batch_size=args.batch_size, threshold=0.95)
    load_model(sem)
    encode(texts[:64], sem)                      # warm-up outside both timings

    with tempfile.TemporaryDirectory() as home:
        wh = Warehouse(home)
        store_records(wh, [RawRecord("bench", i + 1, data={"prompt": t, "answer": "1", "domain": "logic"})
                           for i, t in enumerate(texts)], "bench")
        cfg = CurateConfig(semantic=sem, decontam=DecontamConfig(embedding=False), chunk_rows=args.rows)
        blocks, _ = curate_blocks(wh, cfg, LocalMapper(), wh.read("benchmarks", default_empty=True),
                                  wh.read("decontam_benchmarks", default_empty=True))
        block = {b.name: b for b in blocks}
        state = CurationState("bench", wh.read("prompts"), get_spec("sft_pool").empty(), cfg)
        for name in ("filter", "exact", "minhash"):
            state.apply(block[name].run(state.view()))
        view = state.view()
        set_aside = set(view.clusters.provisional_removals())
        entering = [view.prompts[n] for n in view.unit_heads().tolist() if n not in set_aside]

        t0 = time.perf_counter()
        encode(entering, sem)
        bare = time.perf_counter() - t0
        t0 = time.perf_counter()
        state.apply(block["semantic"].run(state.view()))
        state.apply(block["keep"].run(state.view()))   # the keep decision per duplicate cluster is part of the cost
        stage_s = time.perf_counter() - t0
    stage = state.stages["curate.semantic"]
    print(f"rows={args.rows} entering semantic={stage.rows_in} removed={stage.removed_total} "
          f"encoded={state.counters['encoded']}")
    print(f"bare encode: {bare:.1f}s ({len(entering) / bare:.0f} rows/s)   semantic stage: {stage_s:.1f}s")
    print(f"ratio semantic_dedup/encode = {stage_s / bare:.3f}  (target <= 1.15)")


if __name__ == "__main__":
    main()
