"""The references flow end to end on a real tiny local model, and prompt selection rules."""
import json
import math
import shutil

import numpy as np
import polars as pl
import pytest
from mlflow.tracking import MlflowClient

from tasks.genrm.config import LengthBiasConfig, PromptSelection, ReferencesConfig
from tasks.genrm.length_bias import LengthBiasMonitor
from tasks.genrm.references import ReferencesReport, select_open_prompts
from tasks.genrm.swiss import Standing, final_ranking
from tasks.ingest import content_hash
from tasks.rollout.tiny_model import TINY_LLAMA_NAME, build_tiny_llama

OPEN = [
    ("g1", "general", "Explain why the sky is blue in two sentences.", None, None),
    ("g2", "general", "Give three tips for writing clear emails.", "Be brief, lead with the ask, proofread.", None),
    ("i1", "instruction", "Name a fruit. Answer in lowercase, at most 3 words, and mention apple.", None,
     {"constraints": {"max_words": 3, "required_words": ["apple"], "format": "lowercase"}}),
]
MATH = [("m1", "What is 2 + 3?", "5"), ("m2", "What is 7 * 6?", "42"), ("m3", "What is 10 - 4?", "6")]


def prompt_rows():
    rows = [{"id": i, "source": "test", "domain": d, "prompt": p, "solution": s,
             "metadata": json.dumps(m) if m else None} for i, d, p, s, m in OPEN]
    rows += [{"id": i, "source": "test", "domain": "math", "prompt": p, "answer": a} for i, p, a in MATH]
    return [{**r, "content_hash": content_hash(r["prompt"], r.get("answer"))} for r in rows]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("genrm-models") / TINY_LLAMA_NAME)


@pytest.fixture
def seeded_home(wh, home, tiny_model_dir, tmp_path, monkeypatch):
    # a random tiny Llama judges here (the profile's judge stage is the default run's to train):
    # place the shared build where that alias looks
    shutil.copytree(tiny_model_dir, home / "models" / TINY_LLAMA_NAME)
    monkeypatch.setenv("POSTTRAIN__REFERENCES__JUDGE__ROLLOUT__MODEL", TINY_LLAMA_NAME)
    # held-out synthetic judge items are the default run's to measure (test_pipeline_e2e)
    monkeypatch.setenv("POSTTRAIN__REFERENCES__VALIDATION__SYNTHETIC_ITEMS", "0")
    wh.write("prompts", pl.DataFrame(prompt_rows()))
    labels = tmp_path / "my_labels.jsonl"
    labels.write_text(
        json.dumps({"prompt": "Capital of France?", "first": "Lyon", "second": "Paris", "label": "second"}) + "\n"
        + json.dumps({"prompt": "2+2?", "ground_truth": "4", "response": "\\boxed{4}", "label": True}) + "\n"
        + json.dumps({"prompt": "no label here", "first": "a", "second": "b"}) + "\n"
        + "{not json\n")
    return wh, labels


