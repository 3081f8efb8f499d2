"""What each stage trains on is what a real model needs (issue #30):
- one rendering of a prompt for every stage, and one answer format per domain;
- SFT targets from a teacher's verified, cleaned samples, the gold answer a counted fallback;
- DPO pairs from the policy's own verified-right and verified-wrong samples.
"""
from __future__ import annotations

import json
from importlib import resources

import polars as pl
import pytest

from tasks.audit import _check_sampled_targets
from tasks.genrm.config import JUDGE_DOMAIN
from tasks.genrm.judge import constraint_failures, constraints_from_metadata
from tasks.rollout.base import Completion
from tasks.rollout.chat import DOMAIN_INSTRUCTIONS, LOGIC_INSTRUCTION
from tasks.rollout.config import LocalConfig
from tasks.rollout.local import LocalBackend
from tasks.rollout.tiny_model import tiny_llama_path
from tasks.samples import CleanConfig, SamplesConfig, clean_reason, run_samples
from tasks.scoring import VerifySettings, render_prompt
from tasks.synthesize import generate_task_instances
from tasks.train.config import TrainConfig
from tasks.train.data import (
    Sources,
    build_dpo_pairs,
    build_sft_data,
    gold_response,
)
from tasks.train.encoding import encode_example, prompt_text

PROMPTS = {
    "math": "What is 7 * 6?",
    "code": "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n",
    "logic": "Is the sky green? Give only your final answer inside <answer></answer> tags.",
    "general": "Write two sentences about tea.",
    "instruction": "List three fruits as bullets.",
    JUDGE_DOMAIN: "[Question]\nWhat is 1+1?\n\n[Answer]\n2\n\nIs the answer right? [[1]] or [[0]]",
}


@pytest.fixture(scope="module")
def tiny_backend(tmp_path_factory):
    return LocalBackend.from_path(tiny_llama_path(home=tmp_path_factory.mktemp("llama")), LocalConfig(batch_size=4))


@pytest.mark.parametrize("domain", sorted(PROMPTS))
def test_every_stage_renders_a_prompt_the_same_way(domain, tiny_backend):
    """SFT and DPO (encode_example), RL (prompt_text, which its sampler and its scorer use),
    difficulty and evaluate (render_prompt with a backend), references and calibration (the same
    function with their backend's chat format): one text per (prompt, domain)."""
    tokenizer, prompt = tiny_backend.tokenizer, PROMPTS[domain]
    rl_text = prompt_text(tokenizer, prompt, domain)
    sampled = render_prompt({"prompt": prompt}, domain, VerifySettings(), tiny_backend)
    assert sampled == rl_text
    ids, n_prompt = encode_example(tokenizer, prompt, "an answer", domain)
    bos = tokenizer.bos_token
    expected = tokenizer(rl_text, add_special_tokens=not (bos and rl_text.startswith(bos)))["input_ids"]
    assert ids[:n_prompt] == list(expected)
    if domain in DOMAIN_INSTRUCTIONS:   # the answer format its verifier reads is asked for
        assert DOMAIN_INSTRUCTIONS[domain] in rl_text
    else:
        assert LOGIC_INSTRUCTION not in rl_text and "boxed" not in rl_text


def test_a_logic_prompt_without_a_format_of_its_own_is_asked_for_tags(tiny_backend):
    text = prompt_text(tiny_backend.tokenizer, "Which is heavier, a kilo of iron or of feathers?", "logic")
    assert LOGIC_INSTRUCTION in text


def test_gold_targets_use_each_domains_answer_format():
    assert gold_response("math", "Six sevens.", "42") == "Six sevens.\n\nThe final answer is \\boxed{42}."
    assert gold_response("math", "So \\boxed{42}.", "42") == "So \\boxed{42}."
    assert gold_response("code", "def f():\n    return 1", None) == "```python\ndef f():\n    return 1\n```"
    assert gold_response("code", None, "1") is None
    assert gold_response("logic", "", "Yes") == "<answer>Yes</answer>"
    assert gold_response("general", "Tea is brewed.", None) == "Tea is brewed."
    # every bundled open prompt's reference keeps its own format constraints (wrapped in
    # <answer> tags, 8 of the 20 broke bullets, numbering, json, case or their ending)
    rows = [json.loads(line) for line in
            resources.files("tasks").joinpath("data/open_prompts.jsonl").read_text().splitlines() if line.strip()]
    checked = 0
    for row in rows:
        constraints = constraints_from_metadata(row.get("metadata"))
        if constraints is None:
            continue
        target = gold_response(row["domain"], row.get("solution"), row.get("answer"))
        assert "<answer>" not in target and not constraint_failures(target, constraints), row["id"]
        checked += 1
    assert checked >= 8


