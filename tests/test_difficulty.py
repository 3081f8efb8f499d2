"""End to end: a real tiny model samples, real verifiers (math-verify, the code sandbox)
score, pass@k bands decide, and the warehouse + MLflow record everything.

The code rows put the completion inside a string literal, so their tests decide the
outcome regardless of what the random model writes: always true (too easy), always false
(unsolved), or true for about half of the samples (kept).
"""
import polars as pl
import pytest
import torch
from mlflow.tracking import MlflowClient

from tasks.difficulty import (
    Band,
    DifficultyConfig,
    DifficultySampling,
    kept_prompt_ids,
    run_difficulty,
)
from tasks.passk import pass_at_k
from tasks.rollout.config import LocalConfig
from tasks.rollout.local import LocalBackend
from tasks.rollout.tiny_model import tiny_llama_path


def string_row(row_id: str, condition: str) -> dict:
    return {"id": row_id, "source": "test", "domain": "code", "prompt": 'text = """', "answer": None,
            "tests": f'"""\n\ndef check(candidate):\n    assert {condition}\n', "metadata": '{"entry_point": "text"}'}


POOL_FIELDS = {"content_hash": "h", "text_hash": "t", "pool": "rl", "verifiable": True}

ROWS = [
    string_row("easy", "isinstance(candidate, str)"),
    string_row("impossible", "candidate == 'never produced'"),
    string_row("coin", "len(candidate) % 2 == 0"),
    {"id": "math1", "source": "test", "domain": "math", "prompt": "What is 8 + 9?", "answer": "17",
     "tests": None, "metadata": "{}"},
    {"id": "chat1", "source": "test", "domain": "general", "prompt": "Say hello.", "answer": None,
     "tests": None, "metadata": "{}"},
]


def rl_pool() -> pl.DataFrame:
    return pl.DataFrame([row | POOL_FIELDS | {"cluster_id": row["id"]} for row in ROWS])


def synthetic_tasks() -> pl.DataFrame:
    from tasks.synth.registry import get_task, own_task_names

    name = min(own_task_names())
    task = get_task(name)
    instance = task.generate(seed=1, level=0)
    return pl.DataFrame([{
        "id": instance.id, "task": instance.task, "family": getattr(task, "family", "logic"),
        "level": instance.level, "seed": instance.seed, "prompt": instance.prompt, "question": instance.question,
        "answer": instance.answer, "metadata": instance.metadata_json(), "domain": "logic",
        "level_source": "configured", "cluster_id": instance.id, "split": "rl"}])


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    torch.set_num_threads(1)
    path = tiny_llama_path(home=tmp_path_factory.getbasetemp() / "shared-models-home")
    return LocalBackend.from_path(path, LocalConfig(batch_size=16))


def config(**overrides) -> DifficultyConfig:
    base = {
        "sampling": DifficultySampling(n=6, max_tokens=6, temperature=1.0, seed=3, repetition_window=None),
        "bands": {"math": Band(k=4, low=0.0, high=0.9), "code": Band(k=1, low=0.0, high=0.9),
               "logic": Band(k=1, low=0.0, high=0.9)},
        "use_chat_template": False, "sandbox_timeout_s": 5.0,
    }
    return DifficultyConfig(**(base | overrides))


def test_band_decisions_are_strict():
    band = Band(k=10, low=0.0, high=0.9)
    assert [band.decide(v) for v in (0.0, 0.01, 0.89, 0.9, 1.0)] == ["unsolved", "keep", "keep", "too_easy", "too_easy"]
    with pytest.raises(ValueError, match="below high"):
        Band(low=0.5, high=0.5)
    with pytest.raises(ValueError, match="needs pass@10 but sampling.n=4"):
        DifficultyConfig(sampling=DifficultySampling(n=4))


