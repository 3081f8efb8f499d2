"""Exact, MinHash and semantic dedup; keep rule, references, incremental re-runs."""
from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from datasketch import MinHash

from tasks.curate.config import CurateConfig, MinHashConfig, SemanticConfig
from tasks.curate.minhash import (
    banding_for,
    minhash_signatures,
    near_duplicate_edges,
    optimal_banding,
    signatures_from_bytes,
    signatures_to_bytes,
)
from tasks.curate.normalize import tokenize
from tasks.curate.pipeline import run_curate
from tasks.curate.semantic import neighbours_above
from tasks.ingest import store_records
from tasks.records import RawRecord
from tasks.text import normalize_texts

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi", "omega", "apple", "river", "stone", "cloud", "maple", "ember", "frost", "harbor", "island", "jungle"]


def sentence(rng, n=40):
    return " ".join(rng.choice(WORDS, size=n))


def add_prompts(wh, rows, source="unit"):
    recs = [RawRecord("test.jsonl", i + 1, data=r) for i, r in enumerate(rows)]
    return store_records(wh, recs, source, kind="prompts")


def test_normalization_folds_unicode_case_space_punctuation():
    assert normalize_texts(["Ｆｉｎｄ  X, please!", "find x please"]) == ["find x please"] * 2


def test_signatures_estimate_jaccard_like_datasketch():
    rng = np.random.default_rng(0)
    base = sentence(rng, 200).split()
    variant = base[:150] + list(rng.choice(WORDS, size=50))
    docs = [" ".join(base), " ".join(variant)]
    cfg = MinHashConfig(num_perm=256, ngram=5)
    sig = minhash_signatures(docs, cfg)
    ours = float((sig[0] == sig[1]).mean())
    sets = [{" ".join(d.split()[i:i + 5]) for i in range(len(d.split()) - 4)} for d in docs]
    exact = len(sets[0] & sets[1]) / len(sets[0] | sets[1])
    theirs = []
    for s in sets:
        m = MinHash(num_perm=256, seed=3)
        m.update_batch([x.encode() for x in s])
        theirs.append(m)
    assert abs(ours - exact) < 0.08 and abs(theirs[0].jaccard(theirs[1]) - exact) < 0.08
    assert np.array_equal(signatures_from_bytes(signatures_to_bytes(sig), 256), sig)


def test_banding_derived_from_threshold_matches_datasketch():
    from datasketch.lsh import _optimal_param
    assert (optimal_banding(0.8, 112).bands, optimal_banding(0.8, 112).rows) == _optimal_param(0.8, 112, 0.5, 0.5)
    assert banding_for(MinHashConfig(bands=14, rows_per_band=8)).bands == 14


def test_lsh_finds_planted_near_duplicates_only():
    rng = np.random.default_rng(1)
    originals = [sentence(rng, 60) for _ in range(40)]
    near = [" ".join(o.split()[:-2] + ["zzz", "yyy"]) for o in originals[:10]]   # J ~ 0.85
    sig = minhash_signatures(normalize_texts(originals + near), MinHashConfig(threshold=0.7))
    found = near_duplicate_edges(sig, MinHashConfig(threshold=0.7))
    pairs = {tuple(p) for p in found.pairs.tolist()}
    assert pairs == {(i, 40 + i) for i in range(10)}
    assert (found.jaccard >= 0.7).all()


def test_short_documents_are_one_shingle():
    t = tokenize(normalize_texts(["two words", ""]))
    assert t.lengths.tolist() == [2, 0]
    sig = minhash_signatures(normalize_texts(["two words", "two words", ""]), MinHashConfig())
    assert (sig[0] == sig[1]).all() and (sig[2] == np.uint32(0xFFFFFFFF)).all()