class ScriptedTeacher:
    """Test fake of a RolloutBackend (outputs a model cannot be made to give on cue): answers each
    prompt from a script keyed by a substring of the prompt, ChatML-formatted like a real one."""

    name = "scripted"
    model_name = "scripted-teacher"

    def __init__(self, script: dict[str, list[tuple[str, str]]]):
        self.script = script

    def format_chat(self, messages):
        return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + \
            "<|im_start|>assistant\n"

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            texts = next(v for k, v in self.script.items() if k in p)
            out.append([Completion(t, token_ids=list(range(len(t.split()) + 1)), finish_reason=f)
                        for t, f in texts[: params.n]])
        return out


def _instances(wh, per_task: int = 6):
    rows = generate_task_instances("object_counting", [0], per_task, 0, 3, "configured")["rows"]
    wh.write("synthetic_tasks", pl.DataFrame(rows))
    return [r for r in rows if r["split"] == "sft"]


def _script_for(rows):
    """Per SFT-side instance: the first gets a right answer with reasoning, a bare right answer, a
    wrong one and a truncated right one; the others only wrong answers."""
    script = {}
    for i, r in enumerate(rows):
        right, wrong = r["answer"], str(int(r["answer"]) + 1)
        if i == 0:
            script[r["question"]] = [
                (f"I count each animal in turn and add them up. <answer>{right}</answer>", "stop"),
                (f"<answer>{right}</answer>", "stop"),
                (f"Counting them one by one gives <answer>{wrong}</answer>", "stop"),
                (f"Counting them one by one gives <answer>{right}</answer>", "repetition"),
            ]
        else:
            script[r["question"]] = [(f"Counting them all, I get <answer>{wrong}</answer>", "stop")] * 4
    return script


def _samples_cfg(job: str) -> SamplesConfig:
    return SamplesConfig(**{job: {"enabled": True, "model": "scripted",
                                  "sampling": {"n": 4, "max_tokens": 64, "repetition_window": None}}})


def test_teacher_samples_are_verified_cleaned_and_become_sft_targets_with_a_counted_gold_fallback(wh):
    sft_rows = _instances(wh)
    assert len(sft_rows) >= 2
    _, counts = run_samples(wh, "teacher", _samples_cfg("teacher"), ScriptedTeacher(_script_for(sft_rows)),
                               synthetic_per_task=None, seed=0)
    samples = wh.read("teacher_samples")
    assert samples.height == 4 * len(sft_rows) == counts["samples"]
    first = samples.filter(pl.col("prompt_id") == sft_rows[0]["id"]).sort("sample_index")
    assert first["kept"].to_list() == [True, False, False, False]
    assert first["drop_reason"].to_list() == [None, "no_reasoning", "wrong", "truncated"]
    # every dropped sample is a decision with its reason; kept + dropped = sampled
    decisions = wh.read("decisions").filter(pl.col("stage") == "teacher")
    assert decisions.height == samples.filter(~pl.col("kept")).height == counts["samples"] - counts["kept"]
    assert counts["kept"] == 1 and counts["prompts_with_kept"] == 1 and counts["dropped_wrong"] == 4 * len(sft_rows) - 3

    cfg = TrainConfig(base_model={"kind": "hybrid"}, sft_short={"max_tokens": 4096})
    tokenizer = LocalBackend.from_path(tiny_llama_path(home=wh.home)).tokenizer
    frame, _, report = build_sft_data(Sources(wh, "sft_data"), cfg, tokenizer)
    by_source = dict(zip(frame["source_id"], frame["response_source"]))
    assert by_source[sft_rows[0]["id"]] == "teacher"
    assert all(by_source[r["id"]] == "gold" for r in sft_rows[1:])
    teacher_row = frame.filter(pl.col("response_source") == "teacher").row(0, named=True)
    assert teacher_row["response"].startswith("I count each animal") and teacher_row["sample_model"] == "scripted-teacher"
    assert report.counters()["source_teacher"] == 1 and report.counters()["source_gold"] == len(sft_rows) - 1

    # the audit finds the teacher target among the kept samples of its prompt, and not a forged one
    teacher = wh.read("teacher_samples")
    assert _check_sampled_targets(frame, pl.DataFrame(), teacher, pl.DataFrame()).passed
    forged = frame.with_columns(pl.when(pl.col("response_source") == "teacher").then(pl.lit("<answer>99</answer>"))
                                .otherwise(pl.col("response")).alias("response"))
    check = _check_sampled_targets(forged, pl.DataFrame(), teacher, pl.DataFrame())
    assert check.checked == 1 and len(check.offending) == 1

    # without the fallback, prompts no teacher sample passed are dropped, and counted
    strict = TrainConfig(base_model={"kind": "hybrid"}, sft_short={"max_tokens": 4096}, data={"gold_fallback": False})
    frame, _, report = build_sft_data(Sources(wh, "sft_data"), strict, tokenizer)
    assert frame.height == 1 and report.dropped["no_teacher_sample"] == len(sft_rows) - 1
    assert report.seen == len(sft_rows)
    # or only for the domains named (math keeps its reasoning solutions, logic its teacher only)
    for domains, rows in ((["math"], 1), (["logic"], len(sft_rows))):
        mixed = TrainConfig(base_model={"kind": "hybrid"}, sft_short={"max_tokens": 4096},
                            data={"gold_fallback_domains": domains})
        assert build_sft_data(Sources(wh, "sft_data"), mixed, tokenizer)[0].height == rows