def test_difficulty_stage_writes_rollouts_difficulty_and_decisions(wh, backend):
    wh.write("rl_pool", rl_pool())
    logic = synthetic_tasks()
    wh.write("synthetic_tasks", logic)
    refs = run_difficulty(wh, config(), backend)
    assert set(refs) == {"rollouts", "difficulty", "decisions"}

    difficulty = wh.read("difficulty")
    decisions = wh.read("decisions")
    rollouts = wh.read("rollouts")
    by_id = {r["prompt_id"]: r for r in difficulty.to_dicts()}
    assert by_id["easy"]["decision"] == "too_easy" and by_id["easy"]["correct"] == 6
    assert by_id["impossible"]["decision"] == "unsolved" and by_id["impossible"]["correct"] == 0
    assert by_id["coin"]["decision"] == "keep" and 0 < by_id["coin"]["correct"] < 6
    assert by_id["math1"]["decision"] == "unsolved" and by_id["math1"]["k"] == 4
    assert by_id["chat1"]["decision"] == "unscored"
    synth = by_id[logic["id"][0]]  # a random model does not solve a synthesized puzzle
    assert (synth["source_table"], synth["domain"], synth["decision"]) == ("synthetic_tasks", "logic", "unsolved")
    for row in by_id.values():
        if row["decision"] != "unscored":
            assert row["pass_at_k"] == pytest.approx(pass_at_k(row["n"], row["correct"], row["k"]))

    # nothing is lost: rows in = rows kept + rows removed, each removal with its reason
    kept = kept_prompt_ids(wh)
    assert kept.height + decisions.height == len(ROWS) + 1
    assert dict(zip(decisions["row_id"], decisions["reason"])) == {
        "easy": "too_easy", "impossible": "unsolved", "math1": "unsolved", synth["prompt_id"]: "unsolved"}
    assert set(decisions["stage"]) == {"difficulty"}

    # every sample is stored with its reward and log-prob summary
    assert rollouts.height == 6 * 5
    coin = rollouts.filter(pl.col("prompt_id") == "coin")
    assert coin["reward"].sum() == by_id["coin"]["correct"]
    assert (rollouts["num_tokens"] == rollouts["token_ids"].list.len()).all()
    assert rollouts["logprob_sum"].is_not_null().all()

    run_id = difficulty["run_id"][0]
    artifacts = [a.path for a in MlflowClient().list_artifacts(run_id, "plots")]
    assert "plots/difficulty_pass_rates.png" in artifacts
    metrics = MlflowClient().get_run(run_id).data.metrics
    assert metrics["difficulty.rows_in"] == len(ROWS) + 1 and metrics["difficulty.keep"] == 1


def test_rerun_appends_and_row_limit_applies(wh, backend):
    wh.write("rl_pool", rl_pool())
    run_difficulty(wh, config(), backend)  # synthetic_tasks is absent here: skipped
    refs = run_difficulty(wh, config(max_rows_per_table=2, reuse=False), backend)
    # the cap samples the rows to score; the open prompt (no band) always passes, unscored, so
    # it can reach RL however many verifiable rows are capped
    assert refs["difficulty"].rows == len(ROWS) + 2 + 1
    assert wh.read("rollouts").height == 6 * 4 + 6 * 2
    second = wh.read("difficulty").tail(3)
    assert (second["decision"] == "unscored").sum() == 1 and "chat1" in second["prompt_id"].to_list()


