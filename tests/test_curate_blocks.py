"""Curate as blocks: each block returns what it decided, the runner applies and accounts.

Real blocks on a real warehouse (semantic dedup off, so no model is needed), driven one by
one the way ``run_curate`` drives them; plus two hand-written blocks that break the
contract (counts that disagree with decisions, a row removed twice), which the runner
must refuse.
"""
from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from data_specs import get_spec
from tasks.curate import dedup as dd
from tasks.curate.accounting import StageCount
from tasks.curate.block import BlockResult, CurationView, Decision
from tasks.curate.blocks import DecontamResult, FilterResult, SplitResult
from tasks.curate.config import CurateConfig, DecontamConfig, MinHashConfig, SemanticConfig
from tasks.curate.filters import answer_parses
from tasks.curate.parallel import LocalMapper
from tasks.curate.pipeline import CurationState, curate_blocks, run_curate
from tasks.ingest import store_records
from tasks.records import RawRecord

BASE = ("A shop sells notebooks for 3 dollars each and pens for 2 dollars each. On Monday the shop sold 40 "
        "items and collected 100 dollars in total from those sales. How many notebooks did it sell on Monday?")
BENCH_ITEM = "How many positive divisors does the number 3600 have, counting 1 and the number itself?"
PROMPTS = [
    {"prompt": BASE, "answer": "20", "domain": "math"},
    {"prompt": BASE.upper(), "answer": "20", "domain": "math"},                              # exact duplicate
    {"prompt": BASE + " Show your work.", "answer": "20", "domain": "math"},                # near duplicate
    {"prompt": "Prove that there are infinitely many primes of the form 4k + 3.", "answer": "0", "domain": "math"},
    {"prompt": "Is 91 a prime number, given that it is odd?", "answer": "No", "domain": "math"},
    {"prompt": "Here is one: " + BENCH_ITEM, "answer": "45", "domain": "math"},            # contaminated
    {"prompt": "Spell this word backward (example: sun -> nus): harbor", "answer": "robrah", "domain": "logic"},
    {"prompt": "Write a short poem about the sea and the colour of its waves.", "answer": "Waves.",
     "domain": "general"},
]
CFG = CurateConfig(minhash=MinHashConfig(threshold=0.7), semantic=SemanticConfig(enabled=False),
                   decontam=DecontamConfig(embedding=False), chunk_rows=3)


def _ingest(wh):
    store_records(wh, [RawRecord("p.jsonl", i + 1, data=r) for i, r in enumerate(PROMPTS)], "unit")
    store_records(wh, [RawRecord("b.jsonl", 1, data={"item_id": "q1", "prompt": BENCH_ITEM, "answer": "45",
                                                      "domain": "math"})], "tinybench", kind="benchmarks")


def _blocks_and_state(wh):
    blocks, _ = curate_blocks(wh, CFG, LocalMapper(), wh.read("benchmarks"),
                              pl.DataFrame(schema={"benchmark": pl.Utf8, "item_id": pl.Utf8, "text_hash": pl.Utf8}))
    return blocks, CurationState("r", wh.read("prompts"), get_spec("sft_pool").empty(), CFG)


def test_each_block_returns_its_decisions_and_the_runner_accounts_for_every_row(wh):
    _ingest(wh)
    blocks, state = _blocks_and_state(wh)
    assert [b.name for b in blocks] == ["filter", "exact", "minhash", "keep", "decontaminate", "split"]
    results = {}
    for block in blocks:
        view = state.view()
        with pytest.raises(ValueError):
            view.removed[:] = True                     # blocks read the run's state, never write it
        results[block.name] = state.apply(block.run(view))
    # the dedup blocks only link; the keep block removes, once per cluster
    assert not results["exact"].decisions and [x.kind for x in results["exact"].links] == [dd.EXACT]
    assert not results["minhash"].decisions and results["minhash"].counters["minhash.links"] >= 1
    assert {d.reason for d in results["keep"].decisions} == {"exact_duplicate", "near_duplicate_minhash"}
    assert [d.reference_id for d in results["decontaminate"].decisions] == ["tinybench:q1"]
    assert isinstance(results["filter"], FilterResult) and isinstance(results["split"], SplitResult)
    assert isinstance(results["decontaminate"], DecontamResult)
    state.check_every_row(results["split"].pool)
    removed = state.log.frame().filter(pl.col("decision") == "removed")
    kept = [p for p in results["split"].pool if p]
    assert len(PROMPTS) == len(kept) + removed.height and removed["row_id"].is_unique().all()


