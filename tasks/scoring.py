"""Sampling and scoring shared by the stages that sample a model on prompts (difficulty,
samples, evaluate): the sampling and verification settings, the prompt as training renders it,
verifying completions into rewards, the ``rollouts`` rows they become, and the decision the
newest difficulty run made on each prompt (``latest_decisions``). Below those stages,
so none of them borrows from another."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from tasks.rollout.base import Completion, RolloutBackend, SamplingParams
from tasks.rollout.chat import prompt_content
from tasks.rollout.chat import render_prompt as render_chat_prompt
from tasks.verify.registry import synth_task_name, verify_strict
from tasks.verify.sandbox import SandboxLimits


class DifficultySampling(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n: int = Field(16, ge=1, description="samples per prompt (n >= every band's k)")
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(32_768, ge=1)
    seed: int = 0
    repetition_window: int | None = Field(3000, ge=1)
    repetition_prob: float = Field(0.99, gt=0, lt=1)

    def params(self) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens,
            seed=self.seed, repetition_window=self.repetition_window,
            repetition_prob=self.repetition_prob,
        )


class VerifySettings(BaseModel):
    """How sampled answers are prompted for and verified; shared by difficulty and evaluate."""
    model_config = ConfigDict(extra="forbid")
    # the prompt as every stage renders it (tasks.rollout.chat.render_prompt); off: the bare
    # prompt and its domain instruction, for a test's scripted backend. A profile may not turn
    # it off (``tasks.profile.refuse_raw_prompts``): its training stages always render the chat template
    use_chat_template: bool = True
    verify_workers: int = Field(2, ge=1, description="parallel code sandboxes")
    sandbox_timeout_s: float = Field(10.0, gt=0)
    sandbox_memory_mb: int = Field(512, ge=64)

    def sandbox_limits(self) -> SandboxLimits:
        seconds = max(1, int(self.sandbox_timeout_s))
        return SandboxLimits(timeout_s=self.sandbox_timeout_s, cpu_s=seconds, memory_mb=self.sandbox_memory_mb)


@dataclass
class ScoredSample:
    completion: Completion
    reward: float
    error: str | None




def row_id(row: dict) -> str:
    for key in ("id", "instance_id", "prompt_id"):
        if row.get(key):
            return str(row[key])
    raise ValueError(f"row has no id column (id / instance_id / prompt_id): keys {sorted(row)}")


def row_domain(row: dict) -> str:
    if row.get("domain"):
        return str(row["domain"])
    return "logic" if synth_task_name(row) else "general"


def render_prompt(row: dict, domain: str, cfg: VerifySettings, backend: RolloutBackend) -> str:
    """The row's prompt as training renders it for this domain (``tasks.rollout.chat``)."""
    if not cfg.use_chat_template:
        return prompt_content(row["prompt"], domain)
    return render_chat_prompt(backend.format_chat, row["prompt"], domain)


def score_samples(
    domain: str, row: dict, completions: list[Completion], limits: SandboxLimits, pool: ThreadPoolExecutor
) -> list[ScoredSample]:
    def one(completion: Completion) -> ScoredSample:
        try:
            return ScoredSample(completion, verify_strict(domain, row, completion.text, limits), None)
        except Exception as e:  # noqa: BLE001 - a row that cannot be scored scores 0, with a reason
            return ScoredSample(completion, 0.0, f"{type(e).__name__}: {e}"[:500])

    if domain == "code":  # sandboxes are subprocess-bound: run them side by side
        return list(pool.map(one, completions))
    return [one(c) for c in completions]


def rollout_rows(pid, table, domain, samples, params, backend, run_id) -> list[dict]:
    rows = []
    for index, sample in enumerate(samples):
        c = sample.completion
        logprob_sum, logprob_mean = c.logprob_summary()
        rows.append({
            "rollout_id": f"{pid}:{index}:{run_id}",
            "prompt_id": pid, "source_table": table, "domain": domain, "sample_index": index,
            "text": c.text, "token_ids": list(c.token_ids), "num_tokens": len(c.token_ids),
            "logprob_sum": logprob_sum,
            "logprob_mean": logprob_mean,
            "finish_reason": c.finish_reason, "truncated": c.truncated, "reward": float(sample.reward),
            "verify_error": sample.error, "backend": backend.name,
            "model": getattr(backend, "model_name", backend.name),
            "temperature": params.temperature, "top_p": params.top_p, "seed": params.seed,
            "run_id": run_id,
        })
    return rows


def latest_decisions(difficulty: pl.DataFrame) -> dict[str, str]:
    """prompt_id -> the decision of the newest run that scored it.

    ``difficulty`` is append-only: a prompt kept long ago and rejected since is rejected.
    """
    if difficulty.is_empty():
        return {}
    latest = difficulty.unique("prompt_id", keep="last")   # keep="last": the newest appended row
    return dict(zip(latest["prompt_id"].to_list(), latest["decision"].to_list()))
