"""Sampled, verified responses that training data is built from.

Two jobs, one mechanism (sample the SFT side's prompts, verify, clean, record):
- ``teacher``: reasoning for SFT by rejection sampling (M1's cold start; RFT when the teacher is
  the base model itself). Every sample is verified by its domain's verifier and cleaned
  (finished, not repetitive, the answer present in the domain's format, reasoning before it).
  All samples go to ``teacher_samples`` with ``kept`` and, for the rest, the reason; each
  dropped sample is also a ``decisions`` row. The ``sft_data`` builder takes the kept ones as
  targets and falls back to the bare gold answer only where none passed (counted).
- ``on_policy``: the model DPO starts from (``sft_long``) samples the same prompts; its
  verified-correct and verified-wrong samples become DPO's chosen and rejected sides
  (MiniMax-01: DPO pairs are the policy's own responses, ranked). They go to ``rollouts``,
  which the ``dpo_pairs`` builder reads.

Open prompts (general, instruction) have no rule verifier: a sample of one is kept when the
prompt's checkable constraints (``tasks.genrm.judge``) all hold, and the prompt is skipped
when it has none to check (its reference stays the target).
"""
from __future__ import annotations

import logging
import random
import uuid
from concurrent.futures import ThreadPoolExecutor

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from data_specs.curation import POOL_TABLES
from data_specs.stages import last_of
from tasks.cleaning import CleanConfig, clean_reason
from tasks.genrm.config import OPEN_DOMAINS
from tasks.rollout.base import RolloutBackend
from tasks.scoring import (
    DifficultySampling,
    ScoredSample,
    VerifySettings,
    render_prompt,
    rollout_rows,
    row_domain,
    row_id,
    score_samples,
)
from tasks.tracking import current_run_id, log_counters, log_table, stage_run
from warehouse import TableRef, Warehouse

log = logging.getLogger(__name__)

JOBS = ("teacher", "on_policy")
OUTPUT_TABLE = {"teacher": "teacher_samples", "on_policy": "rollouts"}


class JobSampling(DifficultySampling):
    """How a job samples: a few answers per prompt, long enough to reason, below T 1.0 for a
    teacher (M1 samples its cold-start data from a strong model)."""
    n: int = Field(4, ge=1, description="samples per prompt")
    temperature: float = Field(0.7, ge=0)
    top_p: float = Field(0.95, gt=0, le=1)
    max_tokens: int = Field(512, ge=1)
    repetition_window: int | None = Field(None, ge=1)