def test_run_curate_steps_through_the_blocks_in_order_and_matches_them(wh):
    _ingest(wh)
    seen = []

    def step(name, fn):
        seen.append(name)
        return fn()

    res = run_curate(wh, CFG, run_id="r", step=step)
    assert seen == ["filter", "exact", "minhash", "keep", "decontaminate", "split"]
    assert list(res.stages) == ["curate.filter", "curate.exact", "curate.minhash", "curate.semantic",
                                "curate.decontam", "curate.split"]
    d = wh.read("decisions").filter(pl.col("decision") == "removed")
    for stage in res.stages.values():
        assert stage.removed_total == d.filter(pl.col("stage") == stage.stage).height
    assert res.counters["removed"] == d.height == len(PROMPTS) - res.counters["sft_pool"] - res.counters["rl_pool"]
    assert res.counters["exact.rows_joined"] == 1 and res.counters["minhash.links"] >= 1


class MiscountingBlock:
    """Removes a row but reports no removal in its counts."""
    name = "miscount"

    def run(self, rows: CurationView) -> BlockResult:
        node = int(rows.live_new()[0])
        return BlockResult([StageCount("curate.miscount", rows_in=1, kept=1)],
                           [Decision(rows.node_ids[node], "curate.miscount", "because")])


class RemovingTwiceBlock:
    """Removes the first live row, by id, twice over two results."""
    name = "twice"

    def run(self, rows: CurationView) -> BlockResult:
        row_id = rows.node_ids[int(np.flatnonzero(~rows.removed)[0])]
        count = StageCount("curate.twice", rows_in=1)
        count.removed["because"] = 1
        return BlockResult([count], [Decision(row_id, "curate.twice", "because")])


def test_the_runner_refuses_counts_that_disagree_and_rows_removed_twice(wh):
    _ingest(wh)
    blocks, state = _blocks_and_state(wh)
    state.apply(blocks[0].run(state.view()))          # filter: the node space exists now
    with pytest.raises(RuntimeError, match="disagree with decisions"):
        state.apply(MiscountingBlock().run(state.view()))
    twice = RemovingTwiceBlock()
    result = twice.run(state.view())
    state.apply(result)
    with pytest.raises(RuntimeError, match="removed a second time"):
        state.apply(result)


def test_plain_numbers_skip_the_latex_parse_and_agree_with_it():
    from tasks.verify.math import parse_math_answer
    numbers = ["0", "7", "-3", "+12", "0042", "3.25", "-0.5", "123456789012345"]
    assert all(answer_parses(n) for n in numbers)
    assert all(parse_math_answer(n) for n in numbers)
    assert not answer_parses("twelve apples")


OPEN_PROMPT = {"prompt": "Write three bullet points about keeping bees in a city garden.", "domain": "instruction"}


def test_an_open_prompt_without_an_answer_reaches_rl_with_open_to_rl(wh):
    # M1's tasks without answers survive curation and, with open_to_rl, reach the RL side
    _ingest(wh)
    store_records(wh, [RawRecord("open.jsonl", 1, data=OPEN_PROMPT)], "open")
    cfg = CFG.model_copy(update={"split": CFG.split.model_copy(update={"rl_fraction": 0.0, "open_to_rl": 1.0})})
    res = run_curate(wh, cfg, run_id="r")
    rl, sft = wh.read("rl_pool"), wh.read("sft_pool")
    open_rows = rl.filter(pl.col("domain").is_in(["general", "instruction"]))
    assert sorted(open_rows["domain"].to_list()) == ["general", "instruction"]
    assert open_rows.filter(pl.col("domain") == "instruction")["answer"].to_list() == [None]
    assert rl.height == 2 and not sft["domain"].is_in(["general", "instruction"]).any()   # rl_fraction 0
    removed = wh.read("decisions").filter(pl.col("decision") == "removed")
    assert len(PROMPTS) + 1 == rl.height + sft.height + removed.height == res.counters["rl_pool"] \
        + res.counters["sft_pool"] + res.counters["removed"]
