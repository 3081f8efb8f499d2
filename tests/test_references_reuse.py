"""References incremental per row: a finished home given 10 new prompts samples and plays exactly
those 10; a changed prompt, judge or candidate model plays again.

The candidate model and the judge are scripted backends (test fakes of a RolloutBackend that
record what they were asked): the point is which prompts reach them, not what they answer.
"""
import re

import polars as pl
from scripted import ScriptedBackend

from tasks.genrm.config import ReferencesConfig
from tasks.genrm.references import current_references, run_references
from tasks.ingest import content_hash
from tasks.rollout.base import Completion


class RecordingPolicy:
    """Test fake of a candidate backend: two answers per prompt, every prompt it sampled recorded."""

    name = "scripted-policy"

    def __init__(self, model_name: str = "policy-v1"):
        self.model_name = model_name
        self.prompts: list[str] = []

    def format_chat(self, messages):
        return messages[-1]["content"]

    def generate(self, prompts, params):
        self.prompts += prompts
        return [[Completion(f"answer {i} to {p[-12:]}") for i in range(params.n)] for p in prompts]


def recording_judge(model_name: str) -> ScriptedBackend:
    """A scripted judge: Answer 2 wins every game."""
    return ScriptedBackend(lambda prompt: "[[1]]", model_name)


def open_rows(ids):
    return [{"id": f"g{i:02d}", "source": "test", "domain": "general", "prompt": f"Write a line about topic {i}.",
             "solution": f"A line about topic {i}."} for i in ids]


def write_prompts(wh, rows):
    wh.write("prompts", pl.DataFrame([{**r, "content_hash": content_hash(r["prompt"], None)} for r in rows]))


CFG = ReferencesConfig(
    judge={"consistency": {"blind_samples": 1}},
    candidates=[{"name": "stored", "kind": "stored"},
                {"name": "policy", "kind": "backend", "rollout": {"n": 2, "max_tokens": 8, "repetition_window": None}}],
    prompts={"tables": ["prompts"]}, validation={"enabled": False})


def asked(backend, ids):
    """The prompts of ``ids`` the backend was given (by their topic number in the text)."""
    return {i for i in ids if any(re.search(rf"topic {i}\b", p) for p in backend.prompts)}


def test_ten_new_prompts_in_a_finished_home_are_the_only_ones_played(wh):
    write_prompts(wh, open_rows(range(20)))
    policy, judge = RecordingPolicy(), recording_judge("judge-v1")
    first = run_references(wh, CFG, judge, {"policy": policy}, run_id="run1")
    assert (first.prompts, first.reused, first.references) == (20, 0, 20)
    assert asked(policy, range(20)) == set(range(20))

    write_prompts(wh, open_rows(range(30)))        # 10 new prompts
    policy2, judge2 = RecordingPolicy(), recording_judge("judge-v1")
    second = run_references(wh, CFG, judge2, {"policy": policy2}, run_id="run2")
    assert (second.prompts, second.reused, second.references) == (30, 20, 10)
    assert asked(policy2, range(30)) == set(range(20, 30)) and len(policy2.prompts) == 10
    assert asked(judge2, range(30)) == set(range(20, 30))
    current = current_references(wh)
    assert current.height == 30 and current["row_key"].null_count() == 0
    runs = dict(zip(current["prompt_id"], current["run_id"]))
    assert {runs[f"g{i:02d}"] for i in range(20)} == {"run1"} and {runs[f"g{i:02d}"] for i in range(20, 30)} == {"run2"}
    assert wh.read("tournaments").filter(pl.col("run_id") == "run2")["prompt_id"].n_unique() == 10


def test_a_changed_prompt_judge_or_candidate_model_plays_again(wh):
    write_prompts(wh, open_rows(range(4)))
    run_references(wh, CFG, recording_judge("judge-v1"), {"policy": RecordingPolicy()}, run_id="run1")

    edited = open_rows(range(4))
    edited[1]["solution"] = "A different stored answer."          # a stored candidate changed
    edited[2]["prompt"] = "Write a line about topic 2, in French."  # the prompt changed
    write_prompts(wh, edited)
    policy = RecordingPolicy()
    report = run_references(wh, CFG, recording_judge("judge-v1"), {"policy": policy}, run_id="run2")
    assert report.reused == 2 and asked(policy, range(4)) == {1, 2}

    # a new judge model replays every prompt; so does a new candidate model
    policy = RecordingPolicy()
    assert run_references(wh, CFG, recording_judge("judge-v2"), {"policy": policy}, run_id="run3").reused == 0
    assert asked(policy, range(4)) == {0, 1, 2, 3}
    policy = RecordingPolicy("policy-v2")
    assert run_references(wh, CFG, recording_judge("judge-v2"), {"policy": policy}, run_id="run4").reused == 0
    # and reuse: false plays everything, with the same model and settings
    policy = RecordingPolicy("policy-v2")
    report = run_references(wh, CFG.model_copy(update={"reuse": False}), recording_judge("judge-v2"),
                            {"policy": policy}, run_id="run5")
    assert report.reused == 0 and asked(policy, range(4)) == {0, 1, 2, 3}