def test_the_policys_own_right_and_wrong_samples_pair_for_dpo(wh):
    sft_rows = _instances(wh)
    script = _script_for(sft_rows)
    run_samples(wh, "on_policy", _samples_cfg("on_policy"), ScriptedTeacher(script), synthetic_per_task=None, seed=0)
    cfg = TrainConfig(base_model={"kind": "hybrid"}, dpo_short={"max_tokens": 4096}, data={"verify_chosen": True})
    tokenizer = LocalBackend.from_path(tiny_llama_path(home=wh.home)).tokenizer
    pairs, _, report = build_dpo_pairs(Sources(wh, "dpo_pairs"), cfg, tokenizer)
    on_policy = pairs.filter(pl.col("prompt_id") == sft_rows[0]["id"]).row(0, named=True)
    assert (on_policy["chosen_source"], on_policy["rejected_source"]) == ("rollout_correct", "rollout_wrong")
    assert on_policy["chosen"].startswith("I count each animal") and "gives <answer>" in on_policy["rejected"]
    # the others have only wrong samples: the gold answer is chosen against the policy's wrong one
    others = pairs.filter(pl.col("prompt_id") != sft_rows[0]["id"])
    assert set(others["chosen_source"]) == {"gold"} and set(others["rejected_source"]) == {"rollout_wrong"}
    counters = report.counters()
    assert counters["rejected_rollout_wrong"] == pairs.height and counters["chosen_rollout_correct"] == 1
    # the audit: each sampled side is a right (chosen) or wrong (rejected) sample of its prompt
    rollouts = wh.read("rollouts")
    check = _check_sampled_targets(pl.DataFrame(), pairs, pl.DataFrame(), rollouts)
    assert check.passed and check.checked == pairs.height + 1
    swapped = pairs.with_columns(pl.col("chosen").alias("rejected"), pl.col("rejected").alias("chosen"))
    # the first pair fails on both sides, every other on its rejected side (now a gold answer)
    assert len(_check_sampled_targets(pl.DataFrame(), swapped, pl.DataFrame(), rollouts).offending) == pairs.height + 1


def test_clean_reasons_for_code_math_and_open_samples():
    def sample(text, reward=1.0, finish="stop"):
        from tasks.scoring import ScoredSample
        return ScoredSample(Completion(text, finish_reason=finish), reward, None)

    cfg = CleanConfig(min_reasoning_words=3)
    assert clean_reason("code", sample("def f(): return 1"), cfg) == "no_code_block"
    assert clean_reason("code", sample("```python\ndef f(): return 1\n```"), cfg) is None
    assert clean_reason("math", sample("\\boxed{4}"), cfg) == "no_reasoning"
    assert clean_reason("math", sample("Two and two make \\boxed{4}"), cfg) is None
    assert clean_reason("math", sample("a\na\na\nb \\boxed{4}"), cfg) == "repetitive"
    assert clean_reason("general", sample("Tea is nice."), cfg, constraints_ok=None) == "unverifiable"
    assert clean_reason("general", sample("Tea is nice."), cfg, constraints_ok=False) == "constraints_failed"
    assert clean_reason("general", sample("Tea is nice."), cfg, constraints_ok=True) is None


def test_the_samples_flow_runs_a_real_model_and_accounts_for_every_sample(home, monkeypatch):
    """A real Prefect flow run with the random tiny Llama as teacher: every sample is kept or
    dropped with a reason, and a disabled job (tiny's default) writes nothing."""
    from flows.samples import samples_flow
    from warehouse import Warehouse

    wh = Warehouse(home)
    _instances(wh, per_task=4)
    disabled = samples_flow(job="teacher", profile="tiny", home=str(home))
    assert disabled["enabled"] is False and not wh.exists("teacher_samples")
    monkeypatch.setenv("POSTTRAIN__SAMPLES__TEACHER__ENABLED", "true")
    monkeypatch.setenv("POSTTRAIN__SAMPLES__TEACHER__MODEL", str(tiny_llama_path(home=home)))
    monkeypatch.setenv("POSTTRAIN__SAMPLES__TEACHER__SAMPLING__MAX_TOKENS", "8")
    result = samples_flow(job="teacher", profile="tiny", home=str(home))
    samples = wh.read("teacher_samples")
    n = json.loads(json.dumps(result["counts"]))
    assert samples.height == n["samples"] == 4 * n["prompts"] > 0
    assert samples["kept"].sum() + samples["drop_reason"].is_not_null().sum() == samples.height
    assert wh.read("decisions").filter(pl.col("stage") == "teacher").height == samples.height - samples["kept"].sum()
    assert result["tables"]["teacher_samples"]