def test_blocked_neighbour_search_matches_brute_force():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(300, 16)).astype(np.float32)
    x[150:160] = x[:10] + 0.01 * rng.normal(size=(10, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    nb = neighbours_above(x, x, 0.95, block_rows=37, earlier_only=True)
    sims = x @ x.T
    want = {(i, j) for i in range(300) for j in range(i) if sims[i, j] >= 0.95}
    assert set(zip(nb.query.tolist(), nb.target.tolist())) == want and len(want) >= 10
    assert np.allclose(nb.best[1:], [sims[i, :i].max() for i in range(1, 300)], atol=1e-5)


@pytest.fixture(scope="module")
def semantic_cfg():
    cfg = SemanticConfig(threshold=0.93, batch_size=16)
    from tasks.curate.semantic import load_model
    load_model(cfg)   # once per module
    return cfg


def _curate_cfg(semantic_cfg, **kw):
    return CurateConfig(semantic=semantic_cfg, minhash=MinHashConfig(threshold=0.7),
                        source_priority={"preferred": 1}, **kw)


def _dup_rows(rng):
    base = [f"Find the number of ways to arrange {sentence(rng, 25)} into {k} groups." for k in range(6)]
    return base, [
        {"prompt": base[0], "answer": "12", "domain": "math"},
        {"prompt": base[0].upper().replace(" ", "  "), "answer": "13", "domain": "math"},        # exact (normalized)
        {"prompt": base[1], "answer": "7", "domain": "math"},
        {"prompt": base[1].replace(" into ", " in exactly "), "answer": "7", "domain": "math"},  # near duplicate
        {"prompt": "What is the capital city of the country France?", "answer": "Paris", "domain": "logic"},
        {"prompt": "Which city is the capital of the country of France?", "answer": "Paris", "domain": "logic"},
        {"prompt": base[2], "answer": "3", "domain": "math"},
    ]


def test_dedup_stages_reference_and_keep_rule(wh, semantic_cfg):
    rng = np.random.default_rng(3)
    base, rows = _dup_rows(rng)
    add_prompts(wh, rows)
    # same text as base[2] but from a preferred source: the keep rule picks it
    add_prompts(wh, [{"prompt": base[2] + " ", "answer": "3", "domain": "math"}], source="preferred")
    res = run_curate(wh, _curate_cfg(semantic_cfg))
    d = wh.read("decisions")
    ids = wh.read("prompts").select("id", "prompt", "source")
    by_stage = {s: d.filter(pl.col("stage") == s) for s in ("curate.exact", "curate.minhash", "curate.semantic")}
    assert by_stage["curate.exact"].height == 2 and by_stage["curate.minhash"].height == 1
    assert by_stage["curate.semantic"].height == 1
    preferred = ids.filter(pl.col("source") == "preferred")["id"][0]
    assert preferred in by_stage["curate.exact"]["reference_id"].to_list()
    mh = by_stage["curate.minhash"].row(0, named=True)
    assert 0.7 <= mh["score"] < 1.0 and mh["reference_id"] in ids["id"].to_list()
    assert by_stage["curate.semantic"]["score"][0] >= 0.93
    for stage in res.stages.values():
        assert stage.rows_in == stage.kept + stage.removed_total
    pools = pl.concat([wh.read("sft_pool"), wh.read("rl_pool")])
    assert pools.height == res.stages["curate.split"].kept == 8 - 4
    assert set(pl.concat(by_stage.values())["reference_id"]) <= set(pools["id"])   # every match is a kept row


def test_incremental_rerun_processes_only_new_rows(wh, semantic_cfg):
    rng = np.random.default_rng(4)
    base, rows = _dup_rows(rng)
    add_prompts(wh, rows)
    first = run_curate(wh, _curate_cfg(semantic_cfg))
    assert first.counters["hashed"] == first.stages["curate.exact"].kept == 6   # exact survivors are hashed
    assert first.counters["encoded"] == first.stages["curate.semantic"].rows_in
    kept_before = first.counters["sft_pool"] + first.counters["rl_pool"]

    again = run_curate(wh, _curate_cfg(semantic_cfg))
    assert again.counters["rows_new"] == 0 and again.counters["hashed"] == 0 and again.counters["encoded"] == 0

    fresh = [{"prompt": base[3], "answer": "5", "domain": "math"},                               # new, unique
             {"prompt": base[0].replace(" into ", " in exactly "), "answer": "12", "domain": "math"},  # dup of old
             {"prompt": "What is the capital city of the country of France?", "answer": "Paris", "domain": "logic"}]
    add_prompts(wh, fresh, source="later")
    third = run_curate(wh, _curate_cfg(semantic_cfg))
    assert third.counters["rows_new"] == 3
    assert third.counters["hashed"] == 3           # old signatures came from the warehouse
    assert third.counters["encoded"] == third.stages["curate.semantic"].rows_in <= 3
    assert third.counters["encoded_benchmarks"] == 0
    d = wh.read("decisions").filter(pl.col("run_id") == third.run_id)
    old_ids = set(pl.concat([wh.read("sft_pool"), wh.read("rl_pool")])
                  .filter(pl.col("curate_run") == first.run_id)["id"])
    removed = d.filter(pl.col("decision") == "removed")
    assert removed.height == 2 and set(removed["reference_id"]) <= old_ids
    assert third.counters["sft_pool"] + third.counters["rl_pool"] == kept_before + 1