def test_adding_prompts_to_a_decided_pool_samples_exactly_the_new_ones(wh, backend):
    """Incremental per row: a rerun after 10 prompts joined the pool samples those 10 and reuses
    every other decision (same row key), recorded again under the new run with the run that
    sampled it, removals included; a changed model or sampling setting samples everything."""
    from tasks.difficulty import decided_rows

    wh.write("rl_pool", rl_pool())
    run_difficulty(wh, config(), backend)
    first = wh.read("difficulty")
    added = [{"id": f"add{i}", "source": "test", "domain": "math", "prompt": f"What is {i} + {i}?",
              "answer": str(2 * i), "tests": None, "metadata": "{}"} for i in range(10)]
    wh.append("rl_pool", pl.DataFrame([row | POOL_FIELDS | {"cluster_id": row["id"]} for row in added]))
    before = wh.read("rollouts").height
    run_difficulty(wh, config(), backend)
    rollouts = wh.read("rollouts")
    new_rollouts = rollouts.slice(before)
    assert sorted(set(new_rollouts["prompt_id"])) == sorted(r["id"] for r in added)
    assert new_rollouts.height == 10 * 6
    difficulty = wh.read("difficulty")
    second = difficulty.filter(pl.col("run_id") == difficulty["run_id"][-1])
    assert second.height == len(ROWS) + 10            # every row decided in this run, none lost
    reused = second.filter(pl.col("reused_from").is_not_null())
    assert sorted(reused["prompt_id"]) == sorted(first.filter(pl.col("decision") != "unscored")["prompt_id"])
    assert set(reused["reused_from"]) == set(first["run_id"])
    same = dict(zip(first["prompt_id"], first["decision"]))
    assert all(same[r["prompt_id"]] == r["decision"] for r in reused.iter_rows(named=True))
    # the run's removals are its own decisions rows, reused or sampled
    removed = wh.read("decisions").filter(pl.col("run_id") == second["run_id"][0])
    assert sorted(removed["row_id"]) == sorted(second.filter(~pl.col("decision").is_in(["keep", "unscored"]))["prompt_id"])
    # a decision depends on its sampling: another seed decides every scored row again
    keys = set(decided_rows(wh))
    run_difficulty(wh, config(sampling=DifficultySampling(n=6, max_tokens=6, temperature=1.0, seed=4,
                                                         repetition_window=None)), backend)
    assert wh.read("rollouts").height == rollouts.height + (len(ROWS) - 1 + 10) * 6
    assert not keys & {r for r in wh.read("difficulty").tail(len(ROWS) + 10)["row_key"].to_list() if r}
    # and on the model's weights: a checkpoint rewritten at the same path (a stage trained again)
    # is another model, so its rows are sampled again
    import os
    from pathlib import Path

    weights = max(Path(backend.model_name).rglob("*.safetensors"))
    stat = weights.stat()
    height = wh.read("rollouts").height
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    run_difficulty(wh, config(), backend)
    assert wh.read("rollouts").height == height + (len(ROWS) - 1 + 10) * 6


def test_band_is_on_the_pass_rate_not_on_pass_at_k(wh, backend):
    """M1 keeps 0 < rate < 0.9: a prompt solved by a few of 16 samples is kept, though its
    unbiased pass@10 is near 1 (3 of 16 correct gives pass@10 = 0.964)."""
    assert pass_at_k(16, 3, 10) == pytest.approx(0.964, abs=1e-3)
    wh.write("rl_pool", rl_pool().filter(pl.col("id") == "coin"))
    sampling = DifficultySampling(n=16, max_tokens=6, temperature=1.0, seed=3, repetition_window=None)
    run_difficulty(wh, config(sampling=sampling, bands={"code": Band(k=10, low=0.0, high=0.9)}), backend)
    row = wh.read("difficulty").row(0, named=True)
    assert 0 < row["correct"] < 0.9 * 16 and row["pass_at_k"] >= 0.9      # pass@10 alone would call it too easy
    assert row["decision"] == "keep" and row["pass_at_1"] == row["correct"] / 16


def test_only_rl_side_synthetic_instances_are_sampled(wh, backend):
    both = pl.concat([synthetic_tasks().with_columns(pl.lit("sft").alias("split")),
                      synthetic_tasks().with_columns(pl.lit("other").alias("id"), pl.lit("other").alias("cluster_id"))])
    wh.write("synthetic_tasks", both)
    run_difficulty(wh, config(), backend, tables=("synthetic_tasks",))
    assert wh.read("difficulty")["prompt_id"].to_list() == ["other"]