def test_references_flow_end_to_end_on_a_tiny_local_model(seeded_home, home):
    from flows.references import length_bias_trigger, references_flow

    wh, labels = seeded_home
    result = references_flow(profile="tiny", home=str(home), prompts=["Write a haiku about rain."],
                             labelled_files=[str(labels)])

    # one reference per open prompt (3 from the table, 1 passed by the user)
    refs = wh.read("references")
    assert refs.height == result["references"] == 4
    assert set(refs["prompt_id"]) >= {"g1", "g2", "i1"} and "m1" not in set(refs["prompt_id"])
    standings = wh.read("tournaments")
    matches = wh.read("swiss_matches")
    judgments = wh.read("judgments")
    for ref in refs.iter_rows(named=True):
        table = standings.filter(pl.col("prompt_id") == ref["prompt_id"]).sort("rank")
        assert table.height == ref["n_candidates"] >= 2
        assert table["candidate_id"][0] == ref["candidate_id"] and table["text"][0] == ref["reference"]
        assert ref["rounds_played"] == math.ceil(math.log2(ref["n_candidates"]))
        # the stored games replay to the same winner under the stated ranking rule
        games = matches.filter(pl.col("prompt_id") == ref["prompt_id"])
        replay = {c: Standing(c, s) for c, s in zip(table["candidate_id"], table["seed"])}
        for g in games.iter_rows(named=True):
            replay[g["first_id"]].points += g["points_first"]
            if g["second_id"] is not None:
                replay[g["second_id"]].points += g["points_second"]
                replay[g["first_id"]].opponents.append(g["second_id"])
                replay[g["second_id"]].opponents.append(g["first_id"])
                replay[g["first_id"]].wins += g["verdict"] == -1
                replay[g["second_id"]].wins += g["verdict"] == 1
            else:
                replay[g["first_id"]].wins += 1
        assert final_ranking(list(replay.values()))[0].candidate == ref["candidate_id"]
        played = [frozenset((g["first_id"], g["second_id"])) for g in games.iter_rows(named=True) if g["second_id"]]
        assert len(played) == len(set(played))
    # every model-judged game has 2 orders x 2 blind samples on record, parsed or not
    model_games = matches.filter(~pl.col("status").is_in(["bye", "rule"]))
    swiss_judgments = judgments.filter(pl.col("context") == "swiss")
    assert swiss_judgments.height == 4 * model_games.height > 0
    assert set(swiss_judgments["parse_status"]) <= {"ok", "unparseable", "out_of_range"}
    assert (swiss_judgments["parse_status"] != "ok").sum() > 0           # a random model writes garbage
    assert swiss_judgments.filter(pl.col("parse_status") != "ok")["verdict"].null_count() == \
        (swiss_judgments["parse_status"] != "ok").sum()
    assert result["judge_samples"] == swiss_judgments.height

    # validation: math-derived items + the two good user rows; two bad rows quarantined
    bench = wh.read("judge_benchmark")
    assert bench.filter(pl.col("origin") == "math_perturbed").height == 9
    assert bench.filter(pl.col("origin") == "my_labels").height == 2
    quarantine = wh.read("quarantine")
    assert sorted(quarantine["line"].to_list()) == [3, 4] and set(quarantine["file"]) == {str(labels)}
    assert set(judgments["context"]) == {"swiss", "benchmark", "bon"}

    run = MlflowClient().get_run(result["mlflow_run_id"])
    metrics = run.data.metrics
    for key in ("references.references", "references.games", "references.unparseable_share",
                "genrm.accuracy", "genrm.pairwise_accuracy", "genrm.grade_accuracy",
                "genrm.bon_accuracy", "genrm.pass_at_n", "genrm.bon_gap"):
        assert key in metrics, key
    # Best-of-N graded each of its N candidates on each of the first bon_prompts math prompts
    bon = judgments.filter(pl.col("context") == "bon")
    assert (metrics["genrm.bon_prompts"], metrics["genrm.bon_n"]) == (2, 4)
    assert dict(bon.group_by("prompt_id").agg(pl.col("first_id").n_unique()).iter_rows()) == {"m1": 4, "m2": 4}
    assert metrics["genrm.bon_gap"] == pytest.approx(metrics["genrm.pass_at_n"] - metrics["genrm.bon_accuracy"])
    # accuracy is over every benchmark item, pairwise and grade weighted by their counts, and an
    # item none of whose judge samples parsed counts as wrong: at most the share of items with one
    counts = {kind: metrics[f"genrm.{kind}_items"] for kind in ("pairwise", "grade")}
    assert counts == {kind: float((bench["kind"] == kind).sum()) for kind in counts} and sum(counts.values()) == 11
    assert metrics["genrm.accuracy"] == pytest.approx(
        sum(metrics[f"genrm.{kind}_accuracy"] * n for kind, n in counts.items()) / bench.height)
    read = judgments.filter((pl.col("context") == "benchmark") & (pl.col("parse_status") == "ok"))
    assert metrics["genrm.accuracy"] <= read.select("kind", "prompt_id").unique().height / bench.height
    assert {d.dataset.name.split("@")[0] for d in run.inputs.dataset_inputs} >= {
        "prompts", "references", "tournaments", "swiss_matches", "judgments", "judge_benchmark"}

    # the length-bias monitor triggers the recalibration flow on a biased reward stream
    rng = np.random.default_rng(0)
    monitor = LengthBiasMonitor(LengthBiasConfig(threshold=0.3, window_steps=3, min_group_size=16),
                                on_event=length_bias_trigger(profile="tiny", home=str(home)))
    for _ in range(3):
        lengths = rng.lognormal(6, 0.5, 64)
        correct = (rng.random(64) < 0.5).astype(float)
        z = (np.log(lengths) - 6) / 0.5
        rewards = np.clip(0.5 * correct + 0.25 + 0.08 * z + rng.normal(0, 0.05, 64), 0, 1)
        monitor.update(rewards, lengths, correct)
    assert monitor.events
    calibration = wh.read("judge_calibrations")
    assert calibration.height == 1
    row = calibration.row(0, named=True)
    assert row["slope"] > 0 and abs(row["statistic_after"]) < row["threshold"] < row["statistic"]
    assert row["judge_accuracy"] is not None