class SampleJob(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = False
    # teacher: "base" (the model the first training stage starts from: rejection-sampling
    # fine-tuning), a training stage's name, an alias ("smol") or a path; on_policy: the last SFT stage
    model: str = "base"
    sampling: JobSampling = Field(default_factory=JobSampling)
    domains: list[str] = Field(default_factory=lambda: ["math", "logic", "code", *OPEN_DOMAINS])
    max_prompts: int | None = Field(None, ge=1, description="SFT-side prompts sampled (a seeded draw); None: all")
    max_prompts_per_domain: dict[str, int] = Field(default_factory=dict, description="the domain mix")


class SamplesConfig(VerifySettings):
    """The ``samples`` profile section."""
    teacher: SampleJob = Field(default_factory=SampleJob)
    # DPO's on-policy samples come from the model DPO starts from: the last SFT stage
    on_policy: SampleJob = Field(default_factory=lambda: SampleJob(model=last_of("sft")))
    clean: CleanConfig = Field(default_factory=CleanConfig)
    prompts_per_chunk: int = Field(32, ge=1, description="prompts sent to the backend at once")
    synthetic_per_task: int | None = Field(
        None, ge=1, description="SFT-side synthetic instances per task considered (None: train.data.synthetic_per_task)")


# -- cleaning ------------------------------------------------------------------------------------

# -- the job -------------------------------------------------------------------------------------

def sft_side_prompts(wh: Warehouse, job: SampleJob, synthetic_per_task: int | None, seed: int,
                     sources: dict[str, TableRef] | None = None) -> tuple[list[dict], list[TableRef]]:
    """The SFT side's rows the job samples: the curated SFT pool and the SFT-side synthetic
    instances (at most ``synthetic_per_task`` per task, the instances SFT trains on), in the
    job's domains, capped per domain and in all by seeded draws."""
    rows: list[dict] = []
    refs: list[TableRef] = []
    for table in (POOL_TABLES["sft"], "synthetic_tasks"):
        ref = wh.pinned(table, sources or {})
        if ref is None:
            continue
        df = wh.read(table, ref.snapshot)
        if table == "synthetic_tasks":
            if "split" not in df.columns:
                continue
            df = df.filter(pl.col("split") == "sft").sort("id")
            if synthetic_per_task is not None:
                df = df.group_by("task", maintain_order=True).head(synthetic_per_task)
        refs.append(ref)
        rows += [{**r, "_table": table} for r in df.to_dicts()]
    rows = [r for r in rows if row_domain(r) in job.domains]
    by_domain: dict[str, list[dict]] = {}
    for r in rows:
        by_domain.setdefault(row_domain(r), []).append(r)
    out: list[dict] = []
    for domain, members in by_domain.items():
        cap = job.max_prompts_per_domain.get(domain)
        out += _seeded_draw(members, cap, seed)
    return _seeded_draw(out, job.max_prompts, seed), refs


def _seeded_draw(rows: list[dict], cap: int | None, seed: int) -> list[dict]:
    """At most ``cap`` of ``rows``, a seeded draw kept in their order."""
    if cap is None or len(rows) <= cap:
        return rows
    picked = sorted(random.Random(seed).sample(range(len(rows)), cap))
    return [rows[i] for i in picked]


def _constraints_ok(row: dict, text: str) -> bool | None:
    """Whether an open prompt's response meets every checkable constraint of the prompt (None: it
    states none, or none that parse)."""
    from tasks.genrm.judge import constraint_failures, constraints_from_metadata

    try:
        constraints = constraints_from_metadata(row.get("metadata"))
    except ValueError:
        return None
    if constraints is None or constraints == type(constraints)():
        return None
    return not constraint_failures(text, constraints)


def sample_and_clean(rows: list[dict], job_name: str, cfg: SamplesConfig, backend: RolloutBackend,
                     run_id: str) -> tuple[list[dict], list[dict]]:
    """(sample rows with ``kept`` and ``drop_reason``, decisions rows for the dropped)."""
    job: SampleJob = getattr(cfg, job_name)
    params, limits = job.sampling.params(), cfg.sandbox_limits()
    samples_out, decisions = [], []
    with ThreadPoolExecutor(max_workers=cfg.verify_workers) as pool:
        for start in range(0, len(rows), cfg.prompts_per_chunk):
            chunk = rows[start:start + cfg.prompts_per_chunk]
            prompts = [render_prompt(r, row_domain(r), cfg, backend) for r in chunk]
            for r, completions in zip(chunk, backend.generate(prompts, params)):
                pid, domain = row_id(r), row_domain(r)
                if domain in OPEN_DOMAINS:   # no verifier: the prompt's checkable constraints decide
                    verdicts = [_constraints_ok(r, c.text) for c in completions]
                    scored = [ScoredSample(c, 1.0 if ok else 0.0, None) for c, ok in zip(completions, verdicts)]
                else:
                    scored = score_samples(domain, r, completions, limits, pool)
                    verdicts = [None] * len(scored)
                out = rollout_rows(pid, r["_table"], domain, scored, params, backend, run_id)
                for row, sample, ok in zip(out, scored, verdicts):
                    reason = clean_reason(domain, sample, cfg.clean, ok)
                    row["kept"], row["drop_reason"] = reason is None, reason
                    if reason is not None:
                        decisions.append({"row_id": row["rollout_id"], "stage": job_name, "decision": "removed",
                                          "reason": reason, "reference_id": f"{r['_table']}:{pid}",
                                          "score": sample.reward, "run_id": run_id})
                samples_out += out
            log.info("%s: %d/%d prompts sampled, verified and cleaned", job_name, start + len(chunk), len(rows))
    return samples_out, decisions


def _frame(rows: list[dict], name: str) -> pl.DataFrame:
    from data_specs import get_spec

    spec = get_spec(name)
    return spec.conform(pl.DataFrame(rows, infer_schema_length=None)) if rows else spec.empty()


def run_samples(wh: Warehouse, job_name: str, cfg: SamplesConfig, backend: RolloutBackend,
                synthetic_per_task: int | None, seed: int,
                sources: dict[str, TableRef] | None = None) -> tuple[dict[str, TableRef], dict[str, float]]:
    """Sample, verify and clean the SFT side's prompts with ``backend`` for one job; returns the
    refs written and the counts (samples, kept, dropped by reason, prompts with a kept sample)."""
    if job_name not in JOBS:
        raise ValueError(f"unknown samples job {job_name!r}; expected one of {JOBS}")
    job: SampleJob = getattr(cfg, job_name)
    cap = cfg.synthetic_per_task if cfg.synthetic_per_task is not None else synthetic_per_task
    rows, inputs = sft_side_prompts(wh, job, cap, seed, sources)
    model = getattr(backend, "model_name", backend.name)
    with stage_run(job_name, params={job_name: job.model_dump(), "clean": cfg.clean.model_dump(),
                                     "backend": backend.name, "model": model}) as mlflow_run:
        run_id = mlflow_run or current_run_id() or uuid.uuid4().hex
        for ref in inputs:
            log_table(ref, context="input")
        samples, decisions = sample_and_clean(rows, job_name, cfg, backend, run_id)
        table = OUTPUT_TABLE[job_name]
        frame = _frame(samples, table) if table == "teacher_samples" else _frame(
            [{k: v for k, v in s.items() if k not in ("kept", "drop_reason")} for s in samples], table)
        refs = {}
        if samples:
            refs[table] = wh.append(table, frame, parents=inputs)
        if decisions:
            refs["decisions"] = wh.append("decisions", _frame(decisions, "decisions"), parents=inputs)
        counts = sample_counts(samples, len(rows))
        log_counters(counts, prefix=job_name)
        for ref in refs.values():
            log_table(ref, context="output")
    return refs, counts


def sample_counts(samples: list[dict], prompts: int) -> dict[str, float]:
    kept = [s for s in samples if s["kept"]]
    counts: dict[str, float] = {"prompts": prompts, "samples": len(samples), "kept": len(kept),
                                "correct": sum(1 for s in samples if s["reward"] >= 1.0),
                                "prompts_with_kept": len({s["prompt_id"] for s in kept})}
    for s in samples:
        if s["drop_reason"]:
            counts[f"dropped_{s['drop_reason']}"] = counts.get(f"dropped_{s['drop_reason']}", 0) + 1
    return counts
