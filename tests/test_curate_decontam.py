"""Decontamination: n-gram (any / coverage, short items) and embedding, new benchmarks re-check pools."""
from __future__ import annotations

import polars as pl
import pytest

from tasks.curate.config import CurateConfig, DecontamConfig, SemanticConfig
from tasks.curate.decontaminate import benchmark_grams, ngram_contamination, ngram_overlaps
from tasks.curate.pipeline import run_curate
from tasks.ingest import store_records
from tasks.records import RawRecord
from tasks.text import normalize_texts

LONG_ITEM = ("Let p be the probability that in the process of repeatedly flipping a fair coin one will encounter "
             "a run of five heads before one encounters a run of two tails")


def grams(items, n=13):
    return benchmark_grams([f"bench:{i}" for i in range(len(items))], normalize_texts(items), n)


def test_any_shared_ngram_and_coverage_are_both_reported():
    bench = grams([LONG_ITEM])
    half = " ".join(LONG_ITEM.split()[:16])
    rows = normalize_texts([f"Consider this: {half}. Compute the answer.", LONG_ITEM + " Find p.", "unrelated text"])
    ov = ngram_overlaps(rows, bench)
    by_row = {r["row"]: r for r in ov.iter_rows(named=True)}
    assert set(by_row) == {0, 1}
    assert by_row[1]["coverage"] == 1.0 and 0 < by_row[0]["coverage"] < 0.5 and by_row[0]["shared"] >= 1
    anyrule = ngram_contamination(ov, bench, DecontamConfig(ngram_rule="any"))
    assert anyrule.row.tolist() == [0, 1] and anyrule.reference == ["bench:0", "bench:0"]
    cover = ngram_contamination(ov, bench, DecontamConfig(ngram_rule="coverage", min_coverage=0.5))
    assert cover.row.tolist() == [1]


def test_items_shorter_than_n_match_whole():
    bench = grams(["Compute 17 times 23."])
    ov = ngram_overlaps(normalize_texts(["Please compute 17 times 23 and explain.", "Compute 17 times 24."]), bench)
    assert ov["row"].to_list() == [0] and ov["coverage"][0] == 1.0


def _add(wh, rows, source, kind="prompts"):
    recs = [RawRecord(f"{source}.jsonl", i + 1, data=r) for i, r in enumerate(rows)]
    return store_records(wh, recs, source, kind=kind)


@pytest.fixture(scope="module")
def cfg():
    sem = SemanticConfig(threshold=0.97)
    from tasks.curate.semantic import load_model
    load_model(sem)
    return CurateConfig(semantic=sem, decontam=DecontamConfig(ngram=13, embedding_threshold=0.9))


def test_decontamination_names_the_benchmark_item(wh, cfg):
    _add(wh, [{"item_id": "q1", "prompt": LONG_ITEM + ". Find p as a fraction.", "answer": "3/34", "domain": "math"},
              {"item_id": "q2", "prompt": "How many positive divisors does the number 3600 have in total?",
               "answer": "45", "domain": "math"}], "aime_test", kind="benchmarks")
    _add(wh, [{"prompt": "Here is a classic: " + LONG_ITEM + ". Give p.", "answer": "3/34", "domain": "math"},
              {"prompt": "How many positive divisors does 3600 have in total?", "answer": "45", "domain": "math"},
              {"prompt": "Compute the remainder when 2 to the power 100 is divided by 7.", "answer": "2",
               "domain": "math"}], "train")
    res = run_curate(wh, cfg)
    d = wh.read("decisions").filter(pl.col("stage") == "curate.decontam").sort("reason")
    assert d["reference_id"].to_list() == ["aime_test:q2", "aime_test:q1"]
    assert d["reason"].to_list() == ["embedding_similarity", "ngram_overlap:any_13gram"]
    assert d["score"][0] >= 0.9 and d["score"][1] > 0.5
    assert res.stages["curate.decontam"].rows_in == 3 and res.stages["curate.decontam"].kept == 1


def test_new_benchmark_rechecks_existing_pools(wh, cfg):
    _add(wh, [{"item_id": "h1", "prompt": "What is the sum of the first one hundred positive integers?",
               "answer": "5050", "domain": "math"}], "bench_a", kind="benchmarks")
    _add(wh, [{"prompt": LONG_ITEM + ". What is p?", "answer": "3/34", "domain": "math"},
              {"prompt": "Compute the remainder when 2 to the power 100 is divided by 7.", "answer": "2",
               "domain": "math"}], "train")
    first = run_curate(wh, cfg)
    assert first.counters["sft_pool"] + first.counters["rl_pool"] == 2
    # a user ingests a new benchmark that contains one pool row's question
    _add(wh, [{"item_id": "u1", "prompt": LONG_ITEM, "answer": "3/34", "domain": "math"}], "user_bench",
         kind="benchmarks")
    second = run_curate(wh, cfg)
    assert second.counters["rows_new"] == 0 and second.counters["encoded"] == 0
    assert second.counters["encoded_benchmarks"] == 1 and second.counters["benchmark_items_new"] == 1
    d = wh.read("decisions").filter(pl.col("run_id") == second.run_id)
    assert d["reference_id"].to_list() == ["user_bench:u1"]
    assert second.counters["sft_pool"] + second.counters["rl_pool"] == 1