def test_open_prompts_prefer_sft_pool_then_prompts_and_add_user_prompts(wh):
    report = ReferencesReport()
    wh.write("prompts", pl.DataFrame(prompt_rows()))
    selection = PromptSelection(max_prompts=2)
    chosen = select_open_prompts(wh, selection, ["extra one", {"prompt": "extra two", "constraints": {"max_words": 2}}],
                                 report)
    assert [p.source_table for p in chosen] == ["prompts", "prompts", "user", "user"]
    assert [p.prompt_id for p in chosen[:2]] == ["g1", "g2"]
    assert chosen[3].constraints is not None and chosen[3].constraints.max_words == 2
    wh.write("sft_pool", pl.DataFrame({
        "id": ["s1", "s2"], "source": "test", "domain": ["instruction", "math"], "prompt": ["Say hi.", "1+1?"],
        "metadata": ['{"constraints": {"max_words": "many"}}', None], "content_hash": ["h1", "h2"],
        "text_hash": ["t1", "t2"], "cluster_id": ["c1", "c2"], "pool": "sft", "verifiable": [False, True]}))
    chosen = select_open_prompts(wh, selection, None, report)
    assert [(p.prompt_id, p.source_table) for p in chosen] == [("s1", "sft_pool")]
    assert chosen[0].constraints is None and report.bad_constraints == 1   # bad rules are skipped, counted
    with pytest.raises(ValueError, match="non-empty 'prompt'"):
        select_open_prompts(wh, selection, [{"prompt": "  "}], report)


def test_config_rejects_inconsistent_settings():
    with pytest.raises(ValueError, match="grade_rewards"):
        ReferencesConfig(judge={"grade_rewards": {1: 0.0, 2: 1.0}})
    with pytest.raises(ValueError, match="needs a 'rollout'"):
        ReferencesConfig(candidates=[{"name": "p", "kind": "backend"}])
    with pytest.raises(ValueError, match="unique"):
        ReferencesConfig(candidates=[{"name": "s", "kind": "stored"}, {"name": "s", "kind": "stored"}])


def test_current_references_takes_each_prompts_latest_run(wh):
    from tasks.genrm.references import current_references

    assert current_references(wh).height == 0
    base = {"source_table": "prompts", "prompt": "p", "n_candidates": 2, "rounds_played": 1,
            "decided_by": "points", "judge_model": "m", "candidate_source": "policy", "candidate_id": "policy:0"}
    wh.append("references", pl.DataFrame([{**base, "prompt_id": "a", "run_id": "r1", "reference": "old"},
                                          {**base, "prompt_id": "b", "run_id": "r1", "reference": "kept"}]))
    wh.append("references", pl.DataFrame([{**base, "prompt_id": "a", "run_id": "r2", "reference": "new"}]))
    assert current_references(wh).select("prompt_id", "reference").rows() == [("a", "new"), ("b", "kept")]


def test_the_judge_benchmark_reads_the_prompt_snapshot_it_was_handed(wh):
    """The pipeline hands the references flow the snapshot curate read; a later ingest (a newer
    ``prompts`` snapshot) must not change the judge benchmark built from it, and the benchmark
    records the snapshot it read as its parent. Without ``sources`` the newest is read."""
    from tasks.genrm.validation import build_judge_benchmark

    cfg = ReferencesConfig.model_validate({"validation": {"math_items": 10, "synthetic_items": 0}})
    handed = wh.write("prompts", pl.DataFrame(prompt_rows()))
    later = [{"id": "m9", "source": "test", "domain": "math", "prompt": "What is 9 + 9?", "answer": "18"}]
    newest = wh.write("prompts", pl.DataFrame([{**r, "content_hash": content_hash(r["prompt"], r["answer"])}
                                              for r in later]))
    assert newest.snapshot != handed.snapshot

    pinned, _ = build_judge_benchmark(wh, cfg, sources={"prompts": handed})
    items = wh.read_ref(pinned)
    assert set(items["source_id"]) == {"m1", "m2", "m3"}
    assert [str(p) for p in wh.parents(pinned.name, pinned.snapshot)] == [str(handed)]

    unpinned, _ = build_judge_benchmark(wh, cfg)
    assert set(wh.read_ref(unpinned)["source_id"]) == {"m9"}
    assert [str(p) for p in wh.parents(unpinned.name, unpinned.snapshot)] == [str(newest)]
